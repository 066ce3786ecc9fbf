"""Predicted memory of a plan (autotune/costing/memory.py): each part from the model's sizes, compression, budget."""
import dataclasses
import os

import pytest
from helpers import random_model

from autotune.costing.memory import (
    GB,
    RUNTIME_BYTES,
    ModelSize,
    activation_bytes,
    ane_budget_bytes,
    ane_package_bytes,
    dense_function_bytes,
    moe_call_bytes,
    predict_memory,
    stage_memory,
)
from autotune.searching.templates import template_plan
from runtime.cpu.allocator import PRIMITIVE_BYTES
from runtime.errors import NpumoeError
from runtime.loading.model_loader import model_spec

H, F, E, LAYERS = 64, 48, 8, 4  # random:qwen3_moe: 4 layers of 8 experts, hidden 64, expert width 48, fp32


@pytest.fixture(scope="module")
def model():
    return random_model("random:qwen3_moe")[0]


def test_parts_from_the_model_and_the_plan(model):
    size = ModelSize.of(model)
    assert size.weight_bytes == 4 * sum(p.numel() for p in model.parameters()) + 4 * sum(
        b.numel() for b in model.buffers() if b.is_floating_point())
    assert size.kv_bytes_per_token == 2 * LAYERS * 2 * 16 * 4  # K and V, 2 KV heads of 16, fp32
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    m = predict_memory(plan, size, prompt_tokens=100)
    assert m.ane_packages == LAYERS * E * 3 * H * F * 2  # every expert resident once, fp16
    assert m.kv_cache == 100 * size.kv_bytes_per_token and m.runtime == RUNTIME_BYTES
    assert m.cpu_weights == size.weight_bytes  # the CPU keeps every expert: decode runs exactly
    assert m.total == m.cpu_weights + m.ane_packages + m.activations + m.kv_cache + m.runtime
    assert m.to_json()["total_bytes"] == m.total and "predicted" in m.to_json()["label"]
    on_cpu = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32)
    assert predict_memory(on_cpu, size, 100).ane_packages == 0  # cpu-static groups use the torch weights


def test_dense_functions_on_the_ane_count_their_matrices(model):
    """A plan's dense functions on `ane` hold their projections in its package (fp16, or as compressed), and on the
    host's simulator in fp32; the attention core none; cpu-static ones none (the torch weights)."""
    size = ModelSize.of(model)
    attn = model.model.layers[0].self_attn
    qkv, o = (sum(m.weight.numel() for m in ms) for ms in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,)))
    assert size.dense_function_weights == ((qkv, o, 0),) * LAYERS  # random:qwen3_moe: no shared expert
    plan = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32, dense="ane",
                         context_tokens=128)
    assert dense_function_bytes(plan, size) == LAYERS * (qkv + o) * 2
    assert dense_function_bytes(plan, size, simulated=True) == LAYERS * (qkv + o) * 4
    assert predict_memory(plan, size, 100).ane_packages == LAYERS * (qkv + o) * 2
    on_cpu = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32, dense="cpu-static",
                           context_tokens=128)
    assert dense_function_bytes(on_cpu, size) == 0
    # a gate round's candidates side by side on one simulator: both plans' functions
    assert stage_memory(size, "search", 32, 100, gate_candidates=2, plan=[plan, plan]).ane_packages == \
        2 * LAYERS * (qkv + o) * 4


def test_ane_bytes_follow_each_groups_compression(model):
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    fp16 = ane_package_bytes(plan)
    lp = plan.layers[0]
    squeezed = lp.model_copy(update={"groups": [g.model_copy(update={"compress": "palettize4"}) for g in lp.groups]})
    plan = plan.model_copy(update={"layers": [squeezed, *plan.layers[1:]]})
    assert ane_package_bytes(plan) == fp16 - E * 3 * H * F * 2 + E * 3 * H * F // 2  # layer 0 at 4 bits


def test_budget_leaves_the_rest_for_ane_packages_and_refuses_the_impossible(model):
    size = ModelSize.of(model)
    plan = template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32)
    fixed = predict_memory(plan, size, 64)
    assert ane_budget_bytes(fixed.total / GB + 0.5, size, 32, 64) == pytest.approx(0.5 * GB, abs=2e6)
    with pytest.raises(NpumoeError, match="--memory-gb 0.001 is below what any plan needs"):
        ane_budget_bytes(0.001, size, 32, 64)


