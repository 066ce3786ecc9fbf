"""The fidelity gate of `autotune search`: the cheapest whole plans, measured against the unmodified model; a plan
that meets the proxy but fails the gate is not written."""
import dataclasses
import json
from pathlib import Path

import pytest
from helpers import SMALL, apple_like

from autotune.calibration.traces import synthetic_traces
from autotune.cli import main
from autotune.costing.costmodel import BackendModel, CostModel
from autotune.profiling.profile import Profile, save_profile
from autotune.searching.gate_candidates import ROUNDS, gate_order
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import chunk_candidates, run_search
from autotune.searching.scoring import Scorer
from autotune.searching.space import layer_space
from runtime.plan import load_plan


def _search(d, out, *extra, profile="profile.json"):
    return ["search", "--model", "random:qwen3_moe", "--profile", str(d / profile), "--traces",
            str(d / "traces.npz"), "--trials", "16", "--out", str(out), "--gate-tokens", "512", "--json", *extra]


def _slow_cpu_profile(path):
    """A device whose CPU is 100x slower than its ANE: every search picks ane groups."""
    cost = CostModel({"ane": BackendModel("ane", 0.001, 0.0, 0.3, 0.0, 2, True, None),
                      "cpu-exact": BackendModel("cpu-exact", 0.5, 0.5, 60.0, 0.0, 2, False, None),
                      "cpu-static": BackendModel("cpu-static", 0.5, 0.5, 60.0, 0.0, 2, False, None)})
    save_profile(Profile(host={"id": "slow-cpu", "description": "hand-made: ANE far faster than the CPU"},
                         cost_model=cost, records=[], heldout={"method": "none", "mape": {}},
                         measured_by="hand-made for tests"), path)


@pytest.mark.slow
def test_gate_reports_measured_candidates_and_writes_the_cheapest_passing(workdir, capsys):
    _slow_cpu_profile(workdir / "slow-cpu.json")  # ane groups in every candidate, compressed ones among them
    out = workdir / "gated.json"
    assert main(_search(workdir, out, "--max-ppl-delta", "100", "--min-top1", "0", profile="slow-cpu.json")) == 0
    gate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gate"]
    assert gate["label"].startswith("measured") and gate["tokens"] == 512
    rows = gate["candidates"]
    assert 1 < len(rows) <= 4 and gate["chosen"]["index"] == 0 and gate["chosen"]["passed"]
    assert any(r["static_groups"].get("ane") for r in rows)
    for r in rows:
        assert 0.0 <= r["top1"] <= 1.0 and r["kl"] >= 0.0 and isinstance(r["passed"], bool)
        if r["static_groups"].get("ane"):  # its ane groups ran on ane-sim
            assert r["calls_per_backend"].get("ane-sim", 0) > 0 and r["kl"] > 0.0
        if not r["static_groups"]:  # an all-CPU candidate computes what the model computes
            assert r["ppl_delta"] == 0.0 and r["top1"] == 1.0 and r["kl"] == pytest.approx(0.0, abs=1e-9)
    plan = load_plan(out)
    assert plan.meta["gate"]["top1"] == gate["chosen"]["top1"]


