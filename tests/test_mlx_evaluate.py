"""`autotune evaluate --engine mlx`: a plan's fidelity on the MLX spine (tiny-moe in float32, MLX's CPU device)
against the unmodified model there, mlx-lm's own forward of the same folder; against `--engine torch`'s figures of
the same plan within the fidelity gate's limits."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_lm")

from helpers import one_line_exit_2  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.evaluation.gate import MAX_PPL_DELTA, MIN_TOP1  # noqa: E402

TOKENS, PROMPT = 512, 256


def _template(path, *flags: str):
    assert main(["plan-template", "--model", "tiny-moe", "--exact", "mlx-exact", *flags, "--out", str(path)]) == 0
    return path


def _evaluate(capsys, plan, engine: str) -> dict:
    capsys.readouterr()
    assert main(["evaluate", "--model", "tiny-moe", "--plan", str(plan), "--engine", engine, "--dtype", "float32",
                 "--max-tokens", str(TOKENS), "--prompt-tokens", str(PROMPT), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_all_mlx_exact_plan_is_mlx_lms_own_forward(tmp_path, capsys):
    """Every expert on mlx-exact (mlx-lm's own switch_mlp): the plan's figures are the unmodified model's."""
    r = _evaluate(capsys, _template(tmp_path / "P.json", "--no-groups"), "mlx")
    print(f"all mlx-exact, --engine mlx: ppl {r['ppl_reference']:.4f} -> {r['ppl_plan']:.4f} "
          f"(delta {r['ppl_delta_rel']:.2e}), top-1 {r['top1_agreement']}, KL {r['kl_mean']:.2e}")
    assert r["engine"] == "mlx" and r["tokens"] == TOKENS and r["prompts"] == TOKENS // PROMPT
    assert abs(r["ppl_delta_rel"]) <= 1e-6 and r["top1_agreement"] == 1.0 and abs(r["kl_mean"]) <= 1e-6
    assert r["max_rel_diff_vs_reference"] <= 1e-5
    assert r["tokens_per_backend"] == {"mlx-exact": TOKENS * 2 * 4} and r["drop_rate"] == r["spill_rate"] == 0


def test_mixed_plan_agrees_with_the_torch_spine_within_the_gates_limits(tmp_path, capsys):
    """Groups on ane (ane-sim here, fp16) beside mlx-exact, on both spines: the same accounting, and figures within
    the gate's perplexity and top-1 limits of each other."""
    plan = _template(tmp_path / "P.json", "--backend", "ane")
    ours, theirs = _evaluate(capsys, plan, "mlx"), _evaluate(capsys, plan, "torch")
    for name, r in (("mlx", ours), ("torch", theirs)):
        print(f"mixed plan, --engine {name}: ppl {r['ppl_reference']:.4f} -> {r['ppl_plan']:.4f} "
              f"(delta {r['ppl_delta_rel']:+.2e}), top-1 {r['top1_agreement']:.4f}, KL {r['kl_mean']:.2e}")
    assert ours["engine"] == "mlx" and theirs["engine"] == "torch"
    assert abs(ours["ppl_reference"] / theirs["ppl_reference"] - 1) <= 1e-4  # mlx-lm's forward and transformers'
    assert abs(ours["ppl_plan"] / theirs["ppl_plan"] - 1) <= MAX_PPL_DELTA
    assert abs(ours["ppl_delta_rel"]) <= MAX_PPL_DELTA and ours["top1_agreement"] >= MIN_TOP1
    assert abs(ours["top1_agreement"] - theirs["top1_agreement"]) <= 1 - MIN_TOP1
    for key in ("tokens_per_backend", "calls_per_backend", "assignments", "backend_fallbacks"):
        assert ours[key] == theirs[key], key
    assert ours["tokens_per_backend"]["ane-sim"] > 0


def test_tasks_stay_on_the_torch_spine(tmp_path, capsys):
    plan = _template(tmp_path / "P.json", "--no-groups")
    assert "torch spine only" in one_line_exit_2(
        ["evaluate", "--model", "tiny-moe", "--plan", str(plan), "--engine", "mlx", "--tasks",
         "builtin:pydoc-nextsent", "--limit", "2"], capsys)
