"""The prefill priced as a schedule (`autotune.costing.schedule`): a hand-made two-layer, two-chunk case with each
unit's queue worked out by hand; the schedule of a real shape against the chain it replaces; a run's recorded lane
intervals as steps."""
from __future__ import annotations

import dataclasses

import pytest

from autotune.costing.schedule import (
    CORE_STEP,
    JOIN_STEP,
    KV_STEP,
    Step,
    predict_scheduled,
    schedule,
    steps_from_events,
)
from autotune.costing.whole_prefill import (
    DecoderShape,
    DensePlacement,
    ExpertFigures,
    layer_links,
    pieces,
    placement_of,
    predict_prefill,
)
from autotune.profiling.profile import load_profile
from autotune.searching.dense_choice import ROW_GRAIN, dense_plan, dense_weight_bytes
from autotune.searching.overlap_choice import (
    Candidate,
    choose_overlapped,
    cpu_backends,
    static_rows_grid,
    window_over,
    window_trade,
    with_steps,
)
from runtime.plan import DensePlan


def _chunk() -> list[Step]:
    """Per layer: q/k/v on the GPU (1 ms), the attention core on the GPU (2 ms), the experts: the ANE's groups (3 ms)
    beside the GPU's exact path (1 ms)."""
    return [s for layer in range(2) for s in (Step.of(KV_STEP, layer, {"gpu": 1.0}),
                                              Step.of(CORE_STEP, layer, {"gpu": 2.0}),
                                              Step.of("experts", layer, {"ane": 3.0, "gpu": 1.0}))]


def _queue(sched, unit: str) -> list[tuple[int, int, str, float, float]]:
    return sorted(((o.chunk, o.layer, o.name, o.start_ms, o.end_ms) for o in sched.ops if o.unit == unit),
                  key=lambda o: o[3])


def test_two_layers_two_chunks_one_in_flight_is_the_chain():
    s = schedule([_chunk(), _chunk()], in_flight=1)
    assert s.makespan_ms == 2 * 2 * (1 + 2 + 3)  # every step waits for the one before, the ANE's 3 ms the longer
    assert s.busy_ms == {"gpu": 16.0, "ane": 12.0}
    assert s.idle_ms == {"gpu": 8.0, "ane": 12.0}


def test_two_layers_two_chunks_two_in_flight_by_hand():
    """Chunk 1 takes the GPU while chunk 0's experts run on the ANE; the older chunk wins a tie; chunk 1's core of
    layer l starts after chunk 0's q/k/v of layer l."""
    s = schedule([_chunk(), _chunk()], in_flight=2)
    assert _queue(s, "gpu") == [
        (0, 0, KV_STEP, 0, 1), (0, 0, CORE_STEP, 1, 3), (0, 0, "experts", 3, 4),
        (1, 0, KV_STEP, 4, 5), (1, 0, CORE_STEP, 5, 7),
        (0, 1, KV_STEP, 7, 8), (1, 0, "experts", 8, 9), (0, 1, CORE_STEP, 9, 11), (0, 1, "experts", 11, 12),
        (1, 1, KV_STEP, 12, 13), (1, 1, CORE_STEP, 13, 15), (1, 1, "experts", 15, 16)]
    assert _queue(s, "ane") == [(0, 0, "experts", 3, 6), (1, 0, "experts", 7, 10), (0, 1, "experts", 11, 14),
                                (1, 1, "experts", 15, 18)]
    assert s.makespan_ms == 18.0
    assert s.to_json()["units"] == {  # per op as the priced bound tags them: the core is `attention`
        "ane": {"busy_ms": 12.0, "idle_ms": 6.0, "by_op": {"experts": 12.0}},
        "gpu": {"busy_ms": 16.0, "idle_ms": 2.0, "by_op": {"attention": 8.0, "experts": 4.0, "qkv": 4.0}}}


def test_a_third_chunk_waits_for_the_first():
    s = schedule([_chunk(), _chunk(), _chunk()], in_flight=2)
    first_end = max(o.end_ms for o in s.ops if o.chunk == 0)
    assert min(o.start_ms for o in s.ops if o.chunk == 2) >= first_end


@pytest.fixture(scope="module")
def m2():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_shape_twin import TWINS

    return load_profile("apple-m2-ultra-published").cost_model, DecoderShape.from_config(TWINS["qwen3-30b-a3b"])


