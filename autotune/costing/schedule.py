"""A prefill priced as a schedule: each unit's queue of ops, with up to `in_flight` chunks in flight.

A chunk is a chain of steps (`Step`), layer by layer: each step's parts run on their units side by side (a split
dense function: the static backend's rows beside the host's; the experts: the ANE's groups beside the exact paths)
and the next step starts when all of them are done. With one chunk in flight the schedule is the chain
(`whole_prefill.predict_prefill`'s sum). With two, chunk c+1 runs beside chunk c: the dependencies are the chain
within a chunk and the keys and values across chunks (chunk c+1's attention core of layer l reads chunk c's keys
and values of layer l, made by its `qkv` step), and chunk c+2 starts once chunk c is done. Each unit takes the ready
op that can start first (the older chunk on a tie), never preempted: a list schedule, as the runtime's lanes run it
(`runtime/mlx/overlap.py`). Its figures: the makespan, each unit's busy and idle time, each op's start and end
(`timeline_chart` draws them for a layer range). The work is the chain's: energy and CPU-busy time do not change."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from autotune.costing import evaluator
from autotune.costing.costmodel import CostModel
from autotune.costing.whole_prefill import (
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    PrefillPrediction,
    cache_only_links,
    dense_link,
    expert_link,
    layer_links,
    pieces,
    predict_prefill,
    unit_of,
)

KV_STEP, CORE_STEP = "qkv", "attention_core"  # the step that makes a layer's keys and values; the one reading them
JOIN_STEP = "experts_join"  # a chunk's first half waits here for the experts its second half's chain computes
# each step's op as the priced bound tags it (`autotune.costing.priced_bound`), so a plan's busy time per op compares
BOUND_TAG = {"norms": "rest", "router": "rest", CORE_STEP: "attention", "dense_mlp": "mlp"}
# a decoder layer's steps in the order they run, as (part, index in the part's links, step name); the experts after
# the router
LAYER_ORDER = (("rest", 0, "norms"), ("attention_projections", 0, KV_STEP), ("attention_core", 0, CORE_STEP),
               ("attention_projections", 1, "o_proj"), ("rest", 1, "router"), ("experts", 0, "experts"),
               ("dense_mlp", 0, "dense_mlp"))


@dataclass(frozen=True)
class Step:
    """One step of a chunk's chain: `units` (unit -> busy ms) run side by side; `layer` -1: after the decoder;
    `after`: (chunk offset, step name, layer) of other chunks' steps it also waits for (the last of that name)."""
    name: str
    layer: int
    units: tuple[tuple[str, float], ...]
    after: tuple[tuple[int, str, int], ...] = ()

    @classmethod
    def of(cls, name: str, layer: int, units: dict[str, float], after: tuple = ()) -> "Step":
        return cls(name, layer, tuple((u, float(ms)) for u, ms in units.items() if ms > 0), tuple(after))

    @property
    def ms(self) -> float:
        """The step alone: its longest part."""
        return max((ms for _, ms in self.units), default=0.0)


@dataclass(frozen=True)
class Op:
    """One part of one step, as scheduled."""
    chunk: int
    layer: int
    name: str
    unit: str
    start_ms: float
    end_ms: float


