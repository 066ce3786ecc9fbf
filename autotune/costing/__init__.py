"""costing: see docs/architecture.md."""
