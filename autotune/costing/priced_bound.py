"""What the profile's own op prices allow: the least makespan of any split of a prompt's ops over the units, each op
at the price the cost model gives it at the chunk's rows (`split_program`, a linear program, HiGHS).

In, per chunk size, over one prompt's pieces (`whole_prefill.pieces`: its chunks, or each chunk's halves):
- every decoder layer's dense functions (q/k/v, o_proj, the attention core, the dense MLP) on a full piece: a prefix
  of its rows on each static backend (the ANE's; the CPU's, where the caller names it), the rest on the host (the
  plan's exact path), split at any multiple of `grain` rows, each side priced as `whole_prefill.layer_links` prices
  it (a static function's calls and weights included, its weights at the cheapest of `compressions`; the attention
  core's static calls at the cheapest of the caller's bucket and block templates); on a partial piece, and with
  halves the attention core, the host's only;
- the norms and the router (`rest`), and the final norm and lm_head, on the host only;
- each MoE layer's experts one by one: its calibration rows on the static backend (its groups), on each exact path
  the caller names (the GPU's, the CPU's) or dropped (resident, within `drop_share` of all rows), each unit's price
  per row the least the cost model's `ffn_ms` gives per row at any row count up to the expert's largest per-chunk
  load (the ANE's at its cheapest weight storage), and each layer's calls: a static group's in every calibration
  chunk once any of its experts is resident, an exact path's in as many chunks as its rows need at least;
- a lazy host's last layer (`LazyLast`): the share of a piece's rows it computes in full is a variable, the rest
  computing only their keys and values (`cache_only_links`), as the runtime leaves out what no logit reads;
- constraints: each unit busy at most the makespan; the energy (each unit's busy ms at its backend's power) at most
  the cap; the ANE's resident weights (its experts and each dense function's at their smallest storage, the latter in
  full once any of its rows are on the ANE, every layer's: one placement for all layers) within
  `ane_limits.WINDOW_BYTES`, the 0-1 residencies relaxed to [0, 1].
Out: every dependency (the chain within a chunk, keys and values across chunks), the host's packing and
gather/scatter, a static group's padding above its experts' loads, the memory bus's floor, the lazy last layer's
rows a logit reads, a function's weight limits per program, and uneven chunks. So no schedule of these ops at this
chunk size (one chunk in flight or more, whole chunks or halves) ends before the bound, wherever each price's cost
per row does not grow with the rows (affine prices with non-negative fixed terms: the published M2 Ultra
profile's). Predicted from the profile's prices."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autotune.costing.costmodel import CostModel
from autotune.costing.split_program import Role, Solved, SplitProgram
from autotune.costing.whole_prefill import (
    DecoderShape,
    DensePlacement,
    cache_only_links,
    head_dequant_ms,
    layer_links,
    pieces,
    unit_of,
)
from runtime.coreml import ane_limits

# where each dense function's link sits in `layer_links`' parts
LINK_OF = {"qkv": ("attention_projections", 0), "o_proj": ("attention_projections", 1),
           "attention": ("attention_core", 0), "mlp": ("dense_mlp", 0)}


@dataclass(frozen=True)
class BoundSetup:
    """What the plans may use: `static` backends for dense rows (the first one's window holds the experts and its
    dense weights), the `host`, the dense `functions` a static backend may take beside it, `attention` templates
    (buckets and block of a static core), the experts' exact `paths`, weight `compressions` on the static backend,
    the share of expert rows a plan may drop, the row grain of a split, and each function's weights over all layers
    (`window_bytes`, bytes on the first static backend)."""
    static: tuple[str, ...]
    host: str
    functions: tuple[str, ...]
    attention: tuple[DensePlacement, ...] = ()
    paths: tuple[str, ...] = ()
    compressions: tuple[str, ...] = ("none",)
    drop_share: float = 0.0
    grain: int = 64
    window_bytes: dict[str, float] = dataclasses.field(default_factory=dict)


def priced_bound(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk: int, loads: list[np.ndarray],
                 prompts: float, setup: BoundSetup, energy_cap_mj: float | None = None,
                 halves: bool = False, chain: bool = False) -> Solved:
    """The least makespan of one prompt at `chunk` (see the module docstring); `loads`: each MoE layer's calibration
    counts ([chunks, E], `prompts` prompts); `halves`: the pieces are each chunk's halves; `chain`: the prompt is one
    whole chunk, run as its chain of steps (each layer's norms and router, each dense function, its experts, the
    head), each step as long as its busiest unit: no one-chunk schedule ends before it."""
    if chain and (halves or chunk < prompt_tokens):
        raise ValueError("a chain bound is for one whole chunk")
    prog = SplitProgram()
    windows = {f: prog.var() for f in setup.functions if setup.window_bytes.get(f)}
    for f, v in windows.items():
        prog.window[v] = setup.window_bytes[f]
    covers = _dense(prog, cost, shape, pieces(prompt_tokens, chunk, halves), setup, windows, halves)
    last = shape.num_layers - 1
    expert_cover = None
    if covers and last in shape.moe_layers:  # the lazy last layer's experts: the rows computed in full
        expert_cover = prog.var()
        prog.equal({expert_cover: 1.0, **{w: -share for w, share in covers}})
    _experts(prog, cost, shape, loads, prompts, setup, expert_cover)
    return prog.solve(energy_cap_mj, ane_limits.WINDOW_BYTES, chain)


def _dense(prog: SplitProgram, cost: CostModel, shape: DecoderShape, parts: list[tuple[int, int, bool, int]],
           setup: BoundSetup, windows: dict[str, int], halves: bool) -> list[tuple[int, float]]:
    """Every layer's dense ops and the tail into `prog`; a lazy host's last layer per piece with its cover variable.
    Returns those (variable, share of the prompt's rows)."""
    host, last = setup.host, shape.num_layers - 1
    lazy = cost.is_lazy(host)
    kinds: dict[tuple, list[int]] = {}
    for layer in range(shape.num_layers - lazy):
        kinds.setdefault((layer in shape.moe_layers, shape.mlp_ffn(layer)), []).append(layer)
    prices = _Prices(cost, shape, setup, halves)
    covers = []
    total = sum(p[0] for p in parts)
    for piece, (rows, context, full, _) in enumerate(parts):
        for same in kinds.values():
            prices.layer(prog, same[0], rows, context, full, len(same), windows, piece=piece)
        if lazy:
            w = prog.var()
            covers.append((w, rows / total))
            prices.layer(prog, last, rows, context, full, 1, windows, cover=w, piece=piece)
            only = sum(link.latency_ms for links in cache_only_links(cost, shape, rows, host).values()
                       for link in links)
            kv = prog.var(unit_of(cost, host), only, cost.power_w(host) or 0.0, tag="kv_only", step=f"kv_only:{piece}")
            prog.equal({kv: 1.0, w: 1.0}, 1.0)
    head = float(cost.matmul_ms(host, 1, shape.vocab, shape.hidden) + cost.norm_ms(host, 1, shape.hidden, shape.hidden)
                 + head_dequant_ms(cost, shape, host))
    prog.op([Role(unit_of(cost, host), (head, 0.0), cost.power_w(host) or 0.0, suffix=True)], tag="lm_head",
            step="lm_head")
    return covers


class _Prices:
    """The dense ops of one layer and piece as `SplitProgram` ops, priced by `layer_links` (memoised)."""

    def __init__(self, cost: CostModel, shape: DecoderShape, setup: BoundSetup, halves: bool) -> None:
        self.cost, self.shape, self.setup, self.halves = cost, shape, setup, halves
        self.grain = max(1, setup.grain // 2 if halves else setup.grain)
        self._links: dict[tuple, dict] = {}

    def links(self, layer: int, rows: int, context: int, full: bool, place: DensePlacement) -> dict:
        key = (self.shape.mlp_ffn(layer), layer in self.shape.moe_layers, rows, context, full, place)
        if key not in self._links:
            self._links[key] = layer_links(self.cost, self.shape, layer, rows, context, full, place)
        return self._links[key]

    def layer(self, prog: SplitProgram, layer: int, rows: int, context: int, full: bool, count: int,
              windows: dict[str, int], cover: int | None = None, piece: int = 0) -> None:
        """One layer's dense ops on one piece, `count` layers of its kind (each op a step of the chain: the same
        split in each of those layers)."""
        cost, host = self.cost, self.setup.host
        alone = self.links(layer, rows, context, full, DensePlacement(host=host))
        h_unit, h_power = unit_of(cost, host), cost.power_w(host) or 0.0
        rest = sum(link.latency_ms for link in alone["rest"])
        where = f"@{layer}:{piece}"
        prog.op([Role(h_unit, (rest, 0.0), h_power, suffix=True)], count, cover, "rest", "rest" + where)
        for f, (part, index) in LINK_OF.items():
            if part not in alone:
                continue
            static = full and f in self.setup.functions and not (self.halves and f == "attention")
            points = [*range(0, rows, self.grain), rows] if static else [0, rows]
            suffix = [self.links(layer, rows - s, context, full, DensePlacement(host=host))[part][index].latency_ms
                      if s < rows else 0.0 for s in points]
            roles = [Role(h_unit, tuple(suffix), h_power, suffix=True)]
            if static:
                roles += [r for b in self.setup.static if (r := self.prefix(layer, rows, context, f, b, points))]
            firsts = prog.op(roles, count, cover, f, f + where)
            first = self.setup.static[0] if self.setup.static else None
            if first is not None and f in windows and unit_of(cost, first) in firsts:
                prog.le({firsts[unit_of(cost, first)]: 1.0, windows[f]: -1.0})

    def prefix(self, layer: int, rows: int, context: int, f: str, backend: str, points: list[int]) -> Role | None:
        """`backend`'s prices for the first rows of `f` at each point: the least over the attention templates."""
        cost, host = self.cost, self.setup.host
        unit, part, index = unit_of(cost, backend), *LINK_OF[f]
        templates = self.setup.attention if f == "attention" else tuple(
            DensePlacement(compress=c) for c in self.setup.compressions)
        out = []
        for s in points:
            best = 0.0 if s == 0 else np.inf
            for t in templates if s else ():
                if t.attention_block and s % t.attention_block:
                    continue
                place = dataclasses.replace(t, **{f: backend}, host=host).with_rows(f, s if s < rows else None)
                units = self.links(layer, rows, context, True, place)[part][index].units
                if unit not in units:
                    continue  # the keys fit no bucket: the host's
                ms = units[unit]
                if unit == unit_of(cost, host) and s < rows:  # one unit both sides: less the host's rest
                    ms -= self.links(layer, rows - s, context, True, DensePlacement(host=host))[part][index].latency_ms
                best = min(best, ms)
            out.append(best)
        if not np.isfinite(out[-1]):
            return None
        for i in range(len(out) - 2, 0, -1):  # a point no template splits at: the next one's price (no plan's)
            out[i] = out[i] if np.isfinite(out[i]) else out[i + 1]
        return Role(unit, tuple(map(float, out)), cost.power_w(backend) or 0.0)


def _experts(prog: SplitProgram, cost: CostModel, shape: DecoderShape, loads: list[np.ndarray], prompts: float,
             setup: BoundSetup, last_cover: int | None) -> None:
    """Each MoE layer's experts into `prog` (see the module docstring)."""
    h, f = shape.hidden, shape.expert_ffn
    top = max((int(np.max(c)) for c in loads if np.size(c)), default=0)
    static = setup.static[0] if setup.static else None
    per_row = {p: _per_row(cost, p, top, h, f) for p in setup.paths}
    if static is not None:
        per_row[static] = np.min([_per_row(cost, static, top, h, f, c) for c in setup.compressions], axis=0)
        stored = min(ane_limits.expert_weight_bytes(h, f, c) for c in setup.compressions)
    drops: dict[int, float] = {}
    total = 0.0
    last = shape.num_layers - 1
    for index, counts in enumerate(loads):
        counts = np.asarray(counts)
        n, peak = counts.sum(axis=0).astype(np.float64), counts.max(axis=0)
        total += float(n.sum())
        step = f"experts@{shape.moe_layers[index]}"
        calls = {p: prog.var(unit_of(cost, p), cost.call_ms(p) / prompts, cost.power_w(p) or 0.0, None, "expert_calls",
                             step) for p in per_row}
        cover = last_cover if last_cover is not None and shape.moe_layers[index] == last else None
        for e in np.flatnonzero(n):
            share = {p: prog.var(unit_of(cost, p), n[e] * per_row[p][peak[e]] / prompts, cost.power_w(p) or 0.0,
                                 tag="experts", step=step) for p in per_row}
            for p in setup.paths:  # an exact path calls once per chunk it computes rows in: >= rows / the peak
                prog.le({share[p]: n[e] / peak[e], calls[p]: -1.0})
            terms = {v: 1.0 for v in share.values()}
            if static is not None:
                kept = [share[static]]
                if setup.drop_share > 0:
                    drop = prog.var()
                    drops[drop], terms[drop] = float(n[e]), 1.0
                    kept.append(drop)
                for v in kept:  # resident: its weights in the window, its group called in every chunk
                    prog.window[v] = float(stored)
                    prog.le({v: float(len(counts)), calls[static]: -1.0})
            prog.equal(terms if cover is None else {**terms, cover: -1.0}, 0.0 if cover is not None else 1.0)
    if drops:
        prog.le(drops, setup.drop_share * total, "drops")


def _per_row(cost: CostModel, path: str, top: int, hidden: int, ffn: int, compress: str = "none") -> np.ndarray:
    """[top + 1]: at each row count m, the least ms per row of one expert's FFN on `path` at any count up to m."""
    m = np.arange(1, top + 1)
    ratio = np.asarray(cost.ffn_ms(path, m, hidden, ffn, compress), dtype=np.float64) / m
    return np.r_[np.inf, np.minimum.accumulate(ratio)]