@dataclass
class Schedule:
    """A prefill's schedule: `makespan_ms`, each unit's `busy_ms` and the ops (start and end); `halves`: each
    chunk's dense ops ran per half (`prefill_steps`), which the runtime does not execute."""
    in_flight: int
    makespan_ms: float
    busy_ms: dict[str, float]
    ops: list[Op] = field(default_factory=list)
    halves: bool = False

    @property
    def idle_ms(self) -> dict[str, float]:
        return {u: self.makespan_ms - b for u, b in self.busy_ms.items()}

    def by_op(self) -> dict[str, dict[str, float]]:
        """Each unit's busy ms per op, tagged as the priced bound tags its ops (`BOUND_TAG`: the norms and router
        `rest`, the attention core `attention`, ...), so the plan's work compares with the bound's op by op."""
        out: dict[str, dict[str, float]] = {}
        for op in self.ops:
            into = out.setdefault(op.unit, {})
            tag = BOUND_TAG.get(op.name, op.name)
            into[tag] = into.get(tag, 0.0) + op.end_ms - op.start_ms
        return out

    def to_json(self) -> dict:
        """`in_flight`, `makespan_ms` and per unit `{"busy_ms", "idle_ms", "by_op"}` (predicted)."""
        idle, by_op = self.idle_ms, self.by_op()
        return {"in_flight": self.in_flight, "makespan_ms": round(self.makespan_ms, 6),
                "units": {u: {"busy_ms": round(b, 6), "idle_ms": round(idle[u], 6),
                              "by_op": {t: round(ms, 3) for t, ms in sorted(by_op.get(u, {}).items())}}
                          for u, b in sorted(self.busy_ms.items())},
                "shape": "half-chunks" if self.halves else "chunks", "runtime_executes": not self.halves}


def schedule(chunks: list[list[Step]], in_flight: int = 2, tail: list[Step] = ()) -> Schedule:
    """The list schedule of `chunks` (each a chain of steps) with up to `in_flight` in flight, then `tail` (the
    final norm and lm_head: after the last chunk). A step is ready when its chunk's previous step is done, its
    chunk is in flight, and, for the attention core of layer l, the chunk before has made layer l's keys and
    values. Of the ready steps, the one whose parts can start first is placed next (the older chunk on a tie)."""
    state = _State([list(c) for c in chunks])
    if tail:
        state.chunks[-1] += list(tail)
    active = list(range(min(in_flight, len(chunks))))
    while active:
        c = state.pick(active)
        state.place(c)
        if state.finished(c):
            active.remove(c)
            if c + in_flight < len(chunks):  # a chunk done: the next one enters, then
                active.append(c + in_flight)
                state.entry[c + in_flight] = state.done_at[c][-1]
    busy: dict[str, float] = {}
    for op in state.ops:
        busy[op.unit] = busy.get(op.unit, 0.0) + op.end_ms - op.start_ms
    makespan = max((d[-1] for d in state.done_at if d), default=0.0)
    return Schedule(in_flight, makespan, busy, state.ops)


@dataclass
class _State:
    """The schedule as placed so far: each chunk's steps' end times, each unit's next free time, the ops."""
    chunks: list[list[Step]]
    done_at: list[list[float]] = field(default_factory=list)
    kv_at: list[dict[int, float]] = field(default_factory=list)  # chunk -> layer -> its keys and values made
    last: list[dict[tuple[str, int], int]] = field(default_factory=list)  # chunk -> (name, layer) -> its last index
    free: dict[str, float] = field(default_factory=dict)
    entry: dict[int, float] = field(default_factory=dict)  # when a chunk came in flight (default 0)
    ops: list[Op] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.done_at = [[] for _ in self.chunks]
        self.kv_at = [{} for _ in self.chunks]
        self.last = [{(s.name, s.layer): i for i, s in enumerate(steps)} for steps in self.chunks]

    def finished(self, c: int) -> bool:
        return len(self.done_at[c]) == len(self.chunks[c])

    def ready_at(self, c: int) -> float | None:
        """When chunk c's next step may start (None: the keys and values it reads are not made yet)."""
        i = len(self.done_at[c])
        at = self.done_at[c][i - 1] if i else self.entry.get(c, 0.0)
        step = self.chunks[c][i]
        if step.name == CORE_STEP and c > 0 and any(s.name == KV_STEP and s.layer == step.layer
                                                    for s in self.chunks[c - 1]):
            kv = self.kv_at[c - 1].get(step.layer)
            if kv is None:
                return None
            at = max(at, kv)
        for offset, name, layer in step.after:
            other = self.done_at[c + offset]
            i = self.last[c + offset][name, layer]
            if len(other) <= i:
                return None
            at = max(at, other[i])
        return at

    def pick(self, active: list[int]) -> int:
        """The active chunk whose next step's parts can start first (the older on a tie)."""
        best: tuple[float, int] | None = None
        for c in active:
            at = self.ready_at(c)
            if at is None:
                continue
            step = self.chunks[c][len(self.done_at[c])]
            start = min((max(at, self.free.get(u, 0.0)) for u, _ in step.units), default=at)
            best = min(best or (start, c), (start, c))
        if best is None:
            raise ValueError("no schedulable step: a chunk's keys and values wait on a later chunk")
        return best[1]

    def place(self, c: int) -> None:
        """Chunk c's next step: each part at the later of the step's ready time and its unit's next free time."""
        at = self.ready_at(c)
        step = self.chunks[c][len(self.done_at[c])]
        end = at
        for unit, ms in step.units:
            start = max(at, self.free.get(unit, 0.0))
            self.free[unit] = end_u = start + ms
            end = max(end, end_u)
            self.ops.append(Op(c, step.layer, step.name, unit, start, end_u))
        self.done_at[c].append(end)
        if step.name == KV_STEP:
            self.kv_at[c][step.layer] = end


