"""The plan's attention core on a static backend, spliced into mlx-lm's attention: the torch spine's prepared
`AttentionCore` of each planned layer (one function per context bucket) in place of the model module's
`scaled_dot_product_attention`, while that layer's attention runs (`scoped`). mlx-lm keeps its projections, rope and
KV cache; the core gets the chunk's queries and the cache's keys and values as torch views, and decides as on the
torch spine: a full chunk whose context fits a bucket runs on the function, anything else (a partial chunk, a decode
step, a context past the last bucket, a quantized cache) on mlx-lm's own call. Split by rows, the queries past the
static ones run on MLX's `mx.fast.scaled_dot_product_attention`, after the static call. Imports mlx."""
from __future__ import annotations

import threading
import time

import mlx.core as mx
import torch

from runtime.dense.attention import AttentionCore, Split
from runtime.mlx.mlx_exact import TORCH_DTYPES, to_mx, to_torch
from runtime.stats import lane_of

PART = "attention_core"


def _mlx_core(scale: float):
    """A split core's other queries on MLX: q `[heads, rows, d]`, k and v `[kv_heads, keys, d]`, allowed
    `[rows, keys]` (torch) -> `[heads, rows, d]` (a torch view of MLX's output)."""
    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        y = mx.fast.scaled_dot_product_attention(to_mx(q)[None], to_mx(k)[None], to_mx(v)[None], scale=scale,
                                                 mask=to_mx(allowed)[None, None])
        return to_torch(y[0], q.dtype)

    return run


class _Layer(threading.local):
    core: AttentionCore | None = None


class AttentionSplice:
    """The planned layers' cores (`cores`: the torch spine's, by layer), dispatched from the model module's
    `scaled_dot_product_attention` while their layer's attention runs. `timer`: the spine's `_Timer`."""

    def __init__(self, cores: dict[int, AttentionCore], timer) -> None:
        self.timer, self.current = timer, _Layer()
        self.lanes = None  # two chunks in flight (`runtime.mlx.overlap.Lanes`): each static call on the static lane
        self.cores = {i: AttentionCore(c.chunk, c.fns, c.backend, c.scaling, c.calls,
                                       Split(c.split.rows, _mlx_core(c.scaling)) if c.split else None, c.block)
                      for i, c in cores.items()}

    def scoped(self, index: int, attention):
        """Layer `index`'s attention call (`attention`: what ran it before) with its core current."""
        def call(*args, **kwargs):
            self.current.core = self.cores[index]
            try:
                return attention(*args, **kwargs)
            finally:
                self.current.core = None

        return call

    def sdpa(self, own):
        """The model module's `scaled_dot_product_attention` (`own`: mlx-lm's) with the current layer's core."""
        def run(queries, keys, values, cache, scale, mask, sinks=None):
            core = self.current.core
            usable = core is not None and sinks is None and not hasattr(cache, "bits") and \
                (mask is None or isinstance(mask, str) or mask.dtype == mx.bool_)
            out = self._static(core, queries, keys, values, mask, scale) if usable else None
            if out is None:
                return own(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
            return out

        return run

    def _static(self, core: AttentionCore, q: mx.array, k: mx.array, v: mx.array, mask, scale: float):
        """The core on torch views of the chunk's queries and the cache's keys and values, its output back in MLX
        `[1, heads, queries, d]`; None where it does not take the chunk."""
        start, dtype = time.perf_counter(), TORCH_DTYPES[q.dtype]
        qt, kt, vt = (to_torch(mx.contiguous(a), dtype) for a in (q, k, v))
        allowed = to_torch(mask, torch.bool) if isinstance(mask, mx.array) else None
        key = ("attention", core.backend)

        def call() -> tuple[torch.Tensor | None, int]:  # the calls counted on the static lane (one chunk's at a time)
            before = core.calls[key]
            return core(qt, kt, vt, allowed, scale), core.calls[key] - before

        with torch.inference_mode():
            if self.lanes is None:
                out, calls = call()
            else:  # the chunk's keys and values are written (read above): the next chunk's attention may start
                self.lanes.kv_written()
                with self.lanes.off_host(), self.lanes.on_static(core.backend):
                    out, calls = call()
        if out is None:
            return None
        y = to_mx(out).transpose(0, 2, 1, 3)
        mx.eval(y)
        seconds = time.perf_counter() - start if self.timer.timing else None
        self.timer.lanes.add(PART, lane_of(core.backend), calls, seconds)
        return y