@pytest.mark.slow
def test_a_gate_whose_first_candidates_fail_goes_on_to_a_passing_plan(workdir, capsys, monkeypatch):
    """The search's pick meets the proxy but fails the gate; the gate goes on (the next candidate, then the
    failed ones tightened: drops to spills, then uncompressed) and writes the first that passes, never nothing.
    Each round has a simulator of its own (the rounds' weights never add up), and its peak is predicted."""
    import autotune.evaluation.gate as gate_module

    simulators = []

    class Counted(gate_module.AneSimBackend):
        def __init__(self) -> None:
            super().__init__()
            simulators.append(self)

    monkeypatch.setattr(gate_module, "AneSimBackend", Counted)
    _slow_cpu_profile(workdir / "slow-cpu.json")
    light = workdir / "light.json"
    assert main(_search(workdir, light, "--no-gate", profile="slow-cpu.json")) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["gate"] is None and report["heldout_drop_rate"] <= 0.10  # the proxy holds
    assert any(g.backend == "ane" for lp in load_plan(light).layers for g in lp.groups)
    gated = workdir / "strict.json"
    # One candidate a round, against limits no plan that drops meets: only exact outputs pass (top-1 = 1).
    assert main(_search(workdir, gated, "--gate-candidates", "1", "--max-ppl-delta", "0", "--min-top1", "1",
                        profile="slow-cpu.json")) == 0
    gate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gate"]
    rows, chosen = gate["candidates"], gate["chosen"]
    assert not rows[0]["passed"] and rows[0]["drop_rate"] > 0  # the search's pick, measured and failed
    assert gate["rounds"] == len(rows) > 1 and chosen["index"] == len(rows) - 1  # one a round, up to the first pass
    assert len(simulators) == gate["rounds"] and gate["predicted_peak_mb"] > 0
    assert not any(r["passed"] for r in rows[:-1]) and chosen["passed"]
    assert chosen["top1"] == 1.0 and chosen["ppl_delta"] <= 0.0 and chosen["drop_rate"] == 0.0
    plan = load_plan(gated)
    assert plan.meta["gate"]["top1"] == 1.0 and plan.overflow == chosen["overflow"]
    assert {g.compression for lp in plan.layers for g in lp.groups} <= {"none"} or chosen["compressed_groups"]


def test_the_gate_order_tightens_each_round_and_ends_on_the_all_cpu_plan():
    """Candidates by predicted cost, each compressed one followed by itself uncompressed, a round at a time, each
    round followed by its plans tightened (spill for drop); the all-CPU plan last, within ROUNDS rounds."""
    traces = synthetic_traces(SMALL, 25, 640, skew=1.2, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, 640) for c in chunk_candidates(640)}
    scorer = Scorer(apple_like(), 1024, 512, "ane", 1e12)
    outcome = run_search(workloads, scorer, layer_space(8, ("none", "int8")), trials=0, progress=False)
    assert sorted(outcome.chunks) == [256, 512]

    def key(s):
        return s.chunk_tokens, s.exact_partial, tuple(s.configs)

    def spilled(s):
        return s.chunk_tokens, tuple(dataclasses.replace(c, overflow="spill") if c.resident else c
                                     for c in s.configs)

    for per_round in (1, 2, 4):
        order = gate_order(outcome, scorer, 4096, per_round)
        assert order[0] is outcome.best and len(order) <= per_round * ROUNDS
        assert len({key(s) for s in order}) == len(order)
        assert all(c.resident == 0 for c in order[-1].configs) and order[-1].heldout_drops == 0  # exact, last
        where = {(s.chunk_tokens, tuple(s.configs)): i for i, s in enumerate(order)}
        first = [s for s in order[:per_round] if any(c.resident and c.overflow == "drop" for c in s.configs)]
        assert first  # the instance has plans that drop
        for s in first:  # the first round's plans that drop come back with spills, right after the round
            assert min(per_round, len(order)) <= where[spilled(s)] < 3 * per_round
    assert {s.chunk_tokens for s in gate_order(outcome, scorer, 4096, 1000)} == {256, 512}
    assert {s.chunk_tokens for s in gate_order(outcome, scorer, 300, 1000)} == {256}  # chunks the gate's text holds
    assert gate_order(outcome, scorer, 100, 4) == []


