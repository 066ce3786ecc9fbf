"""The search's objective is the whole prefill as it executes (autotune/searching/objective.py): the lazy last layer
priced by hand inside it, the pick it changes, and no baseline row that is a plan predicted faster than the plan
written."""
import dataclasses

import pytest

from autotune.calibration.traces import synthetic_traces
from autotune.costing.costmodel import BackendModel, CostModel
from autotune.costing.whole_prefill import DecoderShape
from autotune.profiling.profile import load_profile
from autotune.searching.bound_report import priced_bounds
from autotune.searching.dense_choice import choose_dense
from autotune.searching.flight_plan import Flight
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import PLAN_ROWS, WholePrefill
from autotune.searching.optimizer import ranked_solutions, run_search, solution, solution_plan
from autotune.searching.prefill_report import pick_candidates, whole_prefill, whole_prefill_choice
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, layer_space
from runtime.plan import plan_from_json

GPU = "mlx-exact"
SPEC = dict(architecture="synthetic", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8,
            top_k=2, hidden_size=256, expert_ffn_size=128, fingerprint="synthetic-objective")
SHAPE = DecoderShape(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=1000, num_layers=2, moe_layers=(0, 1),
                     num_experts=8, top_k=2, expert_ffn=128, context=4096)
PROMPT, CHUNK = 256, 64


def lanes(gpu_call_ms: float) -> CostModel:
    """The CPU and a lazy GPU (MLX) priced per GFLOP only, the GPU's calls `gpu_call_ms` each; the GPU the plan's
    exact path and the dense half's host (search --engine mlx)."""
    return CostModel({"cpu-exact": BackendModel("cpu-exact", 0.0, 0.0, 0.4, 0.0, 2, False, 60.0),
                      "cpu-static": BackendModel("cpu-static", 0.0, 0.0, 0.4, 0.0, 2, False, 60.0),
                      GPU: BackendModel(GPU, gpu_call_ms, 0.0, 0.05, 0.0, 2, True, 50.0)}).with_exact(GPU)


def traces_at(chunk: int, spec: dict = SPEC, prompts: int = 6) -> list[LayerData]:
    return LayerData.from_traces(synthetic_traces(spec, prompts, PROMPT, skew=1.2, seed=2, tokens=True), chunk, PROMPT)


def test_the_objective_leaves_out_the_lazy_last_layer_by_hand():
    """4 chunks of 64 rows, the last decoder layer (a MoE layer) on the GPU's own exact path, layer 0 with a CPU
    tail (so the last token is not sent alone): the lazy host runs that layer's experts for the last chunk's 64 rows
    only, 3/4 of its expert work left out of the whole prefill; with every layer on its own path, all but the one
    row."""
    scorer = Scorer(lanes(0.2), 256, 128, "cpu-static", 0.0)
    assert scorer.exact == GPU and scorer.cost.is_lazy(GPU)
    layers = traces_at(CHUNK)
    prompts = float(layers[0].tokens.sum()) / PROMPT
    whole = WholePrefill(SHAPE, PROMPT)
    figures = {c: [scorer.score(d, c).latency_ms for d in layers]
               for c in (LayerConfig(0), LayerConfig(0, cpu_tail=4))}
    for configs, share in (([LayerConfig(0, cpu_tail=4), LayerConfig(0)], 192 / 256),
                           ([LayerConfig(0), LayerConfig(0)], 255 / 256),
                           ([LayerConfig(0), LayerConfig(0, cpu_tail=4)], 0.0)):  # a CPU tail there: priced whole
        sol = solution(configs, layers, scorer)
        experts = sum(figures[c][i] for i, c in enumerate(configs)) / prompts
        left_out = share * figures[configs[1]][1] / prompts
        parts = whole.price(sol, layers, scorer).parts_ms
        assert parts["experts"] == pytest.approx(experts - left_out, rel=1e-9)
        assert sol.latency_ms / prompts == pytest.approx(experts, rel=1e-9)  # the experts' sum alone does not see it


def test_the_lazy_last_layer_changes_the_pick():
    """GPU calls dear enough (0.016 ms) that the experts' optimum runs every expert on the CPU, but the lazy last
    layer makes the whole prefill cheaper with that layer on the GPU's own path (its work for 3/4 of the rows left
    out); cheaper calls (0.004 ms) make every layer's own path cheapest, the last token then alone: mlx-lm's own
    placement, the report's mlx-gpu row. The search picks by the whole prefill, not by the experts' sum."""
    layers = traces_at(CHUNK)
    whole = WholePrefill(SHAPE, PROMPT)
    for call, tails, row in ((0.016, [8, 0], None), (0.004, [0, 0], "mlx-gpu")):
        scorer = Scorer(lanes(call), 256, 128, "cpu-static", 0.0)
        space = layer_space(8, split_exact=scorer.splits_exact)
        experts_only = run_search(layers, scorer, space, trials=0, progress=False)
        out = run_search(layers, scorer, space, trials=0, progress=False, whole=whole)
        assert all(c.cpu_tail for c in experts_only.best.configs)  # the experts' sum: a CPU tail in every layer
        assert [c.cpu_tail for c in out.best.configs] == tails and out.best.baseline == row
        assert out.best.latency_ms > experts_only.best.latency_ms  # a dearer experts' sum...
        price = lambda s: whole.price(s, layers, scorer).latency_ms  # noqa: E731
        assert price(out.best) < 0.75 * price(experts_only.best)  # ...a whole prefill at least a quarter cheaper
        ranked = ranked_solutions(out, scorer)  # the gate's order: by the same whole prefill, the pick first
        assert [price(s) for s in ranked] == sorted(price(s) for s in ranked)
        assert price(ranked[0]) == pytest.approx(price(out.best))


