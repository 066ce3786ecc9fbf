"""npumoe auto-tuner: device profiling, cost model, calibration, search, reports. Uses `runtime`."""
