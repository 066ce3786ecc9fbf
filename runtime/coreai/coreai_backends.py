"""The Core AI backend's registry entry: `coreai` (a plan's groups and dense functions as functions of a Core AI
asset, runtime/coreai/coreai_backend.py). Off macOS 27 Apple's in-package runtime runs them on the CPU: exact, but
its times say nothing about a device, so it is not profiled there by default (on macOS 27 each profiled group is
converted and loaded for the Neural Engine: runtime/coreai/device_checks.py); where Core AI is missing (or no asset
was given) its groups run on ane-sim, the Neural Engine's fp16 numerics. Its limits are the Neural Engine's."""
from __future__ import annotations

from runtime.backends.registry import BackendInfo
from runtime.coreai import assets
from runtime.coreai.coreai_backend import CoreAiBackend, open_asset
from runtime.coreai.device_checks import available_on_device, profile_caller
from runtime.coreml import ane_limits
from runtime.coreml.ane import AneBackend
from runtime.coreml.ane_sim import AneSimBackend

BACKENDS = (
    BackendInfo(CoreAiBackend.name, CoreAiBackend, overlaps_cpu=True, fallback=AneSimBackend.name,
                options=("package",), limits=ane_limits.group_violation, dtype_bytes=2, energy_field="ane_mj",
                profiled_by_default=assets.on_neural_engine(), package_suffix=".aimodel", open_package=open_asset,
                profile_call=profile_caller, profile_available=available_on_device, compiles_per_shape=True,
                supersedes=lambda: (AneBackend.name,) if assets.on_neural_engine() else ()),
)
