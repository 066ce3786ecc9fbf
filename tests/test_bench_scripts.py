"""The project's own proof runs: each `scripts/bench_*.py` and `scripts/host_prefill_check.py` in a reduced form
exits 0 and ends with its JSON (a tiny model, a few tokens, one repetition; where the full form builds llama.cpp or
profiles this host for minutes, the reduced one runs our side on a file or profile made here), so that a merge cannot
leave one broken.

Measured on a shared 2-core AMD EPYC host at load 8-10 (wall): bench_search.py with one layer and two trials 39 s
(the default run); bench_serve.py --quick 6 min, bench_prefill.py at 5 prompts of 1,024 tokens 3.7 min and
bench_scale.py --quick (its docstring: within 10 minutes) are past this file's 3-minute budget: they run only with
NPUMOE_SLOW_BENCH_SCRIPTS=1. NPUMOE_SKIP_BENCH_SCRIPTS=1 skips the default ones too. The reduced forms, at load 16-18
(wall; about a quarter of it CPU time): bench_gguf --files 295 s, bench_costmodel 121 s, bench_moe_layer 113 s,
bench_calibrate 26 s, bench_mlx_exact 53 s, bench_generate 48 s, host_prefill_check --model tiny-moe 372 s;
bench_spine --quick (33 s) runs in tests/test_mlx_spine.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
skip_all = pytest.mark.skipif(os.environ.get("NPUMOE_SKIP_BENCH_SCRIPTS") == "1",
                              reason="NPUMOE_SKIP_BENCH_SCRIPTS=1")
slow = pytest.mark.skipif(os.environ.get("NPUMOE_SLOW_BENCH_SCRIPTS") != "1",
                          reason="minutes each: NPUMOE_SLOW_BENCH_SCRIPTS=1 runs them")


def run_script(name: str, *args: str, cwd: Path, timeout: int) -> dict:
    """Run scripts/<name> with `args` in `cwd` on one thread; its exit status 0 and its last stdout line, a JSON
    object."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args], cwd=cwd, env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@skip_all
@pytest.mark.bench
def test_bench_search_at_one_layer(tmp_path):
    out = run_script("bench_search.py", "--layers", "1", "--trials", "2", "--seeds", "0", "--prompts", "5",
                     "--prompt-tokens", "1024", cwd=tmp_path, timeout=600)
    assert out["layers"] == 1 and out["trials_per_layer"] == 2 and out["over_roofline"] > 0


@slow
@pytest.mark.bench
def test_bench_prefill_at_five_prompts(tmp_path):
    out = run_script("bench_prefill.py", "--prompts", "5", "--trials", "2", "--prompt-tokens", "1024",
                     cwd=tmp_path, timeout=1800)
    assert out["prompt_tokens"] == 1024 and out["over_roofline_whole"] > 0


@slow
@pytest.mark.bench
def test_bench_serve_quick(tmp_path):
    from autotune.cli import main

    plan = tmp_path / "tiny.json"
    assert main(["plan-template", "--model", "tiny-moe", "--out", str(plan)]) == 0
    out = run_script("bench_serve.py", "--quick", "--plan", str(plan), cwd=tmp_path, timeout=1800)
    assert out["lost"] == 0 and out["mismatched"] == 0 and out["disconnect_ok"] and out["sigterm_drain_ok"]


@slow
@pytest.mark.bench
def test_bench_scale_quick(tmp_path):
    out = run_script("bench_scale.py", "--quick", cwd=tmp_path, timeout=3600)
    assert out["peak_rss_over_checkpoint_max"] > 0 and out["build_mb_per_s"] > 0


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    from autotune.cli import main

    plan = tmp_path_factory.mktemp("plan") / "tiny.json"
    assert main(["plan-template", "--model", "tiny-moe", "--out", str(plan)]) == 0
    return plan


@pytest.fixture(scope="module")
def mlx_folder(tmp_path_factory) -> Path:
    """tiny-moe converted by mlx-lm to 4 bits (what bench_calibrate and bench_mlx_exact read)."""
    pytest.importorskip("mlx_lm")
    from helpers import convert_to_mlx

    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4", 4, 64)


@skip_all
@pytest.mark.bench
def test_bench_gguf_on_a_written_file(tmp_path):
    """Our side of bench_gguf.py (reader, perplexity, bytes, the memory model's size of the file, generate under a
    template plan) on a Q8_0 file the gguf package writes; llama.cpp's build and reference stay in the full form."""
    pytest.importorskip("gguf")
    from gguf_files import write_tiny_moe_gguf

    file = write_tiny_moe_gguf(tmp_path / "tiny-Q8_0.gguf", "Q8_0")
    out = run_script("bench_gguf.py", "--files", str(file), "--tokens", "128", "--json", cwd=tmp_path, timeout=600)
    entry = out["files"][0]
    assert out["llama_cpp"] is None and entry["tokens"] == 128 and entry["tensors"] == {"Q8_0": 29}
    assert entry["weights_predicted_mb"] == entry["weights_held_mb"] > 0 and 1 < entry["ppl_ours"] < 1000
    assert entry["generate"]["exit"] == 0 and len(entry["generate"]["tokens_ours"]) == 32