def predict_scheduled(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int,
                      experts: ExpertFigures, place: DensePlacement = DensePlacement(), in_flight: int = 2,
                      lazy_last: LazyLast | None = None, halves: bool = False,
                      chunk_rows: tuple[int, ...] = ()) -> tuple[PrefillPrediction, Schedule]:
    """`predict_prefill` priced as a schedule with up to `in_flight` chunks in flight: its latency the schedule's
    makespan, its `schedule` each unit's busy and idle time; the work (parts, CPU-busy time, energy) the chain's.
    `halves`: each chunk's dense ops per half (`prefill_steps`), both halves of each chunk in flight;
    `chunk_rows`: an uneven chunking (`whole_prefill.prompt_chunks`)."""
    chain = predict_prefill(cost, shape, prompt_tokens, chunk_tokens, experts, place, lazy_last=lazy_last,
                            halves=halves, chunk_rows=chunk_rows)
    chunks, tail = prefill_steps(cost, shape, prompt_tokens, chunk_tokens, experts, place, lazy_last, halves,
                                 chunk_rows)
    sched = schedule(chunks, in_flight * (2 if halves else 1), tail)
    sched.in_flight, sched.halves = in_flight, halves  # chunks in flight, each as its two halves
    return dataclasses.replace(chain, latency_ms=sched.makespan_ms, schedule=sched.to_json()), sched


