"""The GPU as a third lane (mlx-exact): the cost model's composition of the ANE's calls, the GPU's exact path and
the CPU's, checked by hand; the search placing cold experts on the GPU only where the profile says it pays; the
mlx-gpu baseline's whole prefill by hand; the trade-off chart."""
import numpy as np
import pytest

from autotune.calibration.traces import synthetic_traces
from autotune.costing.costmodel import BackendModel, CostModel
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, LazyLast, predict_prefill
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import expert_figures, prompts_in
from autotune.searching.optimizer import run_search, solution, solution_plan
from autotune.searching.prefill_report import mlx_gpu_prefill
from autotune.searching.report import plot_tradeoff
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig, layer_space
from runtime.plan import Group, LayerPlan

GPU = "mlx-exact"
SPEC = dict(architecture="synthetic", model_type="qwen3_moe", num_layers=2, moe_layers=[0, 1], num_experts=8,
            top_k=2, hidden_size=256, expert_ffn_size=128, fingerprint="synthetic-gpu-lane")


def three_lanes(gpu_ms_per_gflop: float = 0.05, bus: float | None = None) -> CostModel:
    """ANE, CPU and GPU priced per GFLOP only (no bytes), each call a round 0.1 / 0 / 0.2 ms."""
    return CostModel({"ane": BackendModel("ane", 0.1, 0.0, 0.2, 0.0, 2, True, 2.0),
                      "cpu-exact": BackendModel("cpu-exact", 0.0, 0.0, 0.4, 0.0, 2, False, 60.0),
                      "cpu-static": BackendModel("cpu-static", 0.0, 0.0, 0.4, 0.0, 2, False, 60.0),
                      GPU: BackendModel(GPU, 0.2, 0.0, gpu_ms_per_gflop, 0.0, 2, True, 50.0)},
                     bus_ms_per_mb=bus)


def test_three_lanes_compose_by_hand():
    cost = three_lanes()
    h, f = 1000, 500  # one token through one expert: 6 * 1000 * 500 = 3 MFLOP
    gflop = lambda tokens: 6 * tokens * h * f / 1e9  # noqa: E731
    lp = LayerPlan(layer=0, groups=[Group(backend="ane", experts=[0], capacities=[100])], cpu_exact=[1, 2, 3],
                   exact_split={"cpu-exact": [3]})
    counts = np.array([120, 200, 50, 10])  # expert 0 spills 20 rows to the plan's exact path (the GPU)
    ane = 0.1 + gflop(100) * 0.2  # 0.1 + 0.06
    gpu = 0.2 + gflop(20 + 200 + 50) * 0.05  # its call, then the spilled and the cold rows: 0.2 + 0.0405
    cpu = gflop(10) * 0.4  # the tail expert: 0.012
    latency, cpu_busy = cost.layer_times(lp, counts, h, f, "spill", exact=GPU)
    assert latency == pytest.approx(max(ane, gpu, cpu))  # three lanes side by side: the GPU's is the longest
    assert cpu_busy == pytest.approx(cpu)  # the ANE's and the GPU's time is no CPU work
    assert cost.layer_energy_mj(lp, counts, h, f, "spill", exact=GPU) == pytest.approx(2.0 * ane + 50.0 * gpu
                                                                                        + 60.0 * cpu)
    # the same experts all on the CPU (the plan's exact path cpu-exact): one lane, added CPU work, each expert's rows
    # as torch runs them in half precision (`call_rows`: 200 -> 208)
    lat_cpu, busy = cost.layer_times(lp, counts, h, f, "spill")
    assert busy == pytest.approx(gflop(20 + 208 + 50 + 10) * 0.4) and lat_cpu == pytest.approx(max(ane, busy))
    # the memory bus: the GPU's and the CPU's bytes together take at least the bus's time for them
    slow_bus = three_lanes(bus=1.0)
    mb = sum(float(slow_bus.ffn_mb(p, np.array(rows), h, f).sum()) for p, rows in ((GPU, [20, 200, 50]),
                                                                                  ("cpu-exact", [10])))
    assert slow_bus.layer_ms(lp, counts, h, f, "spill", exact=GPU) == pytest.approx(max(ane, mb * 1.0))
    assert mb * 1.0 > gpu


def _search(cost: CostModel):
    spec = {**SPEC, "hidden_size": 2048, "expert_ffn_size": 768}  # compute, not the calls, decides
    layers = LayerData.from_traces(synthetic_traces(spec, 20, 256, skew=1.2, seed=3))
    scorer = Scorer(cost, spec["hidden_size"], spec["expert_ffn_size"], "ane", 1e12)
    out = run_search(layers, scorer, layer_space(8, split_exact=scorer.splits_exact), trials=0, progress=False)
    return solution_plan(out.best, out.layers, scorer, spec), out


