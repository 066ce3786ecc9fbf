"""`priced` and `off_priced` in `autotune run --json` (`runtime.priced_lanes`): every part executed on a lane the plan
prices it on, or named. The main job's plan's shape on tiny-moe (as `autotune search --model tiny-moe --profile
apple-m2-ultra-published` writes it: no static group, half of each layer's experts on cpu-exact and the rest on
mlx-exact, the dense host mlx-exact and no dense function) on both spines, at 128 tokens in float32."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.engines import mlx_importable
from runtime.loading.model_record import read_model_spec
from runtime.priced_lanes import priced_lanes

needs_mlx = pytest.mark.skipif(not mlx_importable(), reason="needs mlx and mlx-lm")
HOST_PARTS = ["attention_projections", "attention_core", "lm_head", "rest"]  # tiny-moe's parts besides the experts


@pytest.fixture(scope="module")
def main_job_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("priced") / "main-job.json"
    assert main(["plan-template", "--model", "tiny-moe", "--no-groups", "--exact", "mlx-exact", "--out", str(out)]) == 0
    p = json.loads(out.read_text())
    for layer in p["layers"]:
        layer["exact_split"] = {"cpu-exact": layer["cpu_exact"][layer["layer"] % 2::2]}
    p["dense"] = {"attention_context_buckets": [], "layers": [], "exact": "mlx-exact"}
    out.write_text(json.dumps(p))
    return out


def _run(capsys, plan, engine: str) -> dict:
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--engine", engine, "--dtype", "float32",
                 "--max-tokens", "128", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@needs_mlx
def test_the_main_jobs_plan_runs_as_priced_on_the_mlx_spine(main_job_plan, capsys):
    r = _run(capsys, main_job_plan, "mlx")
    assert r["priced"] == {"attention_projections": ["mlx-cpu"], "attention_core": ["mlx-cpu"],
                           "experts": ["mlx-exact", "torch-cpu"], "dense_mlp": ["mlx-cpu"], "lm_head": ["mlx-cpu"],
                           "rest": ["mlx-cpu"]}
    assert set(r["executed"]) == {"experts", *HOST_PARTS}
    assert set(r["executed"]["experts"]) == {"mlx-exact", "torch-cpu"}
    assert r["off_priced"] == [] and r["priced_stand_ins"] == {}


@needs_mlx
def test_the_torch_spine_runs_the_mlx_priced_dense_host_off_priced(main_job_plan, capsys):
    """The dense host is priced on MLX's dense ops; the torch spine runs it on the CPU in torch, as its warning says:
    every part but the experts off priced."""
    r = _run(capsys, main_job_plan, "torch")
    assert r["engine"] == "torch" and set(r["executed"]["experts"]) == {"mlx-exact", "torch-cpu"}
    assert r["off_priced"] == [{"part": part, "lanes": ["torch-cpu"]} for part in HOST_PARTS]


def test_stand_ins_are_priced_by_their_lanes_and_off_priced_names_the_rest():
    """An engine that runs ane's groups on ane-sim and mlx-exact's experts on cpu-exact (MLX absent): the experts are
    priced on those stand-ins' lanes, said as such; a run's lanes outside the priced ones are named per part."""
    plan = template_plan(read_model_spec("tiny-moe"), "tight", "spill", backend="ane", exact="mlx-exact")
    engine = SimpleNamespace(fallbacks={"ane": "ane-sim", "mlx-exact": "cpu-exact"}, dense=None)
    priced = priced_lanes(plan, engine)
    assert priced.to_json() == {part: ["torch-cpu"] for part in
                                ("attention_projections", "attention_core", "dense_mlp", "lm_head", "rest")} | \
        {"experts": ["ane-sim", "torch-cpu"]}
    assert priced.stand_ins == {"ane": "ane-sim", "mlx-exact": "cpu-exact"}
    executed = {"experts": {"ane-sim": {"calls": 8}, "mlx-exact": {"calls": 4}}, "rest": {"torch-cpu": {"calls": 1}},
                "lm_head": {"mlx-cpu": {"calls": 1}, "torch-cpu": {"calls": 1}}}
    assert priced.off(executed) == [{"part": "experts", "lanes": ["mlx-exact"]},
                                    {"part": "lm_head", "lanes": ["mlx-cpu"]}]
