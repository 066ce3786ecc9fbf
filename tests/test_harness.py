"""`evaluate --tasks`: real lm-evaluation-harness runs, fully offline, from a local JSONL task and the built-in
builtin:pydoc-nextsent; accuracy of the plan and the reference paired per example."""
import json
import socket

import pytest

from autotune.cli import main
from autotune.evaluation.harness import paired
from autotune.evaluation.nextsent import CHOICES, items
from runtime.loading.model_loader import TINY_MOE_DIR

needs_tiny = pytest.mark.skipif(not (TINY_MOE_DIR / "config.json").exists(), reason="tiny-moe asset missing")

LOCAL_TASK = """task: npumoe_test_colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""
QUESTIONS = [("The colour of the clear sky at noon is", ["blue", "green", "purple"], 0),
             ("Grass in spring is", ["red", "green", "black"], 1),
             ("Snow is", ["orange", "brown", "white"], 2),
             ("A ripe tomato is", ["red", "blue", "grey"], 0),
             ("Coal is", ["white", "black", "pink"], 1)]


def test_paired_delta_and_stderr():
    r = paired({0: 1.0, 1: 1.0, 2: 0.0, 3: 1.0}, {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 9: 1.0})
    assert r["n"] == 4 and r["accuracy_reference"] == 0.75 and r["accuracy_plan"] == 0.5
    assert r["delta"] == -0.25 and r["stderr"] == pytest.approx(0.4787, abs=1e-4)  # sd of (0,-1,1,-1) / 2


def test_nextsent_items_are_deterministic_four_way_choices():
    first, again = items(), items()
    assert first == again and len(first) >= 300
    assert all(len(set(it["choices"])) == CHOICES and 0 <= it["label"] < CHOICES for it in first)


@needs_tiny
def test_tasks_run_offline_through_lm_eval(tmp_path, capsys, caplog, monkeypatch):
    data = tmp_path / "colours.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": l}) + "\n" for q, c, l in QUESTIONS))
    (tmp_path / "colours.yaml").write_text(LOCAL_TASK.format(data=json.dumps(str(data))))
    plan = tmp_path / "plan.json"
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "ample", "--out", str(plan)]) == 0

    def no_network(*args, **kwargs):
        raise AssertionError(f"lm-eval tried to reach the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert main(["evaluate", "--model", "tiny-moe", "--plan", str(plan), "--tasks",
                 "npumoe_test_colours,builtin:pydoc-nextsent", "--include-path", str(tmp_path), "--limit", "4",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(r["tasks"]) == {"npumoe_test_colours", "npumoe_pydoc_nextsent"}
    assert r["calls_per_backend"].get("cpu-static", 0) > 0 and "static groups" not in caplog.text
    # a plan whose exact path takes every request (a few dozen tokens each): said, since the accuracies then do
    # not test the plan's static groups
    exact = tmp_path / "exact.json"
    exact.write_text(json.dumps({**json.loads(plan.read_text()), "exact_below_tokens": 4096}))
    assert main(["evaluate", "--model", "tiny-moe", "--plan", str(exact), "--tasks", "npumoe_test_colours",
                 "--include-path", str(tmp_path), "--limit", "2", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["calls_per_backend"]) == {"cpu-exact"}
    assert "say nothing of the plan's static groups" in caplog.text
    for t in r["tasks"].values():  # the ample plan computes exactly what the model does: same answers
        assert t["n"] == 4 and t["delta"] == 0.0 and t["stderr"] == 0.0
        assert t["accuracy_plan"] == t["accuracy_reference"]
    assert r["drop_rate"] == 0.0
