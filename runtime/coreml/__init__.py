"""coreml: see docs/architecture.md."""
