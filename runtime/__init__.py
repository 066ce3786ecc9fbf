"""npumoe runtime: plan I/O, the MoE executor, its backends and model loading. Never imports `autotune`.

The application API (`load`, `generate`, `stream_generate`, from `runtime.generation`) is imported on first use,
so `import runtime.plan` stays light."""
from __future__ import annotations

from runtime.cpu.allocator import bound_primitive_cache
from runtime.import_noise import filter_import_noise
from runtime.torchao_hidden import hide_torchao

_API = ("load", "generate", "stream_generate", "Loaded")

hide_torchao()
filter_import_noise()
# before any matmul of ours (auto dtype's bf16 probe runs before a model loads): the libraries read it at their first
bound_primitive_cache()


def __getattr__(name: str):
    if name in _API:
        from runtime import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
