"""`autotune bench`: a plan against mlx-lm, transformers and the all-exact plan, measured side by side on this host
(tiny-moe, short prompts). Timing is never asserted, only that every side ran and was compared: the JSON's keys,
positive ratios, which baseline the plan is, the predictions where the plan's profile prices a side."""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from helpers import convert_to_mlx, one_line_exit_2  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.measuring.bench_run import paired_ratio  # noqa: E402

SIDES = {"all-exact", "mlx-lm", "transformers"}
FLAGS = ["--dtype", "float32", "--prompt-tokens", "48", "--repeats", "1", "--decode-tokens", "3", "--no-progress",
         "--json"]


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert_to_mlx(tmp_path_factory.mktemp("bench") / "q4g64", 4, 64)


def _template(q4: Path, out: Path, *flags: str, profile: str | None = None) -> Path:
    assert main(["plan-template", "--model", str(q4), "--chunk", "32", *flags, "--out", str(out)]) == 0
    if profile:  # as a search writes it: the profile its predictions come from
        plan = json.loads(out.read_text())
        plan["meta"]["profile"] = profile
        out.write_text(json.dumps(plan))
    return out


def _bench(capsys, q4: Path, plan: Path, *flags: str) -> dict:
    capsys.readouterr()
    assert main(["bench", "--model", str(q4), "--plan", str(plan), *FLAGS, *flags]) == 0
    return json.loads(capsys.readouterr().out)


def _check_measured(r: dict) -> None:
    assert set(r["vs"]) == SIDES and set(r["sides"]) == SIDES | {"plan"} and r["threads"] == 1
    assert r["decode_prompt_tokens"] == 48  # well within the context
    for side, v in r["vs"].items():
        assert set(v) >= {"latency", "predicted_latency", "is_plan"}
        assert v["latency"] > 0 and v["decode"] > 0, side
    for s in r["sides"].values():
        assert len(s["prefill"]["runs_ms"]) == 1 and s["measured_prefill_ms"] > 0 and s["decode_tok_s"] > 0
    assert r["lanes"]["simulated"] == [] and "torch-cpu" in r["lanes"]["real"]


def test_bench_a_static_plan_on_torch(q4, tmp_path, capsys):
    """A plan with cpu-static groups on the torch spine is none of the baselines; the shipped Linux profile prices
    the plan, the all-exact plan and transformers' forward (the same all-exact plan on torch: one price), not
    mlx-lm's (it has no mlx-exact records). The report and its chart are written as a set."""
    plan = _template(q4, tmp_path / "static.json", "--backend", "cpu-static", profile="linux-xeon-2c-quick")
    out = tmp_path / "bench.json"
    r = _bench(capsys, q4, plan, "--engine", "torch", "--out", str(out))
    _check_measured(r)
    assert r["engine"] == "torch" and not any(v["is_plan"] for v in r["vs"].values())
    sides = r["sides"]
    assert sides["plan"]["predicted_prefill_ms"] > 0 and sides["mlx-lm"]["predicted_prefill_ms"] is None
    assert sides["all-exact"]["predicted_prefill_ms"] == sides["transformers"]["predicted_prefill_ms"] > 0
    assert all(sides[s]["predicted"]["predicted_parts_ms"]["experts"] > 0 for s in ("plan", "all-exact"))  # routed
    assert r["vs"]["all-exact"]["predicted_latency"] > 0 and r["vs"]["mlx-lm"]["predicted_latency"] is None
    executed = sides["plan"]["executed"]
    assert "cpu-static" in executed["experts"]  # the groups ran on their backend
    assert json.loads(out.read_text())["vs"] == r["vs"]
    assert Path(r["chart"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_an_all_exact_plan_on_mlx_is_mlx_lm(q4, tmp_path, capsys):
    """Every expert on mlx-exact, no static group: on the MLX spine that plan is the all-exact plan and mlx-lm's own
    forward (`is_plan`), not transformers'; its lanes are MLX's."""
    plan = _template(q4, tmp_path / "exact.json", "--exact", "mlx-exact", "--no-groups")
    r = _bench(capsys, q4, plan)
    _check_measured(r)
    assert r["engine"] == "mlx"
    assert {s: v["is_plan"] for s, v in r["vs"].items()} == {"all-exact": True, "mlx-lm": True, "transformers": False}
    assert set(r["sides"]["plan"]["executed"]["experts"]) == {"mlx-exact"}
    assert all(v["predicted_latency"] is None for v in r["vs"].values())  # a template names no profile


@pytest.mark.skipif(sys.platform == "darwin", reason="off a Mac the ane backend runs through its simulator")
def test_bench_never_reports_a_simulator_as_a_device(q4, tmp_path, capsys):
    """A plan's ane groups run on ane-sim here: the lanes say so, and no measured ratio against the plan is given as
    a device's (only as the simulator's)."""
    plan = _template(q4, tmp_path / "ane.json", "--backend", "ane")
    r = _bench(capsys, q4, plan, "--decode-tokens", "0")
    assert r["lanes"]["simulated"] == ["ane -> ane-sim"] and "ane-sim" not in r["lanes"]["real"]
    for v in r["vs"].values():
        assert v["latency"] is None and v["latency_through_simulator"] > 0 and v["simulated"] == ["ane -> ane-sim"]


def test_bench_refuses_bad_input_in_one_line(q4, tmp_path, capsys):
    plan = _template(q4, tmp_path / "exact.json", "--no-groups")
    other = tmp_path / "other.json"
    assert main(["plan-template", "--model", "random:mixtral", "--out", str(other)]) == 0
    out = tmp_path / "never.json"
    assert "plan" in one_line_exit_2(["bench", "--model", str(q4), "--plan", str(other), "--out", str(out)], capsys)
    assert "--prompt-tokens" in one_line_exit_2(["bench", "--model", str(q4), "--plan", str(plan), "--prompt-tokens",
                                                 "99999", "--out", str(out)], capsys)
    short = tmp_path / "short.txt"
    short.write_text("A few words only.")
    assert "tokens" in one_line_exit_2(["bench", "--model", str(q4), "--plan", str(plan), "--text", str(short),
                                        "--out", str(out)], capsys)
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_the_measured_ratio_pairs_each_rounds_runs():
    """Two identical sides on a host whose load came on in the third round between the plan's run and the side's,
    and stayed: the two medians read 2x, each round's pair reads what it is, a tie; two prompts pair prompt by
    prompt."""
    plan, side = [[100.0, 100.0, 100.0, 200.0, 200.0]], [[100.0, 100.0, 200.0, 200.0, 200.0]]
    assert statistics.median(side[0]) / statistics.median(plan[0]) == 2.0
    assert paired_ratio(side, plan) == 1.0
    assert paired_ratio([[110.0, 220.0], [330.0, 330.0]], [[100.0, 200.0], [300.0, 300.0]]) == 1.1