def test_one_in_flight_prices_the_chain_and_two_the_busier_unit(m2):
    """The experts' steps as the chain composes them (packing, then the ANE beside the GPU): one chunk in flight
    is `predict_prefill`'s sum; two end no later, no earlier than the busier unit, with the same work."""
    cost, shape = m2
    experts = ExpertFigures(10.0 + 400.0, 10.0, None, ({"cpu": 10.0}, {"ane": 300.0, "mlx-exact": 400.0}))
    place = DensePlacement(qkv="ane", host="mlx-exact").with_rows("qkv", 512)
    chain = predict_prefill(cost, shape, 4096, 1024, experts, place)
    one, s1 = predict_scheduled(cost, shape, 4096, 1024, experts, place, in_flight=1)
    two, s2 = predict_scheduled(cost, shape, 4096, 1024, experts, place, in_flight=2)
    assert one.latency_ms == pytest.approx(chain.latency_ms, rel=1e-9)
    assert s2.busy_ms == pytest.approx(s1.busy_ms, rel=1e-9)
    assert max(s2.busy_ms.values()) <= two.latency_ms < one.latency_ms
    assert two.energy_mj == one.energy_mj and two.cpu_ms == one.cpu_ms
    assert two.to_json()["predicted_schedule"]["units"]["ane"]["idle_ms"] == pytest.approx(
        two.latency_ms - s2.busy_ms["ane"])


def test_each_layers_experts_step_is_its_own_busiest_unit(m2):
    """Layers whose experts lean on different units (even layers the ANE 6 ms and the GPU 2, odd ones the other way,
    0.2 ms of packing each): one chunk in flight takes each layer's longer side, the chain's sum, not the mean layer's
    (4 ms a side, 48 x 2 ms less); the units' work is the layers' own either way."""
    cost, shape = m2
    per_layer = [({"cpu": 0.2}, {"ane": 6.0, "mlx-exact": 2.0} if i % 2 == 0 else {"ane": 2.0, "mlx-exact": 6.0})
                 for i in range(len(shape.moe_layers))]
    experts = with_steps(ExpertFigures(len(per_layer) * 6.2, len(per_layer) * 0.2, None), per_layer)
    assert experts.steps == ({"cpu": pytest.approx(9.6)}, {"ane": 192.0, "mlx-exact": 192.0})
    place = DensePlacement(host="mlx-exact")
    chain = predict_prefill(cost, shape, 1024, 1024, experts, place)
    one, s1 = predict_scheduled(cost, shape, 1024, 1024, experts, place, in_flight=1)
    assert one.latency_ms == pytest.approx(chain.latency_ms, rel=1e-9)
    mean, s0 = predict_scheduled(cost, shape, 1024, 1024, dataclasses.replace(experts, by_layer=()), place, 1)
    assert one.latency_ms - mean.latency_ms == pytest.approx(len(per_layer) * 2.0, rel=1e-6)
    assert s1.busy_ms == pytest.approx(s0.busy_ms, rel=1e-9)
    ane = {o.layer: o.end_ms - o.start_ms for o in s1.ops if o.unit == "ane"}
    assert ane[shape.moe_layers[0]] == pytest.approx(6.0) and ane[shape.moe_layers[1]] == pytest.approx(2.0)


def test_keys_and_values_cross_chunks_in_order(m2):
    cost, shape = m2
    _, s = predict_scheduled(cost, shape, 2048, 512, ExpertFigures(100.0, 0.0, None), DensePlacement(host="mlx-exact"))
    made = {(o.chunk, o.layer): o.end_ms for o in s.ops if o.name == KV_STEP}
    for o in s.ops:
        if o.name == CORE_STEP and o.chunk:
            assert o.start_ms >= made[o.chunk - 1, o.layer]


def test_recorded_lane_intervals_as_steps():
    """A host hold that wrote layer 0's keys and values is that layer's attention; the time off the host lane is the
    static lane's, beside the exact path's hold for that chunk."""
    events = [("host", 0, 0.0, 2.0, -1), ("kv", 0, 1.5, 1.5, 0), ("off", 0, 2.0, 5.0, -1),
              ("static", 0, 2.1, 4.0, -1), ("exact", 0, 2.0, 3.0, -1), ("host", 0, 5.0, 6.0, -1)]
    (steps,) = steps_from_events(events)
    assert steps == [Step.of(CORE_STEP, 0, {"host": 2.0}), Step.of(KV_STEP, 0, {}),
                     Step.of("static", -1, {"static": 2.0, "host": 1.0}), Step.of("host", -1, {"host": 1.0})]
    assert schedule([steps], 1).makespan_ms == pytest.approx(2.0 + 2.0 + 1.0)


