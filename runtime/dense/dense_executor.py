"""A plan's dense functions installed on a transformers model (`Plan.dense`), keeping transformers' own code path.

Row-wise functions replace module forwards in place (the module's instance `forward`, restored on uninstall), so
the decoder layer's code, its residuals, rope and KV cache run as transformers wrote them:
- `qkv`: the input norm passes its input through untouched, `q_proj` runs the fused function (norm, q, k, v and the
  q/k norms) and keeps k and v for `k_proj` and `v_proj` to return; the q/k norms pass their (already normed) input
  through. Each hand-over checks it is the same tensor, so any other caller gets the module's own forward.
- `o_proj`, a dense MLP: the function in place of the forward. A shared expert: the function returns the expert's
  output and keeps its gate's logit for `shared_expert_gate` to return (the sigmoid and product stay transformers').
A chunk of fewer than the plan's `exact_below` rows (a decode step) runs the modules' own forwards: exact. Others are
cut into the plan's chunks, a partial one padded with zero rows. A function the plan splits by rows (`rows`) takes
each chunk's first rows while the CPU computes the rest with the exact reference at the same time (`Split`): where
its backend runs off the CPU, its call waits on one worker thread meanwhile. The attention core:
runtime/dense/attention.py.
"""
from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from runtime.backends import DenseFn, DenseSpec, StaticBackend, registry
from runtime.backends.protocol import attention_reference, dense_reference
from runtime.dense.attention import EXACT, IMPLEMENTATION, AttentionCore, Split
from runtime.dense.families import mlp_modules
from runtime.dense.specs import attention_spec, layer_specs
from runtime.errors import NpumoeError
from runtime.plan import DenseFunction, DenseLayer, Plan

log = logging.getLogger("npumoe")


class RowFunction:
    """A row-wise dense function on its backend: `[..., in]` -> `[..., out]` in the plan's chunks (`rows`); split,
    the function takes each chunk's first `split.rows` rows and the CPU the rest. The chunking (`pieces`) and the
    padded static call (`on_static`) are what the MLX spine's splices call too (runtime/mlx/splices.py)."""

    def __init__(self, fn: DenseFn, rows: int, exact_below: int, backend: str, part: str, calls: Counter,
                 split: Split | None = None) -> None:
        self.fn, self.rows, self.exact_below, self.backend = fn, rows, exact_below, backend
        self.part, self.calls, self.split = part, calls, split

    def static(self, x) -> bool:
        """Whether these rows (a torch tensor or an MLX array, `[..., in]`) run on the function (else on the
        modules' own forwards, exactly)."""
        static = math.prod(x.shape[:-1]) >= self.exact_below
        if not static:
            self.calls[(self.part, EXACT)] += 1
        return static

    @property
    def static_rows(self) -> int:
        """The rows the function's static shape takes."""
        return self.split.rows if self.split else self.rows

    def pieces(self, total: int) -> list[tuple[int, int, int]]:
        """Each chunk of `total` rows as (start, cut, stop): the function takes rows start:cut (padded to its
        static rows), the split's other side cut:stop (none where cut == stop)."""
        out = []
        for start in range(0, total, self.rows):
            stop = min(start + self.rows, total)
            out.append((start, min(start + self.static_rows, stop), stop))
        return out

    def on_static(self, part: torch.Tensor) -> torch.Tensor:
        """The function on `part` (at most its static rows), padded with zero rows to its shape; `part`'s rows of
        its output (in the function's dtype)."""
        n = part.shape[0]
        if n < self.static_rows:
            part = torch.cat([part, part.new_zeros(self.static_rows - n, part.shape[1])])
        return self.fn(part)[:n]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        outs = []
        for start, cut, stop in self.pieces(flat.shape[0]):
            if cut < stop:
                static = functools.partial(self.on_static, flat[start:cut])
                outs.append(torch.cat(self.split.run(static, self.split.cpu, flat[cut:stop], x.dtype, self.calls,
                                                     self.part)))
            else:
                outs.append(self.on_static(flat[start:cut]).to(x.dtype))
            self.calls[(self.part, self.backend)] += 1
        y = torch.cat(outs) if len(outs) > 1 else outs[0]
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)