def test_search_puts_cold_experts_on_the_gpu_where_it_pays():
    plan, out = _search(three_lanes(gpu_ms_per_gflop=0.01))  # a GPU 40x the CPU, 20x the ANE
    assert plan.exact == GPU
    on_gpu = [e for lp in plan.layers for e in lp.cpu_exact if lp.exact_path_of(e, plan.exact_path) == GPU]
    assert on_gpu and out.best.latency_ms < out.baselines["paper_heuristic"].latency_ms
    assert out.best.latency_ms <= out.baselines["mlx_gpu"].latency_ms


def test_search_keeps_cold_experts_off_a_gpu_that_does_not_pay():
    slow = three_lanes(gpu_ms_per_gflop=40.0)  # a GPU 100x slower than the CPU
    plan, _ = _search(slow)
    assert plan.exact == GPU  # the profile prices the GPU, so the plan may name it...
    # ...but every cold expert of every layer runs on the CPU
    assert all(lp.exact_path_of(e, plan.exact_path) == "cpu-exact" for lp in plan.layers for e in lp.cpu_exact)
    assert any(lp.cpu_exact for lp in plan.layers)


def test_mlx_gpu_baseline_by_hand():
    """One MoE layer, one 64-token chunk, every op on the GPU at 0.05 ms per GFLOP (no bytes: ms_per_mb 0)."""
    cost = CostModel({"cpu-exact": BackendModel("cpu-exact", 0.0, 0.0, 0.4, 0.0, 2, False, 60.0),
                      GPU: BackendModel(GPU, 0.2, 0.0, 0.05, 0.0, 2, True, 50.0)})
    shape = DecoderShape(hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=1000, num_layers=1, moe_layers=(0,),
                         num_experts=8, top_k=2, expert_ffn=128, context=4096)
    spec = {**SPEC, "num_layers": 1, "moe_layers": [0]}
    layers = LayerData.from_traces(synthetic_traces(spec, 5, 64, skew=1.0, seed=1), 64, 64)
    scorer = Scorer(cost, 256, 128, "ane", 1e12)
    assert scorer.exact == GPU
    pred = mlx_gpu_prefill(scorer, shape, layers, 64)
    experts = expert_figures(solution([LayerConfig(0)], layers, scorer), prompts_in(layers, 64))
    whole = predict_prefill(cost, shape, 64, 64, experts, DensePlacement(host=GPU))  # every row of the layer
    m, h, q, kv = 64, 256, 4 * 64, 2 * 64
    flops = (2 * m * h * (q + 2 * kv) + 2 * m * q * h  # q, k, v and o projections
             + 0.5 * 4 * m * m * 4 * 64  # the causal attention core (half the block)
             + 4 * m * h * 4 + 2 * m * 8 * h  # norms and residual adds, the router
             + 6 * h * 128 * 2 * m  # the experts: top-2 of every token
             + 2 * 1000 * h + 4 * h)  # the last row's final norm and lm_head
    assert whole.latency_ms == pytest.approx(flops / 1e9 * 0.05 + 0.2)  # one call of the GPU's exact path
    # mlx-lm sends the prompt's last token alone: its only layer, the last, computes the keys and values alone for
    # the 63 rows before it (`LazyLast`)
    lazy = predict_prefill(cost, shape, 64, 64, experts, DensePlacement(host=GPU), lazy_last=LazyLast(experts, True))
    assert pred.latency_ms == pytest.approx(lazy.latency_ms) and pred.latency_ms < whole.latency_ms / 10
    assert pred.energy_mj == pytest.approx(50.0 * pred.latency_ms) and pred.cpu_ms == 0.0
    full = LayerConfig(0)  # the same experts through the scorer: what the baseline's expert figure is
    assert scorer.score(layers[0], full).cpu_ms == 0.0


