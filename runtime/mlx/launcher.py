"""Whether this process is a rank `mlx.launch` started, without importing mlx (the commands ask before loading it)."""
from __future__ import annotations

import os


def launched() -> bool:
    """Whether this process is a rank `mlx.launch` started (its ring in the environment): a model across Macs
    (`runtime.mlx.cluster`)."""
    return "MLX_RANK" in os.environ and bool(os.environ.get("MLX_HOSTFILE"))