class Patches:
    """Instance `forward`s set on modules, undone in reverse order."""

    def __init__(self) -> None:
        self._saved: list[tuple[torch.nn.Module, object]] = []

    def own(self, module: torch.nn.Module):
        """What calling `module` runs now."""
        return module.forward

    def set(self, module: torch.nn.Module, forward) -> None:
        self._saved.append((module, module.__dict__.get("forward")))
        module.forward = forward

    def undo(self) -> None:
        for module, previous in reversed(self._saved):
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._saved.clear()


class HandOver(threading.local):
    """What one forward hands from one module's call to the next, per thread: a server's long prefill runs on its own
    thread beside the decode steps, through the same modules."""

    def __init__(self) -> None:
        self.raw: torch.Tensor | None = None
        self.kept: dict[str, torch.Tensor] = {}
        self.normed: set[str] = set()
        self.logit: torch.Tensor | None = None


def torch_parts(widths: tuple[int, ...]):
    """A function's concatenated output `[..., sum(widths)]` cut into its outputs along the last axis."""
    return lambda y: [t.contiguous() for t in y.split(list(widths), dim=-1)]


class FusedQKV:
    """The hand-over of one layer's fused norm + q/k/v function between the modules the model calls in turn.
    `fn` takes the raw rows; `parts` cuts its output into q, k and v (torch tensors by default; the MLX spine gives
    its own, with its `Patches`)."""

    def __init__(self, modules: dict[str, torch.nn.Module], fn: RowFunction, splits: tuple[int, ...],
                 parts=None) -> None:
        self.modules, self.fn, self.splits = modules, fn, tuple(splits)
        self.parts = parts or torch_parts(self.splits)
        self.state = HandOver()

    def install(self, patches: Patches) -> None:
        own = {role: patches.own(m) for role, m in self.modules.items()}
        patches.set(self.modules["norm"], lambda x: self._norm(x, own["norm"]))
        patches.set(self.modules["q"], lambda h: self._q(h, own["q"]))
        for role in ("k", "v"):
            patches.set(self.modules[role], lambda h, role=role: self._kept(role, h, own[role]))
        for role in ("q_norm", "k_norm"):
            if role in self.modules:
                patches.set(self.modules[role], lambda x, role=role: self._norm_done(role, x, own[role]))

    def _norm(self, x: torch.Tensor, own) -> torch.Tensor:
        if not self.fn.static(x):
            return own(x)
        self.state.raw = x
        return x

    def _q(self, h: torch.Tensor, own) -> torch.Tensor:
        if h is not self.state.raw:
            return own(h)
        q, k, v = self.parts(self.fn(h))
        self.state.kept = {"k": k, "v": v}
        self.state.normed = {"q_norm", "k_norm"}
        return q

    def _kept(self, role: str, h: torch.Tensor, own) -> torch.Tensor:
        if h is not self.state.raw or role not in self.state.kept:
            return own(h)
        out = self.state.kept.pop(role)
        if not self.state.kept:
            self.state.raw = None
        return out

    def _norm_done(self, role: str, x: torch.Tensor, own) -> torch.Tensor:
        if role not in self.state.normed:
            return own(x)
        self.state.normed.discard(role)
        return x


class FusedSharedExpert:
    """A shared expert's function: the expert's output, and its gate's logit kept for `shared_expert_gate`."""

    def __init__(self, expert: torch.nn.Module, gate: torch.nn.Module, fn: RowFunction, hidden: int,
                 parts=None) -> None:
        self.expert, self.gate, self.fn, self.hidden = expert, gate, fn, hidden
        self.parts = parts or torch_parts((hidden, 1))
        self.state = HandOver()

    def install(self, patches: Patches) -> None:
        own_expert, own_gate = patches.own(self.expert), patches.own(self.gate)
        patches.set(self.expert, lambda x: self._expert(x, own_expert))
        patches.set(self.gate, lambda x: self._gate(x, own_gate))

    def _expert(self, x: torch.Tensor, own) -> torch.Tensor:
        if not self.fn.static(x):
            return own(x)
        out, self.state.logit = self.parts(self.fn(x))
        self.state.raw = x
        return out

    def _gate(self, x: torch.Tensor, own) -> torch.Tensor:
        if x is not self.state.raw:
            return own(x)
        logit, self.state.raw, self.state.logit = self.state.logit, None, None
        return logit


