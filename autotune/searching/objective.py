"""The search's objective: a whole plan's prefill of one prompt as the runtime executes it (its experts, its dense
functions where its plan puts them, the attention core, lm_head, and the last layer a lazy host leaves out), predicted
by `autotune.costing.whole_prefill`; the report prices the plan and its baselines with the same function.

A whole plan is a `Solution` (one decision per MoE layer at a chunk size) with its dense placement: the one chosen at
its chunk size (`dense_choice`), by the rule the plan file follows (`placement`), or its own (`Solution.dense`, a
baseline's). The candidates at each chunk size (`WholePrefill.candidates`): the exact optimum of the experts (the
DP's), the same with the last layer on the host's own exact path where that host is lazy (its work for rows no
logit reads left out, which the experts' sum cannot see), each with the chunk size's dense choice and with its dense
half all on the host (a static dense function reads the last layer's input: no row of it is left out), and every
baseline of the report that is a plan of this model (`PLAN_ROWS`: all exact on each exact path, mlx-lm's own
placement, the Core ML designs that fit); the cheapest by the weighted whole prefill is the pick, so it is never
predicted slower than a row of its own table (the Core ML CPU-only and naive rows stay references: not plans)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune.costing.whole_prefill import (
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    LazyLast,
    PrefillPrediction,
    predict_prefill,
    prompt_chunks,
)
from autotune.searching.dense_choice import DenseChoice, dense_weight_bytes
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import (
    Candidates,
    ChunkSearch,
    Solution,
    baselines,
    best_plan,
    resident_bytes,
    solution,
)
from autotune.searching.scores import Weights, weighted_cost
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, Space
from runtime.backends import EXACT, registry
from runtime.coreml import ane_limits

# the report's whole-prefill rows that are plans of this model (candidates of the search); the others are references
PLAN_ROWS = ("ane-dense-cpu-experts", "ane-dense-masked-experts", "paper-heuristic", "experts-only", "mlx-gpu")


def expert_figures(sol: Solution, prompts: float) -> ExpertFigures:
    """A design's expert figures per prompt (its totals are over the calibration prompts)."""
    return ExpertFigures(sol.latency_ms / prompts, sol.cpu_ms / prompts,
                         None if sol.energy_mj is None else sol.energy_mj / prompts)


def prompts_in(layers: list[LayerData], prompt_tokens: int) -> float:
    """The calibration prompts the layers' traces hold (what a solution's totals are summed over)."""
    return float(layers[0].tokens.sum()) / prompt_tokens


def own(c: LayerConfig) -> bool:
    """Every expert of the layer on the host's own exact path (no static group, no CPU tail)."""
    return c.resident == 0 and c.cpu_tail == 0


def lazy_last(sol: Solution, layers: list[LayerData], scorer: Scorer, shape: DecoderShape,
              prompts: float) -> LazyLast | None:
    """The model's last decoder layer as a lazy host leaves out its work for rows no output reads (`LazyLast`),
    under a design whose experts there run on the host's own exact path (`own`); None where they do not (a layer
    that runs static calls evaluates its input) or the plan's exact path is not lazy."""
    if not scorer.cost.is_lazy(scorer.exact):
        return None
    split, last = all(own(c) for c in sol.configs), shape.num_layers - 1
    if last not in shape.moe_layers:
        return LazyLast(None, split)
    at = {d.layer: (d, c) for d, c in zip(layers, sol.configs)}.get(last)
    if at is None or not own(at[1]):
        return None
    score, energy = scorer.score(*at), scorer.energy(*at)
    return LazyLast(ExpertFigures(score.latency_ms / prompts, score.cpu_ms / prompts,
                                  None if energy is None else energy / prompts), split)