def test_the_cpu_as_a_third_unit_by_hand(m2):
    """o_proj's first 256 rows of each full chunk on the CPU (cpu-static): the CPU's queue gains each layer's
    256-row matmul at its price, the GPU's loses its share of the chunk's, the energy is each unit's busy ms at its
    own power; the choice offers the CPU where the profile prices it (not when the static backend is the CPU)."""
    cost, shape = m2
    experts = ExpertFigures(410.0, 10.0, 300 * 1.58 + 400 * 62.05, ({"cpu": 10.0}, {"ane": 300.0, "mlx-exact": 400.0}))
    host = DensePlacement(host="mlx-exact")
    place = DensePlacement(o_proj="cpu-static", host="mlx-exact").with_rows("o_proj", 256)
    base, s0 = predict_scheduled(cost, shape, 4096, 2048, experts, host)
    got, s1 = predict_scheduled(cost, shape, 4096, 2048, experts, place)
    n, h, q = shape.num_layers * 2, shape.hidden, shape.heads * shape.head_dim
    cpu = n * float(cost.matmul_ms("cpu-static", 256, h, q))
    gpu = n * float(cost.matmul_ms("mlx-exact", 2048, h, q) - cost.matmul_ms("mlx-exact", 2048 - 256, h, q))
    assert s1.busy_ms["cpu"] - s0.busy_ms["cpu"] == pytest.approx(cpu, rel=1e-9)
    assert s0.busy_ms["mlx-exact"] - s1.busy_ms["mlx-exact"] == pytest.approx(gpu, rel=1e-9)
    watts = {b: cost.power_w(b) for b in ("cpu-static", "mlx-exact")}
    assert got.energy_mj - base.energy_mj == pytest.approx(cpu * watts["cpu-static"] - gpu * watts["mlx-exact"],
                                                           rel=1e-9)
    assert cpu_backends(cost, "ane") == ("cpu-static",) and cpu_backends(cost, "cpu-static") == ()


def _halves() -> list[list[Step]]:
    """One chunk as two halves, two layers: each half's q/k/v on the ANE (1 ms), its attention core on the GPU (the
    first half's 2 ms, the second's 3: more keys); the chunk's experts once, in the second half's chain (the ANE
    and the GPU 2 ms each), the first half joining them before its next layer."""
    first = [s for layer in range(2) for s in (Step.of(KV_STEP, layer, {"ane": 1.0}),
                                               Step.of(CORE_STEP, layer, {"gpu": 2.0}),
                                               Step.of(JOIN_STEP, layer, {}, after=((1, "experts", layer),)))]
    second = [s for layer in range(2) for s in (Step.of(KV_STEP, layer, {"ane": 1.0}),
                                                Step.of(CORE_STEP, layer, {"gpu": 3.0}),
                                                Step.of("experts", layer, {"ane": 2.0, "gpu": 2.0}))]
    return [first, second]


def test_half_chunks_by_hand():
    """The second half's q/k/v runs on the ANE while the first half's core runs on the GPU; the second half's core
    starts after the first's keys and values; the first half's next layer waits for the chunk's experts."""
    s = schedule(_halves(), in_flight=2)
    assert _queue(s, "ane") == [(0, 0, KV_STEP, 0, 1), (1, 0, KV_STEP, 1, 2), (1, 0, "experts", 6, 8),
                                (0, 1, KV_STEP, 8, 9), (1, 1, KV_STEP, 9, 10), (1, 1, "experts", 14, 16)]
    assert _queue(s, "gpu") == [(0, 0, CORE_STEP, 1, 3), (1, 0, CORE_STEP, 3, 6), (1, 0, "experts", 6, 8),
                                (0, 1, CORE_STEP, 9, 11), (1, 1, CORE_STEP, 11, 14), (1, 1, "experts", 14, 16)]
    assert s.makespan_ms == 16.0 and s.busy_ms == {"ane": 8.0, "gpu": 14.0}