@pytest.mark.parametrize("profile,chunk_prompt", [("apple-m2-ultra-published", (1024, 2048)), ("lanes", (256, 256))])
def test_no_baseline_plan_is_predicted_faster_than_the_plan(profile, chunk_prompt):
    """Every whole-prefill row of the report that is a plan of this model is a candidate of the search: none is
    predicted faster than the plan written (the README's main job had mlx-gpu at 0.80x). The published M2 Ultra
    profile with the ANE and the dense choice, and the two lanes without them."""
    prompt = chunk_prompt[1]
    if profile == "lanes":
        cost, backend = lanes(0.2), "cpu-static"
    else:
        cost, backend = load_profile(profile).cost_model, "ane"
    spec = {**SPEC, "num_layers": 4, "moe_layers": [0, 1, 2, 3], "num_experts": 16}
    shape = dataclasses.replace(SHAPE, num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=16)
    traces = synthetic_traces(spec, 4, prompt, skew=1.2, seed=5, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, prompt) for c in (256, chunk_prompt[0]) if c <= prompt}
    scorer = Scorer(cost, 256, 128, backend, 1e9)
    prompts = float(next(iter(workloads.values()))[0].tokens.sum()) / prompt

    def dense(chunk, weights, resident):
        return choose_dense(cost, shape, prompt, chunk, backend, weights, prompts, resident)

    out = run_search(workloads, scorer, layer_space(16, split_exact=scorer.splits_exact), trials=0, progress=False,
                     dense=dense if backend == "ane" else None, whole=WholePrefill(shape, prompt))
    report = whole_prefill(out, scorer, shape, prompt)
    rows = report["prefill_baselines"]
    assert {n for n, r in rows.items() if r["candidate"]} <= set(PLAN_ROWS)
    assert not rows["coreml-cpu"]["candidate"] and not rows["coreml-naive"]["candidate"]
    if scorer.splits_exact:
        assert rows["mlx-gpu"]["candidate"]
    for name, row in rows.items():
        if row["candidate"]:
            assert report["vs"][name]["latency"] >= 1.0 - 1e-12, name


M2_PROMPT = 2048
M2_SPEC = {**SPEC, "num_layers": 4, "moe_layers": [0, 1, 2, 3], "num_experts": 16}
M2_SHAPE = dataclasses.replace(SHAPE, num_layers=4, moe_layers=(0, 1, 2, 3), num_experts=16)


@pytest.fixture(scope="module")
def m2_search():
    """The search's outcome on the published M2 Ultra profile, 512- and 1,024-token chunks of 2,048-token prompts."""
    cost, prompt, shape = load_profile("apple-m2-ultra-published").cost_model, M2_PROMPT, M2_SHAPE
    traces = synthetic_traces(M2_SPEC, 4, prompt, skew=1.2, seed=5, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, prompt) for c in (512, 1024)}
    scorer = Scorer(cost, 256, 128, "ane", 1e9)
    prompts = float(next(iter(workloads.values()))[0].tokens.sum()) / prompt

    def dense(chunk, weights, resident):
        return choose_dense(cost, shape, prompt, chunk, "ane", weights, prompts, resident)

    out = run_search(workloads, scorer, layer_space(16, split_exact=scorer.splits_exact), trials=0, progress=False,
                     dense=dense, whole=WholePrefill(shape, prompt))
    return out, scorer