def replaced(own, fn: RowFunction):
    """A module's call as a row-wise function runs it: on the function where its rows are static, else `own`."""
    return lambda x: fn(x) if fn.static(x) else own(x)


def install_fused(items: list, patches: Patches) -> None:
    """Each hand-over (`FusedQKV`, `FusedSharedExpert`) and each (module, row function) replacement, set with
    `patches` (the torch spine's, or the MLX spine's on mlx-lm's modules)."""
    for item in items:
        if isinstance(item, tuple):
            patches.set(item[0], replaced(patches.own(item[0]), item[1]))
        else:
            item.install(patches)


def dense_backend(name: str, given: dict[str, StaticBackend] | None, options: dict | None) -> StaticBackend:
    """The backend to run `name`'s dense functions on: the first one down its fallbacks that can (`prepare_dense`)."""
    for candidate in registry.fallbacks(name):
        backend = registry.resolve(candidate, given, options)  # says so itself where `candidate` falls back
        if hasattr(backend, "prepare_dense"):
            if candidate != name:
                log.warning("backend %r does not run dense functions yet: %s runs the plan's dense functions on it",
                            name, backend.name)
            return backend
    raise NpumoeError(f"no backend down {name!r}'s fallbacks runs dense functions")


def check_dense_fits(model: torch.nn.Module, plan: Plan) -> None:
    """Refuse, in one line naming the layer, a dense placement the loaded model cannot run."""
    dense = plan.dense
    if dense is None:
        return
    context = getattr(model.config, "max_position_embeddings", None)
    attention_layers = [dl.layer for dl in dense.layers if dl.attention is not None]
    if attention_layers and context and dense.attention_context_buckets[-1] > context:
        raise NpumoeError(f"layer {attention_layers[0]}: the attention core's context bucket "
                          f"{dense.attention_context_buckets[-1]} (dense.attention_context_buckets) is past the "
                          f"model's context of {context} positions")
    if attention_layers and not dense.attention_context_buckets:
        raise NpumoeError(f"layer {attention_layers[0]}: the attention core names a backend but "
                          "dense.attention_context_buckets is empty")
    for i, dl in enumerate(dense.layers):
        if dl.mlp is not None and mlp_modules(model, dl.layer) is None:
            raise NpumoeError(f"layer {dl.layer} (dense.layers[{i}].mlp): the layer has neither a dense MLP nor a "
                              "shared expert")


@functools.cache
def _host_not_run(path: str) -> None:
    """Said once a process (the fidelity gate builds an executor per candidate)."""
    log.warning("the plan prices the dense work no static function takes on %r; the torch engine runs it on the CPU "
                "in torch, slower than predicted (the MLX engine runs it where it is priced)", path)