def test_half_chunks_on_a_real_shape(m2):
    """A 4,096-token chunk as two halves of 2,048 (contexts 2,048 and 4,096): each half's q/k/v on the ANE at its
    own price (half the chunk's static rows where split), the experts once per layer over the chunk, the work
    (energy) the halves' chain's, and the schedule at least the busier unit; labelled as not run by the runtime."""
    cost, shape = m2
    experts = ExpertFigures(410.0, 10.0, 300 * 1.58 + 400 * 62.05, ({"cpu": 10.0}, {"ane": 300.0, "mlx-exact": 400.0}))
    place = DensePlacement(qkv="ane", host="mlx-exact").with_rows("qkv", 1024)
    pred, s = predict_scheduled(cost, shape, 4096, 4096, experts, place, halves=True)
    chain = predict_prefill(cost, shape, 4096, 4096, experts, place, halves=True)
    n, h = shape.num_layers, shape.hidden
    qkv = float(cost.matmul_ms("ane", 512, shape.qkv_width, h)) + cost.call_ms("ane")
    assert s.busy_ms["ane"] == pytest.approx(2 * n * qkv + 300.0, rel=1e-9)
    assert sum(1 for o in s.ops if o.name == "experts" and o.unit == "ane") == len(shape.moe_layers)
    assert {o.chunk for o in s.ops if o.name == "experts"} == {1}
    assert pred.energy_mj == chain.energy_mj and pred.cpu_ms == chain.cpu_ms
    assert max(s.busy_ms.values()) <= pred.latency_ms <= chain.latency_ms + 1e-9
    assert pred.schedule["shape"] == "half-chunks" and pred.schedule["runtime_executes"] is False
    assert pred.schedule["in_flight"] == 2  # chunks in flight, each as two halves
    assert pieces(4096, 4096, halves=True) == [(2048, 2048, True, 0), (2048, 4096, True, 4096)]
    assert pieces(4097, 4096, halves=True)[-1] == (1, 4097, False, 1)  # a one-row chunk is not halved


def test_the_window_trade_takes_the_first_candidate_with_room_for_the_projections(m2):
    """Qwen3-30B-A3B's q/k/v and o_proj hold 48 x 2,048 x (5,120 + 4,096) fp16 weights, 1.81 GB: beside them the ANE's
    4 GiB window leaves 2.48 GB for resident experts, so of candidates ranked 3.0, 2.6, 2.4 and 1.0 GB the trade
    takes the 2.4 GB one; none where every candidate holds more."""
    _, shape = m2
    experts = ExpertFigures(1.0, 0.0, None)
    ranked = [Candidate(4096, experts, DensePlacement(host="mlx-exact"), resident_bytes=gb * 1e9)
              for gb in (3.0, 2.6, 2.4, 1.0)]
    room = 4 * 2**30 - 48 * 2048 * (5120 + 4096) * 2
    assert room == pytest.approx(2.4832e9, rel=1e-4)
    assert window_trade(ranked, shape, "ane") == [ranked[2]]
    assert window_trade(ranked[:2], shape, "ane") == []


def _scaled(s: float) -> list[Step]:
    """`_chunk` for a chunk of `s` times its rows: every step's ms scaled."""
    return [Step.of(st.name, st.layer, {u: ms * s for u, ms in st.units}) for st in _chunk()]


def test_an_uneven_two_chunk_case_by_hand():
    """A long first chunk (1.5x) and a short last one (0.5x): chunk 1's layer 0 runs on the GPU while chunk 0's
    experts hold the ANE, its experts then wait for the ANE; the same work as two equal chunks, 19.5 ms."""
    s = schedule([_scaled(1.5), _scaled(0.5)], in_flight=2)
    assert _queue(s, "gpu") == [
        (0, 0, KV_STEP, 0, 1.5), (0, 0, CORE_STEP, 1.5, 4.5), (0, 0, "experts", 4.5, 6.0),
        (1, 0, KV_STEP, 6.0, 6.5), (1, 0, CORE_STEP, 6.5, 7.5), (1, 0, "experts", 7.5, 8.0),
        (0, 1, KV_STEP, 9.0, 10.5), (0, 1, CORE_STEP, 10.5, 13.5), (0, 1, "experts", 13.5, 15.0),
        (1, 1, KV_STEP, 15.0, 15.5), (1, 1, CORE_STEP, 15.5, 16.5), (1, 1, "experts", 16.5, 17.0)]
    assert _queue(s, "ane") == [(0, 0, "experts", 4.5, 9.0), (1, 0, "experts", 9.0, 10.5),
                                (0, 1, "experts", 13.5, 18.0), (1, 1, "experts", 18.0, 19.5)]
    assert s.makespan_ms == 19.5 and s.busy_ms == {"gpu": 16.0, "ane": 12.0}


