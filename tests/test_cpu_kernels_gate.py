"""The CPU's expert kernels as a plan decision (Plan.cpu_weights.kernel_rows): validated in the plan, run by the
runtime, filled by the search from the profile's kernel records, decided by the fidelity gate (int_mm kept where it
passes, dequant where it does not); and a storage whose every candidate the gate refuses followed by the next wider
one that fits --memory-gb (autotune/searching/cpu_choice.py)."""
import json
from pathlib import Path

import pytest
import torch

import autotune.pipeline as pipeline
from autotune.calibration.traces import synthetic_traces
from autotune.cli import main
from autotune.costing.cpu_storage import planned_kernels
from autotune.costing.memory import GB, fixed_memory, model_size
from autotune.evaluation.gate import Candidate, GateLimits, GateSettings, run_gate
from autotune.profiling.profile import load_profile
from autotune.searching.cpu_choice import choose_cpu_storage
from autotune.searching.layer_data import LayerData
from runtime import generation
from runtime.errors import FileFormatError
from runtime.loading.model_loader import moe_layers
from runtime.loading.model_record import read_model_spec, resolve_model
from runtime.plan import CpuWeights, LayerPlan, Plan, plan_from_json, save_plan

PUBLISHED = "apple-m2-ultra-published"
SPEC = read_model_spec("tiny-moe")
INT_MM = {"packed": 0, "int_mm": 16}


def _all_cpu(chunk: int, cpu_weights: CpuWeights | None = None) -> Plan:
    return Plan(model=SPEC, chunk_tokens=chunk, overflow="drop", saliency="router_weight", cpu_weights=cpu_weights,
                layers=[LayerPlan(layer=l, groups=[], cpu_exact=list(range(SPEC.num_experts)))
                        for l in SPEC.moe_layers])


def _records(int_mm_per_row: float) -> list[dict]:
    """Kernel records of tiny-moe's shape: packed cheapest at few rows, int_mm (at this per-row cost) or dequant
    from 16."""
    out = []
    for storage, group, kernel, fixed, per_row in (("bf16", None, "dense", 0.05, 0.010),
                                                   ("int8", None, "packed", 0.01, 0.020),
                                                   ("int8", None, "dequant", 0.20, 0.008),
                                                   ("int8", None, "int_mm", 0.20, int_mm_per_row)):
        out += [{"kind": "expert_kernel", "backend": "cpu-exact", "hidden": SPEC.hidden_size,
                 "ffn": SPEC.expert_ffn_size, "storage": storage, "group_size": group, "kernel": kernel, "rows": r,
                 "median_ms": fixed + per_row * r} for r in (1, 2, 4, 16, 64, 256)]
    return out


def test_kernel_rows_are_validated_and_older_plans_load(tmp_path, capsys):
    good = _all_cpu(256, CpuWeights(kind="int8", kernel_rows=INT_MM)).to_json()
    assert plan_from_json(good).cpu_weights.kernel_rows == INT_MM
    older = _all_cpu(256, CpuWeights(kind="int8")).to_json()
    assert "kernel_rows" not in older["cpu_weights"] and plan_from_json(older).cpu_weights.kernel_rows is None
    for cpu_weights, said in ((dict(kind="int4", kernel_rows={"packed": 0, "int_mm": 16}),
                               "'int_mm' is not a kernel of int4 experts (choose from packed, dequant)"),
                              (dict(kind="bf16", kernel_rows={"packed": 0}), "bf16 runs no quantized kernel"),
                              (dict(kind="int8", kernel_rows={"packed": 4, "dequant": 16}),
                               "no kernel starts at 0 rows")):
        with pytest.raises(FileFormatError, match="cpu_weights.kernel_rows") as bad:
            plan_from_json(dict(good, cpu_weights=cpu_weights))
        assert said in str(bad.value) and "\n" not in str(bad.value)
    with pytest.raises(FileFormatError, match="cpu_weights.kernel_rows"):
        plan_from_json(dict(good, cpu_weights=dict(kind="int8", kernel_rows={"packed": -1})))
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(dict(good, cpu_weights=dict(kind="int8", kernel_rows={"dequant": 16}))))
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(path), "--max-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cpu_weights.kernel_rows" in err[0] and "no kernel starts at 0 rows" in err[0]


@pytest.mark.parametrize("kernel_rows,ran", [(INT_MM, {"packed", "int_mm"}), ({"packed": 0}, {"packed"}),
                                             (None, {"packed", "dequant"})])  # None: the runtime's defaults
