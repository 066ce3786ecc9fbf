"""Two chunks in flight on the MLX spine (`runtime.mlx.overlap`): tiny-moe converted by mlx-lm to 4 bits, float32 on
MLX's CPU device, a plan whose first experts are in static groups on cpu-static (torch: the static lane) and whose
other experts and dense half run on mlx-exact (MLX: the host lane). The same logits and greedy text as one chunk at
a time, the same accounting, each lane's busy and wait time in `executed`."""
from __future__ import annotations

import copy
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from helpers import ROOT, convert_to_mlx, one_line_exit_2  # noqa: E402

from autotune.searching.templates import template_plan  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.loading.model_record import read_model_spec  # noqa: E402
from runtime.mlx.overlap import KvOrder, Lanes, run_in_flight  # noqa: E402
from runtime.mlx.spine_generation import last_logits, prefill_forwards  # noqa: E402
from runtime.plan import DenseFunction, DenseLayer, DensePlan, Group, LayerPlan  # noqa: E402

PROMPT = "Two chunks in flight: the static lane and the host lane never wait for each other. " * 8
CHUNK, TOKENS, GROUPED = 32, 128, 8


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert_to_mlx(tmp_path_factory.mktemp("overlap") / "q4g64", 4, 64)


@pytest.fixture(scope="module", params=[(), ("qkv", "o_proj"), ("attention",)],
                ids=["dense-on-mlx", "qkv-o-proj-spliced", "attention-core-spliced"])
def loaded(q4, request):
    """The plan, its dense half on mlx-exact, or with q/k/v and o_proj, or the attention core (a bucket per full
    chunk's context: its call lets the next chunk's attention start), spliced in on cpu-static (static calls too)."""
    return _load(q4, request.param)


def _load(q4: Path, functions: tuple[str, ...], groups: str = "cpu-static", rows: int | None = None,
          dense: str = "cpu-static", compress: str | None = None):
    """The plan: its first experts in static groups on `groups`, the others on mlx-exact; `functions` spliced in on
    `dense` (q/k/v and o_proj: a full chunk's first `rows` rows, mlx-exact the rest; None: every row; their weights
    stored as `compress`)."""
    spec = read_model_spec(str(q4))
    plan = template_plan(spec, chunk_tokens=CHUNK, exact="mlx-exact", backend=groups)
    layers = [LayerPlan(layer=lp.layer, cpu_exact=list(range(GROUPED, spec.num_experts)),
                        groups=[Group(backend=g.backend, experts=[e for e in g.experts if e < GROUPED],
                                      capacities=[c for e, c in zip(g.experts, g.capacities) if e < GROUPED])
                                for g in lp.groups if min(g.experts) < GROUPED])
              for lp in plan.layers]
    fn = DenseFunction(backend=dense, rows=rows, compress=compress)
    core = "attention" in functions
    placed = DensePlan(attention_context_buckets=list(range(CHUNK, TOKENS + 1, CHUNK)) if core else [],
                       layers=[DenseLayer(layer=i, **{f: dense if f == "attention" else fn for f in functions})
                               for i in range(spec.num_layers)]) if functions else None
    return generation.load(str(q4), plan.model_copy(update={"layers": layers, "dense": placed}), engine="mlx",
                           dtype="float32")


def _ids(loaded) -> list[int]:
    ids = loaded.tokenizer.encode(PROMPT, add_special_tokens=False)[:TOKENS]
    assert len(ids) == TOKENS
    return ids


def _one_at_a_time(model, ids: list[int]) -> torch.Tensor:
    cache = model.make_cache()
    for start, done, rows in prefill_forwards(model, len(ids), CHUNK):
        out = model.forward(ids[start:done], cache, rows)
    return last_logits(out).clone()


