"""searching: see docs/architecture.md."""
