"""lm-evaluation-harness's own OpenAI client (`lm_eval --model local-completions`) against `autotune serve`: the
log-likelihood task `builtin:pydoc-nextsent` scores what `autotune evaluate` scores under the same plan (within one
example), and a generate_until task runs. The note gives the --limit 200 figures; here a smaller limit keeps CI
short."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import runtime
from autotune.cli import main
from autotune.evaluation import nextsent
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import model_spec
from runtime.plan import save_plan

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 24
GEN_TASK = """task: npumoe_echo_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
metric_list:
  - metric: exact_match
"""


def _lm_eval(url: str, tasks: str, include: Path, out: Path, env: dict) -> dict:
    args = ",".join([f"base_url={url}/completions", "model=tiny-moe", f"tokenizer={ROOT / 'runtime/assets/tiny-moe'}",
                     "tokenizer_backend=huggingface", "tokenized_requests=True", "num_concurrent=1", "max_retries=1"])
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                    "--tasks", tasks, "--include_path", str(include), "--limit", str(LIMIT), "--output_path",
                    str(out), "--log_samples"], check=True, env=env, capture_output=True, timeout=600)
    return json.loads(next(out.rglob("results_*.json")).read_text())["results"]


@pytest.mark.slow
def test_lm_eval_local_completions_scores_what_autotune_evaluate_scores(tmp_path, capsys):
    plan = tmp_path / "spill.json"
    save_plan(template_plan(model_spec(runtime.load("tiny-moe", dtype="float32").model), "tight", "spill",
                            chunk_tokens=16), plan)
    assert main(["evaluate", "--model", "tiny-moe", "--plan", str(plan), "--tasks", "builtin:pydoc-nextsent",
                 "--limit", str(LIMIT), "--json", "--threads", "1"]) == 0
    evaluated = json.loads(capsys.readouterr().out)["tasks"][nextsent.TASK]

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    nextsent.write_task(tasks)
    data = tasks / "gen.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "target": "x"}) + "\n" for p in ["def main(", "import os\n"]))
    (tasks / "gen.yaml").write_text(GEN_TASK.format(data=json.dumps(str(data))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--model", "tiny-moe", "--plan", str(plan),
                             "--port", "0", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        url = proc.stdout.readline().split(" at ")[1].split()[0]
        results = _lm_eval(url, f"{nextsent.TASK},npumoe_echo_gen", tasks, tmp_path / "out", env)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    served = results[nextsent.TASK]["acc,none"]
    assert evaluated["n"] == LIMIT
    assert abs(served - evaluated["accuracy_plan"]) * LIMIT <= 1 + 1e-9, (served, evaluated)
    assert "exact_match,none" in results["npumoe_echo_gen"]  # the generate_until task ran through the server
    samples = [json.loads(line) for f in (tmp_path / "out").rglob("samples_npumoe_echo_gen*.jsonl")
               for line in f.read_text().splitlines()]
    assert len(samples) == 2 and all(isinstance(s["resps"][0][0], str) for s in samples)
