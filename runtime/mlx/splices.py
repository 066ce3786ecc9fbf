"""The plan's dense static functions spliced into mlx-lm's forward (the MLX spine's `SPINE_SPLICES`).

The functions are prepared as the torch spine prepares them (`DenseExecutor` on `dense_view`'s torch modules over
mlx-lm's weights) and installed by the torch spine's own hand-overs (`FusedQKV`, `FusedSharedExpert`, `replaced`) on
mlx-lm's modules (`MlxPatches`): so mlx-lm's attention keeps its code, rope, KV cache and
`mx.fast.scaled_dot_product_attention`, and a chunk of fewer than `exact_below` rows (a decode step) runs mlx-lm's
own modules. `MlxRows` runs a prepared `RowFunction` on MLX rows, in its chunks (`RowFunction.pieces`): each chunk's
static rows cross to the backend as a torch view and its output back into MLX (`RowFunction.on_static`); where the
plan splits the function by rows, the chunk's other rows run on mlx-lm's own modules (`share`), started before the
static call so that both compute at once. Imports mlx."""
from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import torch

from runtime.dense.dense_executor import DenseExecutor, FusedQKV, FusedSharedExpert, RowFunction
from runtime.mlx.dense_view import DenseView, Slot
from runtime.mlx.mlx_exact import TORCH_DTYPES, to_mx, to_torch
from runtime.stats import DENSE_PARTS, lane_of


class MlxPatches:
    """The torch spine's `Patches` on mlx-lm's model: a torch module of the view stands for its mlx-lm slot, whose
    call is swapped (`swap(parent, name, new)`: the spine's, undone on uninstall)."""

    def __init__(self, slots: dict[int, Slot], swap: Callable) -> None:
        self.slots, self.swap = slots, swap

    def own(self, module: torch.nn.Module):
        slot = self.slots[id(module)]
        return getattr(slot.parent, slot.name)

    def set(self, module: torch.nn.Module, forward) -> None:
        slot = self.slots[id(module)]
        self.swap(slot.parent, slot.name, forward)


def mlx_parts(widths: tuple[int, ...]) -> Callable[[mx.array], list[mx.array]]:
    """A function's concatenated MLX output cut into its outputs along the last axis."""
    cuts = [sum(widths[:i + 1]) for i in range(len(widths) - 1)]
    return lambda y: mx.split(y, cuts, axis=-1)


class MlxRows:
    """A prepared `RowFunction` on MLX rows `[..., in]`, its calls and time kept per lane (`timer.lanes`) and its
    whole call timed in its part's bucket in a timed pass (`timer`: the spine's `_Timer`)."""

    def __init__(self, fn: RowFunction, share: Callable[[mx.array], mx.array], timer, lane: str) -> None:
        self.fn, self.share, self.timer, self.lane = fn, share, timer, lane
        self.part, self.backend = DENSE_PARTS[fn.part], lane_of(fn.backend)
        self.lanes = None  # two chunks in flight (`runtime.mlx.overlap.Lanes`): each static call on the static lane

    def static(self, x: mx.array) -> bool:
        return self.fn.static(x)

    def __call__(self, x: mx.array) -> mx.array:
        if not self.timer.timing:
            return self._run(x)
        return self.timer.time(self.part, self._run, x)[0]

    def _run(self, x: mx.array) -> mx.array:
        flat = x.reshape(-1, x.shape[-1])
        outs = []
        for start, cut, stop in self.fn.pieces(flat.shape[0]):
            share = self._share(flat[cut:stop]) if cut < stop else None
            outs += [self._static(flat[start:cut])] + ([share] if share is not None else [])
        y = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _share(self, rows: mx.array) -> mx.array:
        """The split's other rows on mlx-lm's modules: started now, beside the static call (in a timed pass,
        computed first, so the static call's time is its own)."""
        out = self.share(rows)
        (mx.eval if self.timer.timing else mx.async_eval)(out)
        self.timer.lanes.add(self.part, self.lane)
        return out

    def _static(self, rows: mx.array) -> mx.array:
        start = time.perf_counter()
        rows_t = to_torch(rows, TORCH_DTYPES[rows.dtype])
        with torch.inference_mode():
            if self.lanes is None:
                y_t = self.fn.on_static(rows_t)
            else:
                with self.lanes.off_host(), self.lanes.on_static(self.fn.backend):
                    y_t = self.fn.on_static(rows_t)
            y = to_mx(y_t.to(rows_t.dtype))
        mx.eval(y)
        self.timer.lanes.add(self.part, self.backend, 1, time.perf_counter() - start if self.timer.timing else None)
        return y


def _qkv_share(m: dict) -> Callable[[mx.array], mx.array]:
    """Norm, q, k, v and the q/k norms of rows [n, H] on mlx-lm's modules, concatenated: the norms over heads where
    their width is a head's, over the projection where it is the projection's."""
    def normed(role: str, y: mx.array) -> mx.array:
        if role not in m:
            return y
        return m[role](y.reshape(y.shape[0], -1, m[role].weight.shape[-1])).reshape(y.shape[0], -1)

    def run(x: mx.array) -> mx.array:
        h = m["norm"](x)
        q, k, v = m["q"](h), m["k"](h), m["v"](h)
        return mx.concatenate([normed("q_norm", q), normed("k_norm", k), v], axis=-1)

    return run


def mlx_splices(dense: DenseExecutor, view: DenseView, timer, lane: str) -> list:
    """The hand-overs of `dense`'s prepared row-wise functions on mlx-lm's modules, each `install`ed with
    `MlxPatches`: `FusedQKV`, `FusedSharedExpert`, or (module, `MlxRows`) for a whole-module replacement."""
    out = []
    for item in dense.fused:
        if isinstance(item, FusedQKV):
            mlx = {role: view.slots[id(m)].module for role, m in item.modules.items()}
            out.append(FusedQKV(item.modules, MlxRows(item.fn, _qkv_share(mlx), timer, lane), item.splits,
                                mlx_parts(item.splits)))
        elif isinstance(item, FusedSharedExpert):
            expert, gate = (view.slots[id(m)].module for m in (item.expert, item.gate))
            rows = MlxRows(item.fn, lambda x, e=expert, g=gate: mx.concatenate([e(x), g(x)], axis=-1), timer, lane)
            out.append(FusedSharedExpert(item.expert, item.gate, rows, item.hidden, mlx_parts((item.hidden, 1))))
        else:
            module, fn = item
            out.append((module, MlxRows(fn, view.slots[id(module)].module, timer, lane)))
    return out
