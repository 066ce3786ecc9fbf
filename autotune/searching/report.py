"""The search report: the plan against the baselines (all figures predicted by the cost model), and its plots."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from autotune.costing.whole_prefill import DENSE_FUNCTIONS
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import SearchOutcome, Solution
from runtime.backends import EXACT
from runtime.errors import NpumoeError
from runtime.plan import Plan

BASELINE_LABELS = {"cpu_only": "CPU only (all experts exact)",
                   "naive_coreml": "naive Core ML (one ANE graph per expert, uniform capacity)",
                   "uniform_grouped": "uniform capacity, groups of 4",
                   "paper_heuristic": "paper heuristic (popularity tiers, groups of 4, hot resident)"}
EXPLANATION_LINES = 12  # the search prints this many lines of its explanation; the report keeps all


def cpu_ms_per_token(sol: Solution, layers: list[LayerData]) -> float:
    """A design's predicted CPU-busy time per token over all MoE layers (packing, cpu-static calls and the exact
    path, on the calibration chunks; the cost model's, in ms of the profile's CPU threads): the paper's CPU-cycles
    metric."""
    return sol.cpu_ms / max(1, int(np.sum(layers[0].tokens)))


def add_cpu_figures(report: dict, outcome: SearchOutcome, layers: list[LayerData], packing_measured: bool) -> None:
    """Put each design's predicted CPU-busy ms per token into the report (`predicted_cpu_ms_per_token` of the plan
    and of each baseline in `baseline_details`; `cpu_ratio_vs`: each baseline's over the plan's, > 1: the plan
    keeps the CPU less busy; None where the plan keeps the CPU idle: no ratio), and `packing_measured`: whether
    the profile costs the host's packing (else it is left out of every figure)."""
    report["packing_measured"] = packing_measured
    report["predicted_cpu_ms_per_token"] = best = cpu_ms_per_token(outcome.best, layers)
    for name, sol in outcome.baselines.items():
        report["baseline_details"][name]["predicted_cpu_ms_per_token"] = cpu_ms_per_token(sol, layers)
    report["cpu_ratio_vs"] = {n: ratio(b["predicted_cpu_ms_per_token"], best)
                              for n, b in report["baseline_details"].items()}


def solution_summary(sol: Solution, calib_chunks: int, heldout_assignments: int) -> dict:
    return {"predicted_latency_ms": sol.latency_ms / calib_chunks,
            "predicted_energy_mj": None if sol.energy_mj is None else sol.energy_mj / calib_chunks,
            "heldout_drop_rate": sol.heldout_drops / max(1, heldout_assignments)}


def energy_ratios(best: dict, base: dict[str, dict]) -> dict[str, float] | None:
    """Each baseline's predicted energy over the plan's (> 1: the plan uses less); None without power figures."""
    if best["predicted_energy_mj"] is None:
        return None
    return {n: ratio(b["predicted_energy_mj"], best["predicted_energy_mj"]) for n, b in base.items()
            if b["predicted_energy_mj"] is not None}


def ratio(baseline: float, plan: float) -> float | None:
    """A baseline's figure over the plan's; None where the plan's is 0 (a fit that prices its work at nothing)."""
    return baseline / plan if plan > 0 else None