def test_tradeoff_chart_is_written(tmp_path):
    whole = {"prompt_tokens": 4096, "predicted_prefill_ms": 1300.0, "predicted_prefill_energy_mj": 8e4,
             "tradeoff": [{"chunk_tokens": c, "heldout_drops": 0, "predicted_prefill_ms": 1300.0 + c,
                           "predicted_prefill_energy_mj": 8e4 - c} for c in (512, 1024, 2048)],
             "prefill_baselines": {"mlx-gpu": {"predicted_prefill_ms": 1500.0, "predicted_prefill_energy_mj": 9e4},
                                   "paper-heuristic": {"predicted_prefill_ms": 1.2e4,
                                                       "predicted_prefill_energy_mj": 1.2e5},
                                   "coreml-cpu": {"predicted_prefill_ms": 1.3e4, "predicted_prefill_energy_mj": None}}}
    plot_tradeoff(whole, tmp_path / "plan.tradeoff.png")
    assert (tmp_path / "plan.tradeoff.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "plan.tradeoff.png").stat().st_size > 5000


@pytest.mark.parametrize("device,overlaps", [("gpu", True), ("cpu", False)])
def test_mlx_exact_timed_on_mlx_cpu_device_is_no_lane_beside_the_cpu(device, overlaps):
    """On Linux the profiler times mlx-exact on MLX's CPU device (records marked `device: cpu`): those calls run on
    this process's CPU, so the fitted model must not price them as a lane beside it."""
    from autotune.costing.fitting import fit_backend

    recs = [{"kind": "matmul", "backend": GPU, "m": m, "n": 1024, "k": 1024, "median_ms": 0.01 * m, "device": device}
            for m in (16, 64, 256)]
    model = fit_backend(GPU, recs, dtype_bytes=2, residual=False)
    assert model.overlaps_cpu is overlaps
    assert CostModel({GPU: model, "cpu-exact": three_lanes().models["cpu-exact"]}).plan_exact() == (
        GPU if overlaps else "cpu-exact")


def test_a_search_for_the_mlx_spine_pins_mlx_exact_timed_on_mlxs_cpu_device():
    """`search --engine mlx` off a Mac: mlx-exact, timed on MLX's CPU device, is the plan's exact path and the dense
    half's host (what `run --engine mlx` runs there), priced on this process's CPU: its time adds to the CPU's, it
    runs beside nothing. A profile without mlx-exact records is refused in one line."""
    from autotune.costing.fitting import fit_backend
    from autotune.searching.dense_choice import choose_dense
    from runtime.errors import NpumoeError

    recs = [{"kind": "group", "backend": GPU, "hidden": 256, "ffn": 128, "capacities": [m], "tokens": m,
             "median_ms": 0.2 + 0.01 * m, "device": "cpu"} for m in (16, 64, 256)]
    cpu = three_lanes().models["cpu-exact"]
    cost = CostModel({GPU: fit_backend(GPU, recs, dtype_bytes=4, residual=False), "cpu-exact": cpu,
                      "cpu-static": three_lanes().models["cpu-static"]})
    assert cost.plan_exact() == "cpu-exact"
    pinned = cost.with_exact(GPU)
    scorer = Scorer(pinned, 256, 128, "cpu-static", 0.0)
    assert pinned.plan_exact() == GPU and scorer.exact == GPU
    assert not scorer.splits_exact  # no CPU tail beside an exact path that runs on the CPU itself
    layers = LayerData.from_traces(synthetic_traces(SPEC, 4, 64, skew=1.2, seed=3))
    out = run_search(layers, scorer, layer_space(8, split_exact=scorer.splits_exact), trials=0, progress=False)
    assert solution_plan(out.best, out.layers, scorer, SPEC).exact_path == GPU  # the lane it was priced on
    assert Scorer(three_lanes(), 256, 128, "ane", 0.0).splits_exact  # beside the GPU's, one
    counts = np.array([40, 0, 25, 7])
    every = LayerPlan(layer=0, groups=[], cpu_exact=[0, 1, 2, 3])
    latency, busy = pinned.layer_times(every, counts, 256, 128, "spill", exact=GPU)
    assert latency == pytest.approx(busy) and busy == pytest.approx(pinned.exact_ms(counts, 256, 128, GPU))
    assert busy == pytest.approx(sum(pinned.ffn_ms(GPU, c, 256, 128) for c in counts) + pinned.call_ms(GPU))
    shape = DecoderShape(256, 4, 2, 64, 1000, 2, (0, 1), 4, 2, 128)
    assert choose_dense(pinned, shape, 512, 256, None, (1.0, 0.0, 0.0), 1.0).placement.host == GPU
    with pytest.raises(NpumoeError, match="no mlx-exact records"):
        CostModel({"cpu-exact": cpu}).with_exact(GPU)


def test_the_dense_half_of_a_search_for_the_mlx_spine_is_priced_on_mlx_exact():
    """Without a Core ML backend the search places no dense function; for the MLX spine (`search --engine mlx`) the
    whole prefill still prices the dense half where that spine runs it, on mlx-exact, not on the CPU's torch."""
    from autotune.searching.prefill_report import whole_prefill

    spec = {**SPEC, "hidden_size": 2048, "expert_ffn_size": 768}
    layers = LayerData.from_traces(synthetic_traces(spec, 20, 256, skew=1.2, seed=3))
    shape = DecoderShape(2048, 16, 4, 128, 1000, 2, (0, 1), 8, 2, 768)
    slow_gpu = three_lanes(gpu_ms_per_gflop=4.0)  # ten times the CPU's time per GFLOP
    parts = {}
    for name, cost in (("cpu", slow_gpu), ("mlx", slow_gpu.with_exact(GPU))):
        scorer = Scorer(cost, 2048, 768, "cpu-static", 1e12)
        out = run_search(layers, scorer, layer_space(8, split_exact=scorer.splits_exact), trials=0, progress=False)
        parts[name] = whole_prefill(out, scorer, shape, 256)["predicted_parts_ms"]
        plan = solution_plan(out.best, out.layers, scorer, spec)
        assert plan.exact_path == GPU  # the plan names the lane its experts were priced on (the GPU's: both)
    for part in ("attention_projections", "attention_core", "lm_head"):
        assert parts["mlx"][part] == pytest.approx(10 * parts["cpu"][part], rel=0.05), part
