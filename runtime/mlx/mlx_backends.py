"""The MLX backends' registry entries: `mlx-exact`, an exact path (exact token counts, no padding, no drop) run by
MLX on the Mac's GPU, or on MLX's CPU device elsewhere. Where MLX is missing, its work runs on `cpu-exact`."""
from __future__ import annotations

from runtime.backends.registry import EXACT, BackendInfo

BACKENDS = (
    BackendInfo("mlx-exact", None, overlaps_cpu=True, fallback=EXACT, exact=True, dtype_bytes=2,
                energy_field="gpu_mj", profiled_by_default=False),
)
