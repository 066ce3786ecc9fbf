"""MLX: the exact path on Apple's GPU through Metal (`mlx-exact`; MLX's CPU device elsewhere), computing routed
experts from a checkpoint's own packed weights (`mx.gather_qmm`), as mlx-lm's `SwitchGLU` does."""