def test_with_an_exact_path_off_the_cpu_the_gate_ends_on_the_exact_lanes_then_the_unmodified_computation():
    """Where the plan's exact path is mlx-exact, the all-on-the-exact-path plan (what mlx-lm runs) comes before the
    last candidate, and the last runs every expert on cpu-exact: the unmodified model's own computation, which passes
    by construction (mlx-exact in float32 beside a bf16 reference does not: top-1 0.985 on a random twin)."""
    traces = synthetic_traces(SMALL, 25, 640, skew=1.2, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, 640) for c in chunk_candidates(640)}
    cost = apple_like()
    cost.models["mlx-exact"] = BackendModel("mlx-exact", 0.02, 0.0, 0.4, 0.0, 2, True, None)  # a GPU beside the CPU
    scorer = Scorer(cost, 1024, 512, "ane", 1e12, exact="mlx-exact")
    assert scorer.splits_exact
    outcome = run_search(workloads, scorer, layer_space(8, ("none",), split_exact=True), trials=0, progress=False)
    for per_round in (1, 2, 4):
        order = gate_order(outcome, scorer, 4096, per_round)
        assert len(order) <= per_round * ROUNDS
        last, before = order[-1], order[-2]
        for d, c in zip(outcome.chunks[last.chunk_tokens].layers, last.configs):
            lp = scorer.layer_plan(d, c)
            assert not lp.groups and sorted(lp.exact_split["cpu-exact"]) == list(range(8))
        assert all(c.resident == 0 and c.cpu_tail == 0 for c in before.configs)  # all on mlx-exact
        assert last.heldout_drops == before.heldout_drops == 0
    # the search's own pick stays first even where it is one of the last candidates (every expert on mlx-exact)
    outcome.best = order[-2]
    assert gate_order(outcome, scorer, 4096, 2)[0] is outcome.best


@pytest.mark.slow
def test_a_gate_shorter_than_one_chunk_is_refused_not_passed(workdir, capsys):
    """Under one chunk of text every candidate runs exactly (a partial chunk), so it would pass as the unmodified
    model: the gate says so in one line instead."""
    _slow_cpu_profile(workdir / "slow-cpu.json")
    out = workdir / "short.json"
    args = _search(workdir, out, profile="slow-cpu.json")
    args[args.index("--gate-tokens") + 1] = "100"
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "less than one chunk" in err[0] and "--gate-tokens" in err[0]
    assert not out.exists()


@pytest.mark.slow
def test_tiny_moe_objective_both_gets_a_plan_that_passes(tmp_path, monkeypatch, capsys):
    """On the published profile's ANE and CPU (its GPU left out: the world this case was found in), its four
    cheapest candidates all fail the gate (top-1 0.9775 at best, before the gate went on): the gate goes on and
    writes a plan within the limits."""
    monkeypatch.chdir(tmp_path)
    published = Path(__file__).resolve().parents[1] / "profiles" / "apple-m2-ultra-published.json"
    profile = json.loads(published.read_text())
    del profile["cost_model"]["backends"]["mlx-exact"]
    (tmp_path / "ane-cpu.json").write_text(json.dumps(profile))
    assert main(["search", "--model", "tiny-moe", "--profile", "ane-cpu.json", "--objective", "both",
                 "--out", "both.json", "--json"]) == 0
    gate = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["gate"]
    rows, chosen = gate["candidates"], gate["chosen"]
    assert gate["rounds"] > 1 and not any(r["passed"] for r in rows[:4])  # the first round fails
    assert chosen["passed"] and chosen["ppl_delta"] <= 0.01 and chosen["top1"] >= 0.99
    plan = load_plan(tmp_path / "both.json")
    assert plan.meta["gate"]["top1"] == chosen["top1"] and plan.chunk_tokens == chosen["chunk_tokens"]


_GATE_CHILD = """
import importlib.util, json, sys, torch
from autotune.evaluation.gate import Candidate, GateLimits, GateSettings, run_gate
from autotune.searching.templates import template_plan
from runtime.loading.model_record import resolve_model
from runtime.resources import peak_rss_mb
torch.set_num_threads(1)
k = int(sys.argv[1])
tiny = resolve_model("tiny-moe", "bfloat16")
tiny.loaded()
exact = "mlx-exact" if importlib.util.find_spec("mlx") else None
plans = [template_plan(tiny.spec, cap, over, backend="ane", chunk_tokens=1024, exact=exact)
         for over in ("drop", "spill") for cap in ("ample", "tight")][:k]
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from the loaded model on
loaded = int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
gate = run_gate(tiny, [Candidate(p, 1.0) for p in plans], GateSettings(candidates=k, tokens=2048,
                limits=GateLimits(0.0, 1.1)), progress=False)
assert len(gate["candidates"]) == k
print(json.dumps({"peak_mb": peak_rss_mb(), "gate_mb": peak_rss_mb() - loaded,
                  "predicted_mb": gate["predicted_peak_mb"]}))
"""


