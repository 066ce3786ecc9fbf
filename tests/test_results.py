"""The library's typed results: each `to_json()` prints exactly the keys, in order, that its command's `--json`
printed before the results were typed (recorded from the commands at the commit before; a contract scripts read)."""
import dataclasses

from helpers import SEARCH_REPORT_ADDED, SEARCH_REPORT_KEYS, random_model

import autotune
from autotune.results import EvaluateResult, RunResult, SearchReport, TasksResult
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import model_spec
from runtime.plan import save_plan

RUN = ["model", "plan", "text", "tokens", "chunk_tokens", "overflow", "latency_ms", "wall_ms_per_token",
       "cpu_ms_per_token", "assignments", "dropped", "spilled", "drop_rate", "spill_rate", "padding_fraction",
       "static_slots", "tokens_per_backend", "calls_per_backend", "per_layer", "prefill", "decode",
       "backend_fallbacks", "drift", "memory", "plan_predicted"]
EVALUATE = ["model", "plan", "text", "tokens", "prompts", "ppl_reference", "ppl_plan", "ppl_delta_rel",
            "top1_agreement", "kl_mean", "max_rel_diff_vs_reference", "drop_rate", "spill_rate", "padding_fraction",
            "assignments", "tokens_per_backend", "calls_per_backend", "backend_fallbacks", "drop_budget",
            "drop_rate_within_1_5x_budget"]
# keys added since, after the recorded ones: the run's time per part (measured; predicted where the plan's profile
# is here), the spine that ran it (evaluate's too), what ran each part and where the plan prices it; the search's:
# helpers.SEARCH_REPORT_ADDED
RUN_ADDED = ["measured_parts_ms", "engine", "executed", "priced", "priced_stand_ins", "off_priced"]
EVALUATE_ADDED = ["engine", "cluster"]
TASKS = ["model", "plan", "limit", "num_fewshot", "tasks", "metric", "drop_rate", "spill_rate", "calls_per_backend",
         "tokens_per_backend", "backend_fallbacks"]


def _plans(tmp_path):
    spec = model_spec(random_model("random:olmoe")[0])
    plan = template_plan(spec, "tight", "drop", chunk_tokens=32)
    save_plan(plan, tmp_path / "plain.json")
    save_plan(plan.model_copy(update={"meta": {"drop_budget": 0.1}}), tmp_path / "budget.json")
    return tmp_path / "plain.json", tmp_path / "budget.json"


def test_run_result_keys_are_the_commands(tmp_path, text_file):
    plain, _ = _plans(tmp_path)
    run = autotune.run_plan("random:olmoe", plain, text=text_file, max_tokens=96)
    assert isinstance(run, RunResult) and list(run.to_json()) == RUN + RUN_ADDED
    assert run.drop_rate == run.to_json()["drop_rate"] > 0 and run.tokens == 96
    full = autotune.run_plan("random:olmoe", plain, text=text_file, max_tokens=200, reference=True,
                             record_traces=tmp_path / "r.npz").to_json()
    # --reference puts its latency before the plan's and its difference after the drift; traces between
    with_all = RUN[:6] + ["reference_latency_ms"] + RUN[6:23] + ["traces", "max_rel_diff_vs_reference"] + RUN[23:]
    assert list(full) == with_all + RUN_ADDED


def test_evaluate_result_keys_are_the_commands(tmp_path, text_file):
    plain, budget = _plans(tmp_path)
    with_budget = autotune.evaluate("random:olmoe", budget, text=text_file, max_tokens=200, prompt_tokens=100,
                                    progress=False)
    assert isinstance(with_budget, EvaluateResult) and list(with_budget.to_json()) == EVALUATE + EVALUATE_ADDED
    assert with_budget.drop_rate_within_1_5x_budget == (with_budget.drop_rate <= 0.15)
    without = autotune.evaluate("random:olmoe", plain, text=text_file, max_tokens=200, prompt_tokens=100,
                                progress=False).to_json()
    assert list(without) == EVALUATE[:-2] + EVALUATE_ADDED  # a plan without a drop budget: no budget keys


def test_tasks_and_search_results_hold_the_commands_keys():
    assert [f.name for f in dataclasses.fields(TasksResult)] == TASKS
    assert [f.name for f in dataclasses.fields(SearchReport)] == SEARCH_REPORT_KEYS + SEARCH_REPORT_ADDED