def test_run_reports_measured_memory_and_cpu_time_next_to_the_prediction(tmp_path, text_file):
    import autotune
    from runtime.plan import save_plan

    model = random_model("random:qwen3_moe")[0]
    save_plan(template_plan(model_spec(model), "ample", backend="cpu-static", chunk_tokens=32), tmp_path / "p.json")
    r = autotune.run_plan("random:qwen3_moe", tmp_path / "p.json", text=text_file, max_tokens=96).to_json()
    assert r["tokens"] == 96 and r["cpu_ms_per_token"] > 0
    assert r["wall_ms_per_token"] == pytest.approx(r["latency_ms"] / 96)
    m = r["memory"]
    assert m["measured_peak_rss_gb"] > 0 and m["predicted"]["prompt_tokens"] == 96
    assert m["predicted_over_measured"] == pytest.approx(m["predicted"]["total_bytes"] / (m["measured_peak_rss_gb"]
                                                                                          * GB), rel=1e-3)
    assert r["plan_predicted"] is None  # a template carries no predictions


def _published(like: str):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_shape_twin import TWINS, twin_config

    return twin_config(like, TWINS[like]["num_hidden_layers"])


def test_cpu_storage_counts_each_kind(model):
    from autotune.costing.memory import cpu_weight_bytes, storage_bytes_per_weight

    size = ModelSize.of(model)
    assert size.expert_weights == LAYERS * E * 3 * H * F and size.expert_bytes == 4 * size.expert_weights
    dense = size.weight_bytes - size.expert_bytes
    assert cpu_weight_bytes(size) == (dense, size.expert_bytes)
    assert cpu_weight_bytes(size, "int8") == (dense, int(size.expert_weights * (1 + 4 / H)))
    assert cpu_weight_bytes(size, "int4", 32) == (dense, int(size.expert_weights * (0.5 + 8 / 32)))
    assert storage_bytes_per_weight("mlx4", 64) == 0.5 + 4 / 64 and storage_bytes_per_weight("mlx6", 32) == 0.875
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    from runtime.plan import CpuWeights, plan_from_json

    plan = plan.model_copy(update={"cpu_weights": CpuWeights(kind="int4", group_size=32)})
    plan = plan_from_json(plan.to_json())
    m = predict_memory(plan, size, 100)
    assert m.cpu_experts == int(size.expert_weights * 0.75) and m.cpu_storage == "int4-g32"
    # one copy: every expert is ANE-resident, and the CPU holds each once, in its int4 storage
    assert m.cpu_copy_of_ane_resident == pytest.approx(m.cpu_experts, rel=1e-9)
    assert m.to_json()["cpu_copy_of_ane_resident_bytes"] == m.cpu_copy_of_ane_resident


@pytest.mark.parametrize("like,gb", [("qwen3-30b-a3b", 20.0), ("phi-3.5-moe", 28.0)])
def test_published_models_from_mlx_4bit_fit_their_goal(like, gb):
    """Every expert on the CPU, packed as the MLX 4-bit (group 64) checkpoint stores it, 4096-token prompts."""
    from autotune.costing.memory import fixed_memory

    config = _published(like)
    full = ModelSize.of_config(config, 2)
    packed = ModelSize.of_config(config, 2, {"bits": 4, "group_size": 64})
    assert packed.expert_bytes == pytest.approx(full.expert_weights * (0.5 + 4 / 64))
    assert fixed_memory(packed, 256, 4096).total / GB <= gb
    assert fixed_memory(full, 256, 4096).total / GB > 60  # bf16: what the issue started from


def test_mlx_folder_predicted_as_loaded(tmp_path):
    """A loaded MLX checkpoint holds what model_size predicts from its config (packed as on disk)."""
    pytest.importorskip("mlx_lm")
    from helpers import convert_to_mlx as convert

    from autotune.costing.memory import model_size
    from runtime.loading.model_loader import load_model
    from runtime.loading.model_record import resolve_model

    folder = convert(tmp_path / "q4", 4, 64)
    loaded = ModelSize.of(load_model(str(folder), "auto")[0])
    predicted = model_size(resolve_model(str(folder)))
    assert predicted.storage == "mlx-4bit-g64" and loaded.storage == "packed"
    assert predicted.weight_bytes == pytest.approx(loaded.weight_bytes, rel=0.03)
    assert predicted.expert_bytes == loaded.expert_bytes