def test_a_script_names_the_extra_it_lacks_in_one_line(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from script_deps import EXTRA, require

    require("bench_x.py", "json")
    with pytest.raises(SystemExit) as e:
        require("bench_x.py", "json", "npumoe_no_such_module")
    assert e.value.code == 2
    assert capsys.readouterr().err == f"bench_x.py: needs npumoe_no_such_module: {EXTRA}\n"


@skip_all
@pytest.mark.bench
def test_bench_calibrate_quick(tmp_path, mlx_folder):
    out = run_script("bench_calibrate.py", "--model", str(mlx_folder), "--max-tokens", "640", "--prompt-tokens",
                     "128", "--chunk", "64", "--repeat", "1", cwd=tmp_path, timeout=600)  # 5 prompts: one held out
    assert out["tokens"] == 640 and out["agreement"]["tokens"] == 4 * 640 and out["torch_over_mlx"] > 0


@skip_all
@pytest.mark.bench
def test_bench_costmodel_on_the_published_profile(tmp_path):
    """The measured layer against a given profile's prediction (the full form profiles this host first)."""
    out = run_script("bench_costmodel.py", "--profile", "apple-m2-ultra-published", "--repeats", "1",
                     cwd=tmp_path, timeout=600)
    assert len(out["rel_error"]) == 4 and out["max_rel_error"] == max(out["rel_error"].values()) > 0


@skip_all
@pytest.mark.bench
def test_bench_generate_quick(tmp_path, tiny_plan):
    out = run_script("bench_generate.py", "--plan", str(tiny_plan), "--repeats", "1", "--prompt-tokens", "32",
                     "--new-tokens", "4", cwd=tmp_path, timeout=600)
    assert out["prefill_ratio_vs_transformers"] > 0 and out["decode_ratio_vs_transformers"] > 0


@skip_all
@pytest.mark.bench
def test_bench_mlx_exact_quick(tmp_path, mlx_folder):
    out = run_script("bench_mlx_exact.py", "--shape", "tiny-moe", "--repeats", "1", "--new-tokens", "4", "--model",
                     str(mlx_folder), cwd=tmp_path, timeout=600)
    assert out["layer"]["rows_1"]["mlx_exact_us"] > 0 and out["generate"]["same_tokens"]


@skip_all
@pytest.mark.bench
def test_bench_moe_layer_quick(tmp_path):
    out = run_script("bench_moe_layer.py", "--repeats", "1", "--threads", "1", cwd=tmp_path, timeout=600)
    assert out["ratio_exact_vs_grouped_mm"] > 0


@skip_all
@pytest.mark.bench
def test_host_prefill_check_on_tiny_moe(tmp_path, monkeypatch):
    """The host check's whole flow (calibrate, search --no-gate, run, the table and host_check.json) on tiny-moe and
    a short prompt, against a host profile made here in seconds (its twins and fresh --quick profile stay in the full
    form)."""
    from helpers import small_profiling

    from autotune.cli import main
    from runtime.loading.model_loader import TINY_MOE_DIR

    small_profiling(monkeypatch)
    host = tmp_path / "host.json"
    for extra in ([], ["--model", str(TINY_MOE_DIR), "--dtype", "auto"]):  # the check's own step, made small here
        assert main(["profile-device", "--quick", "--threads", "1", "--backends", "cpu-exact,cpu-static", "--out",
                     str(host), "--no-progress", *extra]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_prefill_check.py"), "--model",
                           str(TINY_MOE_DIR), "--profile", str(host), "--prompt-tokens", "256", "--prompts", "1",
                           "--repeat", "1", "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "host_check.json").read_text())
    result = report["results"][0]
    assert result["shape"] == "tiny-moe" and result["predicted_prefill_ms"] > 0 and result["measured_prefill_ms"] > 0
    assert done.stdout.startswith("host: ") and "goal met" in done.stdout


def test_host_check_names_the_host_its_engine_dtype_and_threads(monkeypatch):
    """scripts/host_prefill_check.py's output starts with what it measured on: the CPU model (/proc/cpuinfo), the
    engine, the thread count and each shape's compute dtype (the same in its JSON: `host`, `engine`, `threads`,
    `compute_dtype`)."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import host_prefill_check as check

    from autotune.profiling.profile import cpu_model

    result = {"shape": "phi-tiny-moe", "compute_dtype": "bfloat16", "predicted_prefill_ms": 900.0,
              "measured_prefill_ms": 1000.0, "ratio": 0.9, "verdict": "ok", "parts": {}, "chunk_tokens": 1024,
              "measured_prefill_cpu_ms": 950.0, "ratio_cpu": 0.947, "host_speed": None}
    host = check.host_facts(check.THREADS)
    first = check.table([result], host, check.THREADS, "torch").splitlines()[0]
    assert first == (f"host: {cpu_model()} ({host['logical_cores']} logical cores, {host['os']}); engine torch "
                     "(torch on the CPU); 1 torch thread(s); computed in: phi-tiny-moe bfloat16")
    first = check.table([{**result, "compute_dtype": "float32"}], host, check.THREADS, "mlx").splitlines()[0]
    assert "engine mlx (the MLX spine on MLX's CPU device)" in first and first.endswith("phi-tiny-moe float32")


def test_host_check_through_the_mlx_spine_reads_executed_per_prompt(monkeypatch):
    """With --engine mlx the parts measured are `executed`'s (each part's lanes summed, over the run's prompts),
    per prompt, beside the search's prediction for one prompt."""
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import host_prefill_check as check

    run = {"engine": "mlx", "tokens": 8192,
           "executed": {"attention_projections": {"mlx-cpu": {"calls": 8, "ms": 300.0}},
                        "experts": {"mlx-exact": {"calls": 2, "ms": 900.0}, "cpu-static": {"calls": 4, "ms": 100.0}},
                        "rest": {"mlx-cpu": {"calls": 2}}}}
    search = {"predicted_parts_ms": {"attention_projections": 140.0, "experts": 520.0}}
    measured, predicted = check.by_part(run, search, 4096)
    assert measured == {"attention_projections": 150.0, "experts": 500.0, "rest": 0.0, "clock": "wall"}
    assert predicted is search["predicted_parts_ms"]