def test_the_runtime_runs_the_plans_kernels(kernel_rows, ran, tmp_path):
    plan = tmp_path / "plan.json"
    save_plan(_all_cpu(256, CpuWeights(kind="int8", kernel_rows=kernel_rows)), plan)
    loaded = generation.load("tiny-moe", str(plan))
    stores = [l.experts.npumoe_weights for l in moe_layers(loaded.model)]
    assert all(s.kernel_rows == (kernel_rows or {"packed": 0, "dequant": 16}) for s in stores)
    ids = torch.tensor([loaded.tokenizer.encode("def parse(path):\n    return open(path).read()\n" * 24)[:256]])
    with torch.inference_mode():
        loaded.model(ids)
    calls = sum((s.calls for s in stores), start=type(stores[0].calls)())
    assert set(calls) == ran and sum(calls.values()) > 0  # the runtime's own counts: which kernel ran


def test_the_search_takes_the_kernels_from_the_profiles_records():
    size, cost = model_size(resolve_model("tiny-moe")), load_profile(PUBLISHED).cost_model
    layers = LayerData.from_traces(synthetic_traces(SPEC.to_json(), 4, 1024, skew=1.1))

    def choice(records):
        return choose_cpu_storage("int8", None, size, cost, records, layers, SPEC.hidden_size, SPEC.expert_ffn_size,
                                  1024, 1024)

    fast = choice(_records(0.004))  # int_mm the fastest from 16 rows: 0.264 ms against dequant's 0.328
    assert fast.kernel_rows == INT_MM and fast.plan_field().kernel_rows == INT_MM
    assert fast.kernels_reason.startswith("measured: the fastest kernel per row range")
    slow = choice(_records(0.05))  # int_mm dearer than dequant everywhere
    assert slow.kernel_rows == {"packed": 0, "dequant": 16}
    none = choice([])
    assert none.kernel_rows == {"packed": 0, "dequant": 16} and none.kernels_reason.startswith("the runtime's defaults")
    assert planned_kernels([], "bf16", 256)[0] is None


def test_the_gate_keeps_int_mm_where_it_passes_and_rounds_fewer_rows_where_it_does_not():
    """tiny-moe all on the CPU in int8, 4096 gate tokens, int_mm planned from 16 rows (every projection's rows
    rounded too). At chunk 256: top-1 0.9871 under the gate's 0.99, remeasured with int_mm_gate_up (only the
    gate/up projection's rows rounded) 0.9888, still under, then with dequant (no row rounded) 0.9919, passed. At
    chunk 1024 (on an Intel AMX host) int_mm_gate_up passes (0.9915): the chain stops at the first that passes.
    Those are the checkpoint's bf16 figures (in float32, what --dtype auto computes in on an AVX2-only host, the
    first passes at chunk 256 and no remeasure follows)."""
    torch.set_num_threads(1)
    tiny = resolve_model("tiny-moe", "bfloat16")  # loaded once, by the first gate
    gate = run_gate(tiny, [Candidate(_all_cpu(256), 1.0)], GateSettings(candidates=1),
                    progress=False, cpu_weights=("int8", None), kernel_rows=INT_MM)
    first, fewer, lossless = gate["candidates"]
    assert [r["kernel_rows"] for r in gate["candidates"]] == [
        INT_MM, {"packed": 0, "int_mm_gate_up": 16}, {"packed": 0, "dequant": 16}]
    assert [r.get("retry_of") for r in gate["candidates"]] == [None, 0, 1]
    assert {r["candidate"] for r in gate["candidates"]} == {0}
    assert first["kernel_calls"]["int_mm"] > 0 and not first["passed"] and 0.98 < first["top1"] < 0.99
    # each remeasure runs the fallback where the rounding kernel ran (the counts move a little: the rounding moves
    # the routing of later layers)
    assert set(fewer["kernel_calls"]) == {"packed", "int_mm_gate_up"} and not fewer["passed"]
    assert set(lossless["kernel_calls"]) == {"packed", "dequant"}
    assert abs(fewer["kernel_calls"]["int_mm_gate_up"] / first["kernel_calls"]["int_mm"] - 1) < 0.02
    assert first["top1"] < fewer["top1"] < 0.99
    assert lossless["passed"] and lossless["top1"] >= 0.99 and gate["chosen"] is lossless and gate["rounds"] == 1
    longer = run_gate(tiny, [Candidate(_all_cpu(1024), 1.0)], GateSettings(candidates=1),
                      progress=False, cpu_weights=("int8", None), kernel_rows=INT_MM)
    # where the chain stops is the host's fact (on an AVX2 host without VNNI int_mm_gate_up took 0.9885 here and
    # dequant passed): it stops at the first that passes, and runs no more
    chain = [INT_MM, {"packed": 0, "int_mm_gate_up": 16}, {"packed": 0, "dequant": 16}]
    stop = next(i for i, r in enumerate(longer["candidates"]) if r["passed"])
    assert [r["kernel_rows"] for r in longer["candidates"]] == chain[: stop + 1] and stop >= 1
    assert longer["chosen"] is longer["candidates"][stop] and longer["chosen"]["top1"] >= 0.99
    # where int_mm passes (a looser top-1 limit), it is kept: no remeasure
    loose = run_gate(tiny, [Candidate(_all_cpu(256), 1.0)],
                     GateSettings(candidates=1, limits=GateLimits(min_top1=0.98)), progress=False,
                     cpu_weights=("int8", None), kernel_rows=INT_MM)
    assert len(loose["candidates"]) == 1 and loose["chosen"]["kernel_rows"] == INT_MM
    assert loose["chosen"]["top1"] == first["top1"]  # the same measurement: deterministic


