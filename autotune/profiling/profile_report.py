"""A profile's report: the fitted cost model per backend with its held-out error (as a table or JSON), and the plot
of measured against predicted times."""
from __future__ import annotations

from autotune.costing.fitting import out_of_range_errors, predicted_ms, record_group, record_groups
from autotune.profiling.profile import Profile
from runtime.fileio import output_set


def summary(profile: Profile) -> dict:
    mape = profile.heldout_mape
    out = {"profile": profile.path, "host": profile.host.get("id"), "host_description": profile.host.get("description"),
           "measured_by": profile.measured_by, "threads": profile.settings.get("threads"),
           "heldout_method": profile.heldout.get("method"), "backends": {}, "host_costs": {},
           "last_level_cache_bytes": profile.host.get("last_level_cache_bytes"),
           "in_cache_fit": profile.cost_model_in_cache is not None}
    for name, m in sorted(profile.cost_model.models.items()):
        n = sum(1 for r in profile.records if r["backend"] == name and not r.get("excluded"))
        out["backends"][name] = {"heldout_mape": mape.get(name), "records": n, "call_ms": m.call_ms,
                                 "expert_ms": m.expert_ms, "ms_per_gflop": m.ms_per_gflop, "ms_per_mb": m.ms_per_mb,
                                 "gflops": (1e3 / m.ms_per_gflop) if m.ms_per_gflop else None,
                                 "power_w": m.power_w, "residual": m.residual is not None}
    for key in ("host-pack", "host-exact"):
        if key in mape:
            out["host_costs"][key] = {"heldout_mape": mape[key]}
    groups = record_groups(profile.records)
    past = profile.heldout.get("out_of_range") or out_of_range_errors(groups)  # older profiles: from the records
    f32 = profile.heldout.get("float32_fit") or {}
    out["heldout_out_of_range_method"] = past["method"]
    out["heldout_by_part"] = {key: {"records": len(rs), "heldout_mape": mape.get(key),
                                    "heldout_out_of_range_mape": past["mape"].get(key),
                                    "out_of_range_split": past["split"].get(key),
                                    **({"float32_fit_mape": f32[key]} if key in f32 else {})}
                               for key, rs in groups.items()}
    for name, b in out["backends"].items():
        b["heldout_out_of_range_mape"] = past["mape"].get(name)
    return out


def print_summary(profile: Profile) -> None:
    from rich.console import Console
    from rich.table import Table

    s = summary(profile)

    def fmt(v, p="{:.4g}"):
        return "-" if v is None else p.format(v)

    table = Table(title=f"{profile.path or 'profile'}: {s['host_description']} ({s['measured_by']})")
    for col in ("backend", "records", "call ms", "per-expert ms", "GFLOP/s (analytic)", "ms/MB", "residual",
                "power W", "held-out MAPE", "past range"):
        table.add_column(col, justify="left" if col == "backend" else "right")
    for name, b in s["backends"].items():
        table.add_row(name, str(b["records"]), fmt(b["call_ms"]), fmt(b["expert_ms"]), fmt(b["gflops"], "{:.1f}"),
                      fmt(b["ms_per_mb"]), "knn" if b["residual"] else "-",
                      fmt(b["power_w"], "{:.2f}") if b["power_w"] else "not measured",
                      fmt(b["heldout_mape"], "{:.1%}"), fmt(b["heldout_out_of_range_mape"], "{:.1%}"))
    for name, part in s["heldout_by_part"].items():
        if name not in s["backends"]:
            table.add_row(name, str(part["records"]), "", "", "", "", "", "", fmt(part["heldout_mape"], "{:.1%}"),
                          fmt(part["heldout_out_of_range_mape"], "{:.1%}"))
    console = Console(width=max(Console().width, 132))
    console.print(table)
    console.print(f"held-out error: {s['heldout_method']}")
    console.print(f"past range: {s['heldout_out_of_range_method']}")
    if s["in_cache_fit"]:
        llc = s["last_level_cache_bytes"]
        console.print("in-cache fit (records timed back to back): prices models whose weights take at most half "
                      f"the last-level cache ({f'{llc / 2**20:.0f} MiB' if llc else 'size unknown: never used'})")
    if profile.published:
        console.print(f"[bold]not measured by this tool[/bold]: {profile.measured_by}")


def plot(profile: Profile, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[dict]] = {}
    for r in profile.records:
        groups.setdefault(record_group(r), []).append(r)
    keys = sorted(groups)
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys):
        rs = groups[key]
        meas = [r["median_ms"] for r in rs]
        if key.startswith("host-"):
            pred = [r.get("heldout_pred_ms", float("nan")) for r in rs]
        else:
            pred = [r.get("heldout_pred_ms", predicted_ms(profile.cost_model, r)) for r in rs]
        ax.loglog(meas, pred, ".", alpha=0.7)
        lo, hi = min(meas) * 0.8, max(meas) * 1.25
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        mape = profile.heldout_mape.get(key)
        ax.set_title(f"{key}" + (f" (held-out MAPE {mape:.1%})" if mape is not None else ""), fontsize=9)
        ax.set_xlabel("measured ms (median)")
        ax.set_ylabel("predicted ms (held out)")
    fig.suptitle(f"{profile.host.get('description')}: measured vs predicted", fontsize=10)
    fig.tight_layout()
    with output_set(path) as (tmp,):  # whole or not at all; a missing folder is made
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
