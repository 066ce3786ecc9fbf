"""A plan per Mac, predicted: the link figure and its time, the pipelined prefill, the balanced split under memory
budgets, each stage's time and memory, and a two-Mac plan of a Qwen3-235B-A22B slice on the published profile."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.calibration.traces import synthetic_traces
from autotune.costing.pipeline_link import LinkFigure, link_ms, pipeline_ms, profile_link, sequential_ms
from autotune.costing.stage_prefill import layer_bytes, stage_chunk_ms, stage_memory, stage_shape
from autotune.costing.whole_prefill import DecoderShape, ExpertFigures, predict_prefill
from autotune.profiling.profile import load_profile
from autotune.searching.layer_data import LayerData
from autotune.searching.optimizer import chunk_candidates
from autotune.searching.pipeline_layouts import expert_owners, plan_expert, plan_tensor
from autotune.searching.pipeline_plan import Mac, StageSearch, plan_pipeline
from autotune.searching.pipeline_report import pipeline_report
from autotune.searching.pipeline_split import balanced_split, even_split
from runtime.errors import NpumoeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_shape_twin import TWINS  # noqa: E402

QWEN235 = DecoderShape.from_config(TWINS["qwen3-235b-a22b"])


@pytest.fixture(scope="module")
def published():
    return load_profile("apple-m2-ultra-published")


def test_the_published_profile_has_thunderbolt_5_labelled_published(published):
    link = profile_link(published.extra)
    assert (link.name, link.gb_per_s, link.label) == ("thunderbolt-5", 10.0, "published")
    assert "link_gb_s" in published.extra["sources"]
    assert profile_link(published.extra, 5.0).label == "given"


def test_link_time_is_chunk_by_hidden_over_the_rate():
    tb5 = LinkFigure("thunderbolt-5", 10.0)
    # 2048 rows x 4096 hidden x 2 bytes = 16.78 MB at 10 GB/s
    assert link_ms(tb5, 2048, 4096) == pytest.approx(1.6777216)
    assert link_ms(LinkFigure("x", 5.0, latency_ms=0.1), 512, 4096) == pytest.approx(0.1 + 0.8388608)


def test_chunks_overlap_across_stages():
    stages, links = [[2.0, 2.0, 2.0], [3.0, 3.0, 3.0]], [1.0, 1.0, 1.0]
    # stage 0 ends chunks at 2, 4, 6; stage 1 starts chunk 0 at 3 (ends 6), chunk 1 at 6 (9), chunk 2 at 9 (12)
    assert pipeline_ms(stages, links) == 12.0
    assert sequential_ms(stages, links) == 6.0 + 9.0 + 3.0
    assert pipeline_ms([[5.0, 1.0]], [0.0, 0.0]) == 6.0  # one stage: no link, its chunks in turn


def test_the_split_balances_each_macs_own_times():
    assert balanced_split([[1.0] * 10, [1.0] * 10], [1.0] * 10, [0.0, 0.0], [100.0, 100.0]) == [(0, 5), (5, 10)]
    # the second Mac twice as slow: 7 layers (7 ms) and 3 (6 ms), against 6 and 4 (8 ms)
    assert balanced_split([[1.0] * 10, [2.0] * 10], [1.0] * 10, [0.0, 0.0], [100.0, 100.0]) == [(0, 7), (7, 10)]


def test_the_split_keeps_each_stage_within_its_macs_memory():
    # the first Mac holds 1 GB besides its layers and has 4: three layers of 1 GB at most
    assert balanced_split([[1.0] * 10] * 2, [1.0] * 10, [1.0, 0.0], [4.0, 100.0]) == [(0, 3), (3, 10)]
    with pytest.raises(NpumoeError, match="no split of 10 layers over 2 Macs fits"):
        balanced_split([[1.0] * 10] * 2, [1.0] * 10, [0.0, 0.0], [4.0, 4.0])


def test_even_split_is_mlx_lms():
    # mlx-lm: ranks' counts [3, 2] for 5 layers, rank 0 holding the last layers
    assert even_split(5, 2) == [(0, 2), (2, 5)]
    assert even_split(94, 2) == [(0, 47), (47, 94)]


def test_stages_add_up_to_the_whole_prefill(published):
    cost = published.cost_model
    experts = ExpertFigures(600.0, 0.0, None)
    whole = predict_prefill(cost, QWEN235, 4096, 1024, experts).latency_ms
    split = [(0, 40), (40, 94)]
    stages = [stage_chunk_ms(cost, stage_shape(QWEN235, a, b), 4096, 1024, experts.latency_ms * (b - a) / 94,
                             logits=k == 1) for k, (a, b) in enumerate(split)]
    assert [len(s) for s in stages] == [4, 4]
    assert sum(map(sum, stages)) == pytest.approx(whole, rel=1e-9)


def test_qwen3_235b_at_4_bits_is_132_gb_and_half_fits_an_m2_ultra():
    weights = sum(layer_bytes(QWEN235, i) for i in range(94))
    assert weights / 1e9 == pytest.approx(131.7, abs=0.2)  # 2.34e9 weights per layer at 4.5 bits
    half = stage_memory(QWEN235, 47, 94, 4096, 1024, ane_bytes=4e9)
    assert half.kv_cache == 47 * 2 * 4 * 128 * 4096 * 2
    assert 70e9 < half.total < 192e9


def test_a_two_mac_plan_of_a_qwen3_235b_slice(published):
    """1,024 tokens: the plan's chunks of 512 overlap across the two Macs. (At 512 tokens the best is one chunk, which a
    pipeline runs as a chain: its latency equals the sequential one, and a strict `<` held only by rounding.)"""
    shape = DecoderShape.from_config({**TWINS["qwen3-235b-a22b"], "num_hidden_layers": 4})
    spec = dict(num_experts=128, top_k=8, moe_layers=list(shape.moe_layers))
    prompt = 1024
    traces = synthetic_traces(spec, 5, prompt, tokens=True)
    workloads = {c: LayerData.from_traces(traces, c, prompt) for c in chunk_candidates(prompt, shape.context)}
    macs = [Mac(f"mac{i}", published.cost_model, 192e9) for i in range(2)]
    link = profile_link(published.extra)
    report = pipeline_report(plan_pipeline(macs, shape, workloads, prompt, link, StageSearch(trials=0)), shape,
                             workloads, prompt, link)
    assert report["chunk_tokens"] < prompt
    assert report["split"] == [[0, 2], [2, 4]]
    assert report["balance"] < 1.05
    assert all(s["within_budget"] and s["memory"]["total"] < 192 for s in report["stages"])
    chunk = report["chunk_tokens"]
    assert report["link"]["ms_per_boundary_per_chunk"][0] == pytest.approx(chunk * 4096 * 2 / 1e10 * 1e3)
    assert report["busiest_stage_ms"] <= report["pipeline_prefill_ms"] < report["sequential_ms"]
    assert report["vs"]["mlx-gpu"] > 1.0  # the ANE's residents and the overlap ahead of mlx-lm's pipeline
    assert report["layouts"] == {"pipeline": {"chunk_tokens": chunk, "predicted_prefill_ms":
                                              report["pipeline_prefill_ms"]}}
    assert report["layout"] == "pipeline" and report["predicted_prefill_ms"] == report["pipeline_prefill_ms"]


def test_the_tensor_and_expert_layouts_of_a_qwen3_235b_slice(published):
    """One prompt of one chunk: the pipeline cannot overlap it (one stage waits for the other); the tensor layout
    splits every layer's work over both Macs, for two all_sums per layer."""
    shape = DecoderShape.from_config({**TWINS["qwen3-235b-a22b"], "num_hidden_layers": 4})
    spec = dict(num_experts=128, top_k=8, moe_layers=list(shape.moe_layers))
    workloads = {512: LayerData.from_traces(synthetic_traces(spec, 5, 512, tokens=True), 512, 512)}
    macs = [Mac(f"mac{i}", published.cost_model, 192e9) for i in range(2)]
    link, how = profile_link(published.extra), StageSearch(trials=0)
    others = tuple(plan(macs, shape, workloads, 512, link, how) for plan in (plan_tensor, plan_expert))
    report = pipeline_report(plan_pipeline(macs, shape, workloads, 512, link, how), shape, workloads, 512, link,
                             others)
    tensor, expert = report["layouts"]["tensor"], report["layouts"]["expert"]
    # 4 layers x 2 all_sums of 512 x 4096 x 2 bytes, a ring of 2 sending half of it twice, at 10 GB/s
    assert tensor["all_sum_ms"] == expert["all_sum_ms"] == pytest.approx(8 * 512 * 4096 * 2 / 1e10 * 1e3)
    assert tensor["predicted_prefill_ms"] == pytest.approx(tensor["compute_ms"] + tensor["all_sum_ms"])
    rank = tensor["ranks"][0]
    assert rank["plan"]["experts"] == 4 * 128 and rank["plan"]["dense_placement"]["qkv"] is None  # sliced: exact
    assert rank["memory"]["weights"] < report["stages"][0]["memory"]["weights"] * 1.05  # half of 4 layers ~ 2 whole
    assert [r["plan"]["experts"] for r in expert["ranks"]] == [4 * 64, 4 * 64]  # half the experts each, whole
    assert report["layout"] == min(report["layouts"], key=lambda k: report["layouts"][k]["predicted_prefill_ms"])
    assert report["predicted_prefill_ms"] < report["pipeline_prefill_ms"]  # one chunk: nothing to overlap
    assert report["vs"]["mlx-gpu-sharded"] > 1.0  # our plan on each slice ahead of mlx-lm's shard() on the GPU