def prefill_steps(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int,
                  experts: ExpertFigures, place: DensePlacement = DensePlacement(),
                  lazy_last: LazyLast | None = None, halves: bool = False,
                  chunk_rows: tuple[int, ...] = ()) -> tuple[list[list[Step]], list[Step]]:
    """Each chunk's chain of steps (`LAYER_ORDER`, layer by layer) and the tail (final norm and lm_head), from the
    links `predict_prefill` sums (`whole_prefill.layer_links`). The experts' steps (`ExpertFigures.steps`, per
    prompt) are shared among the (chunk, MoE layer) pairs by the rows each computes. A lazy host's last layer
    (`LazyLast`) computes its keys and values only, but for the rows a logit reads.

    `halves`: a micro-pipeline inside each chunk (`whole_prefill.pieces`): its dense, token-parallel ops (norms,
    q/k/v, o_proj, router, MLP) and its attention core run per half, each half a chain of its own, so one unit
    computes one half's projections while another computes the other half's core (the second half's core reads the
    first's keys and values: the same rule as across chunks). The experts run once per chunk over both halves (their
    per-expert batches the chunk's) in the second half's chain; the first half's next step waits for them (a
    join). The runtime does not run it (`Schedule.halves`). `chunk_rows`: an uneven chunking (`prompt_chunks`):
    the experts' steps shared by rows as for any chunking."""
    lazy = lazy_last if lazy_last is not None and cost.is_lazy(place.host) else None
    last, chunks = shape.num_layers - 1, pieces(prompt_tokens, chunk_tokens, halves, chunk_rows)
    padded = chunk_tokens if chunk_rows else 0
    static = any((place.qkv, place.o_proj, place.attention, place.mlp))
    place = place.halved() if halves else place
    out: list[list[tuple[int, dict, int]]] = []  # per piece: (layer, its links by part, rows its experts compute)
    for i, (rows, context, full, expert_rows) in enumerate(chunks):
        layers = []
        for layer in range(shape.num_layers):
            if lazy is None or layer != last or (full and static):
                layers.append((layer, layer_links(cost, shape, layer, rows, context, full, place, padded),
                               expert_rows))
                continue
            read = 0 if i < len(chunks) - 1 else 1 if lazy.split else rows
            layers.append((layer, cache_only_links(cost, shape, rows - read, place.host), 0))
            if read:
                layers.append((layer, layer_links(cost, shape, layer, read, context, full, place, padded), read))
        out.append(layers)
    per_row = _expert_steps(cost, shape, experts, place, lazy, out)
    head = cost.matmul_ms(place.host, 1, shape.vocab, shape.hidden) + cost.norm_ms(place.host, 1, shape.hidden,
                                                                                  shape.hidden)
    tail = [Step.of("lm_head", -1, dense_link(cost, place.host, head).units)]
    joins = [{layer for layer, _, rows in after if rows and layer in shape.moe_layers} if piece[3] == 0 else set()
             for piece, after in zip(chunks, out[1:] + [[]])]  # a first half joins its second half's experts
    return [[step for layer, links, rows in layers
             for step in _layer_steps(layer, links, [{u: ms * rows for u, ms in s.items()} for s in per_row[layer]]
                                      if layer in per_row and rows else [], layer in join)]
            for layers, join in zip(out, joins)], tail


def _expert_steps(cost: CostModel, shape: DecoderShape, experts: ExpertFigures, place: DensePlacement,
                  lazy: LazyLast | None, chunks: list[list[tuple[int, dict, int]]]
                  ) -> dict[int, list[dict[str, float]]]:
    """Each MoE layer's experts' steps per row: the prompt's figures (less what a lazy host leaves out, as
    `expert_link` prices it) over the rows the MoE layers compute, each layer's share of each unit's step its own
    (`ExpertFigures.by_layer`: a step lasts as long as its layer's busiest unit, which the layers' mean hides), else
    an even one."""
    per_row = _mean_steps(cost, shape, experts, place, lazy, chunks)
    mine = experts.by_layer if experts.steps and len(experts.by_layer) == len(shape.moe_layers) else ()
    if not per_row or not mine:
        return {layer: per_row for layer in shape.moe_layers} if per_row else {}
    n = len(mine)
    return {layer: [{u: ms * n * own.get(u, 0.0) / total[u] for u, ms in step.items() if total.get(u)}
                    for step, own, total in zip(per_row, steps, experts.steps)]
            for layer, steps in zip(shape.moe_layers, mine)}


def _mean_steps(cost: CostModel, shape: DecoderShape, experts: ExpertFigures, place: DensePlacement,
                lazy: LazyLast | None, chunks: list[list[tuple[int, dict, int]]]) -> list[dict[str, float]]:
    """The experts' steps per row of a mean MoE layer (`_expert_steps`)."""
    rows = sum(r for layers in chunks for layer, _, r in layers if layer in shape.moe_layers)
    if not rows:
        return []
    prompt = sum(layers[0][2] for layers in chunks)  # layer 0 computes every row
    pruned = prompt - sum(r for layers in chunks for layer, _, r in layers if layer == shape.num_layers - 1)
    whole = expert_link(experts, lazy.experts if lazy else None, pruned / prompt if lazy else 0.0).latency_ms
    scale = whole / experts.latency_ms if experts.latency_ms > 0 else 0.0
    steps = experts.steps or ({unit_of(cost, place.host): experts.latency_ms},)
    return [{u: ms * scale / rows for u, ms in s.items()} for s in steps]


