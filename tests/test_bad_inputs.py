"""Every bad input a clear error: exit 2, one line on stderr naming the problem, no traceback, nothing left behind.

Each case runs `autotune.cli.main` in-process on argv with `{placeholders}` filled from a folder of bad files made
once per module; the working directory is a fresh empty folder, so the default output paths land there too."""
from __future__ import annotations

import fcntl
import json
import logging
import shutil
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import random_model
from safetensors.torch import load_file, save

from autotune.cli import main
from autotune.profiling.profile import SHIPPED_PROFILES, ProfileHostWarning, host_id, load_profile, save_profile
from autotune.searching.templates import template_plan
from runtime.coreml.ane import AneBackend
from runtime.loading.model_loader import TINY_MOE_DIR, model_spec
from runtime.loading.model_record import read_model_spec
from runtime.plan import save_plan

M = ["--model", "random:qwen3_moe"]
S = ["search", *M, "--profile", "{profile}", "--trials", "2"]
P = ["search", *M, "--profile", "apple-m2-ultra-published", "--trials", "2"]  # a published profile: no host warning


def _write_npz(path: Path, arrays: dict[str, np.ndarray]) -> str:
    np.savez(path, **arrays)
    return str(path)


def _bad_traces(d: Path, good: Path) -> dict[str, str]:
    """Variants of a good traces file, each broken in one way."""
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    header = json.loads(arrays["header"].tobytes())
    layer = header["model"]["moe_layers"][0]

    def variant(name: str, **changes) -> str:
        a = {**arrays, **changes}
        return _write_npz(d / f"{name}.npz", {k: v for k, v in a.items() if v is not None})

    def with_header(**fields) -> np.ndarray:
        return np.frombuffer(json.dumps({**header, **fields}).encode(), dtype=np.uint8)

    idx = arrays[f"L{layer}_idx"].copy()
    idx[0, 0] = header["model"]["num_experts"]
    weight = arrays[f"L{layer}_weight"].copy()
    weight[3, 1] = np.nan
    norm = arrays[f"L{layer}_norm"].copy()
    norm[0] = np.inf
    raw = good.read_bytes()
    (d / "truncated.npz").write_bytes(raw[: len(raw) // 2])
    (d / "json.npz").write_text(json.dumps(header))
    return {
        "t_idx": variant("idx", **{f"L{layer}_idx": idx}),
        "t_nan": variant("nan", **{f"L{layer}_weight": weight}),
        "t_norm": variant("norm", **{f"L{layer}_norm": norm}),
        "t_missing": variant("missing", **{f"L{layer}_norm": None}),
        "t_extra": variant("extra", L99_idx=idx),
        "t_chunk": variant("chunk", header=with_header(chunk_tokens=header["chunk_tokens"] // 2)),
        "t_prompt": variant("prompt", header=with_header(chunk_tokens=2 * header["prompt_tokens"])),
        "t_noheldout": variant("noheldout", heldout_chunks=np.zeros_like(arrays["heldout_chunks"])),
        "t_schema": variant("schema", header=with_header(schema="npumoe.plan/1")),
        "t_truncated": str(d / "truncated.npz"),
        "t_json": str(d / "json.npz"),
    }


def _bad_checkpoints(d: Path) -> dict[str, str]:
    """Model directories, each broken in one way, from a saved random model (config.json + model.safetensors) with
    the tokenizer files of tiny-moe where a case needs them."""
    good = d / "ck-good"
    random_model("random:qwen3_moe")[0].save_pretrained(good)
    config = json.loads((good / "config.json").read_text())
    weights = (good / "model.safetensors").read_bytes()

    def checkpoint(name: str, config_change: dict | None = None, files: dict[str, bytes] | None = None,
                   tokenizer: bool = True) -> str:
        m = d / f"ck-{name}"
        m.mkdir()
        (m / "config.json").write_text(json.dumps({**config, **(config_change or {})}))
        for fname, data in (files if files is not None else {"model.safetensors": weights}).items():
            (m / fname).write_bytes(data)
        if tokenizer:
            for t in TINY_MOE_DIR.glob("tokenizer*"):
                shutil.copy(t, m / t.name)
        return str(m)

    def weights_with(name: str, value: float) -> dict[str, bytes]:
        """The checkpoint's weights with one value of tensor `name` set to `value` (NaN, inf)."""
        tensors = load_file(good / "model.safetensors")
        tensors[name].view(-1)[0] = value
        return {"model.safetensors": save(tensors, metadata={"format": "pt"})}

    return {
        "ck_topk": checkpoint("topk", {"num_experts_per_tok": 32}),  # of 8 experts
        "ck_nan_norm": checkpoint("nan-norm", files=weights_with("model.layers.1.post_attention_layernorm.weight",
                                                                  float("nan"))),
        "ck_inf_router": checkpoint("inf-router", files=weights_with("model.layers.2.mlp.gate.weight",
                                                                      float("inf"))),
        "ck_pickle": checkpoint("pickle", files={"pytorch_model.bin": b"PK\x03\x04 a pickle, never opened"}),
        "ck_none": checkpoint("none", files={}),
        "ck_truncated": checkpoint("truncated", files={"model.safetensors": weights[: len(weights) // 2]}),
        "ck_garbage": checkpoint("garbage", files={"model.safetensors": b"\xff" * 64}),
        "ck_shapes": checkpoint("shapes", {"moe_intermediate_size": 2 * config["moe_intermediate_size"]}),
        "ck_layers": checkpoint("layers", {"num_hidden_layers": config["num_hidden_layers"] + 1}),
        "ck_notokenizer": checkpoint("notokenizer", tokenizer=False),
        "ck_othertokenizer": checkpoint("othertokenizer"),  # tiny-moe's 4096 tokens on a 256-row embedding
    }


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> dict[str, str]:
    """Paths of the bad (and a few good) input files the cases name, made once for the module."""
    d = tmp_path_factory.mktemp("bad")
    (d / "adir").mkdir()
    (d / "notes.txt").write_text("not a plan\n")
    (d / "garbage.bin").write_bytes(np.random.default_rng(0).bytes(256))
    (d / "text.txt").write_text("Routing skews toward a few experts; the rest idle. " * 8)
    paths = {"adir": str(d / "adir"), "notes": str(d / "notes.txt"), "garbage": str(d / "garbage.bin"),
             "text": str(d / "text.txt"), "dir": str(d), "missing": str(d / "missing" / "deeper")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileHostWarning)
        shipped = load_profile("apple-m2-ultra-published")
    shipped.host["id"] = host_id()  # this host's, so that loading it warns of nothing
    save_profile(shipped, d / "profile.json")
    paths["profile"] = str(d / "profile.json")
    good = d / "good.npz"
    assert main(["calibrate", *M, "--text", paths["text"], "--chunk", "32", "--prompt-tokens", "64",
                 "--out", str(good), "--json"]) == 0
    paths["traces"] = str(good)
    paths.update(_bad_traces(d, good))
    other = template_plan(model_spec(random_model("random:mixtral")[0]), "ample", "drop", "cpu-static", 64,
                          "router_weight")
    save_plan(other, d / "other-model.json")
    paths["other_plan"] = str(d / "other-model.json")
    paths.update(_bad_checkpoints(d))
    spec = model_spec(random_model("random:qwen3_moe")[0])  # the saved checkpoints hold the same weights
    save_plan(template_plan(spec, "ample", "drop", "cpu-static", 64, "router_weight"), d / "ck-plan.json")
    paths["ck_plan"] = str(d / "ck-plan.json")
    paths.update(_issue19_inputs(d, spec))
    return paths


def _issue19_inputs(d: Path, spec) -> dict[str, str]:
    """Inputs of the last round's sweep: a plan's report path taken by a folder, a profile with a number as text,
    plans with ane groups, a split build's manifest naming a part that is gone, a task YAML that does not parse."""
    (d / "sidecar" / "hw.report.json").mkdir(parents=True)
    profile = json.loads((SHIPPED_PROFILES / "apple-m2-ultra-published.json").read_text())
    next(iter(profile["cost_model"]["backends"].values()))["call_ms"] = "0.25"
    (d / "call-ms-text.json").write_text(json.dumps(profile))
    save_plan(template_plan(spec, "ample", "drop", AneBackend.name, 64, "router_weight"), d / "ane-plan.json")
    tiny = read_model_spec("tiny-moe")
    save_plan(template_plan(tiny, "ample", "drop", "cpu-static", 64, "router_weight"), d / "tiny-plan.json")
    save_plan(template_plan(tiny, "ample", "drop", AneBackend.name, 64, "router_weight"), d / "tiny-ane-plan.json")
    (d / "m.manifest.json").write_text(json.dumps({
        "schema": "npumoe.manifest/1", "model_fingerprint": spec.fingerprint, "layout": "matmul", "compress": "none",
        "packages": [{"path": "gone.part1.mlpackage", "functions": ["layer0_group0"], "weight_bytes": 1,
                      "bytes": 1}]}))
    (d / "tasks").mkdir()
    (d / "tasks" / "broken_task.yaml").write_text("task: broken_task\ndataset_path: [json\n"
                                                  "output_type: multiple_choice\n")
    return {"sidecar_out": str(d / "sidecar" / "hw.json"), "call_ms_text": str(d / "call-ms-text.json"),
            "ane_plan": str(d / "ane-plan.json"), "tiny_plan": str(d / "tiny-plan.json"),
            "tiny_ane_plan": str(d / "tiny-ane-plan.json"), "manifest": str(d / "m.manifest.json"),
            "tasks": str(d / "tasks")}


def run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse errors
        return e.code


def listing(*dirs: str | Path) -> set[str]:
    return {str(p) for d in dirs for p in Path(d).rglob("*")}


# (case id, argv, a word the one-line error must contain)
CASES = [
    ("trials-zero", ["search", *M, "--trials", "0"], "--trials"),
    ("trials-negative", ["search", *M, "--trials", "-5"], "--trials"),
    ("resident-mb-negative", ["search", *M, "--resident-mb", "-1"], "--resident-mb"),
    ("drop-budget-one", ["search", *M, "--drop-budget", "1"], "--drop-budget"),
    ("seed-negative", ["search", *M, "--seed", "-1"], "--seed"),
    ("threads-zero", ["calibrate", *M, "--threads", "0"], "--threads"),
    ("repeat-zero", ["run", *M, "--plan", "{notes}", "--repeat", "0"], "--repeat"),
    ("max-tokens-zero", ["calibrate", *M, "--max-tokens", "0"], "--max-tokens"),
    ("max-tokens-negative", ["calibrate", *M, "--max-tokens", "-1"], "--max-tokens"),
    ("chunk-zero", ["calibrate", *M, "--chunk", "0"], "--chunk"),
    ("chunk-negative", ["calibrate", *M, "--chunk", "-8"], "--chunk"),
    ("chunk-not-int", ["calibrate", *M, "--chunk", "many"], "--chunk"),
    ("prompt-tokens-zero", ["calibrate", *M, "--prompt-tokens", "0"], "--prompt-tokens"),
    ("template-chunk-zero", ["plan-template", *M, "--chunk", "0", "--out", "p.json"], "--chunk"),
    ("shapes-zero", ["profile-device", "--shapes", "0x0"], "--shapes"),
    ("shapes-negative", ["profile-device", "--shapes=-64x64"], "--shapes"),
    ("shapes-garbage", ["profile-device", "--shapes", "big"], "--shapes"),
    ("backends-empty", ["profile-device", "--backends", ""], "--backends"),
    ("storage-driver-missing", ["search", *M, "--storage", "mysql://u@localhost/db"], "driver"),
    ("storage-sqlite-not-db", ["search", *M, "--storage", "sqlite:///{notes}"], "not an SQLite"),
    ("storage-sqlite-missing-dir", ["search", *M, "--storage", "sqlite:///{missing}/s.db"], "no such directory"),
    ("storage-journal-garbage", ["search", *M, "--storage", "journal:{garbage}"], "journal"),
    ("storage-journal-missing-dir", ["search", *M, "--storage", "journal:{missing}/j.log"], "no such directory"),
    ("storage-unknown", ["search", *M, "--storage", "somewhere"], "storage URL"),
    ("search-out-directory", ["search", *M, "--out", "{adir}"], "directory"),
    ("search-out-read-only", ["search", *M, "--out", "/proc/p.json"], "cannot write"),
    ("calibrate-out-read-only", ["calibrate", *M, "--out", "/proc/t.npz"], "cannot write"),
    ("profile-out-directory", ["profile-device", "--out", "{adir}"], "directory"),
    ("template-out-directory", ["plan-template", *M, "--out", "{adir}"], "directory"),
    ("template-out-read-only", ["plan-template", *M, "--out", "/proc/p.json"], "cannot write"),
    ("build-out-not-package", ["build", *M, "--plan", "{notes}", "--out", "notes.txt"], ".mlpackage"),
    ("build-cache-dir-file", ["build", *M, "--plan", "{notes}", "--cache-dir", "{notes}"], "not a directory"),
    ("build-plan-missing", ["build", *M, "--plan", "{missing}/p.json"], "no such file"),
    ("run-plan-directory", ["run", *M, "--plan", "{adir}"], "directory"),
    ("run-package-missing", ["run", *M, "--plan", "{notes}", "--package", "{missing}/x.mlpackage"],
     "no such package"),
    ("plot-no-suffix", ["show-profile", "apple-m2-ultra-published", "--plot", "{adir}"], "must end in"),
    ("plot-read-only", ["show-profile", "apple-m2-ultra-published", "--plot", "/proc/p.png"], "cannot write"),
    ("traces-expert-out-of-range", [*S, "--traces", "{t_idx}"], "expert ids"),
    ("traces-nan-weight", [*S, "--traces", "{t_nan}"], "finite router weights"),
    ("traces-inf-norm", [*S, "--traces", "{t_norm}"], "norms"),
    ("traces-missing-array", [*S, "--traces", "{t_missing}"], "missing array"),
    ("traces-extra-array", [*S, "--traces", "{t_extra}"], "unexpected array"),
    ("traces-chunk-longer-than-header", [*S, "--traces", "{t_chunk}"], "chunk_tokens"),
    ("traces-chunk-longer-than-prompt", [*S, "--traces", "{t_prompt}"], "prompt_tokens"),
    ("traces-no-heldout", [*S, "--traces", "{t_noheldout}"], "--max-tokens"),
    ("traces-wrong-schema", [*S, "--traces", "{t_schema}"], "schema"),
    ("traces-truncated", [*S, "--traces", "{t_truncated}"], "truncated"),
    ("traces-json", [*S, "--traces", "{t_json}"], "not a traces file"),
    ("traces-garbage", [*S, "--traces", "{garbage}"], "not a traces file"),
    ("memory-gb-impossible", [*S, "--traces", "{traces}", "--memory-gb", "0.001"], "--memory-gb 0.001"),
    ("memory-gb-negative", ["search", *M, "--memory-gb", "-1"], "--memory-gb"),
    ("traces-other-model", ["search", "--model", "random:mixtral", "--profile", "{profile}",
                            "--traces", "{traces}"], "another model"),
    ("calibrate-chunk-over-prompt", ["calibrate", *M, "--text", "{text}", "--chunk", "512", "--prompt-tokens",
                                     "256"], "--prompt-tokens"),
    ("calibrate-no-heldout", ["calibrate", *M, "--text", "{text}", "--prompt-tokens", "256"], "held-out"),
    ("calibrate-text-missing", ["calibrate", *M, "--text", "{missing}/t.txt"], "cannot read"),
    ("plan-other-model", ["run", *M, "--plan", "{other_plan}", "--text", "{text}"], "other-model.json"),
    ("plan-not-json", ["run", *M, "--plan", "{notes}", "--text", "{text}"], "notes.txt"),
    ("checkpoint-pickle-only", ["calibrate", "--model", "{ck_pickle}"], "safetensors only"),
    ("template-checkpoint-pickle-only", ["plan-template", "--model", "{ck_pickle}", "--out", "p.json"],
     "safetensors only"),
    ("checkpoint-no-weights", ["calibrate", "--model", "{ck_none}"], "no model.safetensors"),
    ("checkpoint-truncated", ["calibrate", "--model", "{ck_truncated}"], "truncated"),
    ("template-checkpoint-truncated", ["plan-template", "--model", "{ck_truncated}", "--out", "p.json"],
     "truncated"),
    ("checkpoint-garbage", ["calibrate", "--model", "{ck_garbage}"], "not a safetensors file"),
    ("checkpoint-config-shapes", ["calibrate", "--model", "{ck_shapes}"], "does not match"),
    ("checkpoint-config-layers", ["calibrate", "--model", "{ck_layers}"], "does not match"),
    ("checkpoint-no-tokenizer", ["calibrate", "--model", "{ck_notokenizer}"], "no tokenizer files"),
    ("checkpoint-other-tokenizer", ["calibrate", "--model", "{ck_othertokenizer}", "--text", "{text}"],
     "another model"),
    ("run-other-tokenizer", ["run", "--model", "{ck_othertokenizer}", "--plan", "{ck_plan}", "--text", "{text}"],
     "another model"),
    ("generate-other-tokenizer", ["generate", "--model", "{ck_othertokenizer}", "--prompt", "To be, or not"],
     "another model"),
    ("model-missing", ["calibrate", "--model", "{missing}"], "neither a built-in model"),
    # issue 64: the round-7 sweep (the GGUF cases: tests/test_gguf.py)
    *[(f"{cmd}-top-k-past-the-experts", [cmd, "--model", "{ck_topk}", *extra],
       "num_experts_per_tok 32 is more than the model's 8 experts")
      for cmd, extra in [("generate", ["--prompt", "To be"]), ("plan-template", ["--out", "p.json"])]],
    ("generate-nan-norm", ["generate", "--model", "{ck_nan_norm}", "--prompt", "To be"],
     "model.layers.1.post_attention_layernorm.weight holds values that are not finite (NaN or inf)"),
    ("template-inf-router", ["plan-template", "--model", "{ck_inf_router}", "--out", "p.json"],
     "model.layers.2.mlp.gate.weight holds values that are not finite (NaN or inf)"),
    # issue 19: the last round's sweep
    ("search-report-path-is-a-folder", [*S, "--traces", "{traces}", "--out", "{sidecar_out}"], "hw.report.json"),
    ("profile-number-as-text", ["show-profile", "{call_ms_text}"], "call_ms"),
    ("shapes-negative-separate-value", ["profile-device", "--shapes", "-64x64"], "--shapes: sizes must be positive"),
    *[(f"published-profile-{name}", [*P, "--traces", f"{{{key}}}"], needle) for name, key, needle in [
        ("traces-expert-out-of-range", "t_idx", "expert ids"), ("traces-nan-weight", "t_nan", "finite router"),
        ("traces-inf-norm", "t_norm", "norms"), ("traces-missing-array", "t_missing", "missing array"),
        ("traces-extra-array", "t_extra", "unexpected array"), ("traces-no-heldout", "t_noheldout", "--max-tokens"),
        ("traces-truncated", "t_truncated", "truncated")]],
    ("evaluate-ane-plan-unknown-task", ["evaluate", "--model", "tiny-moe", "--plan", "{tiny_ane_plan}", "--tasks",
                                        "nosuch", "--include-path", "{tasks}"], "nosuch"),
    ("generate-max-tokens-huge", ["generate", *M, "--prompt", "To be", "--max-tokens", "1000000000000"],
     "max_tokens 1000000000000"),
    ("generate-past-the-context", ["generate", *M, "--prompt", "To be, or not", "--max-tokens", "4200"],
     "context of 4096 positions"),
    ("generate-manifest-part-missing", ["generate", *M, "--plan", "{ane_plan}", "--package", "{manifest}",
                                        "--prompt", "To be"], "gone.part1.mlpackage does not exist"),
    ("run-record-traces-too-short", ["run", *M, "--plan", "{ck_plan}", "--text", "{text}", "--max-tokens", "8",
                                     "--record-traces", "t.npz"], "--record-traces"),
    ("evaluate-broken-task-yaml", ["evaluate", "--model", "tiny-moe", "--plan", "{tiny_plan}", "--tasks",
                                   "broken_task", "--include-path", "{tasks}"], "broken_task.yaml is not valid YAML"),
    ("evaluate-limit-without-tasks", ["evaluate", *M, "--plan", "{ck_plan}", "--limit", "5"], "--limit"),
    *[(f"{cmd}-prompt-past-the-context", [cmd, "--model", "tiny-moe", *extra, "--prompt-tokens", "8192"],
       "--prompt-tokens 8192 is longer than tiny-moe's context of 4096 tokens")
      for cmd, extra in [("run", ["--plan", "{tiny_plan}"]), ("evaluate", ["--plan", "{tiny_plan}"]),
                         ("calibrate", []), ("search", ["--profile", "apple-m2-ultra-published"])]],
    ("run-one-prompt-past-the-context", ["run", "--model", "tiny-moe", "--plan", "{tiny_plan}", "--max-tokens",
                                         "8192"], "--max-tokens 8192 is longer than tiny-moe's context"),
    ("search-gate-tokens-under-a-chunk", [*S, "--traces", "{traces}", "--gate-tokens", "1"],
     "--gate-tokens 1 is less than one chunk of the smallest chunk searched (64 tokens)"),
    ("search-gate-tokens-before-calibrating", ["search", "--model", "tiny-moe", "--profile",
                                               "apple-m2-ultra-published", "--gate-tokens", "1"],
     "smallest chunk searched (256 tokens)"),  # refused before the traces it lacks are made
    *[(f"search-in-flight-{n}", ["search", *M, "--in-flight", n], "--in-flight") for n in ("0", "3")],
    ("search-in-flight-without-mlx", [*P, "--in-flight", "2"], "--in-flight 2: two chunks in flight run on the MLX "
                                                               "spine only; give --engine mlx"),
    ("search-in-flight-across-macs", [*P, "--engine", "mlx", "--in-flight", "2", "--macs", "2"],
     "--in-flight 2 plans one Mac's prefill: not with --macs or --hosts"),
    ("run-in-flight-on-torch", ["run", "--model", "tiny-moe", "--plan", "{tiny_plan}", "--engine", "torch",
                                "--in-flight", "2"], "--in-flight 2 runs a plan's prefill on the MLX spine"),
    ("no-command", [], "required"),
    ("unknown-option", ["search", *M, "--trails", "5"], "unrecognized"),
]


@pytest.mark.parametrize("argv,needle", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input(argv, needle, bad, tmp_path, monkeypatch, capsys, caplog):
    monkeypatch.chdir(tmp_path)
    argv = [a.format(**bad) for a in argv]
    before = listing(tmp_path, bad["dir"])
    caplog.clear()
    code = run_cli(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    # in-process, the notes the CLI logs to stderr reach caplog instead: they count as lines too
    notes = [f"(logged) {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert notes == [], notes + [err]
    lines = err.strip("\n").split("\n")
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("autotune"), err
    assert needle in lines[0], err
    assert listing(tmp_path, bad["dir"]) == before


def test_version_and_module_entry(capsys):
    import subprocess

    assert run_cli(["--version"]) == 0
    assert capsys.readouterr().out.startswith("autotune ")
    out = subprocess.run([sys.executable, "-m", "autotune", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("autotune ")


def test_every_option_has_help():
    from autotune.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    missing = [f"{name} {act.option_strings or act.dest}" for name, p in sub.choices.items()
               for act in p._actions if not act.help]
    assert missing == []


def test_second_search_on_one_sqlite_storage_is_refused(bad, tmp_path, monkeypatch, capsys):
    """SQLite storage takes one search at a time (two race on its tables and enqueued trials): the second is
    refused in one line that points to journal:, which serves several processes."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "study.db"
    with open(f"{db}.lock", "a") as held:  # what a running search holds
        fcntl.flock(held, fcntl.LOCK_EX)
        before = listing(tmp_path)
        code = run_cli([a.format(**bad) for a in S] + ["--traces", bad["traces"], "--storage", f"sqlite:///{db}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "journal:" in err, err
    assert listing(tmp_path) == before


def test_search_outputs_are_one_set(bad, tmp_path, monkeypatch, capsys):
    """When the map cannot be drawn, neither the plan nor its report is left behind."""
    from autotune import pipeline
    from runtime.errors import NpumoeError

    def fail(*args):
        raise NpumoeError("cannot draw the map")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(pipeline, "plot_plan_map", fail)
    code = run_cli([a.format(**bad) for a in S] + ["--traces", bad["traces"], "--out", "sub/plan.json"])
    assert code == 2 and "cannot draw the map" in capsys.readouterr().err
    assert listing(tmp_path) == set()  # no plan, no report, no temp file, not even the folder made for them


def test_show_profile_plot_makes_a_missing_folder(tmp_path, monkeypatch, capsys):
    """The README's promise: a missing output folder is created. A published profile is no host mismatch."""
    monkeypatch.chdir(tmp_path)
    assert run_cli(["show-profile", "apple-m2-ultra-published", "--plot", "out/nodir/p.png"]) == 0
    assert (tmp_path / "out" / "nodir" / "p.png").read_bytes().startswith(b"\x89PNG")
    assert capsys.readouterr().err == ""


def test_search_on_a_published_profile_says_so_once_and_leaves_no_lock(bad, tmp_path, monkeypatch, capsys, caplog):
    """One note names the published figures (no host warning), one line the parts priced past its records, and the
    SQLite study's lock goes with the search."""
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "study.db"
    argv = [*P, "--traces", bad["traces"], "--storage", f"sqlite:///{db}", "--out", "plan.json", "--json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProfileHostWarning)
        assert run_cli(argv) == 0
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]  # the CLI's stderr lines
    assert len(said) == 2 and "note: profile apple-m2-ultra-published holds published figures" in said[0], said
    assert said[1].startswith("profile apple-m2-ultra-published (published figures) prices ") and "experts: " in said[1]
    assert capsys.readouterr().err == ""
    assert {p.name for p in tmp_path.iterdir()} == {"study.db", "plan.json", "plan.report.json", "plan.map.png",
                                                    "plan.tradeoff.png"}  # the whole prefill's latency/energy chart
    assert (tmp_path / "plan.tradeoff.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("how", ["full-disk", "closed-pipe"])
def test_a_failing_stdout_ends_in_one_line(how, tmp_path):
    """`> /dev/full` or a reader that went away: one line on stderr and exit 2, not a traceback (nor a second
    error when the interpreter flushes stdout at exit)."""
    import os
    import subprocess

    if how == "full-disk":
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full on this host")
        out = os.open("/dev/full", os.O_WRONLY)
    else:
        read, out = os.pipe()
        os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "autotune", "show-profile", "apple-m2-ultra-published", "--json"],
                              stdout=out, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    finally:
        os.close(out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    reason = "No space left on device" if how == "full-disk" else "Broken pipe"
    assert lines[0].startswith("autotune show-profile: error: cannot write") and reason in lines[0], lines