def test_two_in_flight_gives_each_chunk_sizes_best_within_the_gpu_alones_energy(m2_search):
    """Two chunks in flight on the published M2 Ultra profile (the CPU a third unit): `by_chunk` has the chunk sizes
    it priced and two uneven two-chunk splits (`half_chunks` the same as half-chunks, `half_chunk` their fastest); the
    plan is the fastest whole-chunk one within the cap (what the runtime runs), at no more than mlx-gpu's energy, and
    ends no earlier than the priced bound at its chunk size; each unit's busy and idle ms add up to its row's
    latency. The plan `search --in-flight 2` writes of it (`flight_plan.Flight`) says the schedule's chunking,
    dense half and figures, and ends no later than the search's plan as a chain."""
    # a size whose chain is past 1.5x the best's is not priced
    (out, scorer), prompt, shape = m2_search, M2_PROMPT, M2_SHAPE
    report, chosen = whole_prefill_choice(out, scorer, shape, prompt, in_flight=2)
    rows = report["by_chunk"]
    equal = {c: r for c, r in rows.items() if "+" not in c}  # the others: two uneven chunks (`uneven_pairs`)
    assert set(equal) <= {"512", "1024"} and "1024" in equal and len(rows) - len(equal) == 2
    assert all(r["chunks"] == prompt // int(c) for c, r in equal.items())
    assert all(r["chunks"] == 2 and sum(map(int, c.split("+"))) == prompt for c, r in rows.items() if c not in equal)
    key = "+".join(map(str, report["chunk_rows"])) if "chunk_rows" in report else str(report["chunk_tokens"])
    assert key in rows
    fits = [r["predicted_prefill_ms"] for r in rows.values() if r["within_energy_cap"]]
    halves = [r["predicted_prefill_ms"] for r in report["half_chunks"].values() if r["within_energy_cap"]]
    # the plan: the fastest schedule the runtime runs (whole chunks); the half-chunks' best beside it
    assert report["predicted_prefill_ms"] == report["executable"]["predicted_prefill_ms"] == min(fits)
    assert report["runtime_executes"] and report["predicted_schedule"]["shape"] == "chunks"
    half = min(report["half_chunks"].values(), key=lambda r: (not r["within_energy_cap"], r["predicted_prefill_ms"]))
    assert report["half_chunk"]["predicted_prefill_ms"] == half["predicted_prefill_ms"]
    assert report["half_chunk"]["within_energy_cap"] == bool(halves) and not report["half_chunk"]["runtime_executes"]
    gpu = report["prefill_baselines"]["mlx-gpu"]
    assert report["half_chunk"]["vs_mlx_gpu_latency"] == pytest.approx(gpu["predicted_prefill_ms"]
                                                                       / half["predicted_prefill_ms"])
    # no plan within the cap ends before the priced bound at its chunk size (`autotune.costing.priced_bound`)
    bound = priced_bounds(out, scorer, shape, prompt, gpu["predicted_prefill_ms"], gpu["predicted_prefill_energy_mj"],
                          None)["by_chunk"]
    for priced in (rows, report["half_chunks"]):
        for chunk, r in priced.items():  # the bound prices equal chunks only (uneven ones: "first+second")
            if "+" not in chunk and r["within_energy_cap"]:
                assert bound[chunk]["bound_ms"] <= r["predicted_prefill_ms"] * (1 + 1e-6)
    assert report["predicted_prefill_energy_mj"] <= gpu["predicted_prefill_energy_mj"]
    for r in rows.values():
        for unit in r["units"].values():
            assert unit["busy_ms"] + unit["idle_ms"] == pytest.approx(r["predicted_prefill_ms"], rel=1e-6)
    flight = Flight(report, chosen)
    plan = plan_from_json(solution_plan(flight.solution, out.chunks[flight.solution.chunk_tokens].layers, scorer,
                                        M2_SPEC, flight.chunk_tokens, dense=flight.dense(shape),
                                        predicted=flight.predicted()).model_copy(update=flight.fields()).to_json())
    assert plan.in_flight == 2 and plan.chunk_tokens == report["chunk_tokens"]
    assert plan.chunk_rows == report.get("chunk_rows") and (plan.chunk_rows is None or sum(plan.chunk_rows) == prompt)
    place = report["dense_placement"]
    assert plan.dense.exact == place["host"] == GPU
    assert {f for dl in plan.dense.layers for f in ("qkv", "o_proj", "attention", "mlp") if getattr(dl, f)} == {
        f for f in ("qkv", "o_proj", "attention", "mlp") if place[f]}
    assert plan.predicted["predicted_schedule"] == report["predicted_schedule"]
    assert report["predicted_prefill_ms"] == chosen.prediction.latency_ms <= report["one_in_flight_ms"] * (1 + 1e-12)


def test_two_in_flight_after_the_gate_keeps_the_picks_experts(m2_search):
    """Where the gate (or --measure, --robust) chose the pick's experts, two chunks in flight weigh those alone (with
    their CPU tail and without): the schedule chooses their chunking and dense half only."""
    out, scorer = m2_search
    cands = pick_candidates(out, scorer, M2_SHAPE, M2_PROMPT)
    assert cands[0].solution is out.best and cands[0].chunk == out.best.chunk_tokens
    assert len(cands) == 1 + any(c.cpu_tail for c in out.best.configs)
    for c in cands:
        assert [dataclasses.replace(x, cpu_tail=0) for x in c.solution.configs] == [
            dataclasses.replace(x, cpu_tail=0) for x in out.best.configs]
