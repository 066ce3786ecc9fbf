"""calibration: see docs/architecture.md."""
