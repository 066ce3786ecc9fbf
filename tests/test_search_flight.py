"""`autotune search --in-flight 2` (autotune/searching/flight_plan.py): tiny-moe on the published M2 Ultra profile for
the MLX spine, on synthetic routing of 512-token prompts. The plan says it runs two chunks in flight and carries the
schedule's figures, which end no later than the same search's one-at-a-time plan as a chain; `generate` runs it in
flight (the plan's own `in_flight`) with the greedy text of one chunk at a time."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from autotune.calibration.traces import save_traces, synthetic_traces  # noqa: E402
from autotune.cli import main  # noqa: E402
from autotune.searching.report import format_report  # noqa: E402
from runtime.loading.model_record import read_model_spec  # noqa: E402
from runtime.plan import load_plan  # noqa: E402

PROMPT_TOKENS = 512


@pytest.fixture(scope="module")
def searched(tmp_path_factory) -> dict:
    """The same search with one and with two chunks in flight: each one's plan and report."""
    d = tmp_path_factory.mktemp("flight")
    traces = d / "traces.npz"
    save_traces(synthetic_traces(read_model_spec("tiny-moe").to_json(), 10, PROMPT_TOKENS, skew=1.2, seed=3,
                                 tokens=True), traces)
    out = {}
    for n in (1, 2):
        plan = d / f"plan{n}.json"
        assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--traces", str(traces),
                     "--trials", "5", "--no-gate", "--engine", "mlx", "--in-flight", str(n), "--out", str(plan),
                     "--json"]) == 0
        out[n] = {"plan": plan, "report": json.loads((d / f"plan{n}.report.json").read_text())}
    return out


def test_the_two_in_flight_plan_carries_the_schedules_figures(searched):
    one, two = (load_plan(searched[n]["plan"]) for n in (1, 2))
    report = searched[2]["report"]
    whole = report["whole_prefill"]
    assert one.in_flight is None and searched[1]["report"]["whole_prefill"]["in_flight"] == 1
    assert two.in_flight == 2 and whole["in_flight"] == 2
    # the schedule's makespan: the plan's, the report's and the two-in-flight choice's (`executable`) alike
    figure = two.predicted["predicted_prefill_ms"]
    assert figure == report["predicted_prefill_ms"] == whole["predicted_prefill_ms"]
    assert figure == whole["executable"]["predicted_prefill_ms"]
    assert two.predicted["predicted_schedule"] == whole["predicted_schedule"]
    assert set(whole["predicted_schedule"]["units"]) == set(whole["executable"]["units"])
    # the same work scheduled two in flight ends no later than the one-at-a-time plan's chain
    assert figure <= one.predicted["predicted_prefill_ms"] * (1 + 1e-12)
    assert two.chunk_tokens == report["chunk_tokens"] and two.chunk_rows == whole.get("chunk_rows")
    units = whole["predicted_schedule"]["units"]
    line = next(t for t in format_report(report).splitlines() if "two chunks in flight" in t)
    assert all(f"{u} busy {v['busy_ms']:.1f}" in line for u, v in units.items())
    assert not any("two chunks in flight" in t for t in format_report(searched[1]["report"]).splitlines())


def _generate(capsys, plan, *extra) -> dict:
    prompt = "Two chunks in flight: the static lane and the host lane never wait for each other. " * 40
    capsys.readouterr()
    assert main(["generate", "--model", "tiny-moe", "--engine", "mlx", "--dtype", "float32", "--plan", str(plan),
                 "--prompt", prompt, "--max-tokens", "6", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_and_run_run_the_plan_in_flight_with_the_same_greedy_text(searched, capsys):
    """The prompt spans two chunks of the plan or more: by default its prefill runs two in flight (each lane's busy
    and wait time in `executed`), with `--in-flight 1` one at a time; the same tokens. `run` prefills in flight
    too."""
    plan = searched[2]["plan"]
    planned, single = _generate(capsys, plan), _generate(capsys, plan, "--in-flight", "1")
    assert planned["prompt_tokens"] > load_plan(plan).chunk_tokens
    assert "lanes" in planned["executed"] and "lanes" not in single["executed"]
    assert planned["text"] == single["text"] and planned["text"]
    assert main(["run", "--model", "tiny-moe", "--engine", "mlx", "--dtype", "float32", "--plan", str(plan),
                 "--max-tokens", str(planned["prompt_tokens"]), "--json"]) == 0
    ran = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert ran["tokens"] == planned["prompt_tokens"] and ran["executed"]["lanes"]["host"]["busy_ms"] > 0
