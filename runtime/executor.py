"""The MoE executor: keeps transformers' routing and replaces expert compute by the plan.

Per layer and chunk: rank each expert's assignments by saliency, pack the ones that fit into the group's
fixed slices, run each group in one static call, run cold experts (and spilled overflow) exactly on the plan's exact
paths (cpu-exact, or another registered one: `Plan.exact`, `LayerPlan.exact_split`), then combine with the router
weights. Registered as a transformers experts implementation.

Decode policy: a chunk with fewer tokens than the plan's `exact_below` (every decode step) runs wholly on the exact
path (cpu-exact: transformers' own grouped kernel): no static call, no padding, no drop, no overhead where static
groups cannot pay off. A layer without groups runs its other chunks on the chunked exact path, expert by expert,
as the cost model prices it (and faster than transformers' kernel at a chunk's rows: measured on the Linux x86-64
host, fp32, one thread, 1.6x at a Qwen3-30B-A3B-width 4,096-token chunk, 1.14x at tiny-moe's 2,048).
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial

import numpy as np
import torch
from transformers.integrations.moe import ExpertsInterface

from runtime.backends import ExactFn, ExactPath, GroupFn, GroupSpec, StaticBackend, registry
from runtime.dense import DenseExecutor
from runtime.drift import DriftMonitor
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.plan import LayerPlan, Plan, check_plan_matches
from runtime.stats import PHASES, LayerStats, RunStats

IMPLEMENTATION = "npumoe"


class LayerExecutor:
    """One MoE layer under its plan: lookup tables from expert id to slice, and the prepared group calls."""

    def __init__(self, layer_plan: LayerPlan, module: torch.nn.Module, plan: Plan, stats: LayerStats,
                 backends: dict[str, StaticBackend], exact: ExactFn | None = None,
                 exact_paths: dict[str, ExactPath] | None = None) -> None:
        """`exact_paths`: the exact paths the plan names, resolved (`resolve_exact_paths`; default: resolved here);
        `exact`: a compute replacing theirs (the profiler swaps in identity to time host work alone)."""
        n = module.num_experts
        self.exact = exact
        self.module, self.own_stats = module, stats
        self.chunk, self.spill, self.rule = plan.chunk_tokens, plan.overflow == "spill", plan.saliency
        self.exact_below = plan.exact_below
        # Set by a PlanExecutor: the calling thread's phase and sequences, and this layer's stats per phase.
        self.context: ForwardContext | None = None
        self.phase_stats: dict[str, LayerStats] = {}
        # The layer's exact paths, the plan's first (spills, decode steps, cold experts), then its exact_split's;
        # `path_of[e]`: which one runs expert e's exact assignments. Prepared before the groups: a path that moves
        # the experts (mlx-exact: into MLX's memory, the largest tensor held twice for a moment) peaks before a
        # group's backend adds its own weights (ane-sim's fp16 experts), not on top of them
        names = [plan.exact_path, *(p for p in (layer_plan.exact_split or {}) if p != plan.exact_path)]
        paths = {p: (exact_paths or {}).get(p) or registry.resolve_exact(p) for p in names}
        self.paths = [(paths[p].name, paths[p].prepare(module)) for p in names]
        self.base = torch.full((n,), -1, dtype=torch.long)  # first packed row of each grouped expert
        self.cap = torch.zeros(n, dtype=torch.long)
        self.group_of = torch.full((n,), -1, dtype=torch.long)
        self.groups: list[tuple[str, GroupFn, int, int]] = []  # (backend name, fn, first row, end row)
        row = 0
        for gi, g in enumerate(layer_plan.groups):
            backend = backends[g.backend]
            fn = backend.prepare(GroupSpec(layer_plan.layer, gi, tuple(g.experts), tuple(g.capacities), module,
                                           g.compression))
            for e, c in zip(g.experts, g.capacities):
                self.base[e], self.cap[e], self.group_of[e] = row, c, gi
                row += c
            self.groups.append((backend.name, fn, row - g.slots, row))
        self.slots = row
        self.path_of = torch.zeros(n, dtype=torch.long)
        for i, p in enumerate(names[1:], 1):
            self.path_of[(layer_plan.exact_split or {})[p]] = i
        # Where a group or an exact path runs off the CPU, the chunk's exact path runs meanwhile on one worker.
        self.overlap = bool(layer_plan.groups) and (any(backends[g.backend].overlaps_cpu for g in layer_plan.groups)
                                                    or any(paths[p].overlaps_cpu for p in names))
        self.pool: ThreadPoolExecutor | None = None
        self.own_pool = False

    def open(self, worker: ThreadPoolExecutor | None = None) -> None:
        """Run the chunk's exact path on a worker where groups overlap the CPU: `worker` (a run's, shared by its
        layers), else one of its own; `close` lets it go (stopping its own)."""
        if self.overlap and self.pool is None:
            self.pool, self.own_pool = worker or ThreadPoolExecutor(1, thread_name_prefix="npumoe-exact"), not worker

    def close(self) -> None:
        if self.pool is not None and self.own_pool:
            self.pool.shutdown(wait=True)
        self.pool = None

    @property
    def stats(self) -> LayerStats:
        """Where this call counts: the calling thread's phase's stats (standalone: the layer's own)."""
        return self.own_stats if self.context is None else self.phase_stats[self.context.phase]

    def __call__(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        below = self.exact_below * (1 if self.context is None else self.context.sequences)
        if x.shape[0] < below:
            return self._all_exact(x, top_k_index, top_k_weights)
        if x.shape[0] <= self.chunk:
            return self._chunk(x, top_k_index, top_k_weights)
        return torch.cat([self._chunk(x[s:s + self.chunk], top_k_index[s:s + self.chunk],
                                      top_k_weights[s:s + self.chunk]) for s in range(0, x.shape[0], self.chunk)])

    def _chunk(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = idx.shape[1]
        eid, w = idx.reshape(-1), weights.reshape(-1).to(x.dtype)
        tok = torch.arange(eid.numel()) // k
        grouped = self.base[eid] >= 0
        out = torch.zeros_like(x)
        st = self.stats
        loads = torch.bincount(eid, minlength=self.base.numel())

        exact, n_over = ~grouped, 0
        if self.groups:
            kept, rows, overflow = self._pack_rows(x, eid, w, tok, grouped, loads)
            exact = exact | overflow if self.spill else exact
            n_over = int(overflow.sum())
        st.record_chunk(x.shape[0], loads, n_over, self.spill)
        future = self.pool.submit(self._exact, x, eid, w, tok, exact, st) if self.pool else None
        if self.groups:
            packed = x.new_zeros(self.slots, x.shape[1])
            packed[rows] = x[tok[kept]]
            y = torch.cat([self._group_call(st, name, fn, packed[a:b]) for name, fn, a, b in self.groups])
            out.index_add_(0, tok[kept], y[rows] * w[kept, None])
            filled = torch.bincount(self.group_of[eid[kept]], minlength=len(self.groups)).tolist()
            for (name, _, a, b), f in zip(self.groups, filled):
                st.calls_per_backend[name] += 1
                st.tokens_per_backend[name] += f
                st.filled += f
                st.slots += b - a
        exact_out = future.result() if future else self._exact(x, eid, w, tok, exact, st)
        if exact_out is not None:
            out.index_add_(0, *exact_out)
        return out

    @staticmethod
    def _group_call(st: LayerStats, name: str, fn: GroupFn, rows: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        y = fn(rows)
        st.seconds_per_backend[name] += time.perf_counter() - start
        return y

    def _all_exact(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Every assignment exact, in one call of the plan's exact path (cpu-exact: transformers' grouped kernel).
        Not shown to the drift monitor: the plan never ran these chunks."""
        st = self.stats
        name, path = self.paths[0]
        self._count_all_exact(st, x.shape[0], idx.reshape(-1).tolist())
        start = time.perf_counter()
        out = path.forward(x, idx, weights, st)
        st.seconds_per_backend[name] += time.perf_counter() - start
        return out

    def _count_all_exact(self, st: LayerStats, tokens: int, ids: list[int]) -> None:
        st.tokens += tokens  # a few tokens (a decode step): counting in Python is cheaper than more torch ops
        st.assignments += len(ids)
        _count_exact(st, self.paths[0][0], len(ids), len(set(ids)))

    def count_exact(self, idx: torch.Tensor | np.ndarray) -> None:
        """Count, computing nothing, what `__call__` counts for assignments `idx` [T, k] (torch or numpy) of a layer
        with no groups whose experts all run on its first exact path: for a caller that runs them itself (the MLX
        spine runs mlx-lm's own kernel there), so both spines account alike. A decode step's few ids are counted
        in Python (no torch call: the MLX spine counts every layer of every step)."""
        below = self.exact_below * (1 if self.context is None else self.context.sequences)
        st = self.stats
        if idx.shape[0] < below:
            return self._count_all_exact(st, idx.shape[0], idx.reshape(-1).tolist())
        idx = torch.as_tensor(idx).long()
        for s in range(0, idx.shape[0], self.chunk):
            eid = idx[s:s + self.chunk].reshape(-1)
            loads = torch.bincount(eid, minlength=self.base.numel())
            st.record_chunk(eid.numel() // idx.shape[1], loads, 0, self.spill)
            _count_exact(st, self.paths[0][0], eid.numel(), int((loads > 0).sum()))

    def _pack_rows(self, x, eid, w, tok, grouped, loads):
        """Rank each expert's assignments by descending saliency; the first `cap[e]` keep a packed row."""
        saliency = w if self.rule == "router_weight" else w * x.norm(dim=-1)[tok]
        order = torch.argsort(saliency, descending=True, stable=True)
        order = order[torch.argsort(eid[order], stable=True)]  # by expert, then by saliency
        starts = loads.cumsum(0) - loads
        rank = torch.empty_like(eid)
        rank[order] = torch.arange(eid.numel()) - starts[eid[order]]
        kept = grouped & (rank < self.cap[eid])
        return kept, self.base[eid[kept]] + rank[kept], grouped & ~kept

    def _exact(self, x, eid, w, tok, mask, st: LayerStats) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The masked assignments on their exact paths, grouped by expert, no padding, counted in `st` (the
        caller's: this may run on the exact-path worker). Returns (token index, rows)."""
        sel = mask.nonzero().squeeze(1)
        if sel.numel() == 0:
            return None
        sel = sel[torch.argsort(eid[sel], stable=True)]
        if len(self.paths) == 1:
            return self._exact_on(0, x, eid, w, tok, sel, st)
        on = self.path_of[eid[sel]]
        parts = [self._exact_on(i, x, eid, w, tok, sel[on == i], st) for i in range(len(self.paths))]
        parts = [p for p in parts if p is not None]
        return torch.cat([t for t, _ in parts]), torch.cat([y for _, y in parts])

    def _exact_on(self, path: int, x, eid, w, tok, sel, st: LayerStats) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Assignments `sel` (sorted by expert) on exact path `path`."""
        if sel.numel() == 0:
            return None
        counts = torch.bincount(eid[sel], minlength=self.base.numel())
        experts = counts.nonzero().squeeze(1).tolist()
        counts = counts[experts].tolist()
        name, layer = self.paths[path]
        start = time.perf_counter()
        xs = x[tok[sel]]
        y = self.exact(self.module, xs, experts, counts) if self.exact else layer.run(xs, experts, counts, st)
        st.seconds_per_backend[name] += time.perf_counter() - start
        _count_exact(st, name, sel.numel(), len(experts))
        return tok[sel], y * w[sel, None]


def _count_exact(st: LayerStats, name: str, assignments: int, experts: int) -> None:
    """One exact-path call of `experts` experts over `assignments` assignments."""
    st.tokens_per_backend[name] += assignments
    st.calls_per_backend[name] += experts


def _npumoe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    executor = getattr(self, "_npumoe_executor", None)
    if executor is None:
        raise RuntimeError("experts implementation 'npumoe' is set but no plan is installed; use PlanExecutor")
    return executor(hidden_states, top_k_index, top_k_weights)


ExpertsInterface.register(IMPLEMENTATION, _npumoe_experts_forward)


def resolve_exact_paths(plan: Plan) -> dict[str, ExactPath]:
    """Every exact path the plan names (`Plan.exact`, each layer's `exact_split`), each resolved once: an
    unavailable one runs on its fallback (cpu-exact), said once."""
    names = {plan.exact_path, *(p for lp in plan.layers for p in (lp.exact_split or {}))}
    return {name: registry.resolve_exact(name) for name in sorted(names)}


class ForwardContext(threading.local):
    """Per thread: the phase its forwards count as (`pinned`: kept until unpinned) and how many sequences one
    forward holds (a batched decode step: the exact_below rule counts per sequence). Per thread, so a prefill on
    its own thread and the decode steps beside it each keep theirs."""
    phase: str = "prefill"
    pinned: bool = False
    sequences: int = 1


class PlanRun:
    """What every spine keeps of a plan's run (the torch spine's `PlanExecutor`, the MLX spine's `MlxSpine`): the
    backends and exact paths resolved once, one `LayerExecutor` per MoE layer (one accounting of capacity, drops
    and spills for both), the run statistics per phase, the drift monitor and each thread's forward context."""

    def __init__(self, plan: Plan, backends: dict[str, StaticBackend] | None, options: dict | None,
                 exact_paths: dict[str, ExactPath]) -> None:
        """`backends`: ready backends by name; the others the plan names are made by the registry, with `options`
        (e.g. `{"package": path}` for the ane backend) given to those that take them."""
        self.plan = plan
        self.stats = RunStats(exact_paths=frozenset(registry.exact_paths()))
        registry.check_options(options or {})
        # Resolve each named backend once per run, so an unavailable one falls back (and says so) once.
        named = {g.backend for lp in plan.layers for g in lp.groups}
        self.backends = {name: registry.resolve(name, backends, options) for name in sorted(named)}
        self.exact_paths = exact_paths
        self.fallbacks = {name: b.name for name, b in [*self.backends.items(), *self.exact_paths.items()]
                          if b.name != name}
        self.context = ForwardContext()
        self.drift = DriftMonitor(plan)
        self.layers: dict[int, LayerExecutor] = {}

    def add_layer(self, index: int, module: torch.nn.Module) -> LayerExecutor:
        """MoE layer `index` (its experts module `module`) under the plan, counted in this run."""
        layer = LayerExecutor(self.plan.layer(index), module, self.plan, self.stats.layer(index), self.backends,
                              exact_paths=self.exact_paths)
        layer.context, layer.phase_stats = self.context, {p: self.stats.layer(index, p) for p in PHASES}
        self.stats.layer(index).watcher = partial(self.drift.observe, index)
        self.layers[index] = layer
        return layer

    @property
    def phase(self) -> str:
        """The calling thread's phase."""
        return self.context.phase

    @property
    def pinned(self) -> bool:
        return self.context.pinned

    def set_phase(self, phase: str, pin: bool = False) -> None:
        """Count what the calling thread runs next as `phase`; `pin` keeps it until unpinned (else each forward
        classifies itself)."""
        assert phase in PHASES, phase
        self.context.phase, self.context.pinned = phase, pin

    def set_sequences(self, n: int) -> None:
        """The calling thread's next forwards run `n` sequences at once (a batched decode step): each layer's
        exact_below rule counts each sequence's tokens, so n one-token steps run exactly as one would."""
        self.context.sequences = n

    def reset(self) -> None:
        """Start counting afresh (run statistics, the drift monitor, backends' energy), as before a repeated run."""
        self.stats.reset()
        self.drift.reset()
        for backend in self._energy_backends():
            backend.energy.clear()

    def _energy_backends(self) -> list[StaticBackend]:
        """The backends that measure their calls' energy: an `energy` dict (per function: summed mJ per unit and
        `calls`), e.g. `ane` with zeus-apple-silicon. A backend serving several names is listed once."""
        unique = {id(b): b for b in self.backends.values()}
        return [b for b in unique.values() if isinstance(getattr(b, "energy", None), dict)]

    def energy(self) -> dict[str, dict[str, float]]:
        """Per backend that measured some, the energy of its calls since the last reset: mJ per unit and `calls`
        (measured by the backend, never estimated)."""
        out = {}
        for backend in self._energy_backends():
            total: Counter = Counter()
            for per_function in backend.energy.values():
                total.update(per_function)
            if total:
                out[backend.name] = dict(total)
        return out


class PlanExecutor(PlanRun):
    """Installs a plan on a transformers MoE model (and uninstalls it); collects run statistics."""

    def __init__(self, model: torch.nn.Module, plan: Plan, backends: dict[str, StaticBackend] | None = None,
                 plan_path: str = "", options: dict | None = None) -> None:
        """`backends`, `options`: as `PlanRun` takes them."""
        check_plan_matches(plan, model_spec(model), plan_path)
        super().__init__(plan, backends, options, resolve_exact_paths(plan))
        self.model = model
        for layer in moe_layers(model):
            self.add_layer(layer.index, layer.experts)
        # The plan's dense functions (Plan.dense), installed and uninstalled with the experts: runtime/dense.
        # Given the backends resolved for the groups: a backend named by both is one instance, its fallback said once.
        self.dense = (DenseExecutor(model, plan, {**(backends or {}), **self.backends}, options)
                      if plan.dense is not None else None)
        self.worker: ThreadPoolExecutor | None = None  # the layers' exact-path worker while installed
        self._previous: str | None = None
        self._hook = None

    def _classify_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: a decode step feeds one token per sequence onto a cache that already holds some."""
        if self.pinned:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        decode = (ids is not None and ids.shape[1] == 1 and cache is not None
                  and hasattr(cache, "get_seq_length") and cache.get_seq_length() > 0)
        self.set_phase("decode" if decode else "prefill")

    def install(self) -> "PlanExecutor":
        # One exact-path worker for every layer (they run one after another): glibc gives each thread its own
        # malloc arena, which keeps what it freed, so a worker per layer held one layer's exact-path temporaries
        # per layer, and the gate's spilling candidates on tiny-moe grew its peak 215.7 -> 321.1 MiB (2 -> 4)
        if self.worker is None and any(layer.overlap for layer in self.layers.values()):
            self.worker = ThreadPoolExecutor(1, thread_name_prefix="npumoe-exact")
        for layer in moe_layers(self.model):
            self.layers[layer.index].open(self.worker)
            layer.experts._npumoe_executor = self.layers[layer.index]
        self._previous = self.model.config._experts_implementation
        self.model.set_experts_implementation(IMPLEMENTATION)
        self._hook = self.model.register_forward_pre_hook(self._classify_forward, with_kwargs=True)
        if self.dense is not None:
            self.dense.install()
        return self

    def uninstall(self) -> None:
        if self.dense is not None:
            self.dense.uninstall()
        self.model.set_experts_implementation(self._previous or "grouped_mm")
        for layer in moe_layers(self.model):
            layer.experts._npumoe_executor = None
            self.layers[layer.index].close()
        if self.worker is not None:
            self.worker.shutdown(wait=True)
            self.worker = None
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @property
    def installed(self) -> bool:
        return self._hook is not None

    @contextmanager
    def applied(self, on: bool) -> Iterator[None]:
        """The plan installed (`on`) or not for the block; installed or not as before, after it."""
        was = self.installed
        if on and not was:
            self.install()
        elif was and not on:
            self.uninstall()
        try:
            yield
        finally:
            if self.installed != was:
                (self.install if was else self.uninstall)()

    def __enter__(self) -> "PlanExecutor":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()
