"""The CPU's expert kernels timed per storage kind (autotune/profiling/kernels.py) and the pick of the fastest."""
from __future__ import annotations

from autotune.costing.kernel_choice import DECODE_ROWS, PREFILL_ROWS, fastest_kernel, kernel_rows
from autotune.profiling.kernels import kernel_records
from autotune.profiling.profile import load_profile, save_profile
from autotune.profiling.settings import Settings


def _rec(storage, kernel, rows, ms, group=None):
    return {"kind": "expert_kernel", "backend": "cpu-exact", "hidden": 64, "ffn": 64, "storage": storage,
            "group_size": group, "kernel": kernel, "rows": rows, "median_ms": ms}


def test_fastest_kernel_and_the_dequant_threshold():
    recs = [_rec("int8", "packed", r, 0.01 * r) for r in (1, 4, 16, 64, 256)]
    recs += [_rec("int8", "dequant", r, 0.2 + 0.001 * r) for r in (1, 4, 16, 64, 256)]
    recs += [_rec("int4", "packed", r, 0.01 * r, 64) for r in (1, 256)]
    recs += [_rec("int4", "dequant", r, 9.0, 64) for r in (1, 256)]
    assert fastest_kernel(recs, "int8", 1) == ("packed", 0.01)
    assert fastest_kernel(recs, "int8", 300)[0] == "dequant"
    assert fastest_kernel(recs, "int8", 20)[0] == "packed"  # nearest measured: 16 rows, 0.16 < 0.216 ms
    assert kernel_rows(recs, "int8")["dequant"] == 64
    assert kernel_rows(recs, "int4:64") == {"packed": 0}  # packed wins at the most rows measured: never dequant
    assert kernel_rows(recs, "int8") == {"packed": 0, "dequant": 64}
    int_mm = recs + [_rec("int8", "int_mm", r, 0.05 + 0.0005 * r) for r in (1, 4, 16, 64, 256)]
    assert kernel_rows(int_mm, "int8") == {"packed": 0, "int_mm": 16}  # 0.058 < 0.16 ms at 16 rows, < 0.232 at 64
    try:
        fastest_kernel(recs, "int4:32", 1)
    except KeyError:
        pass
    else:
        raise AssertionError("int4 groups of 32 were never measured")


def test_records_measured_and_kept_by_the_profile(tmp_path):
    s = Settings({"t": (64, 64)}, tokens=[1], groups=[], pack_tokens=[], warmup=0, min_runs=2, max_runs=2,
                 min_time_s=0.0)
    recs = kernel_records(s, 64, 64, "t")
    kinds = {(r["storage"], r["kernel"]) for r in recs}
    assert kinds == {("bf16", "dense"), ("int8", "packed"), ("int8", "dequant"), ("int8", "int_mm"),
                     ("int8", "int_mm_gate_up"), ("int4", "packed"), ("int4", "dequant")}
    assert len(recs) == len(kinds) * len(DECODE_ROWS + PREFILL_ROWS) and all(r["median_ms"] > 0 for r in recs)
    from autotune.profiling.profile import SHIPPED_PROFILES

    prof = load_profile(str(SHIPPED_PROFILES / "apple-m2-ultra-published.json"))
    prof.extra["kernel_records"] = recs
    save_profile(prof, tmp_path / "p.json")
    again = load_profile(str(tmp_path / "p.json"))
    assert again.extra["kernel_records"] == recs
    assert fastest_kernel(again.extra["kernel_records"], "bf16", 1)[0] == "dense"
