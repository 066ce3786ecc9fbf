"""The CPU: the `cpu-static` and `cpu-exact` backends (torch), the experts' CPU-side storages and their kernels, the
packed MLX affine format computed on the CPU, and the allocator policy a CPU prefill runs under."""