@pytest.fixture(scope="module")
def tiny_traces(tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces") / "tiny.npz"
    assert main(["calibrate", "--model", "tiny-moe", "--out", str(traces), "--max-tokens", "8192", "--json"]) == 0
    return traces


def _search(tmp_path, traces, *extra) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    rc = main(["search", "--model", "tiny-moe", "--traces", str(traces), "--out", str(out), "--threads", "1",
               "--trials", "8", "--gate-candidates", "1", "--gate-tokens", "2048", "--measure", "0", "--json",
               *extra])
    return rc, json.loads(out.read_text()) if rc == 0 else {}


def test_a_refused_storage_is_followed_by_the_next_wider_one(tmp_path, tiny_traces, capsys, caplog, monkeypatch):
    """int4 fails the gate by construction (a top-1 limit above 1); the search then gates int8 (the next wider within
    the budget; bf16 does not fit), whose plan passes. A pin is never overridden: pinned int4 is refused, exit 2."""
    size = model_size(resolve_model("tiny-moe"))
    need = {k: fixed_memory(size, 1024, 1024, k, 64).total / GB for k in ("bf16", "int8")}
    budget = round((need["int8"] + need["bf16"]) / 2, 4)
    gated: list[str] = []

    def gate(loaded, candidates, settings, *, cpu_weights, **kw):
        gated.append(cpu_weights[0])
        if cpu_weights[0] == "int4":
            settings = GateSettings(settings.candidates, GateLimits(min_top1=1.01), settings.tokens, settings.text)
        return run_gate(loaded, candidates, settings, cpu_weights=cpu_weights, **kw)

    monkeypatch.setattr(pipeline, "run_gate", gate)
    capsys.readouterr()
    rc, plan = _search(tmp_path, tiny_traces, "--profile", PUBLISHED, "--memory-gb", str(budget))
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and gated == ["int4", "int8"]
    refused = report["cpu_weights"]["gate_refused"]
    assert [r["storage"] for r in refused] == ["int4:64"] and refused[0]["candidates"] >= 1
    assert report["cpu_weights"]["storage"] == "int8" and report["gate"]["cpu_weights"] == "int8"
    assert report["cpu_weights"]["reason"].startswith("the gate refused every int4:64 candidate; int8 is the next")
    assert plan["cpu_weights"]["kind"] == "int8" and plan["meta"]["gate"]["top1"] >= 0.99
    assert plan["predicted"]["memory"]["total_bytes"] <= budget * GB
    assert any("refused every candidate with int4:64 CPU experts: searching int8" in r.getMessage()
               for r in caplog.records)
    gated.clear()
    rc, _ = _search(tmp_path, tiny_traces, "--profile", PUBLISHED, "--memory-gb", str(budget), "--cpu-weights", "int4")
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and gated == ["int4"] and "error: no candidate passes the fidelity gate (" in err[-1]


@pytest.mark.slow
def test_the_search_writes_the_kernels_the_gate_passed(tmp_path, tiny_traces, capsys):
    """A profile whose records make int_mm the fastest from 16 rows: the search plans it, the gate decides, and the
    plan and the report say which kernel runs from which row and why (the gate's figures)."""
    profile = json.loads((Path(__file__).resolve().parents[1] / "profiles" / f"{PUBLISHED}.json").read_text())
    profile["kernel_records"] = _records(0.004)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    capsys.readouterr()
    rc, plan = _search(tmp_path, tiny_traces, "--profile", str(path), "--cpu-weights", "int8", "--gate-tokens",
                       "4096")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cw, gate = report["cpu_weights"], report["gate"]
    assert rc == 0 and plan["cpu_weights"]["kernel_rows"] == gate["chosen"]["kernel_rows"] == cw["kernel_rows"]
    assert gate["candidates"][0]["kernel_rows"] == INT_MM  # measured first with the profile's fastest
    assert cw["kernels_reason"].startswith("measured: the fastest kernel per row range")
    assert f"top-1 {gate['chosen']['top1']:.4f}" in cw["kernels_reason"]
    if cw["kernel_rows"] != INT_MM:  # int_mm refused: the chosen row is a remeasure with kernels that round fewer
        assert "retry_of" in gate["chosen"] and "refused them, so the kernels that round fewer rows" in cw[
            "kernels_reason"]
        said = [cw["kernels_reason"].index(f"candidate {r['index']} ") for r in gate["candidates"]]
        assert said == sorted(said)  # every measure of the chosen candidate, in order