@pytest.mark.slow
def test_the_gates_peak_does_not_grow_with_its_candidates():
    """tiny-moe, one round of 2 and of 4 candidates (ane groups on ane-sim, sharing their experts as stored; the
    second two spill their overflow onto the exact path, mlx-exact where MLX is installed) over two 1024-token
    prompts in chunks of 1024, each in a fresh process: the process's peak RSS through the gate is the same within
    5%. Measured before the fixes: 2 -> 4 grew 215.7 -> 321.1 MiB over the loaded model, as each layer's exact-path
    worker kept its own malloc arena and MLX kept its freed buffers; every candidate's chunk of logits held at once
    before that. Its prediction grows by a KV cache per side."""
    import os
    import subprocess
    import sys

    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("resets the peak RSS through Linux's /proc/self/clear_refs")
    runs = {k: json.loads(subprocess.run([sys.executable, "-c", _GATE_CHILD, str(k)], capture_output=True, text=True,
                                         check=True).stdout.strip().splitlines()[-1]) for k in (2, 4)}
    two, four = runs[2]["peak_mb"], runs[4]["peak_mb"]
    assert abs(four / two - 1) <= 0.05, runs
    kv = 2 * 4 * 2 * 64 * 2 * 1024 / 2**20  # keys and values of tiny-moe's 4 layers, 2 KV heads, at 1024 tokens
    assert runs[4]["predicted_mb"] - runs[2]["predicted_mb"] == pytest.approx(2 * kv, abs=0.2), runs


_PROMPTS_CHILD = """
import ctypes, json, torch
from autotune.calibration.workload import encode_text
from autotune.evaluation.fidelity import compare_plans
from autotune.evaluation.gate import GATE_TEXT
from autotune.searching.templates import template_plan
from runtime.cpu.allocator import primitive_cache_bytes, release_freed_heap, temporaries_returned
from runtime.executor import PlanExecutor
from runtime.loading.model_record import resolve_model
torch.set_num_threads(1)
class Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Mallinfo2
def in_use():  # malloc's bytes in use, its heaps' and its mmapped blocks', after the freed ones went back
    release_freed_heap()
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd
tiny = resolve_model("tiny-moe", "bfloat16")
model, tokenizer = tiny.loaded()
ids = encode_text(tokenizer, GATE_TEXT, 3 * 1024)
plans = [template_plan(tiny.spec, "ample", "drop", chunk_tokens=c, grouped=False) for c in (1024, 256)]
with temporaries_returned():
    executors = [PlanExecutor(model, p) for p in plans]
    held = [in_use()]
    for start in range(0, ids.numel(), 1024):
        compare_plans(executors, ids[start:start + 1024], 1024, progress=False)
        held.append(in_use())
print(json.dumps({"held": held, "caches": primitive_cache_bytes()}))
"""


@pytest.mark.slow
def test_the_gates_memory_stops_growing_after_its_first_prompt():
    """tiny-moe in bf16, the unmodified model beside two all-exact candidates (chunks of 1024 and 256) over three
    1024-token prompts, in a fresh process: what malloc holds in use grows in the first prompt by at most torch's
    caches of compiled primitives as priced (`allocator.primitive_cache_bytes`: both full, 0.28 MiB an entry), and
    by under 1 MiB a prompt after it (under four entries: every row count of the experts' calls came in the first).
    Measured before the bound: ideep's cache at its default 1,024 entries grew 21, 16 and 9 MiB a prompt after the
    first; the main job's gate peaked at 812 MiB for 596 predicted."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux") or not __import__("ctypes.util").util.find_library("c"):
        pytest.skip("reads glibc's mallinfo2")
    run = json.loads(subprocess.run([sys.executable, "-c", _PROMPTS_CHILD], capture_output=True, text=True,
                                    check=True).stdout.strip().splitlines()[-1])
    held, caches = run["held"], run["caches"]
    mib = [round(h / 2**20, 2) for h in held]
    assert held[1] - held[0] <= caches + (2 << 20), (mib, caches >> 20)
    assert all(later - earlier < 1 << 20 for earlier, later in zip(held[1:], held[2:])), mib