def corrected(pred: PrefillPrediction, factors: dict[str, float]) -> PrefillPrediction:
    """A prediction with each part's latency times its factor (the parts run one after another: the whole is their
    sum); CPU-busy time and energy scaled as the latency is."""
    parts = {p: ms * factors.get(p, 1.0) for p, ms in pred.parts_ms.items()}
    scale = sum(parts.values()) / pred.latency_ms if pred.latency_ms > 0 else 1.0
    return dataclasses.replace(pred, latency_ms=sum(parts.values()), cpu_ms=pred.cpu_ms * scale, parts_ms=parts,
                               energy_mj=None if pred.energy_mj is None else pred.energy_mj * scale)


def all_dense(backend: str, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int) -> DensePlacement:
    """Every dense function on `backend`, an attention function for every full chunk's context."""
    buckets = tuple(c for r, c in prompt_chunks(prompt_tokens, chunk_tokens) if r == chunk_tokens)
    return DensePlacement(backend, backend, backend, backend, buckets)


def host_of(scorer: Scorer) -> str:
    """Where a plan without a dense choice runs its dense half: the exact path a search pinned (search --engine
    mlx: mlx-exact), else the CPU (the plan names no dense host)."""
    return scorer.cost.exact_path or EXACT


def placement(sol: Solution, choice: DenseChoice | None, host: str) -> DensePlacement:
    """Where a whole plan runs its dense functions (what its plan file's `dense` field says): its own (`sol.dense`),
    else the choice made at its chunk size, except for a plan with nothing resident (the all-exact plans: the
    unmodified model's computation) and one keeping more experts resident than the choice was made beside, past the
    ANE's window with them: their dense functions stay on the choice's host. Without a choice, all on `host`."""
    if sol.dense is not None:
        return sol.dense
    if choice is None:
        return DensePlacement(host=host)
    if not any(cfg.resident for cfg in sol.configs):
        return DensePlacement(host=choice.placement.host)
    beside = resident_bytes(sol, choice.shape.hidden, choice.shape.expert_ffn)
    return choice.placement if choice.fits_beside(beside) else DensePlacement(host=choice.placement.host)