def test_stage_predictions_count_what_each_stage_holds(model, monkeypatch):
    """calibrate runs the decoder stack alone and keeps its traces; the search's gate holds the reference and K
    candidates side by side (a KV cache each), the reference's chunk of logits and one candidate's (however many
    candidates), and 7 x 64 rows of fp32 logits."""
    size = ModelSize.of(model)
    cal = stage_memory(size, "calibrate", 32, 100, tokens=1000)
    traces = 1000 * LAYERS * (2 * 6 + 4)  # per MoE layer and token: top-2 ids (int16) and weights (fp32), a norm
    assert cal.activations == activation_bytes(size, 32, 100, logits_rows=0, chunk_logits=0) + traces
    assert cal.kv_cache == 100 * size.kv_bytes_per_token and cal.ane_packages == 0
    search = stage_memory(size, "search", 32, 100, gate_candidates=4)
    assert search.kv_cache == 5 * cal.kv_cache
    assert search.activations - (cal.activations - traces) == 2 * 32 * size.vocab * 4 + 4 * 7 * 64 * size.vocab
    two = stage_memory(size, "search", 32, 100, gate_candidates=2)
    assert two.activations == search.activations and search.total - two.total == 2 * cal.kv_cache
    assert dict(search.terms)["logits_reference_and_one_candidate"] == 2 * 32 * size.vocab * 4
    assert sum(v for k, v in search.terms if k != "mlx_move_moment") == search.total  # no mlx-exact: no move
    # where torch's matmuls go through oneDNN, its caches of compiled primitives are held full (at the bound, unset)
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    on, off = (stage_memory(dataclasses.replace(size, onednn=o), "search", 32, 100, gate_candidates=4)
               for o in (True, False))
    assert on.total - off.total == dict(on.terms)["onednn_primitive_caches"] == 2 * 128 * PRIMITIVE_BYTES
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=32)
    assert stage_memory(size, "search", 32, 100, plan=plan).ane_packages == LAYERS * E * 3 * H * F * 2
    with pytest.raises(NpumoeError, match="^stage 'run': calibrate or search"):
        stage_memory(size, "run", 32, 100)


@pytest.mark.slow
def test_calibrate_peak_rss_within_its_stage_prediction(tmp_path):
    """tiny-moe's calibrate, in a process of its own: its summary's `memory`, the process's peak RSS beside
    stage_memory's calibrate, agree within 15%."""
    import json
    import os
    import subprocess
    import sys

    from autotune.costing.memory import model_size
    from runtime.loading.model_record import resolve_model

    code = ("import json, autotune.pipeline as p; "
            f"r = p.calibrate(p.resolve_model('tiny-moe'), max_tokens=5120, out={str(tmp_path / 't.npz')!r}, "
            "progress=False); "
            "print(json.dumps(r.summary['memory']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    memory = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                       env=env).stdout.splitlines()[-1])
    predicted = stage_memory(model_size(resolve_model("tiny-moe")), "calibrate", 256, 1024, tokens=5120).total
    assert memory["predicted"]["total_bytes"] == predicted
    measured = memory["measured_peak_rss_gb"] * GB
    assert 1 / 1.15 <= measured / predicted <= 1.15, (measured / GB, predicted / GB)
    assert memory["predicted_over_measured"] == pytest.approx(predicted / measured, rel=1e-3)


_MOVE_CHILD = """
import json, torch, transformers
from autotune.costing.memory import ModelSize, mlx_move_bytes
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import model_spec
from runtime.mlx.mlx_exact import MlxExactLayer
from runtime.resources import peak_rss_mb
torch.manual_seed(0)
config = transformers.Qwen3MoeConfig(hidden_size=1024, moe_intermediate_size=512, num_experts=64,
                                     num_experts_per_tok=4, num_hidden_layers=1, num_attention_heads=8,
                                     num_key_value_heads=2, head_dim=64, vocab_size=256, intermediate_size=512)
model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
size = ModelSize.of(model)
plan = template_plan(model_spec(model), exact="mlx-exact", grouped=False)
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here (the fp32 init peaked higher)
before = peak_rss_mb()
MlxExactLayer(model.model.layers[0].mlp.experts)
print(json.dumps({"predicted": mlx_move_bytes(size, [plan]), "measured": (peak_rss_mb() - before) * 2**20,
                  "cpu_only": mlx_move_bytes(size, [template_plan(model_spec(model), grouped=False)])}))
"""


def test_the_gate_predicts_the_move_of_torchs_experts_into_mlx():
    """mlx-exact on torch's model moves each layer's experts into MLX's memory: the largest tensor (the fused gate
    and up, 64 MB here) is held twice for a moment; the search stage's prediction counts it, measured in a fresh
    process's peak RSS."""
    pytest.importorskip("mlx.core")
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("resets the peak RSS through Linux's /proc/self/clear_refs")
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MOVE_CHILD], capture_output=True, text=True, check=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    assert r["cpu_only"] == 0 and r["predicted"] == 64 * 2 * 512 * 1024 * 2
    assert 0.8 <= r["measured"] / r["predicted"] <= 1.25, r


