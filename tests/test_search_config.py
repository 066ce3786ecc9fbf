"""`SearchConfig`: one search as one value. Its defaults are the command's, so the library and the command are the
same search (byte-identical plan layers), and a bad option is refused before the search runs."""
import dataclasses
import json

import pytest
from helpers import SEARCH_REPORT_ADDED, SEARCH_REPORT_KEYS

import autotune
from autotune.cli import build_parser, main
from autotune.commands.search import ACROSS_MACS, search_config
from autotune.searching.config import SearchConfig
from runtime.errors import NpumoeError
from runtime.plan import COMPRESSIONS


def test_every_search_option_is_a_config_field_with_the_commands_default():
    args = build_parser().parse_args(["search", "--model", "m"])
    flags = {k for k in vars(args) if k not in ("command", "func", "model", "json", *ACROSS_MACS)}
    assert flags == {f.name for f in dataclasses.fields(SearchConfig)}
    assert search_config(args) == SearchConfig()
    parsed = search_config(build_parser().parse_args(
        ["search", "--model", "m", "--drop-budget", "0.2", "--max-ppl-delta", "2", "--compress", "none,int8",
         "--no-gate", "--threads", "1"]))
    assert (parsed.drop_budget, parsed.max_ppl_delta, parsed.compress, parsed.no_gate, parsed.threads) == (
        0.2, 2.0, ("none", "int8"), True, 1)


def test_the_compress_default_is_the_configs_policy():
    assert SearchConfig().compress_kinds == COMPRESSIONS  # the gate measures what compression costs
    assert SearchConfig(no_gate=True).compress_kinds == ("none",)  # nothing would
    assert SearchConfig(compress=["int8"], no_gate=True).compress_kinds == ("int8",)
    assert SearchConfig(no_gate=True).gate_settings() is None
    s = SearchConfig(max_ppl_delta=2.0, min_top1=0.9, gate_candidates=3, gate_tokens=1024).gate_settings()
    assert (s.candidates, s.limits.max_ppl_delta, s.limits.min_top1, s.tokens) == (3, 0.02, 0.9, 1024)
    with pytest.raises(NpumoeError, match="not a weight storage"):
        SearchConfig(compress=("zip",))


@pytest.mark.slow
def test_search_plan_with_the_default_config_is_the_command(tmp_path, monkeypatch, capsys):
    """The same search from the library and from the command line: the same plan layers, byte for byte, and the
    same report keys as before the config."""
    monkeypatch.chdir(tmp_path)  # both calibrate into / read traces/tiny-moe.npz here
    assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--out", "cli.json",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report) == SEARCH_REPORT_KEYS + SEARCH_REPORT_ADDED and report["gate"]["chosen"]["passed"]
    result = autotune.search_plan("tiny-moe", SearchConfig(profile="apple-m2-ultra-published", out="lib.json"),
                                  progress=False)
    cli = json.loads((tmp_path / "cli.json").read_text())
    lib = json.loads((tmp_path / "lib.json").read_text())
    assert json.dumps(cli["layers"]) == json.dumps(lib["layers"])
    assert (cli["chunk_tokens"], cli["overflow"], cli["meta"]["decisions"]) == (
        lib["chunk_tokens"], lib["overflow"], lib["meta"]["decisions"])
    assert list(result.to_json()) == SEARCH_REPORT_KEYS + SEARCH_REPORT_ADDED and result.to_json()["plan"] == "lib.json"


@pytest.mark.slow
def test_a_random_model_is_built_once_per_search(tmp_path, monkeypatch, workdir):
    """Spec, size, context, the calibration it needs and the gate all read one resolved model."""
    import autotune.calibration.stage
    import autotune.pipeline
    import runtime.loading.model_loader as loader
    import runtime.loading.model_record

    built = []
    real = loader.load_model

    def counting(name, dtype="auto"):
        built.append(name)
        return real(name, dtype)

    for module in (loader, runtime.loading.model_record, autotune.pipeline, autotune.calibration.stage):
        monkeypatch.setattr(module, "load_model", counting)
    monkeypatch.chdir(tmp_path)  # no traces here: the search calibrates
    result = autotune.search_plan("random:qwen3_moe", SearchConfig(profile=str(workdir / "profile.json"), trials=4,
                                                                    gate_tokens=1024, out="p.json"), progress=False)
    assert built == ["random:qwen3_moe"]
    assert result.report.gate["chosen"]["passed"] and (tmp_path / "traces" / "random_qwen3_moe.npz").exists()