@dataclass(frozen=True)
class WholePrefill:
    """The objective: the whole prefill of one `prompt_tokens` prompt of the model `shape` describes; `factors`:
    each part's correction from whole plans measured on this host (`measuring.feedback`; none: as priced)."""
    shape: DecoderShape
    prompt_tokens: int
    factors: tuple[tuple[str, float], ...] = ()

    def price(self, sol: Solution, layers: list[LayerData], scorer: Scorer,
              choice: DenseChoice | None = None) -> PrefillPrediction:
        """A whole plan's prefill, predicted (`layers`: the traces at its chunk size, what its totals sum)."""
        prompts = prompts_in(layers, self.prompt_tokens)
        pred = predict_prefill(scorer.cost, self.shape, self.prompt_tokens, sol.chunk_tokens,
                               expert_figures(sol, prompts), placement(sol, choice, host_of(scorer)),
                               lazy_last=lazy_last(sol, layers, scorer, self.shape, prompts))
        return corrected(pred, dict(self.factors)) if self.factors else pred

    def cost(self, sol: Solution, layers: list[LayerData], scorer: Scorer, choice: DenseChoice | None,
             weights: Weights) -> float:
        """The scalar the search minimises: the whole prefill's weighted latency, energy and CPU-busy time."""
        return float(weighted_cost(self.price(sol, layers, scorer, choice), weights))

    def rows(self, layers: list[LayerData], scorer: Scorer, budget_rate: float, experts_only: Solution
             ) -> dict[str, Solution]:
        """The report's whole-prefill baselines at the layers' chunk size, each a `Solution` with its own dense
        placement: `PREFILL_BASELINES`' designs (`experts_only`: the search's experts alone, dense ops on the CPU)."""
        chunk = layers[0].chunk_tokens
        base = baselines(layers, scorer, budget_rate, chunk)
        ane = all_dense(scorer.backend, self.shape, self.prompt_tokens, chunk)
        n = self.shape.num_experts
        masked = solution([LayerConfig(n, n, capacity=chunk) for _ in layers], layers, scorer)
        designs = {"coreml-cpu": (base["cpu_only"], DensePlacement()),
                   "coreml-naive": (base["naive_coreml"], ane),
                   "ane-dense-cpu-experts": (base["cpu_only"], ane),
                   "ane-dense-masked-experts": (masked, ane),
                   "paper-heuristic": (base["paper_heuristic"], ane),
                   "experts-only": (experts_only, DensePlacement())}
        if scorer.splits_exact:  # mlx-lm's own placement: every expert and dense op on the GPU's exact path
            designs["mlx-gpu"] = (base["mlx_gpu"], DensePlacement(host=scorer.exact))
        return {name: dataclasses.replace(sol, dense=place, baseline=name) for name, (sol, place) in designs.items()}

    def is_plan(self, sol: Solution, layers: list[LayerData], scorer: Scorer, drop_budget: int) -> bool:
        """Whether a baseline row is a plan this search may write: one of `PLAN_ROWS`, its dense functions on a
        static backend only where that backend is Core ML's (what the runtime runs) and they fit the ANE's window
        beside its resident experts, each layer within the hard limits, its held-out drops within the budget."""
        if sol.baseline not in PLAN_ROWS or sol.heldout_drops > drop_budget:
            return False
        place = sol.dense or DensePlacement()
        if any((place.qkv, place.o_proj, place.attention, place.mlp)):
            if registry.get(scorer.backend).limits is None:
                return False
            resident = resident_bytes(sol, self.shape.hidden, self.shape.expert_ffn)
            dense = dense_weight_bytes(self.shape, place)
            if ane_limits.resident_over_window({"experts": resident, "dense functions": dense}) > 0:
                return False
        return all(scorer.score(d, c).violation == 0 for d, c in zip(layers, sol.configs))

    def lazy_last_optimum(self, search: ChunkSearch, space: Space, scorer: Scorer, budget: int,
                          weights: Weights) -> Solution | None:
        """Where the host is lazy and the last decoder layer is a MoE layer: the experts' optimum with that layer's
        experts all on the host's own exact path (its work for rows no logit reads is then left out, which the
        experts' sum does not see); None elsewhere."""
        last = self.shape.num_layers - 1
        if not scorer.cost.is_lazy(scorer.exact) or not search.layers or search.layers[-1].layer != last:
            return None
        row = space.canonical(space.row_of(space.params_of(LayerConfig(0))))
        pool = [*search.pool[:-1], Candidates(row, scorer.score_rows(search.layers[-1], space, row))]
        return best_plan(search, space, scorer, budget, weights, pool=pool)

    def candidates(self, search: ChunkSearch, choice: DenseChoice | None, scorer: Scorer, space: Space,
                   budget: int, budget_rate: float, weights: Weights) -> list[Solution]:
        """The whole plans at one chunk size (see the module docstring), each once."""
        optima = [s for s in (search.best, self.lazy_last_optimum(search, space, scorer, budget, weights)) if s]
        host = DensePlacement(host=choice.placement.host if choice else host_of(scorer))
        found = optima + [dataclasses.replace(s, dense=host) for s in optima]  # each with its dense half on the host
        if search.best is not None:
            rows = self.rows(search.layers, scorer, budget_rate, search.best)
            found += [s for s in rows.values() if self.is_plan(s, search.layers, scorer, budget)]
        out, seen = [], set()
        for s in found:
            key = (s.exact_partial, tuple(s.configs), placement(s, choice, host_of(scorer)))
            if key not in seen:
                seen.add(key)
                out.append(s)
        return out

    def best(self, search: ChunkSearch, choice: DenseChoice | None, scorer: Scorer, space: Space, budget: int,
             budget_rate: float, weights: Weights) -> tuple[float, Solution] | None:
        """The cheapest whole plan at one chunk size and its weighted whole prefill (None: no candidate)."""
        priced = [(self.cost(s, search.layers, scorer, choice, weights), i, s)
                  for i, s in enumerate(self.candidates(search, choice, scorer, space, budget, budget_rate, weights))]
        if not priced:
            return None
        cost, _, sol = min(priced, key=lambda t: (t[0], t[1]))  # ties: the earlier (the experts' optimum first)
        return cost, sol

