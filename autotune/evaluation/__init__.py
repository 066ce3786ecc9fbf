"""evaluation: see docs/architecture.md."""
