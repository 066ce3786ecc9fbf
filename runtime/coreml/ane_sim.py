"""The `ane-sim` backend: what an `ane` group's Core ML function computes, on any host.

The builder's function (runtime.coreml.converter) takes the packed rows in fp16, holds each expert's weights in
fp16 (or compressed: int8 per channel, a 4-bit k-means palette per 16 output channels) and rounds to fp16 after
every op: gate_up projection, silu, the gated product, the down projection. ane-sim computes the same thing in
torch: fp32 arithmetic inside an op, fp16 values between ops, as the builder's host evaluation
(runtime.coreml.mil_eval) does. Compressed weights are not re-derived here: each expert's matrices go through
coremltools' own compression pass, configured as the builder configures it, on the builder's own program of that
expert, and the decompressed fp16 values are kept (and cached on disk: palettization runs k-means).

So off macOS a plan's `ane` groups run here instead of on cpu-static (which computes in the model's dtype with the
original weights): `run`, `evaluate` and `generate` report what a Mac would compute. The layout (matmul or
conv1x1) changes where values sit, not what they are; the weights are decompressed through the builder's
program in the layout given.
"""
from __future__ import annotations

import hashlib
import io
import threading
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

from runtime.backends.protocol import DenseFn, DenseSpec, GroupFn, GroupSpec
from runtime.coreml.ane import expert_weights_fp16
from runtime.coreml.dense_sim import dense_fp16
from runtime.fileio import atomic_write_bytes, cache_root
from runtime.plan import COMPRESSIONS

SIM_VERSION = 1  # bump when the decompressed weights change: invalidates the disk cache


def decompressed(gate_up: np.ndarray, down: np.ndarray, compress: str, layout: str = "matmul"
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The fp16 weights an ANE function of this expert computes with: coremltools' compression pass (as
    `autotune build` configures it) run on the builder's program of the expert, then its own decompression."""
    if compress == "none":
        return gate_up, down
    from runtime.coreml.compression import COMPRESSION_FUNCTIONS, compression_config, one_kmeans_thread
    from runtime.coreml.converter import (
        FunctionSpec,
        function_program,
        quiet_coremltools_import,
        quiet_progress,
    )

    quiet_coremltools_import()
    from coremltools.converters.mil.mil.passes.graph_pass import PassOption
    from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

    fs = FunctionSpec(0, 0, (0,), (1,), gate_up.shape[1], down.shape[1])
    prog = function_program(fs, {0: (gate_up, down)}, layout)
    graph_pass = PASS_REGISTRY["compression::" + COMPRESSION_FUNCTIONS[compress]]
    graph_pass.set_options([PassOption("config", compression_config(compress)), PassOption("joint_compression", False)])
    with one_kmeans_thread(), quiet_progress():
        graph_pass.apply(prog)
    out = {"gate_up": gate_up, "down": down}  # a matrix under the pass's size threshold stays as it is
    for op in prog.functions["main"].operations:
        for kind in out:
            if op.op_type.startswith("constexpr_") and op.name.startswith(f"layer0_expert0_{kind}_"):
                out[kind] = np.asarray(op.materialized_val_inference(), dtype=np.float16).reshape(out[kind].shape)
    return out["gate_up"], out["down"]


def _cache_path(gate_up: np.ndarray, down: np.ndarray, compress: str, layout: str):
    from runtime.coreml.converter import quiet_coremltools_import

    quiet_coremltools_import()
    import coremltools as ct

    h = hashlib.sha256(f"{SIM_VERSION}:{ct.__version__}:{compress}:{layout}:{gate_up.shape}:{down.shape}".encode())
    h.update(gate_up.tobytes())
    h.update(down.tobytes())
    return cache_root() / "ane-sim" / f"{h.hexdigest()[:40]}.npz"


def cached_decompressed(gate_up: np.ndarray, down: np.ndarray, compress: str, layout: str = "matmul"
                        ) -> tuple[np.ndarray, np.ndarray]:
    """`decompressed`, kept on disk by the weights' digest: a search's gate and a later evaluate share them."""
    if compress == "none":
        return gate_up, down
    path = _cache_path(gate_up, down, compress, layout)
    try:
        with np.load(path) as f:
            return f["gate_up"], f["down"]
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):  # absent or damaged: computed again, rewritten
        pass
    gu, d = decompressed(gate_up, down, compress, layout)
    buf = io.BytesIO()
    np.savez(buf, gate_up=gu, down=d)
    atomic_write_bytes(path, buf.getvalue())
    return gu, d


def _r16(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to fp16 and back: a value stored between two ops of the function."""
    return t.to(torch.float16).to(torch.float32)


def expert_fp16(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's gated FFN as the function computes it; `x` and the weights hold fp16 values (any float dtype)."""
    f = down.shape[1]
    gu = _r16(x @ gate_up.float().T)
    h = _r16(_r16(F.silu(gu[:, :f])) * gu[:, f:])
    return _r16(h @ down.float().T)


class AneSimBackend:
    """The ANE function's numerics on the CPU: fp16 activations, weights and outputs, compressed weights
    decompressed as coremltools does. Weights are prepared once per (module, expert, compression) and shared by
    every group and plan this instance prepares."""
    name = "ane-sim"
    overlaps_cpu = False

    def __init__(self, layout: str = "matmul") -> None:
        self.layout = layout
        self._weights: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._modules: dict[int, torch.nn.Module] = {}  # keeps each keyed module alive, so its id stays its own
        self._lock = threading.Lock()

    def available(self) -> tuple[bool, str]:
        return True, "the ANE function's fp16 numerics, simulated on the CPU"

    def weights(self, module: torch.nn.Module, expert: int, compress: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as fp16 tensors holding what the function computes with."""
        if compress not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compress!r}; choose from {', '.join(COMPRESSIONS)}")
        key = (id(module), expert, compress)
        with self._lock:
            if key not in self._weights:
                self._modules[id(module)] = module
                gu, d = cached_decompressed(*expert_weights_fp16(module, expert), compress, self.layout)
                self._weights[key] = (torch.from_numpy(np.ascontiguousarray(gu)),
                                      torch.from_numpy(np.ascontiguousarray(d)))
            return self._weights[key]

    def prepare(self, group: GroupSpec) -> GroupFn:
        weights = [self.weights(group.module, e, group.compress) for e in group.experts]
        caps = list(group.capacities)

        def run(packed: torch.Tensor) -> torch.Tensor:
            x = _r16(packed.detach().float())  # the function's input is fp16
            y = torch.cat([expert_fp16(xe, gu, d) for xe, (gu, d) in zip(x.split(caps), weights)])
            return y.to(packed.dtype)

        return run

    def prepare_dense(self, spec: DenseSpec) -> DenseFn:
        """A plan's dense function as the ANE computes it (runtime/coreml/dense_sim.py)."""
        return dense_fp16(spec)
