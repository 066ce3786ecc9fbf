"""The MLX spine: a plan installed on mlx-lm's own model (`spine_loading`). The dense half runs in MLX as mlx-lm
computes it (`mx.fast.scaled_dot_product_attention`, mlx-lm's KV cache); each MoE block's experts are the plan's
block (`moe_block`), accounted by the torch spine's own `LayerExecutor` (`PlanRun`). Imports mlx.

What ran where is kept per part (`runtime.stats.Executed`): calls always (a counter per call, no sync); time in a
timed pass only (`timed()`), where each part's inputs and outputs are evaluated around it, since MLX's lazy graph
otherwise computes every part at the forward's end."""
from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from runtime.backends.registry import REFERENCE, registry
from runtime.dense.dense_executor import DenseExecutor, install_fused
from runtime.dense.parts import PartTimes
from runtime.dense.specs import backend_specs
from runtime.errors import NpumoeError
from runtime.executor import PlanRun
from runtime.loading.model_record import read_model_spec
from runtime.mlx.attention_splice import AttentionSplice
from runtime.mlx.blocks import MOE_BLOCKS, moe_blocks
from runtime.mlx.dense_view import dense_view
from runtime.mlx.formats import NAME, placed_dense, unspliced
from runtime.mlx.mlx_exact import device
from runtime.mlx.moe_block import (
    CountedSwitch,
    PlannedSwitch,
    SwitchExactLayer,
    SwitchExactPath,
    fast_layer,
    torch_experts,
)
from runtime.mlx.overlap import KvOrder, Lanes, OrderedAttention
from runtime.mlx.splices import MlxPatches, MlxRows, mlx_splices
from runtime.packages import PackageTarget, bind_package
from runtime.plan import Plan, check_plan_matches
from runtime.stats import Executed

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
KV = ("k_proj", "v_proj", "k_norm")  # what the KV cache holds is made of these
SHARED = ("shared_expert", "shared_expert_gate")


def dense_lane() -> str:
    """The lane MLX's dense ops run on here: `mlx-gpu` (Metal) or `mlx-cpu` (MLX's CPU device)."""
    return f"mlx-{device()}"


class _Timer:
    """Calls per part bucket always; in a timed pass (`timing`), each call's time with its inputs evaluated before
    and its output after. `lanes`: the spliced dense functions' calls per (part, lane), with the static calls' own
    time in a timed pass (their whole call's is in their part's bucket). `cache_only`: the forward fills the KV
    cache only, and the last layer's work past its keys and values is left out as an untimed forward leaves it
    (`_LastBlock` sets `pruning` from there)."""

    def __init__(self) -> None:
        self.timing, self.times, self.lanes = False, PartTimes(), Executed()
        self.cache_only = self.pruning = False

    def time(self, bucket: str, fn, *args, reads: Callable | None = None, **kwargs) -> tuple[object, float]:
        """`fn(*args, **kwargs)` timed, evaluated through `reads(out)` (default: its output)."""
        mx.eval([a for a in args if isinstance(a, mx.array)])
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        mx.eval(out if reads is None else reads(out))
        seconds = time.perf_counter() - start
        self.times.seconds[bucket] += seconds
        return out, seconds


class _Part:
    """A module of mlx-lm's model in its part's bucket: counted per call, and timed in a timed pass (but where the
    forward leaves it out: `_Timer.pruning`, unless it makes the keys or values the cache holds: `kv`)."""

    def __init__(self, inner, bucket: str, timer: _Timer, kv: bool = False) -> None:
        self.inner, self.bucket, self.timer, self.kv = inner, bucket, timer, kv

    def __call__(self, *args, **kwargs):
        self.timer.times.calls[self.bucket] += 1
        if not self.timer.timing or (self.timer.pruning and not self.kv):  # built, never computed
            return self.inner(*args, **kwargs)
        return self.timer.time(self.bucket, self.inner, *args, **kwargs)[0]


class _LastBlock(_Part):
    """The last decoder layer's attention, where nothing past it runs eagerly: in a timed forward that fills the
    cache only, it evaluates the cache it writes, not its output, and the layer's parts after its keys and values
    are left out (`_Timer.pruning`), as MLX leaves them out of an untimed forward (nothing reads them)."""

    def __call__(self, *args, **kwargs):
        if not (self.timer.timing and self.timer.cache_only):
            return super().__call__(*args, **kwargs)
        self.timer.times.calls[self.bucket] += 1
        self.timer.pruning = True
        cache = kwargs.get("cache") or next(a for a in args if hasattr(a, "state"))
        return self.timer.time(self.bucket, self.inner, *args, reads=lambda _: cache.state, **kwargs)[0]

    def __getattr__(self, name: str):  # an attribute of the module (the embedding's `as_linear`, a width)
        return getattr(self.inner, name)