def search_report(outcome: SearchOutcome, calib_chunks: int, heldout_assignments: int, seconds: float,
                  context: dict) -> dict:
    """The JSON report (and what `search --json` prints). Latency/energy are per calibration chunk, all MoE
    layers, predicted by the profile's cost model; drop rates are on held-out traces (`add_cpu_figures` adds the
    CPU-busy time)."""
    if heldout_assignments < 1:  # a drop rate over no held-out data would read as "no drops"
        raise NpumoeError("no held-out assignments in the traces: held-out drop rates need held-out chunks")
    best = solution_summary(outcome.best, calib_chunks, heldout_assignments)
    base = {n: solution_summary(s, calib_chunks, heldout_assignments) for n, s in outcome.baselines.items()}
    return {**best,
            "figures": "predicted by the cost model (per calibration chunk, all MoE layers); drop rates on held-out "
                       "traces",
            "baselines": {n: b["predicted_latency_ms"] for n, b in base.items()},
            "baseline_details": base,
            "speedup_vs": {n: ratio(b["predicted_latency_ms"], best["predicted_latency_ms"]) for n, b in base.items()},
            "energy_ratio_vs": energy_ratios(best, base),
            "gap_vs_exact": outcome.gap_vs_exact, "exact_layers": outcome.exact_layers,
            "trials": outcome.trials, "search_seconds": seconds,
            "pareto_front": [solution_summary(s, calib_chunks, heldout_assignments) for s in outcome.front],
            **context}


def format_whole_prefill(w: dict) -> list[str]:
    """The whole prefill in lines: the plan's time and parts, where the dense functions run, each baseline's ratio."""
    parts = ", ".join(f"{k} {v:.1f}" for k, v in w["predicted_parts_ms"].items() if v)
    place = w["dense_placement"]
    on = [k for k in DENSE_FUNCTIONS if place[k]]
    host = place.get("host", EXACT)
    where = (f"{', '.join(on)} on {place[on[0]]}" + (f" (attention buckets {place['attention_context_buckets']})"
                                                    if place["attention"] else "") + f", the rest on {host}"
             if on else f"all on {host}")
    core = [core_reads(place, w["chunk_tokens"])] if place.get("attention_block") and place["attention"] else []
    times = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731  (None: the plan's or the roofline's is 0)
    vs = ", ".join(f"{k} {times(v['latency'])}" for k, v in w["vs"].items())
    refs = [k for k, b in w.get("prefill_baselines", {}).items() if not b.get("candidate", True)]
    said = (f"; the plan is the {w['plan_is']} row" if w.get("plan_is") else "") + (
        f"; reference rows (not plans the search could write): {', '.join(refs)}" if refs else "")
    return [f"whole prefill of one {w['prompt_tokens']}-token prompt (predicted): {w['predicted_prefill_ms']:.1f} ms = "
            f"{parts}; dense functions: {where}", *in_flight_lines(w),
            *core, f"  baselines' latency over the plan's: {vs}; over the roofline {times(w['over_roofline_whole'])}"
                   f"{said}"]


def in_flight_lines(w: dict) -> list[str]:
    """With two chunks in flight: the schedule's chunking and each unit's busy and idle ms, against the chain."""
    if w.get("in_flight", 1) < 2:
        return []
    rows = "+".join(map(str, w["chunk_rows"])) if w.get("chunk_rows") else f"chunks of {w['chunk_tokens']}"
    units = ", ".join(f"{u} busy {v['busy_ms']:.1f} / idle {v['idle_ms']:.1f} ms"
                      for u, v in w["predicted_schedule"]["units"].items())
    return [f"  two chunks in flight ({rows}): {units}; the search's pick as a chain {w['one_in_flight_ms']:.1f} ms"]


def core_reads(place: dict, chunk: int) -> str:
    """The attention core in causal blocks: the keys each full chunk's blocks read, against the whole bucket every
    query would read unblocked (the figure that decides)."""
    rows = place["static_rows"].get("attention", chunk)
    chunks = "; ".join(f"the chunk at {s}: {k[0]}..{k[-1]} keys over {len(k)} calls, not {int(s) + chunk}"
                       for s, k in list(place["attention_reads"].items())[:2])
    more = len(place["attention_reads"]) - 2
    return (f"  attention core: its first {rows} queries of each full chunk in causal blocks of "
            f"{place['attention_block']}, each reading the smallest bucket holding its keys ({chunks}"
            + (f"; {more} more chunk(s)" if more > 0 else "") + ")")


