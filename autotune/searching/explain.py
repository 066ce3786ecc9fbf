"""Why a plan is what it is, in a few lines: the chunk and what it amortises, per layer the resident experts and the
load they carry, and where the static backend does not pay, the figure that decides it. Every figure is predicted
by the cost model (per chunk, from the calibration traces' mean loads)."""
from __future__ import annotations

from collections import Counter

import numpy as np

from autotune.costing.costmodel import CostModel, ffn_work
from autotune.searching.decisions import layer_plan
from autotune.searching.layer_data import LayerData
from autotune.searching.space import LayerConfig
from runtime.plan import LayerPlan, Plan

SHOWN_IDS = 6  # resident expert ids listed per layer; the rest are counted


def explain(plan: Plan, layers: list[LayerData], cost: CostModel, backend: str) -> list[str]:
    """The explanation's lines, chunk first, then one per MoE layer. `backend`: the static backend the search
    placed groups on."""
    h, f = plan.model.hidden_size, plan.model.expert_ffn_size
    by_layer = {d.layer: d for d in layers}
    lines = [chunk_line(plan, by_layer, cost, h, f)]
    for lp in plan.layers:
        data = by_layer[lp.layer]
        lines.append(resident_line(lp, data, plan.exact_path) if lp.groups
                     else no_pay_line(lp, data, cost, backend, h, f, plan.exact_path))
    return lines


def exact_lanes(lp: LayerPlan, default: str) -> str:
    """Where a layer's experts in no group run exactly, by exact path: "8 on mlx-exact, 8 on cpu-exact"."""
    paths = Counter(lp.exact_path_of(e, default) for e in lp.cpu_exact)
    return ", ".join(f"{n} on {path}" for path, n in sorted(paths.items(), key=lambda item: (-item[1], item[0])))


def plan_exact_lanes(plan: Plan) -> str:
    """The same over every MoE layer, per layer where every layer splits alike."""
    per_layer = {exact_lanes(lp, plan.exact_path) for lp in plan.layers}
    if len(per_layer) == 1:
        return f"{per_layer.pop()} per layer"
    paths = Counter(lp.exact_path_of(e, plan.exact_path) for lp in plan.layers for e in lp.cpu_exact)
    return ", ".join(f"{n} on {path}" for path, n in sorted(paths.items())) + " over all layers"


def _mean_counts(data: LayerData) -> np.ndarray:
    return np.rint(data.calib.mean(0)).astype(np.int64)


def chunk_line(plan: Plan, by_layer: dict[int, LayerData], cost: CostModel, h: int, f: int) -> str:
    """What the chunk amortises: each static call's fixed cost and weight streaming, over the assignments it
    holds."""
    c = plan.chunk_tokens
    groups = [(lp, g) for lp in plan.layers for g in lp.groups]
    if not groups:
        exact = sum(float(cost.layer_ms(lp, _mean_counts(by_layer[lp.layer]), h, f, plan.overflow, plan.exact_path))
                    for lp in plan.layers)
        return (f"chunk {c} tokens: no static group, so there is nothing to amortise: every MoE layer runs exactly "
                f"({plan_exact_lanes(plan)}), {exact:.3f} ms per chunk over all MoE layers")
    backend = groups[0][1].backend
    model = cost.backend_model(backend)
    call = cost.call_ms(backend)
    held = 0.0
    for lp, g in groups:
        loads = by_layer[lp.layer].calib[:, list(g.experts)]
        held += float(np.minimum(loads, np.asarray(g.capacities)).sum(1).mean())
    per_call = held / len(groups)
    experts = np.mean([len(g.experts) for _, g in groups])
    weights_mb = float(ffn_work(0, h, f, model.dtype_bytes)[1]) * experts
    stream = model.ms_per_mb * weights_mb
    return (f"chunk {c} tokens: each of the plan's {len(groups)} static calls per chunk ({backend}) pays "
            f"{call:.3f} ms fixed and streams its experts' weights once ({weights_mb:.1f} MB, {stream:.3f} ms); "
            f"both are shared by the {per_call:.0f} assignments a call holds on average, "
            f"{(call + stream) / max(per_call, 1e-9) * 1e3:.2f} us each")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _ids(experts: list[int]) -> str:
    shown = ", ".join(str(e) for e in experts[:SHOWN_IDS])
    return shown + (f", ... {len(experts) - SHOWN_IDS} more" if len(experts) > SHOWN_IDS else "")


def resident_line(lp: LayerPlan, data: LayerData, exact: str) -> str:
    """Which experts are resident and what share of the layer's calibration load they carry."""
    resident = [e for g in lp.groups for e in g.experts]
    load = data.calib.sum(0)
    share = float(load[resident].sum() / max(1, load.sum()))
    backends = "/".join(sorted({g.backend for g in lp.groups}))
    return (f"layer {lp.layer}: experts {_ids(resident)} ({len(resident)} of {load.size}) resident on {backends} in "
            f"{len(lp.groups)} group(s) carry {share:.0%} of its load; the rest run exactly "
            f"({exact_lanes(lp, exact) or 'none'})")


def no_pay_line(lp: LayerPlan, data: LayerData, cost: CostModel, backend: str, h: int, f: int, exact: str) -> str:
    """Why a layer keeps every expert on its exact paths: a static call alone costs more than the layer's exact
    work, or else the best single group of its hottest experts is predicted slower."""
    counts = _mean_counts(data)
    cpu = float(cost.layer_ms(lp, counts, h, f, "spill", exact))
    call = cost.call_ms(backend)
    where = f"all exact ({exact_lanes(lp, exact)})"
    if call >= cpu:
        return (f"layer {data.layer}: {where}: {_a(backend)} call costs {call:.3f} ms, more than this layer's "
                f"whole expert work there, {cpu:.3f} ms per chunk")
    n = data.calib.shape[1]
    best = None
    for r in (2 ** i for i in range(int(np.log2(n)) + 1)):
        lp = layer_plan(data, LayerConfig(r, r, 1, (1.0,), "spill"), backend)
        t = float(cost.layer_ms(lp, counts, h, f, "spill"))
        if best is None or t < best[0]:
            best = (t, r)
    t, r = best
    share = float(counts[data.rank[:r]].sum() / max(1, counts.sum()))
    return (f"layer {data.layer}: {where}, {cpu:.3f} ms per chunk: the best single {backend} group of its "
            f"hottest experts ({r}, {share:.0%} of the load, capacity at their largest load) is predicted at "
            f"{t:.3f} ms, its call {call:.3f} ms and padded slots included")