def _layer_steps(layer: int, links: dict[str, list[evaluator.Link]], experts: list[dict[str, float]],
                 join: bool = False) -> list[Step]:
    """One layer's links as steps in `LAYER_ORDER` (a cache-only layer has norms and qkv only); `join`: a chunk's
    first half, whose experts the next piece's chain computes (a step of no work that waits for them)."""
    steps = []
    for part, index, name in LAYER_ORDER:
        if part == "experts":
            steps += [Step.of(name, layer, units) for units in experts]
            steps += [Step.of(JOIN_STEP, layer, {}, after=((1, name, layer),))] if join else []
        elif index < len(links.get(part, [])):
            steps.append(Step.of(name, layer, links[part][index].units))
    return steps


def steps_from_events(events: list[tuple[str, int, float, float, int]]) -> list[list[Step]]:
    """Each chunk's chain of steps from a run's recorded lane intervals (`runtime.mlx.overlap.Lanes(record=True)`,
    one chunk in flight): a host-lane hold is a step on `host` (the attention core of the layer whose keys and
    values it wrote, then that write); a time off the host lane is a step on `static` (its static calls and the
    chunk thread's own packing) beside the `host` time its layer's exact path held meanwhile."""
    chunks = sorted({e[1] for e in events if e[0] in ("host", "off")})
    out = []
    for c in chunks:
        mine = sorted((e for e in events if e[1] == c), key=lambda e: e[2])
        kvs = [e for e in mine if e[0] == "kv"]
        steps = []
        for kind, _, start, end, _ in (e for e in mine if e[0] in ("host", "off")):
            if kind == "host":
                layers = [e[4] for e in kvs if start <= e[3] <= end]
                steps.append(Step.of(CORE_STEP if layers else "host", layers[0] if layers else -1,
                                     {"host": end - start}))
                steps += [Step.of(KV_STEP, layer, {}) for layer in layers]
                continue
            inside = lambda k: sum(e[3] - e[2] for e in mine if e[0] == k and start <= e[2] < end)  # noqa: E731
            exact = inside("exact")
            steps.append(Step.of("static", -1, {"static": max(inside("static"), end - start - exact),
                                                "host": exact}))
        out.append(steps)
    return out


def timeline_chart(sched: Schedule, path: str, layers: tuple[int, int] = (0, 2), title: str = "") -> None:
    """The schedule's ops of layers `layers` (first, last inclusive) as a PNG: one row per unit, one bar per op
    (colour: its chunk; label: its step), time on the x axis (predicted ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [o for o in sched.ops if layers[0] <= o.layer <= layers[1] and o.end_ms > o.start_ms]
    units = sorted({o.unit for o in ops})
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.8 * len(units)))
    for o in ops:
        row = units.index(o.unit)
        ax.barh(row, o.end_ms - o.start_ms, left=o.start_ms, color=colours(o.chunk % 10), edgecolor="black",
                linewidth=0.3)
        if o.end_ms - o.start_ms > 0.04 * (max(p.end_ms for p in ops) - min(p.start_ms for p in ops)):
            ax.text((o.start_ms + o.end_ms) / 2, row, f"c{o.chunk} L{o.layer}\n{o.name}", ha="center",
                    va="center", fontsize=6)
    ax.set_yticks(range(len(units)), units)
    ax.set_xlabel("ms (predicted)")
    pieces_are = "half-chunk" if sched.halves else "chunk"
    ax.set_title(title or f"{sched.in_flight} chunk(s) in flight{' as half-chunks' if sched.halves else ''}, layers "
                 f"{layers[0]}-{layers[1]}: units as rows, ops as bars (colour: {pieces_are})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
