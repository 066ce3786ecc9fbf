"""lm-evaluation-harness tasks on the planned model and on the unmodified one, over the same examples.

Both runs wrap the same model object in lm-eval's HFLM (batch size 1, so a chunk of the plan never mixes two
requests' tokens or padding); the plan's executor is installed for the second. Accuracy is paired per example:
the delta's standard error is that of the per-example differences, not of two independent accuracies. Hub and
dataset downloads are switched off: a task runs from local files or the datasets cache, or fails.
"""
from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from autotune.evaluation import nextsent
from runtime.backends import registry
from runtime.errors import NpumoeError
from runtime.executor import PlanExecutor

log = logging.getLogger("npumoe")

OFFLINE_ENV = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
BUILTIN_TASKS = {nextsent.NAME: nextsent.write_task}
METRIC = "acc"


def _lm_eval():
    os.environ.update(OFFLINE_ENV)  # before datasets is imported: it reads these once
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its notes on passing a model object are not ours
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise NpumoeError(f"--tasks needs lm-evaluation-harness ({e.name} is missing): "
                          "pip install -e '.[eval]'") from None
    return lm_eval, HFLM, TaskManager


def _per_example(samples: list[dict]) -> dict[int, float]:
    return {int(s["doc_id"]): float(s[METRIC]) for s in samples if METRIC in s}


def paired(reference: dict[int, float], plan: dict[int, float]) -> dict:
    """Accuracy of each over the shared examples, the delta (points of accuracy, plan - reference) and its
    standard error from the per-example differences."""
    ids = sorted(set(reference) & set(plan))
    ref = np.array([reference[i] for i in ids])
    got = np.array([plan[i] for i in ids])
    d = got - ref
    n = len(ids)
    stderr = float(d.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    return {"accuracy_plan": float(got.mean()), "accuracy_reference": float(ref.mean()),
            "delta": float(d.mean()), "stderr": stderr, "n": n}


def _task_manager(TaskManager, include: list[str], names: list[str]):
    """Local task folders first; lm-eval's own ~15K task files are indexed (tens of seconds) only when a task is
    not found there. lm-eval skips a task file it cannot parse, so a task missing locally beside a broken YAML is
    reported as that file and its error."""
    manager = TaskManager(include_path=include, include_defaults=False)
    if any(t not in manager.all_tasks for t in names):
        broken = _broken_yaml(include)
        if broken:
            missing = [t for t in names if t not in manager.all_tasks]
            raise NpumoeError(f"--tasks: task {', '.join(missing)} not found: {broken}")
        manager = TaskManager(include_path=include, include_defaults=True)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise NpumoeError(f"--tasks: unknown task {', '.join(unknown)} (lm-eval's tasks, the built-in "
                          f"{', '.join(BUILTIN_TASKS)}, or a task YAML under --include-path)")
    return manager


def _broken_yaml(folders: list[str]) -> str | None:
    """The first task YAML under `folders` that is not valid YAML, as "FILE is not valid YAML (the error)"."""
    import yaml

    class _Tags(yaml.SafeLoader):  # lm-eval's own tags (!function) are not errors here
        pass

    _Tags.add_multi_constructor("!", lambda loader, suffix, node: None)
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.y*ml")):
            try:
                yaml.load(path.read_text(encoding="utf-8"), Loader=_Tags)  # noqa: S506 (a SafeLoader)
            except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
                return f"{path} is not valid YAML ({' '.join(str(e).split())[:200]})"
    return None


@contextmanager
def prepared_tasks(tasks: list[str], include_path: str | None) -> Iterator[tuple[list[str], object]]:
    """(task names, lm-eval TaskManager) with every task found, built-in ones written to a temp folder that lasts
    the block: call it before loading the model, so that a bad task is the only line (no load notes before it)."""
    _, _, TaskManager = _lm_eval()
    with tempfile.TemporaryDirectory(prefix="npumoe-tasks-") as tmp:
        names = [BUILTIN_TASKS[t](tmp) if t in BUILTIN_TASKS else t for t in tasks]
        yield names, _task_manager(TaskManager, [tmp] + ([include_path] if include_path else []), names)


def run_tasks(executor: PlanExecutor, tokenizer: object, tasks: tuple[list[str], object], limit: int | None,
              num_fewshot: int | None) -> dict:
    """{task: paired accuracies} for every task lm-eval ran (a group's subtasks each) on the model without and
    with `executor`'s plan, plus what the executor did on the tasks' text (drop and spill rates). `tasks`: what
    `prepared_tasks` yields."""
    if not hasattr(tokenizer, "pad_token_id"):
        raise NpumoeError("--tasks needs a model with a transformers tokenizer (tiny-moe or a model directory), "
                          "not a random: model")
    model = executor.model
    lm_eval, HFLM, _ = _lm_eval()
    names, manager = tasks
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1, device="cpu")

    def evaluate() -> dict:
        out = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=True, bootstrap_iters=0)
        return {t: _per_example(s) for t, s in out["samples"].items()}

    with executor.applied(False):
        reference = evaluate()
    with executor.applied(True):
        planned = evaluate()
    total = executor.stats.total()
    results = {t: paired(reference[t], planned[t]) for t in reference if reference[t]}
    if any(lp.groups for lp in executor.plan.layers) and not set(total.calls_per_backend) - set(registry.exact_paths()):
        log.warning("every request of the tasks is shorter than the plan's exact_below_tokens (%d): they ran wholly "
                    "on the exact path, so the accuracies say nothing of the plan's static groups",
                    executor.plan.exact_below)
    return {"tasks": results, "metric": METRIC, "drop_rate": total.dropped / max(1, total.assignments),
            "spill_rate": total.spilled / max(1, total.assignments),
            "calls_per_backend": dict(total.calls_per_backend), "tokens_per_backend": dict(total.tokens_per_backend),
            "backend_fallbacks": executor.fallbacks}
