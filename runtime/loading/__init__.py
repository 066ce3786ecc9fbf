"""loading: see docs/architecture.md."""
