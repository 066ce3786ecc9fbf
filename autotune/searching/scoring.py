"""Scoring decisions: one through the plan entry it means and the cost model (`Scorer.score`, the reference), many
at once (`Scorer.score_rows`): a thin adapter from decisions to the evaluator's rows (autotune.costing.evaluator),
from per-band and per-residency parts that the decisions share; a test holds the two equal. Every price is the cost
model's and every limit ane_limits' or the evaluator's."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from autotune.costing import evaluator
from autotune.costing.costmodel import CostModel, ExactLanes
from autotune.searching.decisions import layer_plan, overflow, violation
from autotune.searching.layer_data import LayerData
from autotune.searching.scores import Score, Scores
from autotune.searching.space import MAX_TIERS, QUANTILES, SIZINGS, LayerConfig, Space
from runtime.backends import EXACT, registry
from runtime.coreml import ane_limits
from runtime.plan import COMPRESSIONS, LayerPlan

BATCH = 65_536  # decisions scored per numpy pass (bounds the [decisions, chunks] temporaries)

@dataclass
class _LayerParts:
    """What every decision of one layer shares: per residency, the cold experts' exact work on each exact path; per
    band (lo, hi) and quantile, its capacity, static cost per compression, held-out overflow and calibration
    overflow."""
    cold_ms: dict  # path -> [E+1, chunks] its exact ms of experts ranked r.. (no call/host cost)
    cold_mb: dict  # path -> [E+1, chunks] the MB they move
    cold_n: np.ndarray  # [E+1, chunks] their assignments
    total_n: np.ndarray  # [chunks] all assignments
    bands: dict = field(default_factory=dict)  # (lo, hi) -> dict of arrays over QUANTILES


@dataclass
class _Cores:
    """The distinct cores (residents, GPU head, tiers, quantiles, sizing) of a batch of decisions, and each
    decision's core."""
    index: np.ndarray  # [rows] each decision's core
    residents: np.ndarray  # [cores]
    head: np.ndarray  # the ranks the GPU head takes before the residents
    tiers: np.ndarray  # at most the residents (one band per tier)
    quantiles: np.ndarray  # [cores, tiers] each band's capacity quantile (index into QUANTILES)
    sizing: np.ndarray


def _cores(space: Space, rows: np.ndarray) -> _Cores:
    names = [p for p, _ in space.params]
    r = space.column(rows, "resident").astype(np.int64)
    qcols = [names.index(q) for q in space.dim("quantiles").params]
    heads = space.dim("gpu_head").values if "gpu_head" in dict(space.params) else (0,)
    hi = rows[:, names.index("gpu_head")] if len(heads) > 1 else np.zeros(len(rows), dtype=np.int64)
    core_key = np.concatenate([r[:, None], hi[:, None], rows[:, [names.index("tiers")] + qcols
                                                              + [names.index("sizing")]]], 1)
    radices = (int(r.max()) + 1, len(heads), len(space.dim("tiers").values), *[len(QUANTILES)] * len(qcols),
               len(space.dim("sizing").values))
    _, first, ci = np.unique(np.ravel_multi_index(core_key.T, radices), return_index=True, return_inverse=True)
    cores = core_key[first]
    cr, ch = cores[:, 0], np.asarray(heads)[cores[:, 1]]
    cores = np.delete(cores, 1, axis=1)  # as before the head: residents, tiers, quantiles, sizing
    ct = np.minimum(np.asarray(space.dim("tiers").values)[cores[:, 1]], np.maximum(cr, 1))
    cq = np.searchsorted(QUANTILES, np.asarray(QUANTILES)[cores[:, 2:2 + len(qcols)]])
    return _Cores(ci.reshape(-1), cr, ch, ct, cq, np.asarray(space.dim("sizing").values)[cores[:, -1]])


