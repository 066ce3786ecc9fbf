"""A fitted cost model is total: any coefficient may be zero (NNLS puts a term the others absorb at its bound), a
lane may have no dense records, and every consumer of the fit (the roofline, dense prices, the search, the robust
pick, the reports and charts) still gives finite figures, never a division by zero."""
import json
import math

import pytest
from helpers import SMALL
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from autotune.calibration.traces import synthetic_traces
from autotune.costing.costmodel import BackendModel, CostModel, HostCosts
from autotune.costing.dense_prices import DenseFit
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, ExpertFigures, predict_prefill, roofline_ms
from autotune.searching.dense_choice import choose_dense
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import run_search
from autotune.searching.prefill_report import whole_prefill
from autotune.searching.report import add_cpu_figures, format_report, plot_pareto, plot_tradeoff, search_report
from autotune.searching.robustness import assess
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space

SHAPE = DecoderShape(hidden=1024, heads=8, kv_heads=2, head_dim=128, vocab=4096, num_layers=2, moe_layers=(0, 1),
                     num_experts=8, top_k=2, expert_ffn=512, context=4096)
PROMPT, CHUNKS = 256, (128, 256)
BACKENDS = {"ane": (2, True), "cpu-exact": (2, False), "cpu-static": (2, False)}  # dtype bytes, off the CPU
coef = st.one_of(st.just(0.0), st.floats(1e-4, 5.0))


@st.composite
def dense_fits(draw) -> dict[str, DenseFit]:
    """A lane's dense fits: none (no records: priced from its expert fit), or each op's, any rate zero."""
    if draw(st.booleans()):
        return {}
    return {op: DenseFit(draw(coef), draw(coef), "measured (drawn)", draw(st.one_of(st.none(), coef)))
            for op in ("matmul", "attention", "elementwise")}


@st.composite
def cost_models(draw) -> CostModel:
    power = draw(st.booleans())
    models = {name: BackendModel(name, draw(coef), draw(coef), draw(coef), draw(coef), dtype, off,
                                 draw(coef) if power else None)
              for name, (dtype, off) in BACKENDS.items()}
    host = draw(st.one_of(st.just(None), st.tuples(*[coef] * 6)))
    return CostModel(models, HostCosts(pack=host, exact=host), dense={b: draw(dense_fits()) for b in models})


def finite(obj) -> None:
    """Every number in a report is finite (None where a ratio has no denominator)."""
    json.dumps(obj, allow_nan=False, default=str)


@pytest.fixture(scope="module")
def workloads():
    traces = synthetic_traces(SMALL, 6, PROMPT, skew=1.2, tokens=True)
    return {c: LayerData.from_traces(traces, c, PROMPT) for c in CHUNKS}


def test_a_zero_rate_leaves_the_other_lanes_roofline():
    """The ANE's fitted rate 0 (its matmul time all in the call and byte terms): the roofline is the CPU's."""
    lanes = {b: BackendModel(b, 0.1, 0.0, r, 0.01, 2, b == "ane") for b, r in (("ane", 0.0), ("cpu-exact", 2.0))}
    cost = CostModel(lanes)
    gflop = SHAPE.flops_per_token((PROMPT + 1) / 2) * PROMPT / 1e9
    assert roofline_ms(cost, SHAPE, PROMPT, "ane") == pytest.approx(gflop * 2.0)
    lanes["cpu-exact"].ms_per_gflop = 0.0  # no lane prices its FLOPs: no roofline
    assert roofline_ms(cost, SHAPE, PROMPT, "ane") is None


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: a
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # search per example; the draw is printed
@given(cost=cost_models(), robust=st.booleans())
def test_every_consumer_of_a_fit_is_total(cost, robust, workloads, tmp_path):
    roof = roofline_ms(cost, SHAPE, PROMPT, "ane")
    assert roof is None or math.isfinite(roof) and roof > 0
    ane = DensePlacement("ane", "ane", "ane", "ane", (128, 256))
    for place in (DensePlacement(), ane):
        pred = predict_prefill(cost, SHAPE, PROMPT, 256, ExpertFigures(0.0, 0.0, None), place)
        finite(pred.to_json())
    scorer = Scorer(cost, SHAPE.hidden, SHAPE.expert_ffn, "ane", 1e12)
    objective = "both" if cost.has_energy else "latency"

    def dense(chunk, weights, resident):
        return choose_dense(cost, SHAPE, PROMPT, chunk, "ane", weights, 12.0, resident)

    out = run_search(workloads, scorer, layer_space(8), objective=objective, trials=0, progress=False, dense=dense)
    out.best, rob = assess(out, scorer, pick=robust)
    if rob.dense_choice is not None:
        out.dense[out.best.chunk_tokens] = rob.dense_choice
    layers = out.chunks[out.best.chunk_tokens].layers
    report = search_report(out, layers[0].calib_chunks, sum(int(d.heldout.sum()) for d in layers), 0.0, {})
    add_cpu_figures(report, out, layers, True)
    report["whole_prefill"] = whole_prefill(out, scorer, SHAPE, PROMPT)
    report["robustness"] = rob.to_json()
    finite(report)
    assert format_report(report)
    plot_tradeoff(report["whole_prefill"], tmp_path / "tradeoff.png")
    if objective == "both":
        plot_pareto(report, tmp_path / "pareto.png")