def _moe_call_peaks(model, ids) -> list[int]:
    """Each MoE layer's peak of malloc's bytes in use (glibc's mallinfo2, heaps and mmapped blocks) during its
    experts' call, over what was in use as the call began: read after every torch op, while the op's inputs and
    output are alive."""
    import ctypes

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2

    def in_use() -> int:
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd

    peaks: list[int] = []
    start: list[int] = []  # what was in use as the current call began (empty: no call running)

    class Reading(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if start:
                peaks[-1] = max(peaks[-1], in_use() - start[0])
            return out

    def begin(*_) -> None:
        start[:] = [in_use()]
        peaks.append(0)

    experts = [layer.mlp.experts for layer in model.model.layers]
    hooks = [e.register_forward_pre_hook(begin) for e in experts] + \
        [e.register_forward_hook(lambda *_: start.clear()) for e in experts]
    try:
        with torch.inference_mode(), Reading():
            model.model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return peaks


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_layers_padded_groups_are_priced_as_they_run(dtype):
    """tiny-moe with every expert in ane groups on ane-sim, each padded to the whole 256-token chunk (the gate's
    template candidates): each layer's MoE call peaks within 10% of `moe_call_bytes`, the search stage's
    `layer_working_set` holds that price, and the packed rows' gate/up and down priced for every slot at once (what
    it priced before) would read 1.5-1.6x."""
    import sys

    import torch

    from runtime.coreml.ane_sim import AneSimBackend
    from runtime.executor import PlanExecutor
    from runtime.loading.model_loader import load_model

    if not sys.platform.startswith("linux") or not __import__("ctypes.util").util.find_library("c"):
        pytest.skip("reads glibc's mallinfo2")
    model, _ = load_model("tiny-moe", dtype)
    size, chunk = ModelSize.of(model), 256
    plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=chunk)
    ids = torch.randint(0, size.vocab, (1, chunk), generator=torch.Generator().manual_seed(0))
    with PlanExecutor(model, plan, {AneSimBackend.name: AneSimBackend()}):
        _moe_call_peaks(model, ids)  # the first call of each shape makes what later ones reuse
        measured = max(_moe_call_peaks(model, ids))
    predicted = moe_call_bytes(size, chunk, [plan], ane_simulated=True)
    assert 0.9 <= predicted / measured <= 1.1, (predicted / 2**20, measured / 2**20)
    slots = sum(g.slots for g in plan.layers[0].groups)
    every_slot_at_once = slots * (2 * size.hidden + 3 * size.expert_ffn) * size.dtype_bytes
    assert every_slot_at_once / measured > 1.4
    terms = dict(stage_memory(size, "search", chunk, chunk, plan=plan).terms)
    assert terms["layer_working_set"] - dict(stage_memory(size, "search", chunk, chunk).terms)["layer_working_set"] \
        == predicted - moe_call_bytes(size, chunk)