def test_an_uneven_chunking_on_a_real_shape(m2):
    """4,096 tokens as 2,560 + 1,536 at chunk_tokens 2,560: q/k/v's static side takes its 1,024 rows of each chunk,
    o_proj's unsplit function its 2,560-row shape on both (the short chunk's rows padded, as `RowFunction` runs
    it); the experts' steps shared by rows; the work the chain's."""
    cost, shape = m2
    experts = ExpertFigures(410.0, 10.0, 300 * 1.58 + 400 * 62.05, ({"cpu": 10.0}, {"ane": 300.0, "mlx-exact": 400.0}))
    place = DensePlacement(qkv="ane", o_proj="ane", host="mlx-exact").with_rows("qkv", 1024)
    pred, s = predict_scheduled(cost, shape, 4096, 2560, experts, place, chunk_rows=(2560, 1536))
    chain = predict_prefill(cost, shape, 4096, 2560, experts, place, chunk_rows=(2560, 1536))
    n, h, q, call = shape.num_layers, shape.hidden, shape.heads * shape.head_dim, cost.call_ms("ane")
    qkv = float(cost.matmul_ms("ane", 1024, shape.qkv_width, h)) + call
    o_proj = float(cost.matmul_ms("ane", 2560, h, q)) + call
    assert s.busy_ms["ane"] == pytest.approx(2 * n * (qkv + o_proj) + 300.0, rel=1e-9)
    ane = [sum(o.end_ms - o.start_ms for o in s.ops if o.chunk == c and o.name == "experts" and o.unit == "ane")
           for c in (0, 1)]
    assert ane == pytest.approx([300.0 * 2560 / 4096, 300.0 * 1536 / 4096], rel=1e-9)
    assert pred.energy_mj == chain.energy_mj and max(s.busy_ms.values()) <= pred.latency_ms <= chain.latency_ms
    assert pred.to_json()["chunk_rows"] == [2560, 1536]
    assert pieces(4096, 2560, rows=(1536, 2560)) == [(1536, 1536, True, 1536), (2560, 4096, True, 2560)]
    assert pieces(5000, 2560, rows=(1536,)) == [(1536, 1536, True, 1536), (2560, 4096, True, 2560),
                                                (904, 5000, False, 904)]


def test_the_finer_row_grid_is_never_worse_than_the_coarse_one(m2):
    """The dense placement chosen under the schedule for a two-layer shape, one 4,096-token chunk: refined by
    ROW_GRAIN around the grid's picks (steps of 256 here), it ends no later than the grid's own, here sooner with
    rows off the grid (each step's ANE and GPU parts closer to finishing together), still multiples of ROW_GRAIN."""
    cost, _ = m2
    shape = DecoderShape(hidden=2048, heads=32, kv_heads=4, head_dim=128, vocab=32000, num_layers=2,
                         moe_layers=(0, 1), num_experts=64, top_k=4, expert_ffn=768)
    experts = ExpertFigures(29.0, 1.0, 12 * 1.58 + 16 * 62.05, ({"cpu": 1.0}, {"ane": 12.0, "mlx-exact": 16.0}))
    cand = Candidate(4096, experts, DensePlacement(host="mlx-exact"))
    backends = ("ane", *cpu_backends(cost, "ane"))
    coarse = choose_overlapped(cost, backends, shape, 4096, cand, grain=0)
    fine = choose_overlapped(cost, backends, shape, 4096, cand)
    assert fine.prediction.latency_ms < coarse.prediction.latency_ms
    again, _ = predict_scheduled(cost, shape, 4096, 4096, experts, fine.placement)
    assert fine.prediction.latency_ms == again.latency_ms
    assert all(r % ROW_GRAIN == 0 for _, r in fine.placement.rows)
    assert any(r % static_rows_grid(4096)[1] for _, r in fine.placement.rows)