def test_experts_are_dealt_in_a_snake_by_popularity():
    calib = np.array([[80, 70, 60, 50, 40, 30, 20, 10]])
    owners = expert_owners([LayerData(0, calib, calib, 8)], 8, 2)
    assert [o.tolist() for o in owners] == [[0, 3, 4, 7], [1, 2, 5, 6]]  # 180 and 180 assignments


def _macs_args(d, out, *extra):
    return ["search", "--model", "random:qwen3_moe", "--profile", str(d / "profile.json"), "--traces",
            str(d / "traces.npz"), "--no-gate", "--trials", "2", "--out", str(out), "--json", *extra]


def test_search_across_two_macs_writes_a_plan_per_stage(workdir, tmp_path, capsys):
    from autotune.cli import main
    from runtime.mlx.cluster import rank_split, read_pipeline
    from runtime.plan import load_plan

    out = tmp_path / "plan.json"
    assert main(_macs_args(workdir, out, "--macs", "2", "--link-gb-s", "10")) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = load_plan(out).model.num_layers
    assert report["split"] == [[0, n // 2], [n // 2, n]]  # identical layers: the balanced split halves them
    assert [s["rank"] for s in report["stages"]] == [1, 0]  # mlx-lm's order: rank 0 holds the last layers
    assert report["link"]["gb_per_s"] == 10.0 and report["link"]["label"] == "given"
    assert report["predicted"]["prefill_ms"] == report["layouts"]["pipeline"]["prefill_ms"] > 0
    tensor = report["layouts"]["tensor"]  # each host's plan on its slice: priced beside the pipeline
    assert tensor["prefill_ms"] == pytest.approx(tensor["compute_ms"] + tensor["all_sum_ms"])
    assert report["layout"] == min(report["layouts"], key=lambda k: report["layouts"][k]["prefill_ms"])
    for k, s in enumerate(report["stages"]):
        assert load_plan(s["plan"]).meta["pipeline"] == {"stage": k, "of": 2, "layers": s["layers"],
                                                         "rank": 1 - k, "host": f"mac{k}"}
    pipe = out.with_suffix(".pipeline.json")
    split, plans = read_pipeline(pipe)
    assert rank_split(split) == [n - n // 2, n // 2]
    assert plans == {1: report["stages"][0]["plan"], 0: report["stages"][1]["plan"]}


def test_search_across_macs_refuses_a_profile_without_a_link(workdir, tmp_path, capsys):
    from autotune.cli import main

    out = tmp_path / "plan.json"
    assert main(_macs_args(workdir, out, "--macs", "2")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "has no link figure between Macs" in err[-1]
    assert not out.exists() and not out.with_suffix(".stage0.json").exists()  # refused before the search


def test_search_across_macs_refuses_macs_too_small_before_searching(workdir, tmp_path, capsys):
    from autotune.cli import main

    out = tmp_path / "plan.json"
    assert main(_macs_args(workdir, out, "--macs", "2", "--link-gb-s", "10", "--mac-memory-gb", "1")) == 2
    assert "no split of" in capsys.readouterr().err.strip().splitlines()[-1] and not out.exists()


def test_an_mlx_hostfile_names_the_macs(tmp_path):
    from autotune.searching.pipeline_search import read_hosts

    f = tmp_path / "hosts.json"
    f.write_text(json.dumps([{"ssh": "m1", "ips": ["10.0.0.1"], "memory_gb": 96},
                             {"ssh": "m2", "ips": ["10.0.0.2"], "profile": "apple-m2-ultra-published"}]))
    hosts = read_hosts(f, "p", 192.0)
    assert [(h.name, h.profile, h.memory_gb) for h in hosts] == [("m1", "p", 96.0),
                                                                 ("m2", "apple-m2-ultra-published", 192.0)]
    f.write_text("[{}]")
    with pytest.raises(NpumoeError, match="cannot read the hosts"):
        read_hosts(f, None, 192.0)


def test_tensor_parallel_is_priced_with_two_all_sums_per_layer_per_chunk(published):
    from autotune.searching.pipeline_report import mlx_gpu_sharded, sharded_shape

    half = sharded_shape(QWEN235, 2)
    assert (half.heads, half.kv_heads, half.expert_ffn, half.hidden) == (32, 2, 768, 4096)
    shape = DecoderShape.from_config({**TWINS["qwen3-235b-a22b"], "num_hidden_layers": 2})
    traces = synthetic_traces(dict(num_experts=128, top_k=8, moe_layers=[0, 1]), 5, 512, tokens=True)
    layers = LayerData.from_traces(traces, 256, 512)
    mac = Mac("m", published.cost_model, 192e9)
    out = mlx_gpu_sharded(mac, 2, shape, layers, 512, LinkFigure("tb5", 10.0))
    # 2 chunks x 2 layers x 2 all_sums; a ring all-reduce on 2 Macs sends each 2(2-1)/2 = all of its 256 x 4096 x 2
    # bytes (half in the reduce-scatter, half in the all-gather): 2,097,152 bytes at 10 GB/s, 0.2097152 ms
    assert out["all_sum_ms"] == pytest.approx(8 * 0.2097152)
    assert out["predicted_prefill_ms"] == pytest.approx(out["compute_ms"] + out["all_sum_ms"])
