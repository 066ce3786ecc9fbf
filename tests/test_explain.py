"""Why a plan is what it is (autotune/searching/explain.py): the decisive figures, from the cost model."""
import numpy as np
from helpers import SMALL, apple_like

from autotune.calibration.traces import synthetic_traces
from autotune.searching.explain import explain
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import solution_plan
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig


def _plan(configs, layers, scorer):
    from autotune.searching.optimizer import Solution

    return solution_plan(Solution(configs, 0.0, None, 0), layers, scorer, SMALL, 256)


def test_all_cpu_layers_name_the_call_cost_against_their_cpu_work():
    layers = LayerData.from_traces(synthetic_traces(SMALL, 10, 256, skew=1.2))
    cost = apple_like()
    scorer = Scorer(cost, SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    plan = _plan([LayerConfig(0) for _ in layers], layers, scorer)
    lines = explain(plan, layers, cost, "ane")
    assert lines[0].startswith("chunk 256 tokens: no static group")
    cpu = float(cost.exact_ms(np.rint(layers[0].calib.mean(0)).astype(int), SMALL["hidden_size"],
                              SMALL["expert_ffn_size"]))
    assert cpu > cost.call_ms("ane")  # so the line names the best single group instead of the call alone
    assert (f"all exact ({SMALL['num_experts']} on cpu-exact), {cpu:.3f} ms per chunk" in lines[1]
            and "best single ane group" in lines[1])


def test_the_lanes_named_are_the_plans_exact_paths():
    """A plan with half of each layer's experts on mlx-exact says so (it said "all on the CPU")."""
    layers = LayerData.from_traces(synthetic_traces(SMALL, 10, 256, skew=1.2))
    cost = apple_like()
    scorer = Scorer(cost, SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    plan = _plan([LayerConfig(0) for _ in layers], layers, scorer)
    half = SMALL["num_experts"] // 2
    plan = plan.model_copy(update={"layers": [lp.model_copy(update={"exact_split": {"mlx-exact": list(range(half))}})
                                              for lp in plan.layers]})
    lines = explain(plan, layers, cost, "ane")
    lanes = f"{half} on cpu-exact, {half} on mlx-exact"
    assert f"every MoE layer runs exactly ({lanes} per layer)" in lines[0]
    assert all(f"all exact ({lanes})" in line for line in lines[1:])
    assert "on the CPU" not in " ".join(lines)


def test_resident_layers_name_their_experts_and_load_share():
    layers = LayerData.from_traces(synthetic_traces(SMALL, 10, 256, skew=1.2))
    cost = apple_like()
    scorer = Scorer(cost, SMALL["hidden_size"], SMALL["expert_ffn_size"], "ane", 1e12)
    plan = _plan([LayerConfig(2, 2) for _ in layers], layers, scorer)
    lines = explain(plan, layers, cost, "ane")
    top = [int(e) for e in layers[0].rank[:2]]
    share = layers[0].calib.sum(0)[top].sum() / layers[0].calib.sum()
    assert lines[1] == (f"layer {layers[0].layer}: experts {top[0]}, {top[1]} (2 of {SMALL['num_experts']}) "
                        f"resident on ane in 1 group(s) carry {share:.0%} of its load; "
                        f"the rest run exactly ({SMALL['num_experts'] - 2} on cpu-exact)")
    assert "0.095 ms fixed" in lines[0] and "static calls per chunk (ane)" in lines[0]