class DenseExecutor:
    """A plan's dense functions prepared on their backends for one model; `install` / `uninstall` apply them."""

    def __init__(self, model: torch.nn.Module, plan: Plan, backends: dict[str, StaticBackend] | None = None,
                 options: dict | None = None) -> None:
        check_dense_fits(model, plan)
        self.model, self.plan = model, plan
        self.calls: Counter = Counter()  # (part, backend name) -> calls
        self.patches = Patches()
        self._backends: dict[str, StaticBackend] = {}
        self._given, self._options = backends, options
        self.fused: list = []  # FusedQKV / FusedSharedExpert, and (module, RowFunction) replacements
        self.cores: dict[int, AttentionCore] = {}
        self._attention_fns: dict[tuple[str, int], DenseFn] = {}  # one per (backend, bucket): shared by layers
        self._previous_attention: str | None = None
        self.splits: list[tuple[Split, bool]] = []  # each split, and whether its backend runs off the CPU
        self.pool: ThreadPoolExecutor | None = None
        for dl in plan.dense.layers if plan.dense else ():
            self._prepare_layer(dl)

    def _backend(self, name: str) -> StaticBackend:
        if name not in self._backends:
            self._backends[name] = dense_backend(name, self._given, self._options)
        return self._backends[name]

    def ran_on(self, name: str) -> str:
        """The backend that runs the dense functions the plan puts on `name` (a stand-in's name where `name` falls
        back)."""
        return self._backend(name).name

    def _split(self, backend: StaticBackend, rows: int | None, cpu: DenseFn) -> Split | None:
        if rows is None:
            return None
        split = Split(rows, cpu)
        self.splits.append((split, bool(getattr(backend, "overlaps_cpu", False))))
        return split

    def _row_function(self, spec: DenseSpec, placed: DenseFunction) -> RowFunction:
        backend = self._backend(placed.backend)
        return RowFunction(backend.prepare_dense(spec), self.plan.chunk_tokens, self.plan.exact_below, backend.name,
                           spec.kind, self.calls, self._split(backend, placed.rows, dense_reference(spec)))

    def _prepare_layer(self, dl: DenseLayer) -> None:
        for spec, placed in layer_specs(self.model, self.plan, dl):
            fn = self._row_function(spec, placed)
            if spec.kind == "qkv":
                self.fused.append(FusedQKV(dict(spec.modules), fn, spec.splits))
            elif spec.form.shared_gate:
                self.fused.append(FusedSharedExpert(spec.modules["mlp"], spec.modules["gate"], fn, spec.splits[0]))
            else:
                self.fused.append((spec.modules["o" if spec.kind == "o_proj" else "mlp"], fn))
        if dl.attention is not None:
            self.cores[dl.layer] = self._attention_core(dl.attention, dl.layer)

    def _attention_core(self, name: str, index: int) -> AttentionCore:
        backend = self._backend(name)
        fns = {}
        for bucket in self.plan.dense.attention_context_buckets:
            key = (backend.name, bucket)
            if key not in self._attention_fns:
                self._attention_fns[key] = backend.prepare_dense(attention_spec(self.model, self.plan, index, bucket))
            fns[bucket] = self._attention_fns[key]
        scaling = float(self.model.model.layers[index].self_attn.scaling)
        cpu = lambda q, k, v, allowed: attention_reference(q, k, v, allowed, scaling)  # noqa: E731
        return AttentionCore(self.plan.chunk_tokens, fns, backend.name, scaling, self.calls,
                             self._split(backend, self.plan.dense.attention_rows, cpu), self.plan.dense.attention_block)

    @property
    def attention_functions(self) -> int:
        """Distinct attention-core functions prepared: one per (backend, bucket), however many layers use them."""
        return len(self._attention_fns)

    def install(self) -> "DenseExecutor":
        """The functions on the torch model (the MLX spine takes them prepared, and installs its own splices)."""
        if self.plan.dense is not None and self.plan.dense.exact not in (None, EXACT):
            _host_not_run(self.plan.dense.exact)
        if any(overlaps for _, overlaps in self.splits):
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="npumoe-dense")
        for split, overlaps in self.splits:
            split.pool = self.pool if overlaps else None
        install_fused(self.fused, self.patches)
        if self.cores:
            for index, core in self.cores.items():
                self.model.model.layers[index].self_attn._npumoe_attention = core
            self._previous_attention = self.model.config._attn_implementation
            self.model.set_attn_implementation(IMPLEMENTATION)
        return self

    def uninstall(self) -> None:
        self.patches.undo()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None
        for split, _ in self.splits:
            split.pool = None
        if self._previous_attention is not None:
            self.model.set_attn_implementation(self._previous_attention)
            self._previous_attention = None
        for index in self.cores:
            self.model.model.layers[index].self_attn.__dict__.pop("_npumoe_attention", None)

    def to_json(self) -> dict:
        """Calls per dense part and backend (cpu-exact: the rows or chunks that ran on the CPU exactly)."""
        out: dict[str, dict[str, int]] = {}
        for (part, backend), n in sorted(self.calls.items()):
            out.setdefault(part, {})[backend] = n
        return out