@dataclass
class _CoreBands:
    """Each core's bands summed: static cost per compression, drops, slots, calibration overflow (count, ms, MB per
    chunk), the largest capacity, and per band its running capacity sums and first rank."""
    static: np.ndarray  # [cores, compressions]
    drops: np.ndarray
    slots: np.ndarray
    spill_n: np.ndarray  # [cores, chunks]
    spill_ms: np.ndarray
    spill_mb: np.ndarray
    cap_max: np.ndarray
    cums: np.ndarray  # [cores, MAX_TIERS, E+1] running capacity sums per band, padded
    lo_of: np.ndarray  # [cores, MAX_TIERS]

    @classmethod
    def zeros(cls, n_cores: int, n_chunks: int, n_kinds: int, e1: int) -> "_CoreBands":
        return cls(np.zeros((n_cores, n_kinds)), np.zeros(n_cores), np.zeros(n_cores),
                   *(np.zeros((n_cores, n_chunks)) for _ in range(3)), np.zeros(n_cores),
                   np.zeros((n_cores, MAX_TIERS, e1)), np.zeros((n_cores, MAX_TIERS), dtype=np.int64))

    def add(self, sel: np.ndarray, j: int, band: dict, q: np.ndarray, kind_names: list[str]) -> None:
        """Band `band` at quantiles `q` as band j of the cores `sel`."""
        self.cap_max[sel] = np.maximum(self.cap_max[sel], band["cap_max"][q])
        self.cums[sel, j] = band["cum"][q]
        self.static[sel] += np.stack([band["static"][k][q] for k in kind_names], 1)
        for name in ("drops", "slots", "spill_n", "spill_ms", "spill_mb"):
            getattr(self, name)[sel] += band[name][q]