def test_compressed_dense_weights_take_less_of_the_window_and_stream_fewer_bytes(m2):
    """Qwen3-30B-A3B's q/k/v and o_proj on the ANE: 1.81 GB of fp16 weights, half as int8, a quarter as 4-bit
    palettes (`ane_limits.BYTES_PER_WEIGHT`); the CPU's reference backend computes with the model's own weights
    whatever the placement's `compress`. A compressed function is priced at its stored bytes per call (the profile
    has no decompression cost for the ANE: only the bytes term changes), plus the profile's decompression rate
    where it has one."""
    cost, shape = m2
    fp16 = 48 * 2048 * (5120 + 4096) * 2
    both = DensePlacement(qkv="ane", o_proj="ane", host="mlx-exact")
    for compress, share in (("none", 1.0), ("int8", 0.5), ("palettize4", 0.25)):
        assert dense_weight_bytes(shape, dataclasses.replace(both, compress=compress), "ane") == fp16 * share
    on_cpu = DensePlacement(qkv="cpu-static", o_proj="ane", host="mlx-exact", compress="int8")
    assert on_cpu.stored("qkv") == "none" and on_cpu.stored("o_proj") == "int8"
    assert dense_weight_bytes(shape, on_cpu) == 48 * 2048 * (5120 * 2 + 4096 * 1)

    m, n, k = 4096, shape.qkv_width, shape.hidden
    fp16_ms, int8_ms = float(cost.matmul_ms("ane", m, n, k)), float(cost.stored_matmul_ms("ane", m, n, k, "int8"))
    ane = cost.backend_model("ane")
    assert fp16_ms - int8_ms == pytest.approx(ane.ms_per_mb * n * k * (2 - 1) / 1e6, rel=1e-9)
    links = {c: layer_links(cost, shape, 0, m, m, True, dataclasses.replace(both, compress=c))
             for c in ("none", "int8")}
    qkv = {c: links[c]["attention_projections"][0].latency_ms for c in links}
    assert qkv["none"] - qkv["int8"] == pytest.approx(fp16_ms - int8_ms, rel=1e-9)
    rated = dataclasses.replace(cost, models={**cost.models, "ane": dataclasses.replace(
        ane, decompress_ms_per_mb={"int8": 0.01})}, _lut={})
    assert float(rated.stored_matmul_ms("ane", m, n, k, "int8")) == pytest.approx(int8_ms + 0.01 * n * k / 1e6)


def test_the_schedule_compresses_dense_weights_only_where_the_window_asks(m2):
    """3.5 GB of resident experts leave 0.79 GB of the ANE's 4 GiB window: neither q/k/v (1.01 GB) nor o_proj
    (0.81 GB) fits as fp16, so with fp16 alone neither runs there; allowed int8 and 4-bit palettes, the choice puts
    projections on the ANE stored at the least compression that fits (one step less would not) and ends sooner. The
    plan it writes names the storage on the ANE's functions, and reading the plan back gives the same placement."""
    cost, shape = m2
    experts = ExpertFigures(410.0, 10.0, 300 * 1.58 + 400 * 62.05, ({"cpu": 10.0}, {"ane": 300.0, "mlx-exact": 400.0}))
    backends = ("ane", *cpu_backends(cost, "ane"))
    fp16 = Candidate(4096, experts, DensePlacement(host="mlx-exact"), resident_bytes=3.5e9)
    any_store = dataclasses.replace(fp16, stores=("none", "int8", "palettize4"))
    plain, packed = (choose_overlapped(cost, backends, shape, 4096, c) for c in (fp16, any_store))
    assert "ane" not in (plain.placement.qkv, plain.placement.o_proj) and plain.placement.compress == "none"
    place = packed.placement
    assert "ane" in (place.qkv, place.o_proj) and place.compress in ("int8", "palettize4")
    assert window_over(shape, place, 3.5e9, "ane") <= 0
    less = any_store.stores[any_store.stores.index(place.compress) - 1]
    assert window_over(shape, dataclasses.replace(place, compress=less), 3.5e9, "ane") > 0
    assert packed.prediction.latency_ms < plain.prediction.latency_ms
    written = DensePlan.model_validate(dense_plan(place, shape))
    stored = {(fn.backend, fn.compress) for dl in written.layers for f in ("qkv", "o_proj")
              if (fn := getattr(dl, f)) is not None}
    assert {c for b, c in stored if b == "ane"} == {place.compress}
    assert {c for b, c in stored if b != "ane"} <= {None}
    back = placement_of(written)
    assert dataclasses.replace(back, rows=tuple(sorted(back.rows))) == dataclasses.replace(
        place, rows=tuple(sorted(place.rows)))