def format_report(r: dict) -> str:
    energy = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    cpu = lambda d: "-" if d.get("predicted_cpu_ms_per_token") is None else f"{d['predicted_cpu_ms_per_token']:.4f}"  # noqa: E731
    lines = [f"{'design':<64} {'latency ms':>11} {'energy mJ':>10} {'CPU ms/token':>13} {'held-out drops':>15}",
             f"{'tuned plan':<64} {r['predicted_latency_ms']:>11.4f} {energy(r['predicted_energy_mj']):>10} "
             f"{cpu(r):>13} {r['heldout_drop_rate']:>15.2%}"]
    for name, b in r["baseline_details"].items():
        lines.append(f"{BASELINE_LABELS.get(name, name):<64} {b['predicted_latency_ms']:>11.4f} "
                     f"{energy(b['predicted_energy_mj']):>10} {cpu(b):>13} {b['heldout_drop_rate']:>15.2%}")
    lines.append("latency and energy: predicted by the cost model of profile "
                 f"{r.get('profile', '?')}, per chunk of {r.get('chunk_tokens', '?')} tokens over all MoE layers; "
                 "CPU ms/token: predicted CPU-busy time (packing, cpu-static calls, the exact path) per token"
                 + ("" if r.get("packing_measured", True) else
                    " (this profile measured no host packing: left out, so a plan with every expert off the CPU "
                    "shows 0)"))
    if r.get("predicted_memory"):
        m = r["predicted_memory"]
        budget = f" (budget --memory-gb {r['memory_gb']:g})" if r.get("memory_gb") else ""
        lines.append(f"memory: {m['total_gb']:.2f} GB predicted{budget} = CPU-side weights "
                     f"{m['cpu_weights_bytes'] / 1e9:.2f} + ANE packages {m['ane_package_bytes'] / 1e9:.2f} + "
                     f"activations {m['activations_bytes'] / 1e9:.3f} + KV cache at {m['prompt_tokens']} tokens "
                     f"{m['kv_cache_bytes'] / 1e9:.3f} + runtime {m['runtime_bytes'] / 1e9:.2f}")
    if r.get("whole_prefill"):
        lines += format_whole_prefill(r["whole_prefill"])
    if r.get("priced_outside"):
        lines.append("priced past the profile's records (the fit's form alone, not interpolated): " + "; ".join(
            f"{part}: {', '.join(x['text'] for x in reaches)}" for part, reaches in r["priced_outside"].items()))
    if r.get("robustness"):
        rob = r["robustness"]
        worst = max(rob["cases"], key=lambda c: c["regret"], default=None)
        pick = " (--robust pick)" if rob["robust_pick"] else ""
        when = f" when {worst['case']}" if worst else ""
        lines.append(f"robustness{pick}: worst-case {rob['objective']} regret {rob['max_regret']:.2%}{when}"
                     + " (predicted, vs the best plan for each perturbed profile)")
        if rob.get("cost_of_robustness"):
            lines.append(f"the --robust pick trades {rob['cost_of_robustness']:+.2%} predicted {rob['objective']} "
                         f"for a worst-case regret of {rob['max_regret']:.2%} instead of the nominal plan's "
                         f"{rob['nominal_max_regret']:.2%}")
        if rob.get("regret_floor") is not None:
            lines.append(f"no plan among the search's candidates has a worst-case regret below "
                         f"{rob['regret_floor']:.2%} (a bound: the least weighted mean of the cases' regrets)")
    if r.get("gap_vs_exact") is not None:
        lines.append(f"Optuna alone vs the exact optimum of the same space: {r['gap_vs_exact']:+.2%}")
    if r.get("gate"):
        lines += format_gate(r["gate"])
    if r.get("explanation"):
        shown = r["explanation"][:EXPLANATION_LINES]
        more = len(r["explanation"]) - len(shown)
        lines += ["why (predicted):"] + [f"  {line}" for line in shown]
        if more:
            lines.append(f"  ... {more} more line(s) in the report's `explanation`")
    return "\n".join(lines)


