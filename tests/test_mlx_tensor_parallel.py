"""The tensor layout across two ranks of MLX's ring on 127.0.0.1 (free ports): every rank every layer, sliced by
mlx-lm's `shard()`, under its plan on the MLX spine (static groups taking the rank's slice of their experts), tiny-moe
at 4 bits in float32, against one process; and what refuses it before the ring is joined."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ENV, ROOT, convert_to_mlx, free_ports, launch, one_line_exit_2

pytest.importorskip("mlx_lm")
TEXT = "Static capacity tiers and grouped experts run beside the exact path on every Mac of the ring."


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


@pytest.fixture(scope="module")
def tensor(tiny4, tmp_path_factory):
    """A pipeline file naming the tensor layout beside its plan: cpu-static groups at a tight capacity spilling to
    mlx-exact (float32), every rank under it."""
    from autotune.cli import main

    d = tmp_path_factory.mktemp("plan")
    assert main(["plan-template", "--model", str(tiny4), "--exact", "mlx-exact", "--chunk", "16", "--capacity",
                 "tight", "--overflow", "spill", "--backend", "cpu-static", "--out", str(d / "plan.json")]) == 0
    stages = [{"stage": 0, "rank": 1, "layers": [0, 2], "plan": "plan.json"},
              {"stage": 1, "rank": 0, "layers": [2, 4], "plan": "plan.json"}]
    (d / "plan.pipeline.json").write_text(json.dumps({"schema": "npumoe.pipeline/1", "layout": "tensor",
                                                      "split": [[0, 2], [2, 4]], "stages": stages}))
    return d


RANK = """import json
import sys
import numpy as np
import torch
from runtime.generation import load
from runtime.mlx.cluster import cluster_spec
from runtime.mlx.spine_generation import prefill_logits

model, plan, out, text = sys.argv[1:5]
loaded = load(model, plan, dtype="float32", engine="mlx", cluster=cluster_spec(model, plan, None))
ids = torch.tensor(loaded.tokenizer.encode(text))
logits = prefill_logits(loaded.model, ids, loaded.plan.chunk_tokens, every_position=True)
np.save(f"{out}/rank{loaded.cluster.spec.rank}.npy", logits.numpy())
print(json.dumps({"rank": loaded.cluster.spec.rank, "layers": loaded.cluster.layers,
                  "spilled": loaded.executor.stats.total().spilled}))
"""


@pytest.mark.slow
def test_two_ranks_in_tensor_parallel_match_one_process(tiny4, tensor, tmp_path):
    import runtime
    from runtime.mlx.spine_generation import prefill_logits
    from runtime.prefill import max_rel_diff

    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = free_ports(2, consecutive=True)[0]
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "--hosts", "127.0.0.1", "-n", "2",
           "--starting-port", str(port), "--env", f"PYTHONPATH={ROOT}", "--env", "OMP_NUM_THREADS=1",
           "--python", sys.executable, str(script), str(tiny4), str(tensor / "plan.json"), str(tmp_path), TEXT]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=ENV, cwd=tmp_path)
    ranks = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    assert len(ranks) == 2, done.stdout[-2000:] + done.stderr[-3000:]
    assert [r["layers"] for r in ranks] == [[0, 4], [0, 4]]  # every rank every layer, sliced
    assert ranks[0]["spilled"] == ranks[1]["spilled"] > 0  # each rank routes every token
    one = runtime.load(str(tiny4), plan=str(tensor / "plan.json"), engine="mlx", dtype="float32")
    ids = torch.tensor(one.tokenizer.encode(TEXT))
    want = prefill_logits(one.model, ids, one.plan.chunk_tokens, every_position=True)
    for k in (0, 1):  # the ranks' slices summed by all_sum: float32 rounding in another order, no more
        got = torch.from_numpy(np.load(tmp_path / f"rank{k}.npy"))
        assert got.shape == want.shape and max_rel_diff(got, want) <= 1e-5


@pytest.mark.slow
def test_run_under_the_launcher_in_tensor_parallel(tiny4, tensor, tmp_path):
    ranks = launch(["run", "--model", str(tiny4), "--plan", str(tensor / "plan.json"), "--engine", "mlx",
                    "--dtype", "float32", "--max-tokens", "64", "--reference", "--json"], tmp_path)
    assert [(r["rank"], r["layers"]) for r in ranks] == [(0, [0, 4]), (1, [0, 4])]
    for r in ranks:  # against mlx-lm's own shard() forward on the same two ranks
        assert r["max_rel_diff_vs_reference"] <= 1e-5 and r["assignments"] == 64 * 4 * 2  # top-2, every layer


@pytest.mark.usefixtures("a_rank")  # this process as rank 0 of a ring nobody listens on
def test_a_plan_with_dense_functions_placed_is_refused_before_the_ring(tiny4, tensor, tmp_path, capsys):
    from autotune.cli import main

    dense = tmp_path / "dense.json"
    assert main(["plan-template", "--model", str(tiny4), "--exact", "mlx-exact", "--chunk", "16", "--backend",
                 "cpu-static", "--dense", "cpu-static", "--out", str(dense)]) == 0
    capsys.readouterr()
    layout = json.loads((tensor / "plan.pipeline.json").read_text())
    for stage in layout["stages"]:
        stage["plan"] = "dense.json"
    (tmp_path / "dense.pipeline.json").write_text(json.dumps(layout))
    line = one_line_exit_2(capsys=capsys, argv=["run", "--model", str(tiny4), "--plan", str(dense), "--engine", "mlx"])
    assert line.startswith("autotune run: error:") and "places dense functions on a static backend" in line


def test_the_tensor_layout_refuses_widths_that_do_not_divide():
    from runtime.errors import NpumoeError
    from runtime.mlx.tensor_parallel import check_shardable

    check_shardable({"num_attention_heads": 4, "num_key_value_heads": 2, "moe_intermediate_size": 256}, 2, None)
    with pytest.raises(NpumoeError, match="num_key_value_heads 2 does not divide"):
        check_shardable({"num_attention_heads": 4, "num_key_value_heads": 2}, 4, None)


def test_a_pipeline_file_names_a_layout_the_runtime_runs(tmp_path):
    from runtime.errors import NpumoeError
    from runtime.mlx.tensor_parallel import read_layout

    path = tmp_path / "p.json"
    path.write_text(json.dumps({"split": [[0, 4]]}))
    assert read_layout(path) == "pipeline"
    path.write_text(json.dumps({"layout": "expert"}))
    with pytest.raises(NpumoeError, match="names the layout 'expert'"):
        read_layout(path)