@dataclass
class Scorer:
    """Scores decisions for every layer with one cost model; caches by (layer, chunk, decision)."""
    cost: CostModel
    hidden: int
    ffn: int
    backend: str  # the static backend every group runs on (search_plan picks it among the profile's)
    resident_bytes_per_layer: float
    with_energy: bool = False  # score energy too (the energy objectives); else only `energy()` computes it
    # the plan's exact path (`Plan.exact`): cold experts but a layer's CPU tail, spills, partial chunks; default:
    # the profile's exact path off the CPU where it prices one (`CostModel.plan_exact`)
    exact: str | None = None
    _cache: dict = field(default_factory=dict, init=False, repr=False)  # a copy (dataclasses.replace) starts empty
    _parts: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.exact = self.exact or self.cost.plan_exact()

    @property
    def splits_exact(self) -> bool:
        """Whether a layer may split its cold experts between the plan's exact path and the CPU (a `cpu_tail`): where
        that path runs off the CPU (mlx-exact timed on MLX's CPU device is on it: nothing to run beside)."""
        return self.exact != EXACT and self.cost.overlaps(self.exact)

    def layer_plan(self, data: LayerData, cfg: LayerConfig) -> LayerPlan:
        return layer_plan(data, cfg, self.backend, self.exact)

    def score(self, data: LayerData, cfg: LayerConfig) -> Score:
        """One decision through its plan entry and the cost model (the reference for `score_rows`)."""
        key = (data.layer, data.chunk_tokens, cfg)
        if key not in self._cache:
            lp = self.layer_plan(data, cfg)
            per_chunk, cpu = map(np.asarray, self.cost.layer_times(lp, data.calib, self.hidden, self.ffn,
                                                                   cfg.overflow, self.exact))
            energy = self._energy_chunks(data, lp, cfg) if self.with_energy else None
            drops = overflow(lp, data.heldout) if cfg.overflow == "drop" else 0
            v = violation(lp, self.backend, self.hidden, self.ffn, self.resident_bytes_per_layer)
            self._cache[key] = Score(float(per_chunk.sum()), None if energy is None else float(energy.sum()), drops,
                                     v, float(per_chunk[data.partial].sum()),
                                     None if energy is None else float(energy[data.partial].sum()),
                                     float(cpu.sum()), float(cpu[data.partial].sum()))
        return self._cache[key]

    def _energy_chunks(self, data: LayerData, lp: LayerPlan, cfg: LayerConfig) -> np.ndarray | None:
        e = self.cost.layer_energy_mj(lp, data.calib, self.hidden, self.ffn, cfg.overflow, self.exact)
        return None if e is None else np.asarray(e, dtype=np.float64)

    def energy(self, data: LayerData, cfg: LayerConfig) -> float | None:
        e = self._energy_chunks(data, self.layer_plan(data, cfg), cfg)
        return None if e is None else float(np.sum(e))

    def partial_exact(self, data: LayerData) -> Score:
        """The layer's partial chunks run wholly on the plan's exact path (its exact_below_tokens above their
        length): the same whatever the decision (memoised: every DP over the layer adds it)."""
        key = (data.layer, data.chunk_tokens, id(data), "partial-exact")
        if key not in self._cache:
            self._cache[key] = self._partial_exact(data)
        return self._cache[key]

    def _partial_exact(self, data: LayerData) -> Score:
        counts = data.calib[data.partial]
        every = LayerPlan.model_construct(layer=data.layer, groups=[], cpu_exact=list(range(counts.shape[1])))
        t = evaluator.totals(self.cost.layer_work(every, counts, self.hidden, self.ffn, "drop", self.exact),
                             np.ones(len(counts), dtype=bool))
        ms, cpu = float(t.latency_ms[0]), float(t.cpu_ms[0])
        mj = None if t.energy_mj is None else float(t.energy_mj[0])
        return Score(ms, mj, heldout_drops=0, violation=0.0, partial_ms=ms, partial_mj=mj, cpu_ms=cpu,
                     partial_cpu_ms=cpu)

    # --- many decisions at once ------------------------------------------------------------------------------------
    def with_cost(self, cost: CostModel, with_energy: bool) -> "Scorer":
        """A scorer for `cost` sharing this one's bulk figures where they do not depend on what differs: a cost
        model that changes a call cost or a power, not the experts' compute, reuses every band."""
        out = dataclasses.replace(self, cost=cost, with_energy=with_energy)
        out._parts = self._parts
        return out

    def _layer_parts(self, data: LayerData) -> _LayerParts:
        paths = sorted({EXACT, self.exact})
        key = (data.layer, data.chunk_tokens, id(data), self.hidden, self.ffn,
               self.cost.backend_model(self.backend).ffn_key(), *(self.cost.backend_model(p).ffn_key() for p in paths))
        if key not in self._parts:
            ranked = data.calib[:, data.rank]
            zeros = np.zeros((1, ranked.shape[0]))

            def cold(per_expert: np.ndarray) -> np.ndarray:  # [chunks, E] -> [E+1, chunks]: sums over ranks r..
                f = np.asarray(per_expert, dtype=np.float64).reshape(ranked.shape)
                return np.concatenate([np.cumsum(f[:, ::-1], axis=1)[:, ::-1].T, zeros])

            self._parts[key] = _LayerParts(
                {p: cold(self.cost.ffn_ms(p, ranked, self.hidden, self.ffn)) for p in paths},
                {p: cold(self.cost.ffn_mb(p, ranked, self.hidden, self.ffn)) for p in paths},
                cold(ranked), ranked.sum(1).astype(np.float64))
        return self._parts[key]

    def _band(self, data: LayerData, parts: _LayerParts, lo: int, hi: int, sizing: str) -> dict:
        """A band's figures at every quantile: its capacities (the largest, the sum, running sums over its ranks
        padded to E+1), static ms per compression, held-out overflow, and per calibration chunk the overflow's count
        and exact ms."""
        if (lo, hi, sizing) not in parts.bands:
            self._fill_bands(data, parts, lo, [hi], sizing)
        return parts.bands[(lo, hi, sizing)]

    def _fill_bands(self, data: LayerData, parts: _LayerParts, lo: int, his: list[int], sizing: str) -> None:
        """`_band` of the bands lo..hi-1 for every hi in `his` at once, as running sums over ranks taken at each
        band's end: sized per expert, a rank's capacity and overflow are the same whatever band it is in; sized per
        band, they depend only on the band's capacity, so the sums run once per distinct capacity."""
        his = sorted({h for h in his if (lo, h, sizing) not in parts.bands})
        if not his:
            return
        n = np.asarray(his) - lo  # each band's length
        width, e1 = int(n[-1]), len(data.rank) + 1
        ranks = data.rank[lo:lo + width]
        calib, held = data.calib[:, ranks], data.heldout[:, ranks]

        def running(a: np.ndarray) -> np.ndarray:  # [..., W] -> [..., W+1]: sums over the first k ranks
            return np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, axis=-1, dtype=np.float64)], -1)

        def ffn(backend: str, rows: np.ndarray, kind: str = "none") -> np.ndarray:
            return np.asarray(self.cost.ffn_ms(backend, rows, self.hidden, self.ffn, kind), dtype=np.float64)

        def mb(rows: np.ndarray) -> np.ndarray:
            return np.asarray(self.cost.ffn_mb(self.exact, rows, self.hidden, self.ffn), dtype=np.float64)

        if sizing == "expert":  # [Q, W] per rank: every band's figure is the running sum at its end
            caps = data.expert_capacities(lo, lo + width)
            over = np.maximum(calib[None] - caps[:, None, :], 0)  # [Q, C, W]
            at = lambda a: np.moveaxis(running(a)[..., n], -1, 0)  # noqa: E731  [..., W] -> [B, ...]
            static = {k: at(ffn(self.backend, caps, k)) for k in COMPRESSIONS}
            spill_ms, spill_n, spill_mb = at(ffn(self.exact, over)), at(over), at(mb(over))
            drops = at(np.maximum(held[None] - caps[:, None, :], 0).sum(1))
            caps_b = np.where(np.arange(width)[None, None, :] < n[:, None, None], caps[None], 0)  # [B, Q, W]
            cum = np.zeros((len(n), len(QUANTILES), e1))
            cum[:, :, 1:width + 1] = np.cumsum(caps_b, axis=2)
            cum[:, :, width + 1:] = cum[:, :, width:width + 1]
            cap_max, slots = caps_b.max(2), caps_b.sum(2)
        else:  # one capacity per band and quantile: running sums per distinct capacity, taken at each band's end
            cap_bq = np.stack([data.band_capacities(lo, int(h)) for h in his])  # [B, Q]
            values, which = np.unique(cap_bq, return_inverse=True)
            which = which.reshape(cap_bq.shape)
            over = np.maximum(calib[None] - values[:, None, None], 0)  # [V, C, W]
            pick = lambda a: a[which, ..., n[:, None]]  # noqa: E731  [V, ..., W+1] -> [B, Q, ...]
            spill_ms, spill_n = pick(running(ffn(self.exact, over))), pick(running(over))
            spill_mb = pick(running(mb(over)))
            drops = pick(running(np.maximum(held[None] - values[:, None, None], 0).sum(1)))
            static = {k: n[:, None] * ffn(self.backend, cap_bq, k) for k in COMPRESSIONS}
            cum = np.minimum(np.arange(e1)[None, None, :], n[:, None, None]) * cap_bq[:, :, None].astype(np.float64)
            cap_max, slots = cap_bq, n[:, None] * cap_bq
        for b, h in enumerate(his):
            parts.bands[(lo, h, sizing)] = {
                "cap_max": cap_max[b], "slots": slots[b], "cum": cum[b],
                "static": {k: v[b] for k, v in static.items()}, "drops": drops[b],
                "spill_n": spill_n[b], "spill_ms": spill_ms[b], "spill_mb": spill_mb[b]}

    def score_rows(self, data: LayerData, space: Space, rows: np.ndarray) -> Scores:
        """Scores of canonical rows of `space` (equal to `score` of each row's decision), in batches."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(space.params))
        parts = [self._score_batch(data, space, rows[i:i + BATCH]) for i in range(0, max(1, len(rows)), BATCH)]
        return Scores.concat(parts)

    def _score_batch(self, data: LayerData, space: Space, rows: np.ndarray) -> Scores:
        """Decisions sharing residency, tiers and quantiles (a `core`) share their bands, exact path and packing;
        group size and compression only change the static calls' cost, so per decision only the overlap of that
        one number with each chunk's exact path is left (sum of max(static, exact) from sorted exact times)."""
        parts = self._layer_parts(data)
        cores = _cores(space, rows)
        kinds = space.column(rows, "compress") if "compress" in dict(space.params) else np.full(len(rows), "none")
        kind_names = [str(k) for k in np.unique(kinds)]
        return self._core_scores(data, space, rows, parts, cores, self._core_bands(data, parts, cores, kind_names),
                                 kinds, kind_names)

    def _core_bands(self, data: LayerData, parts: _LayerParts, cores: _Cores, kind_names: list[str]) -> _CoreBands:
        """Each core's bands summed: band j holds ranks lo..hi-1 after the head, as np.array_split cuts them; the
        bands sharing a (sizing, lo) are filled at once."""
        cr, ct = cores.residents, cores.tiers
        out = _CoreBands.zeros(len(cr), data.calib.shape[0], len(kind_names), len(data.rank) + 1)
        base, extra = cr // np.maximum(ct, 1), cr % np.maximum(ct, 1)
        e1 = len(data.rank) + 1
        for j in range(MAX_TIERS):
            size = np.where(j < ct, base + (j < extra), 0)
            out.lo_of[:, j] = j * base + np.minimum(j, extra)
            lo = cores.head + out.lo_of[:, j]
            used = np.nonzero(size > 0)[0]
            by_sizing = np.searchsorted(SIZINGS, cores.sizing[used])
            bands, which = np.unique((by_sizing * e1 + lo[used]) * e1 + size[used], return_inverse=True)
            starts = np.asarray(bands) // e1  # (sizing, lo) of each band
            for key in np.unique(starts).tolist():
                sz, l = divmod(key, e1)
                self._fill_bands(data, parts, l, (l + np.asarray(bands)[starts == key] % e1).tolist(), SIZINGS[sz])
            for key, sel in zip(bands.tolist(), np.split(used[np.argsort(which, kind="stable")],
                                                         np.cumsum(np.bincount(which.reshape(-1)))[:-1])):
                rest, n = divmod(key, e1)
                sz, l = divmod(rest, e1)
                out.add(sel, j, self._band(data, parts, l, l + n, SIZINGS[sz]), cores.quantiles[sel, j], kind_names)
        return out

    def _core_scores(self, data: LayerData, space: Space, rows: np.ndarray, parts: _LayerParts, cores: _Cores,
                     b: _CoreBands, kinds: np.ndarray, kind_names: list[str]) -> Scores:
        """Per core, its CPU tail and overflow policy (0 drop, 1 spill): each chunk's exact lanes, packing; per
        decision its calls; composed by the evaluator."""
        r = space.column(rows, "resident").astype(np.int64)
        g = space.column(rows, "group_size").astype(np.int64)
        spill = (space.column(rows, "overflow") == "spill").astype(np.int64)
        ci, cr, ch = cores.index, cores.residents, cores.head
        n_cores, n_chunks = len(cr), data.calib.shape[0]
        tail = (space.column(rows, "cpu_tail").astype(np.int64) if "cpu_tail" in dict(space.params)
                else np.zeros(len(rows), dtype=np.int64))
        # the (core, tail) pairs the rows take: each pair's lanes once, under both overflow policies
        pairs, pi = np.unique(np.stack([ci, tail], 1), axis=0, return_inverse=True)
        lanes = self._exact_lanes(parts, cr[pairs[:, 0]], ch[pairs[:, 0]], pairs[:, 1],
                                  tuple(a[pairs[:, 0]] for a in (b.spill_ms, b.spill_n, b.spill_mb)))
        total = np.broadcast_to(parts.total_n, (n_cores, n_chunks))
        pack = np.where((cr > 0)[:, None], self.cost.pack_ms(total, self.hidden, b.slots[:, None]), 0.0)  # [C, n]
        calls = np.where(r > 0, -(-r // g), 0)
        s_row = self.cost.static_ms(self.backend, b.static[ci, np.searchsorted(kind_names, kinds)], calls)
        off_cpu = self.cost.overlaps(self.backend)
        zero = np.zeros(len(rows))
        power = self.cost.power_w(self.backend) if self.with_energy else None
        flat = lambda a: None if a is None else a.reshape(-1, n_chunks)  # noqa: E731  [P, 2, n] -> [P*2, n]
        work = evaluator.LayerWork(zero if off_cpu else s_row, s_row if off_cpu else zero, flat(lanes.latency),
                                   pack, pi.reshape(-1) * 2 + spill, ci,
                                   None if power is None else power * s_row,
                                   self.cost.power_w(EXACT) if self.with_energy else None, flat(lanes.cpu),
                                   flat(lanes.mj) if self.with_energy else None)
        full, part = evaluator.totals(work, ~data.partial), evaluator.totals(work, data.partial)
        # the limits do not depend on where the cold experts run: once per decision but its CPU tail
        others = [i for i, (p, _) in enumerate(space.params) if p != "cpu_tail"]
        _, one, back = np.unique(rows[:, others], axis=0, return_index=True, return_inverse=True)
        v = self._violation_rows(r[one], g[one], kinds[one], b.cap_max[ci[one]], lambda rows_at, bounds: _slots_at(
            b.cums[ci[one[rows_at]]], b.lo_of[ci[one[rows_at]]], bounds))[back.reshape(-1)]
        energy = None if full.energy_mj is None else full.energy_mj + part.energy_mj
        return Scores(full.latency_ms + part.latency_ms, energy, np.where(spill == 1, 0, b.drops[ci]).astype(np.int64),
                      v, part.latency_ms, part.energy_mj, full.cpu_ms + part.cpu_ms, part.cpu_ms)

    def _exact_lanes(self, parts: _LayerParts, r: np.ndarray, h: np.ndarray, tail: np.ndarray, spill: tuple
                     ) -> ExactLanes:
        """[pairs, 2, chunks] exact lanes of each (residents `r` after a head of `h`, CPU `tail`) under each overflow
        policy (0 drop, 1 spill: the overflow `spill` = (ms, n, MB) [pairs, chunks] on the plan's exact path): the
        plan's path runs the head's ranks ..h-1 and cold ranks h+r..s-1 (s = max(h+r, E - tail)), cpu-exact ranks
        s.. (with one exact path, s = E)."""
        e = len(parts.cold_n) - 1
        after = h + r
        s = np.maximum(after, e - tail) if self.splits_exact else np.full(len(r), e)
        policy = lambda a: np.stack([np.zeros_like(a), a], 1)  # noqa: E731 [P, n] -> [P, 2, n]

        def on(table: np.ndarray) -> np.ndarray:  # ranks ..h-1 and h+r..s-1: [P, 1, n]
            return (table[0] - table[h] + table[after] - table[s])[:, None]

        work = [(self.exact, on(parts.cold_ms[self.exact]) + policy(spill[0]), on(parts.cold_n) + policy(spill[1]),
                 on(parts.cold_mb[self.exact]) + policy(spill[2])),
                (EXACT, parts.cold_ms[EXACT][s][:, None], parts.cold_n[s][:, None], parts.cold_mb[EXACT][s][:, None])]
        return self.cost.exact_lanes(work, self.hidden)

    def _violation_rows(self, r: np.ndarray, g: np.ndarray, kinds: np.ndarray, cap_max: np.ndarray,
                        slots_at) -> np.ndarray:
        """`violation` of each decision, from its residents, group size, compression, largest capacity and
        `slots_at(rows, bounds)` (summed capacities of ranks below each bound): every group's program against its
        backend's limits (r // g full groups and one of r % g), and the resident budget."""
        eb = np.zeros(len(r))
        for k in np.unique(kinds):
            eb[kinds == k] = ane_limits.expert_weight_bytes(self.hidden, self.ffn, str(k))
        v = evaluator.over_budget(r * eb, self.resident_bytes_per_layer)
        limits = getattr(registry.get(self.backend), "limits", None)
        if limits is None:
            return v
        if limits is not ane_limits.group_violation:  # another backend's limits: group by group
            for i in np.nonzero(r > 0)[0]:
                ri, gi = int(r[i]), int(g[i])
                caps = np.diff(slots_at(np.array([i]), np.arange(ri + 1)[None, :])[0]).astype(np.int64)
                v[i] += sum(limits(caps[j:j + gi].tolist(), self.hidden, self.ffn, str(kinds[i]))
                            for j in range(0, ri, gi))
            return v
        # the ANE's: a program's usage but its slots is the same for every full group; slots are summed per group
        full, rest = np.where(r > 0, r // g, 0), np.where(r > 0, r % g, 0)
        for n, count in ((g, full), (rest, rest > 0)):
            v += count * ane_limits.violation(ane_limits.program_usage(n, self.hidden, self.ffn, expert_bytes=eb))
        maybe = np.nonzero((r > 0) & (np.minimum(g, r) * cap_max > ane_limits.MAX_AXIS))[0]
        if maybe.size:  # packed slots per group, from the running sums of capacities at the group bounds
            ri, gi = r[maybe], g[maybe]
            bounds = np.minimum(np.arange(int((ri // gi).max()) + 2)[None, :] * gi[:, None], ri[:, None])
            v[maybe] += ane_limits.violation({"slots": np.diff(slots_at(maybe, bounds), axis=1)}).sum(1)
        return v


def _slots_at(cums: np.ndarray, lo: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """[rows, bounds]: capacities of the ranks below each bound, from each band's running sums ([rows, tiers,
    E+1], padded past the band) and first rank ([rows, tiers])."""
    out = np.zeros(bounds.shape)
    for j in range(cums.shape[1]):
        at = np.clip(bounds - lo[:, j:j + 1], 0, cums.shape[2] - 1)
        out += np.take_along_axis(cums[:, j], at, axis=1)
    return out