def plot_plan_map(plan: Plan, path: str | os.PathLike) -> None:
    """Layer x expert map: colour = tier, or the exact path an expert in no group runs on (cpu-exact, mlx-exact:
    the GPU); cell text = group and capacity, or the exact path; title = backends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n_layers, n_experts = len(plan.layers), plan.model.num_experts
    runs_on = {(li, e): lp.exact_path_of(e, plan.exact_path) for li, lp in enumerate(plan.layers) for e in lp.cpu_exact}
    paths = sorted(set(runs_on.values()) | {EXACT}, key=lambda p: (p != EXACT, p))
    tier = np.full((n_layers, n_experts), -1.0)  # an exact path: -1 - its index in `paths`
    group = np.full((n_layers, n_experts), -1)
    caps = np.zeros((n_layers, n_experts), dtype=int)
    for (li, e), p in runs_on.items():
        tier[li, e] = -1 - paths.index(p)
    for li, lp in enumerate(plan.layers):
        for gi, g in enumerate(lp.groups):
            for j, (e, c) in enumerate(zip(g.experts, g.capacities)):
                tier[li, e] = g.tier[j] if g.tier else 0
                group[li, e], caps[li, e] = gi, c
    low, top = -len(paths), int(max(tier.max(), -1))
    fig, ax = plt.subplots(figsize=(max(6, n_experts * 0.35), max(2.5, n_layers * 0.35 + 1.5)))
    im = ax.imshow(tier, cmap=plt.get_cmap("viridis", top - low + 1), vmin=low - 0.5, vmax=top + 0.5, aspect="auto")
    if n_experts * n_layers <= 2048:
        for li in range(n_layers):
            for e in range(n_experts):
                txt = paths[-1 - int(tier[li, e])].split("-")[0] if group[li, e] < 0 else \
                    f"g{group[li, e]}\n{caps[li, e]}"
                bright = top > low and (tier[li, e] - low) / (top - low) > 0.5  # viridis: dark low, bright high
                ax.text(e, li, txt, ha="center", va="center", fontsize=5, color="k" if bright else "white")
    cbar = fig.colorbar(im, ax=ax, ticks=np.arange(low, top + 1))
    cbar.ax.set_yticklabels([paths[-1 - t] for t in range(low, 0)] + [f"tier {t}" for t in range(top + 1)])
    backends = sorted({g.backend for lp in plan.layers for g in lp.groups})
    rest = ", ".join(p for p in paths if p in runs_on.values()) or "none"
    ax.set_title(f"plan map: groups on {', '.join(backends)} (cell: group, capacity)\nthe rest on {rest}; overflow "
                 f"{plan.overflow}" if backends else f"plan map: no static group, every expert exact on {rest}",
                 fontsize=8)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(n_layers), [str(lp.layer) for lp in plan.layers])
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_pareto(report: dict, path: str | os.PathLike) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    front = report["pareto_front"]
    ax.plot([p["predicted_latency_ms"] for p in front], [p["predicted_energy_mj"] for p in front], "o-",
            label="searched Pareto front")
    ax.plot([report["predicted_latency_ms"]], [report["predicted_energy_mj"]], "r*", ms=14, label="chosen plan")
    for name, b in report["baseline_details"].items():
        if b["predicted_energy_mj"] is not None:
            ax.plot([b["predicted_latency_ms"]], [b["predicted_energy_mj"]], "s", label=BASELINE_LABELS.get(name, name))
    _save_chart(fig, ax, path, "predicted latency per chunk (ms)", "predicted energy per chunk (mJ)",
                "latency vs energy (predicted by the cost model)")


def _save_chart(fig, ax, path: str | os.PathLike, xlabel: str, ylabel: str, title: str) -> None:
    """A latency/energy chart's labels, legend and file."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    if ax.get_legend_handles_labels()[0]:  # none: nothing priced energy
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_tradeoff(whole: dict, path: str | os.PathLike) -> None:
    """The whole prefill's trade (a report's `whole_prefill`): the candidate plans' predicted latency against
    energy, the pick, mlx-gpu and the paper's heuristic marked (the other baselines faint)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def point(d: dict) -> tuple[float, float]:
        return d["predicted_prefill_ms"] / 1e3, (d["predicted_prefill_energy_mj"] or 0.0) / 1e3

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    cands = [point(c) for c in whole.get("tradeoff", []) if c["predicted_prefill_energy_mj"] is not None]
    if cands:
        ax.scatter(*zip(*cands), s=18, c="0.6", label="candidate plans (chunk size x drop budget)")
    marks = {"mlx-gpu": ("s", "tab:blue", "mlx-gpu (every op on the GPU)"),
             "paper-heuristic": ("^", "tab:orange", "the paper's heuristic")}
    for name, b in whole["prefill_baselines"].items():
        if b["predicted_prefill_energy_mj"] is None:
            continue
        shape, color, label = marks.get(name, ("x", "0.8", None))
        ax.scatter(*point(b), marker=shape, s=60 if label else 25, c=color, label=label or None, zorder=3)
        if not label:
            ax.annotate(name, point(b), fontsize=6, color="0.5")
    if whole.get("predicted_prefill_energy_mj") is not None:
        ax.scatter(*point(whole), marker="*", s=220, c="tab:red", label="the pick", zorder=4)
    low = np.min([c.get_offsets().min(0) for c in ax.collections] or [(1.0, 1.0)], axis=0)
    for axis, scale, least in ((ax.xaxis, ax.set_xscale, low[0]), (ax.yaxis, ax.set_yscale, low[1])):
        if least <= 0:  # a fit that prices a figure at 0: no log axis for it
            continue
        scale("log")  # plain numbers at 1, 2 and 5 of each decade
        axis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        axis.set_minor_locator(matplotlib.ticker.LogLocator(subs=(2.0, 5.0)))
        axis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    _save_chart(fig, ax, path, f"predicted prefill latency (s, {whole['prompt_tokens']}-token prompt)",
                "predicted prefill energy (J)", "latency vs energy, whole prefill (predicted by the cost model)")


def sidecar(plan_path: str | os.PathLike, suffix: str) -> Path:
    p = Path(plan_path)
    return p.with_name(p.stem + suffix)


def format_gate(gate: dict) -> list[str]:
    """The fidelity gate's table: each candidate's predicted time and measured fidelity, and the one chosen."""
    limits = gate["limits"]
    lines = [f"fidelity gate ({gate['label']}; limits: perplexity delta <= {limits['max_ppl_delta']:.2%}, top-1 >= "
             f"{limits['min_top1']:g}; {gate['seconds']:.1f} s; peak RSS {gate['peak_rss_mb']:.0f} MiB"
             + (f", {gate['predicted_peak_mb']:.0f} MiB predicted" if gate.get("predicted_peak_mb") else "") + "):",
             f"  {'#':>2} {'predicted ms':>12} {'ppl delta':>10} {'top-1':>7} {'mean KL':>9} {'static groups':<34} "
             f"{'compressed':<18} passed"]
    for c in gate["candidates"]:
        exact = ", ".join(f"{n} {p}" for p, n in sorted(c.get("exact_experts", {}).items()))
        groups = ", ".join(f"{n} {b}" for b, n in c["static_groups"].items()) or f"none ({exact or '-'})"
        packed = ", ".join(f"{n} {k}" for k, n in c["compressed_groups"].items()) or "-"
        chosen = " <- chosen" if gate["chosen"] and gate["chosen"]["index"] == c["index"] else ""
        lines.append(f"  {c['index']:>2} {c['predicted_ms']:>12.4f} {c['ppl_delta']:>+10.3%} {c['top1']:>7.4f} "
                     f"{c['kl']:>9.2e} {groups:<34} {packed:<18} {'yes' if c['passed'] else 'no'}{chosen}")
    return lines