def test_two_in_flight_gives_the_one_at_a_time_logits_and_accounting(loaded):
    model, spine = loaded.model, loaded.executor
    ids = _ids(loaded)
    spine.reset()
    ref = _one_at_a_time(model, ids)
    sequential = spine.stats.total()
    part = "attention_core" if loaded.plan.dense and loaded.plan.dense.layers[0].attention else \
        "attention_projections"
    calls = spine.executed().to_json()[part].get("cpu-static", {}).get("calls")
    spine.reset()
    pieces = [(ids[s:d], rows) for s, d, rows in prefill_forwards(model, len(ids), CHUNK)]
    assert len(pieces) == TOKENS // CHUNK
    lanes = Lanes(record=True)
    got = last_logits(model.forward_in_flight(pieces, model.make_cache(), 2, lanes)).clone()
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-6
    overlapped = spine.stats.total()
    for key in ("tokens_per_backend", "calls_per_backend"):
        assert getattr(overlapped, key) == getattr(sequential, key) and getattr(sequential, key), key
    assert sequential.tokens_per_backend["cpu-static"] > 0 and sequential.tokens_per_backend["mlx-exact"] > 0
    if loaded.plan.dense:  # the spliced functions ran their static calls, in flight as one at a time
        assert spine.executed().to_json()[part]["cpu-static"]["calls"] == calls
        assert calls >= len(pieces) * len(loaded.plan.dense.layers)
    lanes_ms = spine.executed().to_json()["lanes"]
    assert set(lanes_ms) == {"host", "static"}
    assert all(f["busy_ms"] > 0 and f["wait_ms"] >= 0 for f in lanes_ms.values())
    # each chunk wrote every layer's keys and values, in chunk order
    kv = [(e[4], e[1], e[3]) for e in lanes.events if e[0] == "kv"]
    for layer in {k[0] for k in kv}:
        times = [t for _, _, t in sorted(k for k in kv if k[0] == layer)]
        assert len(times) == TOKENS // CHUNK and times == sorted(times)


