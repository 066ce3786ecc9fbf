"""mlx-lm's Mixtral and PhiMoE folders (their MoE block `block_sparse_moe`, PhiMoE's router `gate`, its attention
and head biases) read by our loader, against mlx-lm's own forward of the same folder; random weights, converted by
`mlx_lm.convert -q` here."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from helpers import SMALL, convert_family, mlx_fp32  # noqa: E402

from autotune.cli import main  # noqa: E402
from runtime.loading.model_loader import load_model  # noqa: E402


@pytest.fixture(scope="module", params=["mixtral", "phimoe"])
def folder(request, tmp_path_factory) -> Path:
    return convert_family(tmp_path_factory.mktemp("family") / request.param, request.param)


def test_read_as_mlx_lm_computes(folder):
    model, _ = load_model(str(folder), "float32")
    ids = torch.randint(0, SMALL["vocab_size"], (64,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = model(ids[None]).logits[0].float().numpy()
    ref = np.array(mlx_fp32(folder)(mx.array(ids.numpy()[None]))[0].astype(mx.float32))
    # the routers too: a router rounded to bf16 picks other experts (7e-2 measured), exact reading gives 4e-7
    assert float(np.abs(ours - ref).max() / np.abs(ref).max()) < 1e-5


def test_plan_template_and_run(folder, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["plan-template", "--model", str(folder), "--capacity", "tight", "--overflow", "spill",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", "--model", str(folder), "--plan", str(plan), "--dtype", "float32", "--max-tokens", "128",
                 "--reference", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dropped"] == 0 and out["spilled"] > 0  # tight capacities spill, never drop
    assert out["max_rel_diff_vs_reference"] < 1e-5  # cpu-static groups and spills, float32: exact
