"""MLX checkpoints as `mlx_lm.convert -q` writes them, read by our loader and kept packed, against mlx-lm's own
forward on the same folder. The checkpoints are made here by converting the embedded tiny-moe."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from helpers import (  # noqa: E402
    all_cpu_plan,
    mlx_fp32,
    one_line_exit_2,  # noqa: E402
)
from helpers import convert_to_mlx as convert  # noqa: E402

from autotune.calibration.texts import DEFAULT_EVAL_TEXT  # noqa: E402
from autotune.calibration.workload import encode_text  # noqa: E402
from autotune.cli import main  # noqa: E402
from runtime import generation  # noqa: E402
from runtime.cpu.quantized import QuantizedEmbedding, QuantizedExperts, QuantizedLinear  # noqa: E402
from runtime.errors import NpumoeError  # noqa: E402
from runtime.executor import PlanExecutor  # noqa: E402
from runtime.loading.model_loader import load_model, model_spec  # noqa: E402
from runtime.loading.model_record import read_model_spec  # noqa: E402
from runtime.plan import Plan, save_plan  # noqa: E402
from runtime.prefill import prefill_chunks  # noqa: E402


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return convert(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


def mlx_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(model(mx.array(ids.numpy()[None])).astype(mx.float32))[0])


def stored_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def test_kept_packed_and_same_spec(q4):
    model, _ = load_model(str(q4), "auto")
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight_q is model.model.embed_tokens.weight_q
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantizedLinear)
    assert isinstance(model.model.layers[0].mlp.experts.npumoe_weights, QuantizedExperts)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert held <= 1.05 * stored_bytes(q4)  # packed as on disk (plus rotary tables), never a full-width copy
    assert model_spec(model) == read_model_spec(str(q4))


@pytest.mark.parametrize("bits,group", [(4, 32), (6, 64), (8, 128)])
def test_widths_and_groups_match_mlx(bits, group, tmp_path):
    folder = convert(tmp_path / f"q{bits}g{group}", bits, group)
    model, tok = load_model(str(folder), "float32")
    ids = encode_text(tok, DEFAULT_EVAL_TEXT, 256)
    with torch.inference_mode():
        ours = model(ids[None]).logits[0].float()
    ref = mlx_logits(mlx_fp32(folder), ids)
    # a near-tie in a router may pick another expert for a token (a large local difference): compare means
    assert float((ours - ref).abs().mean() / ref.abs().mean()) < 5e-3
    assert float((ours.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.99


@pytest.mark.slow
def test_all_cpu_plan_against_mlx_lm_on_4096_tokens(q4):
    """Perplexity within 0.5% of mlx-lm's forward on the same checkpoint and top-1 agreement >= 0.99, on 4096
    held-out tokens (evaluate's text) in prompts of 1024. Both compute in float32: mlx-lm's own bf16 forward agrees
    with its float32 forward on 93% of this text's top-1 tokens (measured), so bf16 rounding is not compared."""
    model, _ = load_model(str(q4), "float32")
    loaded = generation.load(str(q4), all_cpu_plan(model), dtype="float32")
    ids = encode_text(loaded.tokenizer, DEFAULT_EVAL_TEXT, 4096)
    reference = mlx_fp32(q4)
    nll, nll_ref, agree = 0.0, 0.0, 0
    for s in range(0, ids.numel(), 1024):
        prompt = ids[s:s + 1024]
        with torch.inference_mode():
            ours = torch.cat([o.logits[0].float() for o in prefill_chunks(loaded.model, prompt, 256)])
        ref = mlx_logits(reference, prompt)
        nll += float(F.cross_entropy(ours[:-1], prompt[1:], reduction="sum"))
        nll_ref += float(F.cross_entropy(ref[:-1], prompt[1:], reduction="sum"))
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
    n = ids.numel() - 4
    assert ids.numel() == 4096
    assert abs(math.exp((nll - nll_ref) / n) - 1) <= 0.005
    assert agree / ids.numel() >= 0.99
    assert loaded.stats.total().tokens_per_backend["cpu-exact"] == 4 * 4096 * 2


def _edit_config(folder: Path, **quantization) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization"].update(quantization)
    (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder: Path, key: str) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    del tensors[key]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "mlx"})
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("case,needle", [
    ("mode", "config.json: quantization mode 'mxfp4' is not supported"),
    ("bits", "model.embed_tokens.weight: packed shape [4096, 32] does not fit 8-bit codes of 256 inputs"),
    ("scales", "model.layers.0.self_attn.q_proj.weight: quantized weight without its "
               "model.layers.0.self_attn.q_proj.scales"),
])
def test_bad_checkpoint_one_line(case, needle, q4, tmp_path, capsys):
    """Refused when opened, by every command: plan-template wrote a plan for an mxfp4 folder and search started
    calibrating before failing, until the quantization, dtypes and packed shapes were checked on opening."""
    bad = tmp_path / "bad"
    shutil.copytree(q4, bad)
    if case == "mode":
        _edit_config(bad, mode="mxfp4")
    elif case == "bits":
        _edit_config(bad, bits=8)
    else:
        _drop_tensor(bad, "model.layers.0.self_attn.q_proj.scales")
    with pytest.raises(NpumoeError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_model(str(bad))
    plan = tmp_path / "plan.json"
    save_plan(all_cpu_plan(load_model(str(q4))[0]), plan)
    capsys.readouterr()
    traces = tmp_path / "traces.npz"
    for argv in (["run", "--model", str(bad), "--plan", str(plan), "--max-tokens", "64"],
                 ["plan-template", "--model", str(bad), "--out", str(tmp_path / "template.json")],
                 ["search", "--model", str(bad), "--trials", "5", "--no-gate", "--traces", str(traces),
                  "--out", str(tmp_path / "searched.json")]):
        code = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and needle in err[0], (argv[0], err)
    assert not traces.exists() and not (tmp_path / "template.json").exists()  # no calibration, no plan


def test_a_scale_that_is_not_a_number_is_refused_as_corrupt(q4, tmp_path, capsys):
    """A packed weight's scales are checked as they are read (its codes need no check): a NaN there would make its
    group's weights NaN and every token's output with them."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(q4, bad)
    key = "model.layers.1.mlp.switch_mlp.down_proj.scales"
    tensors = load_file(bad / "model.safetensors")
    tensors[key].view(-1)[5] = float("nan")
    save_file(tensors, bad / "model.safetensors", metadata={"format": "mlx"})
    before = sorted(tmp_path.rglob("*"))
    assert f"{key} holds values that are not finite (NaN or inf)" in one_line_exit_2(
        ["generate", "--model", str(bad), "--engine", "torch", "--prompt", "To be", "--max-tokens", "4"], capsys)
    assert sorted(tmp_path.rglob("*")) == before


def test_the_fingerprint_covers_the_quantization(q4, tmp_path, capsys):
    """mlx-lm keeps the routers at 8 bits whatever the experts' width: the 4- and the 8-bit folders have the same
    routers and shape, so until the fingerprint covered the formats, a plan for one was taken for the other."""
    q8 = convert(tmp_path / "q8g64", 8, 64)
    assert read_model_spec(str(q4)) == model_spec(load_model(str(q4))[0])
    assert read_model_spec(str(q8)).fingerprint != read_model_spec(str(q4)).fingerprint
    plan = tmp_path / "plan.json"
    save_plan(all_cpu_plan(load_model(str(q4))[0]), plan)
    capsys.readouterr()
    code = main(["run", "--model", str(q8), "--plan", str(plan), "--max-tokens", "64"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "fingerprint" in err[0], err


def test_commands_take_the_folder(q4, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    save_plan(all_cpu_plan(load_model(str(q4))[0]), plan)
    for argv in (["run", "--max-tokens", "256", "--json"], ["evaluate", "--max-tokens", "256", "--json"],
                 ["generate", "--prompt", "def main():", "--max-tokens", "4", "--json"]):
        assert main([argv[0], "--model", str(q4), "--plan", str(plan), *argv[1:]]) == 0, capsys.readouterr().err
        out = json.loads(capsys.readouterr().out)
        if argv[0] == "evaluate":
            assert out["ppl_delta_rel"] == 0.0 and out["top1_agreement"] == 1.0  # all-CPU: the model itself


def test_build_takes_the_folder(q4, tmp_path):
    """`autotune build` from an MLX folder: each function's experts dequantized from the packed codes (that expert
    alone, to the fp16 a package stores), compressed as its plan group says, linted and checked on the host."""
    from autotune.pipeline import build, resolve_model
    from autotune.searching.templates import template_plan
    from runtime.coreml.ane import META_KEY, expert_weights_fp16, weights_digest
    from runtime.coreml.mil_eval import TOLERANCE

    template = template_plan(read_model_spec(str(q4)), "ample", backend="ane", chunk_tokens=32)
    kinds = {0: "int8", 1: "palettize4"}  # layer 0's first two groups on ane, each stored its own way
    layers = [lp.model_copy(update={"groups": [
        g.model_copy(update={"backend": "ane", "compress": kinds[gi]} if (lp.layer, gi) in {(0, 0), (0, 1)}
                     else {"backend": "cpu-static"}) for gi, g in enumerate(lp.groups)]}) for lp in template.layers]
    plan = tmp_path / "plan.json"
    save_plan(template.model_copy(update={"layers": layers}), plan)
    result = build(resolve_model(str(q4)), plan, out=tmp_path / "q4.mlpackage", cache_dir=tmp_path / "cache",
                   progress=False)
    assert [fs.compress for fs in result.functions] == ["int8", "palettize4"]
    errors = [c.max_rel_error for c in result.checks]
    assert errors[0] <= TOLERANCE["int8"] and errors[1] <= TOLERANCE["palettize4"], errors
    assert result.package_bytes < 0.5 * result.unique_weight_bytes  # compressed, not fp16

    # the weights a function holds are mlx's dequantized expert, rounded to fp16 once
    model, _ = load_model(str(q4), "auto")
    experts = model.model.layers[0].mlp.experts
    gate_up, down = expert_weights_fp16(experts, 3)
    w = experts.npumoe_weights
    ref = [np.array(mx.dequantize(mx.array(p.packed[3].view(torch.int32).numpy().view(np.uint32)),
                                  mx.array(p.scales[3].float().numpy()), mx.array(p.biases[3].float().numpy()),
                                  p.group_size, p.bits)) for p in (w.gate, w.up, w.down)]
    np.testing.assert_array_equal(gate_up, np.concatenate(ref[:2]).astype(np.float16))
    np.testing.assert_array_equal(down, ref[2].astype(np.float16))
    manifest = json.loads(Path(result.manifest).read_text())
    assert manifest["model_fingerprint"] == read_model_spec(str(q4)).fingerprint
    import coremltools as ct

    meta = json.loads(ct.utils.load_spec(result.package).description.metadata.userDefined[META_KEY])
    group = result.functions[0]
    # what the ane backend checks a package against at load: the digest of the loaded model's packed experts
    assert meta["functions"][group.name]["weights_sha256"] == weights_digest(experts, group.experts)


def test_dense_functions_from_the_folder(q4):
    """A plan's dense functions on a packed checkpoint: ane-sim computes them from the dequantized projections (the
    model's own forward within fp16's error) and a package stores mlx's dequantized weights, rounded to fp16 once
    (the gate of a search on an MLX folder ran ane-sim's functions over `QuantizedLinear`s: it failed there)."""
    from autotune.searching.templates import template_plan
    from runtime.coreml.dense_io import dense_weights
    from runtime.dense.specs import backend_specs

    model, _ = load_model(str(q4), "float32")
    def dense_plan(backend: str) -> Plan:
        return template_plan(model_spec(model), "ample", "drop", "cpu-static", chunk_tokens=32, dense=backend,
                             context_tokens=128)

    plan = dense_plan("ane-sim")
    ids = torch.randint(3, 4000, (96,), generator=torch.Generator().manual_seed(0))
    ref = torch.cat([o.logits[0] for o in prefill_chunks(model, ids, 32)])
    with PlanExecutor(model, plan) as ex:
        got = torch.cat([o.logits[0] for o in prefill_chunks(model, ids, 32)])
        assert ex.dense.to_json()["qkv"] == {"ane-sim": 3 * model.config.num_hidden_layers}
    assert 0 < (got - ref).abs().max() <= 0.05 * ref.abs().max()

    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear)
    spec = next(s for s in backend_specs(model, dense_plan("ane"), "ane") if s.kind == "qkv" and s.layer == 0)
    p = q.weight_q
    mlx_q = np.array(mx.dequantize(mx.array(p.packed.view(torch.int32).numpy().view(np.uint32)),
                                   mx.array(p.scales.float().numpy()), mx.array(p.biases.float().numpy()),
                                   p.group_size, p.bits))
    np.testing.assert_array_equal(dense_weights(spec)["layer0_q_w"], mlx_q.astype(np.float16))
