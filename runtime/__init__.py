"""npumoe runtime: plan I/O, the MoE executor, its backends and model loading. Never imports `autotune`."""