class _TiedHead(_Part):
    """A tied embedding: looked up as it is (`rest`), its `as_linear` timed as the lm_head."""

    def __call__(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def as_linear(self, x: mx.array) -> mx.array:
        return _Part(self.inner.as_linear, "lm_head", self.timer)(x)


def forward_rows(model: nn.Module, ids: mx.array, cache: list | None, rows: str = "all",
                 lazy: bool = False) -> mx.array | None:
    """mlx-lm's forward of token ids `ids` [1, L] on `cache` (continued in place), evaluated: the logits of every
    position (`rows` "all": [1, L, vocab]), of the last (`"last"`: [1, 1, vocab]; the head computes one row, as
    transformers' `logits_to_keep=1`), or none (`"none"`: the cache filled, as mlx-lm's prefill evaluates it).
    `lazy`: the last row's logits left for the caller to evaluate (a pipelined decode step)."""
    if rows == "all":
        out = model(ids, cache=cache)
        mx.eval(out)
        return out
    hidden = model.model(ids, cache)  # every family mlx-lm writes: its decoder, then its head
    if rows == "none":  # the cache only, as mlx-lm's prefill: the last layer's MLP is never computed (no row needs it)
        mx.eval([c.state for c in cache])
        return None
    tied = getattr(model.args, "tie_word_embeddings", False)
    head = model.model.embed_tokens.as_linear if tied else model.lm_head
    out = head(hidden[:, -1:, :])
    if not lazy:
        mx.eval(out)
    return out


class MlxSpine(PlanRun):
    """Installs a plan on mlx-lm's model of `path` (and uninstalls it); collects run statistics and `executed`."""

    def __init__(self, model: nn.Module, plan: Plan, path: Path, backends: dict | None = None,
                 plan_path: str = "", options: dict | None = None, package: str | None = None) -> None:
        """`package`: what `autotune build` wrote for the plan, bound as the torch spine binds it (`bind_package`,
        against torch views of the experts) and given to the backends that take it."""
        spec = read_model_spec(str(path))
        check_plan_matches(plan, spec, plan_path)
        if unspliced(plan):
            raise NpumoeError(f"the plan puts dense functions ({', '.join(unspliced(plan))}) on a static backend, "
                              "which the MLX spine does not splice in yet: run it with --engine torch, or search it "
                              "for the MLX spine (it places only those the spine runs)")
        names = {plan.exact_path, *(p for lp in plan.layers for p in (lp.exact_split or {}))}
        exact = {n: SwitchExactPath() if n == NAME else registry.resolve_exact(n) for n in sorted(names)}
        blocks = moe_blocks(model)
        modules = {index: torch_experts(block.switch_mlp, index, check=not fast_layer(plan.layer(index), plan))
                   for index, block in blocks.items()}
        # the torch form of the modules the plan's dense functions read (views of mlx-lm's weights), what a package's
        # dense functions are checked against and the static backends prepare from
        self.view = dense_view(model, path, plan) if placed_dense(plan) else None
        if package:
            dense = partial(backend_specs, self.view.model) if self.view is not None else None
            backends = {**(backends or {}), **bind_package(package, plan, PackageTarget(spec, modules, dense),
                                                           plan_path)}
            options = {**(options or {}), "package": package}
        super().__init__(plan, backends, options, exact)
        self.model, self.timer = model, _Timer()
        self.switches: dict[int, CountedSwitch | PlannedSwitch] = {}
        for index, block in blocks.items():
            layer = self.add_layer(index, modules[index])
            layer.open()  # a worker per layer, for the spine's life
            fast = fast_layer(plan.layer(index), plan)
            self.switches[index] = (CountedSwitch if fast else PlannedSwitch)(block.switch_mlp, layer, self.timer)
        self._originals: list[tuple[nn.Module, str, object]] = []
        self.lane = dense_lane()
        self.in_flight_lanes: dict[str, dict[str, float]] = {}
        self.dense = self.attention = None
        self.splices: list = []
        if self.view is not None:
            self.dense = DenseExecutor(self.view.model, plan, {**(backends or {}), **self.backends}, options)
            self.splices = mlx_splices(self.dense, self.view, self.timer, self.lane)
            self.attention = AttentionSplice(self.dense.cores, self.timer) if self.dense.cores else None
        # where each layer's attention finds `scaled_dot_product_attention`: its family's module in mlx-lm
        self._families = {sys.modules[type(layer.self_attn).__module__] for layer in model.layers}

    def install(self) -> MlxSpine:
        if self._originals:
            return self
        blocks = moe_blocks(self.model)
        for index, switch in self.switches.items():
            self._swap(blocks[index], "switch_mlp", switch)
        blocks = {id(block) for block in blocks.values()}
        for layer in self.model.layers:
            attn = layer.self_attn
            for name in PROJECTIONS:
                if name in attn:
                    self._swap(attn, name, _Part(attn[name], "attention_projections", self.timer, name in KV))
            block = _LastBlock if layer is self.model.layers[-1] and self.prunes_last else _Part
            self._swap(layer, "self_attn", block(attn, "block", self.timer))
            for name in (n for n in MOE_BLOCKS if n in layer):
                if id(layer[name]) not in blocks:  # a dense MLP layer
                    self._swap(layer, name, _Part(layer[name], "dense_mlp", self.timer))
                    continue
                for shared in (s for s in SHARED if s in layer[name]):
                    self._swap(layer[name], shared, _Part(layer[name][shared], "dense_mlp", self.timer))
        inner = self.model.model if "model" in self.model else self.model
        if "lm_head" in self.model:
            self._swap(self.model, "lm_head", _Part(self.model["lm_head"], "lm_head", self.timer))
        else:
            self._swap(inner, "embed_tokens", _TiedHead(inner["embed_tokens"], "rest", self.timer))
        if self.splices:  # over the part wrappers: a row count under exact_below calls them, counted and timed
            install_fused(self.splices, MlxPatches(self.view.slots, self._swap))
        if self.attention is not None:
            self._install_attention()
        return self

    def _install_attention(self) -> None:
        """The planned layers' attention cores: each such layer's attention call makes its core current, and the
        family's `scaled_dot_product_attention` runs the current core where it takes the chunk."""
        for index in self.attention.cores:
            layer = self.model.layers[index]
            self._swap(layer, "self_attn", self.attention.scoped(index, layer.self_attn))
        for family in self._families:
            own = family.scaled_dot_product_attention
            self._swap(family, "scaled_dot_product_attention", self.attention.sdpa(own))

    def _swap(self, parent: nn.Module, name: str, new: object) -> None:
        self._originals.append((parent, name, getattr(parent, name)))  # a module, or a wrapper set before
        setattr(parent, name, new)

    def uninstall(self) -> None:
        for parent, name, module in reversed(self._originals):
            setattr(parent, name, module)
        self._originals.clear()

    @property
    def installed(self) -> bool:
        return bool(self._originals)

    @contextmanager
    def applied(self, on: bool) -> Iterator[None]:
        """The plan installed (`on`) or not (mlx-lm's own model) for the block; as before, after it."""
        was = self.installed
        (self.install if on else self.uninstall)()
        try:
            yield
        finally:
            (self.install if was else self.uninstall)()

    def forward(self, ids: mx.array, cache: list | None, rows: str = "all") -> mx.array | None:
        """`forward_rows` under the plan, evaluated and counted."""
        self._phase_of(ids, cache)
        start = time.perf_counter()
        self.timer.cache_only = rows == "none"
        try:
            out = forward_rows(self.model, ids, cache, rows)
        finally:
            self.timer.cache_only = self.timer.pruning = False
        if self.timer.timing:
            self.timer.times.seconds["total"] += time.perf_counter() - start
        self.timer.times.calls["total"] += 1
        self.flush(computed_last=rows != "none")
        return out

    def schedule(self, ids: mx.array, cache: list) -> tuple[mx.array, Callable[[], None]]:
        """A decode step's forward under the plan, its last row's logits left lazy (a pipelined step:
        `SpineModel.step`), and the count of its expert ids, to call once they are evaluated: taken now, so a step
        scheduled after this one is not read (which would wait for it)."""
        self._phase_of(ids, cache)
        out = forward_rows(self.model, ids, cache, "last", lazy=True)
        self.timer.times.calls["total"] += 1
        taken = [(switch, switch.take()) for switch in self.switches.values() if isinstance(switch, CountedSwitch)]

        def count() -> None:
            for switch, inds in taken:
                switch.count(inds)
        return out, count

    def _phase_of(self, ids: mx.array, cache: list | None) -> None:
        """A forward not pinned to a phase is a decode step where it feeds one token onto a filled cache."""
        if not self.pinned:
            decode = ids.shape[1] == 1 and cache is not None and cache[0].offset > 0
            self.set_phase("decode" if decode else "prefill")

    def flush(self, computed_last: bool = True) -> None:
        """Count the assignments of the forwards evaluated since (the all-mlx-exact layers count after the fact).
        `computed_last` False: a forward that filled the cache only, where the last layer's block never ran (as in
        mlx-lm's prefill): its routing is not counted (reading it would compute that layer's attention)."""
        last = len(self.model.layers) - 1
        for index, switch in self.switches.items():
            if isinstance(switch, CountedSwitch):
                inds = switch.take()
                if computed_last or index != last:
                    switch.count(inds)

    @contextmanager
    def in_flight(self, lanes: Lanes) -> Iterator[None]:
        """The plan run with chunks in flight (`runtime.mlx.overlap`) for the block: each layer's attention in chunk
        order, the planned layers off the host lane, their static calls (and the spliced dense functions') on the
        static lane and their MLX exact paths on the host lane; as before, after it."""
        order, swapped = KvOrder(lanes), len(self._originals)
        lanes.apart(self.cpu_apart)
        for index, layer in enumerate(self.model.layers):
            self._swap(layer, "self_attn", OrderedAttention(layer.self_attn, index, order))
        held, touched = [], []
        for switch in self.switches.values():
            if isinstance(switch, PlannedSwitch):
                held.append((switch.layer, list(switch.layer.groups)))
                switch.layer.groups = [(n, lanes.static(fn), a, b) for n, fn, a, b in switch.layer.groups]
                touched += [switch, *(p for _, p in switch.layer.paths if isinstance(p, SwitchExactLayer))]
        touched += [rows for item in self.splices for rows in (item if isinstance(item, tuple) else vars(item).values())
                    if isinstance(rows, MlxRows)]
        touched += [self.attention] if self.attention is not None else []
        for obj in touched:
            obj.lanes = lanes
        try:
            yield
        finally:
            for layer, groups in held:
                layer.groups = groups
            for obj in touched:
                obj.lanes = None
            while len(self._originals) > swapped:
                parent, name, module = self._originals.pop()
                setattr(parent, name, module)

    @property
    def cpu_apart(self) -> set[str]:
        """The CPU's static backend (`REFERENCE`) where the plan's dense functions name it beside another static
        backend: a unit of its own, so its calls run on a lane of their own in flight."""
        dense = self.plan.dense.backends if self.plan.dense else set()
        groups = {g.backend for lp in self.plan.layers for g in lp.groups}
        return {REFERENCE} if REFERENCE in dense and (dense | groups) - {REFERENCE} else set()

    @property
    def prunes_last(self) -> bool:
        """Whether a forward that fills the cache only leaves out the last layer's work past its keys and values
        (MLX computes what an output reads): where nothing in that layer runs eagerly (no static call: no spliced
        dense function, its experts mlx-lm's own). The cost model prices it the same way (`LazyLast`)."""
        switch = self.switches.get(len(self.model.layers) - 1)
        return not self.splices and self.attention is None and (switch is None or isinstance(switch, CountedSwitch))

    @property
    def all_fast(self) -> bool:
        """Every MoE layer runs mlx-lm's own switch_mlp (no static group, nothing off mlx-exact)."""
        return all(isinstance(s, CountedSwitch) for s in self.switches.values())

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Time each part for the block (each evaluated around itself: slower than an untimed forward)."""
        self.timer.timing = True
        try:
            yield
        finally:
            self.timer.timing = False

    def reset(self) -> None:
        super().reset()
        self.timer.times = PartTimes()
        self.timer.lanes.clear()
        self.in_flight_lanes.clear()

    def add_lanes(self, figures: dict[str, dict[str, float]]) -> None:
        """A prefill run in flight: each lane's busy and wait ms (`Lanes.figures`), summed since the last reset."""
        for lane, fig in figures.items():
            into = self.in_flight_lanes.setdefault(lane, {"busy_ms": 0.0, "wait_ms": 0.0})
            for key, ms in fig.items():
                into[key] = round(into[key] + ms, 3)

    def executed(self) -> Executed:
        """What ran each part since the last reset: the spliced dense functions' static calls on their backends'
        lanes, the rest of the dense half on this device's MLX lane (its time: the part's less those static calls'),
        the experts on the lanes the plan put them on; times where a timed pass measured them."""
        out = Executed()
        times, lanes = self.timer.times, self.timer.lanes
        calls, ms = times.parts_calls(), times.parts_ms() if times.seconds else {}
        static_s = Counter()
        for (part, lane), n in lanes.calls.items():
            if lane != self.lane:
                out.add(part, lane, n, lanes.seconds[part, lane] if ms else None)
                static_s[part] += lanes.seconds[part, lane]
        for part, n in calls.items():
            n += lanes.calls[part, self.lane]
            if part != "experts" and n:
                out.add(part, self.lane, n, ms[part] / 1e3 - static_s[part] if ms else None)
        out.add_experts(self.stats.total())
        out.lanes = {lane: dict(fig) for lane, fig in self.in_flight_lanes.items()}
        return out