def test_the_cpu_beside_the_ane_runs_on_a_lane_of_its_own(q4):
    """Groups on the ANE (here its simulation), q/k/v and o_proj's first half of each chunk's rows on cpu-static (the
    other half on mlx-exact): the CPU's calls have a lane of their own beside the static lane (`Lanes.apart`), both
    busy; the logits are the one-at-a-time run's."""
    loaded = _load(q4, ("qkv", "o_proj"), groups="ane", rows=CHUNK // 2)
    model, spine = loaded.model, loaded.executor
    ids = _ids(loaded)
    ref = _one_at_a_time(model, ids)
    spine.reset()
    pieces = [(ids[s:d], rows) for s, d, rows in prefill_forwards(model, len(ids), CHUNK)]
    got = last_logits(model.forward_in_flight(pieces, model.make_cache(), 2, Lanes())).clone()
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-6
    lanes_ms = spine.executed().to_json()["lanes"]
    assert set(lanes_ms) == {"host", "static", "cpu-static"}
    assert all(f["busy_ms"] > 0 for f in lanes_ms.values())


def test_projections_stored_compressed_on_the_ane_run_in_flight_as_one_at_a_time(q4):
    """q/k/v and o_proj on the ANE (its simulation: the weights coremltools' int8 pass stores) as the search writes
    them where the window asks: two in flight give the one-at-a-time logits; the storage is applied (not the fp16
    functions' logits) and close to them (int8 per output channel)."""
    packed = _load(q4, ("qkv", "o_proj"), groups="ane", dense="ane", compress="int8")
    ids = _ids(packed)
    ref = _one_at_a_time(packed.model, ids)
    pieces = [(ids[s:d], rows) for s, d, rows in prefill_forwards(packed.model, len(ids), CHUNK)]
    got = last_logits(packed.model.forward_in_flight(pieces, packed.model.make_cache(), 2, Lanes())).clone()
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-6
    assert packed.plan.dense.layers[0].qkv.compression == "int8"
    plain = _load(q4, ("qkv", "o_proj"), groups="ane", dense="ane")
    fp16 = _one_at_a_time(plain.model, ids)
    assert 0 < float((ref - fp16).abs().max() / fp16.abs().max()) <= 0.05


def test_greedy_text_of_generate_is_the_same_in_flight(loaded, q4):
    """Two in flight set on the model, or by the plan's `in_flight` (what `runtime.load` reads: `search --in-flight
    2` writes it): the greedy text of one chunk at a time."""
    ids = _ids(loaded)
    texts = {}
    for n in (1, 2):
        loaded.model.in_flight = n
        texts[n] = generation.generate(loaded, ids, max_tokens=8).text
    loaded.model.in_flight = 1
    planned = generation.load(str(q4), loaded.plan.model_copy(update={"in_flight": 2}), engine="mlx", dtype="float32")
    assert planned.model.in_flight == 2 and loaded.model.in_flight == 1
    planned.executor.reset()
    texts["plan"] = generation.generate(planned, ids, max_tokens=8).text
    assert set(planned.executor.executed().to_json()["lanes"]) >= {"host", "static"}  # it ran in flight
    assert texts[1] == texts[2] == texts["plan"] and texts[1]


def test_a_failing_chunk_ends_the_prefill_with_its_error():
    """A chunk's forward that raises (MLX's CPU device refusing an op, say) ends the prefill with its error: the
    next chunk, waiting for its keys and values, gives up rather than waiting forever."""
    lanes = Lanes()
    order = KvOrder(lanes)

    def first():
        raise ValueError("the first chunk's error")

    def second():
        order.wait(0, 1)  # layer 0's keys and values of chunk 0: never written
        return "unreachable"

    got = []

    def prefill():
        try:
            run_in_flight([first, second], lanes)
        except Exception as e:  # noqa: BLE001 - the test reads which
            got.append(e)

    thread = threading.Thread(target=prefill, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and len(got) == 1 and str(got[0]) == "the first chunk's error"


def test_in_flight_without_a_plan_on_the_mlx_spine_is_refused_in_one_line(capsys):
    line = one_line_exit_2(["generate", "--model", "tiny-moe", "--prompt", "hello", "--engine", "torch",
                            "--in-flight", "2", "--max-tokens", "1"], capsys)
    assert "--in-flight 2" in line and "--engine mlx" in line


def _bench_spine():
    spec = importlib.util.spec_from_file_location("bench_spine", ROOT / "scripts" / "bench_spine.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_spine_measures_each_placement_in_flight_and_one_at_a_time(q4, tmp_path, capsys):
    """`bench_spine.py --overlap --placement balanced,schedule` on a host profile (the checked-in Xeon's, MLX priced
    20x its CPU): both placements side by side, each the same logits and greedy text in flight as one at a time,
    the balanced one's groups sized; a placement it does not know, or one without a profile, refused in one line."""
    profile = json.loads((ROOT / "profiles" / "linux-xeon-2c-quick.json").read_text())
    mlx = copy.deepcopy(profile["cost_model"]["backends"]["cpu-exact"])
    mlx.update(ms_per_gflop=mlx["ms_per_gflop"] * 20, ms_per_mb=mlx["ms_per_mb"] * 20)
    profile["cost_model"]["backends"]["mlx-exact"] = mlx
    (tmp_path / "host.json").write_text(json.dumps(profile))
    bench = _bench_spine()
    args = ["--overlap", "--json", "--threads", "1", "--model", str(q4), "--prompt-tokens", str(TOKENS), "--chunk",
            str(CHUNK), "--decode-tokens", "4", "--profile", str(tmp_path / "host.json")]
    assert bench.main([*args, "--placement", "balanced,schedule"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == "balanced" and list(out["placements"]) == ["balanced", "schedule"]
    assert out["overlap_speedup"] == out["placements"]["balanced"]["overlap_speedup"] > 0
    for name, side in out["placements"].items():
        assert side["chosen"]["placement"] == name and side["overlap_max_rel_diff"] <= 1e-6
        assert side["greedy_text_equal"] and side["overlap_predicted_speedup"] > 0
        assert side["lanes_ms"]["two_in_flight"]["static"]["busy_ms"] > 0
    assert out["placements"]["schedule"]["chosen"]["grouped_experts"] == 16
    assert 1 <= out["chosen"]["grouped_experts"] <= 16
    assert out["two_in_flight_ms_over"]["balanced"] == 1.0
    for bad in (["--placement", "fastest"], ["--placement", "balanced", "--profile", ""]):
        capsys.readouterr()
        assert bench.main([*args, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--placement" in err[0]
