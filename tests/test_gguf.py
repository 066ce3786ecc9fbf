"""GGUF files (`--model file.gguf`), written here by the `gguf` package's own writer from tiny-moe's safetensors
checkpoint: the block formats decoded exactly into our packed affine groups (against the package's dequantizer), the
model against the safetensors checkpoint within each format's error, the experts kept packed, and bad files refused
in one line with nothing written."""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf_files import (  # noqa: E402
    ARCH_OF,
    model_metadata,
    model_tensors,
    permute_for_llama_cpp,
    tiny_moe_metadata,
    tiny_moe_tensors,
    write_tiny_moe_gguf,
)
from helpers import one_line_exit_2  # noqa: E402

from autotune.calibration.modelstats import perplexity  # noqa: E402
from autotune.calibration.texts import read_text  # noqa: E402
from autotune.cli import main  # noqa: E402
from autotune.searching.templates import template_plan  # noqa: E402
from runtime.cpu.quantized import dequantize  # noqa: E402
from runtime.errors import NpumoeError  # noqa: E402
from runtime.loading.gguf_file import GGUFFile  # noqa: E402
from runtime.loading.gguf_model import ARCHS, hf_config, qk_row_order  # noqa: E402
from runtime.loading.gguf_quants import EXACT, convert_exact, pack_codes, requantize  # noqa: E402
from runtime.loading.model_loader import (  # noqa: E402
    TINY_MOE_DIR,
    load_model,
    model_spec,
    moe_layers,
)
from runtime.loading.model_record import read_model_spec  # noqa: E402
from runtime.plan import save_plan  # noqa: E402

# per format: (largest perplexity change against the safetensors checkpoint, least top-1 agreement), on 1,024
# held-out tokens (measured: Q8_0 0.003% and 1.000, Q4_0 0.56% and 0.91)
WITHIN = {"Q8_0": (0.001, 0.99), "Q4_0": (0.015, 0.85)}


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory):
    """The folders `--model file.gguf` makes go to a fresh cache (never the user's)."""
    root = tmp_path_factory.mktemp("npumoe-cache")
    before = os.environ.get("NPUMOE_CACHE")
    os.environ["NPUMOE_CACHE"] = str(root)
    yield root
    if before is None:
        del os.environ["NPUMOE_CACHE"]
    else:
        os.environ["NPUMOE_CACHE"] = before


@pytest.fixture(scope="module")
def files(tmp_path_factory, cache):
    d = tmp_path_factory.mktemp("gguf")
    tensors = tiny_moe_tensors()
    return {t: write_tiny_moe_gguf(d / f"tiny-moe-{t}.gguf", t, tensors=tensors) for t in WITHIN}


@pytest.fixture(scope="module")
def reference():
    model, tokenizer = load_model("tiny-moe", "float32")
    ids = tokenizer.encode(read_text("builtin:pydoc-heldout")[:8000])[:1024]
    return model, tokenizer, ids


def _full(c) -> np.ndarray:
    return dequantize(torch.from_numpy(c.packed.view(np.int32)), torch.from_numpy(c.scales),
                      torch.from_numpy(c.biases), c.bits).numpy()


def _random_blocks(type_name: str, rows: int, n: int, rng) -> np.ndarray:
    """Random blocks of a type whose fp16 factors (the first two or four bytes) are small finite numbers."""
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]]
    data = rng.integers(0, 256, (rows, n // block, size), dtype=np.uint8)
    halves = 1 if type_name in ("Q8_0", "Q4_0", "Q5_0", "Q6_K") else 2
    factors = rng.uniform(1e-3, 5e-2, (rows, n // block, halves)).astype(np.float16)
    start = size - 2 if type_name == "Q6_K" else 0  # Q6_K keeps its d last
    data[..., start:start + 2 * halves] = factors.view(np.uint8).reshape(rows, n // block, 2 * halves)
    return data.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(EXACT))
def test_blocks_decode_as_llama_cpp_does(type_name):
    """Our codes, scales and biases give llama.cpp's values (its gguf package's dequantizer): exactly for the
    types with one fp16 factor per group, within the measured fp16 rounding of d * sc for the K-quants."""
    data = _random_blocks(type_name, 6, 512, np.random.default_rng(0))
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[type_name])
    c = convert_exact(data, type_name)
    got, peak = _full(c), np.abs(want).max()
    if type_name.endswith("_K"):
        assert 0 < c.fp16_rounding < 1e-3
        assert np.abs(got - want).max() / peak == pytest.approx(c.fp16_rounding, rel=1e-3)
    else:
        assert c.fp16_rounding == 0.0
        np.testing.assert_array_equal(got, want)


def test_other_types_requantized_with_their_error():
    """Q6_K (16-value groups) goes to 8-bit groups of 32: the error reported is the error measured."""
    data = _random_blocks("Q6_K", 4, 512, np.random.default_rng(1))
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q6_K)
    c = requantize(want)
    err = np.abs(_full(c) - want).max() / np.abs(want).max()
    assert c.bits == 8 and err == pytest.approx(c.requant_error, rel=1e-6) and 0 < err < 4e-3


def test_five_bit_codes_pack_as_mlx_reads_them():
    codes = np.random.default_rng(2).integers(0, 32, (3, 64), dtype=np.uint8)
    from runtime.cpu.quantized import unpack

    packed = torch.from_numpy(pack_codes(codes, 5).view(np.int32))
    np.testing.assert_array_equal(unpack(packed, 5).numpy(), codes)


def _from_file(model: torch.nn.Module, path: Path) -> torch.nn.Module:
    """A full-width copy of `model` holding the file's values as the gguf package dequantizes them."""
    import copy

    out = copy.deepcopy(model)
    f = GGUFFile(path)
    params = dict(out.named_parameters())
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    parts = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
             "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate"}
    with torch.no_grad():
        for name, (_, shape, _, _) in f.tensors.items():
            values = torch.from_numpy(np.stack([f.read_values(name, i) for i in range(shape[0])])
                                      if len(shape) == 3 else f.read_values(name))
            _, layer, part, _ = (name.split(".") + ["", "", ""])[:4] if name.startswith("blk.") else ("", "", "", "")
            base = f"model.layers.{layer}."
            if part == "ffn_gate_exps" or part == "ffn_up_exps":
                f_ = shape[1]
                half = slice(0, f_) if part == "ffn_gate_exps" else slice(f_, 2 * f_)
                params[base + "mlp.experts.gate_up_proj"][:, half] = values
            elif part == "ffn_down_exps":
                params[base + "mlp.experts.down_proj"].copy_(values)
            else:
                target = names.get(name) or base + parts[part] + ".weight"
                params[target].copy_(values.reshape(params[target].shape))
    return out


@pytest.mark.parametrize("type_name", sorted(WITHIN))
def test_the_file_runs_as_llama_cpp_decodes_it(type_name, files, reference):
    """The model read from the file is the one the file holds (the gguf package's own dequantized values in a
    full-width copy: the same logits), its experts packed at the format's width, never at full width."""
    model, tokenizer, ids = reference
    ours, tok = load_model(str(files[type_name]), "float32")
    x = torch.tensor([ids[:256]])
    with torch.no_grad():
        got = ours(input_ids=x).logits
        want = _from_file(model, files[type_name])(input_ids=x).logits
    assert (got - want).abs().max().item() < 2e-4
    bits = {"Q8_0": 8, "Q4_0": 4}[type_name]
    for layer in moe_layers(ours):
        w = layer.experts.npumoe_weights
        assert not hasattr(layer.experts, "gate_up_proj")
        assert [p.bits for p in (w.gate, w.up, w.down)] == [bits] * 3
        assert w.stored_bytes() == 3 * 16 * 256 * 256 * (bits / 8 + 4 / 32)  # codes, fp16 scale and bias per 32
    assert ours.config.norm_topk_prob is True  # llama.cpp's qwen3moe always renormalises the top-k weights
    text = "def f(x):\n    return {'a': [1, 2]}  # ünïcode <|endoftext|>"
    assert tok.encode(text) == tokenizer.encode(text)
    assert read_model_spec(str(files[type_name])) == model_spec(ours)


@pytest.mark.parametrize("type_name", sorted(WITHIN))
def test_within_the_formats_error_of_the_safetensors_checkpoint(type_name, files, reference):
    model, _, ids = reference
    ours, _ = load_model(str(files[type_name]), "float32")
    max_change, min_top1 = WITHIN[type_name]
    assert abs(perplexity(ours, ids) / perplexity(model, ids) - 1) < max_change
    x = torch.tensor([ids[:512]])
    with torch.no_grad():
        top1 = (ours(input_ids=x).logits.argmax(-1) == model(input_ids=x).logits.argmax(-1)).float().mean().item()
    assert top1 >= min_top1


def test_routing_as_llama_cpp_runs_each_architecture(tmp_path):
    """qwen2moe's top-k weights are not renormalised by llama.cpp (qwen3moe's are), whatever a key says."""
    tiny = {"token_embd.weight": np.zeros((4096, 256), np.float32)}
    path = write_tiny_moe_gguf(tmp_path / "q2.gguf", "F32", arch="qwen2moe", tensors=tiny, metadata={
        "qwen2moe.expert_shared_feed_forward_length": (512, "UINT32"), "qwen2moe.expert_weights_norm": (True, "BOOL")})
    config = hf_config(GGUFFile(path))
    assert config["model_type"] == "qwen2_moe" and config["norm_topk_prob"] is False
    assert config["shared_expert_intermediate_size"] == 512 and config["moe_intermediate_size"] == 256


def _tensor_type_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s type field sits in the file's tensor table."""
    reader = gguf.GGUFReader(path)
    field = next(t.field for t in reader.tensors if t.name == name)
    return field.offset + 8 + len(name.encode()) + 4 + 8 * len(field.parts[3])


def _bad_files(d: Path, good: Path) -> dict[str, Path]:
    raw = good.read_bytes()
    (d / "truncated.gguf").write_bytes(raw[:int(len(raw) * 0.7)])
    patched = bytearray(raw)
    at = _tensor_type_offset(good, "blk.1.ffn_up_exps.weight")
    patched[at:at + 4] = (99).to_bytes(4, "little")
    (d / "type.gguf").write_bytes(bytes(patched))
    tiny = {"token_embd.weight": np.zeros((4096, 256), np.float32)}
    write_tiny_moe_gguf(d / "arch.gguf", "F32", arch="gpt2", tensors=tiny)
    write_tiny_moe_gguf(d / "key.gguf", "F32", tensors=tiny, metadata={"qwen3moe.expert_used_count": ("2", "STRING")})
    write_tiny_moe_gguf(d / "topk.gguf", "F32", tensors=tiny, metadata={"qwen3moe.expert_used_count": (32, "UINT32")})
    write_tiny_moe_gguf(d / "context.gguf", "F32", tensors=tiny, metadata={"qwen3moe.context_length": (0, "UINT32")})
    tokens = tiny_moe_metadata()["tokenizer.ggml.tokens"][0][:300]  # its merges name the 3,796 tokens left out
    write_tiny_moe_gguf(d / "merges.gguf", metadata={"tokenizer.ggml.tokens": (tokens, "STRING"),
                                                     "tokenizer.ggml.token_type": ([1] * 300, "INT32")})
    return {k: d / f"{k}.gguf" for k in BAD}


BAD = {
    "truncated": "runs past the end of the file",
    "type": "tensor blk.1.ffn_up_exps.weight has quantization type 99",
    "arch": "architecture 'gpt2' is not one this reader runs",
    "key": "metadata key qwen3moe.expert_used_count is STRING, expected an integer",
    "topk": "qwen3moe.expert_used_count 32 is more than the model's 16 experts",
    "context": "qwen3moe.context_length must be a positive integer, got 0",
    "merges": "which is not among its 300 tokens: not a vocabulary the tokenizer can build",
}


def test_corrupt_weights_and_another_models_plan_one_line(files, tmp_path, capsys):
    """A file whose every tensor byte is random (the header intact) is corrupt: refused in one line by its scales
    (no numpy warning of the overflows on the way) and, for what reads only the routers, by theirs; a plan of another
    model is refused before the weights load (no loader's note ahead of the error)."""
    good = files["Q8_0"]
    raw = bytearray(good.read_bytes())
    start = gguf.GGUFReader(good).data_offset
    raw[start:] = np.random.default_rng(0).bytes(len(raw) - start)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(bytes(raw))
    other = tmp_path / "other.json"
    save_plan(template_plan(read_model_spec("tiny-moe"), "ample"), other)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert "scales that are not finite (NaN or inf): the file is corrupt" in one_line_exit_2(
            ["generate", "--model", str(corrupt), "--prompt", "To be", "--max-tokens", "4"], capsys)
        for argv in (["plan-template", "--model", str(corrupt), "--out", str(tmp_path / "p.json")],
                     ["run", "--model", str(corrupt), "--plan", str(other), "--max-tokens", "64"]):
            assert "mlp.gate.weight holds values that are not finite (NaN or inf)" in one_line_exit_2(argv, capsys)
    assert "plan is for a different model" in one_line_exit_2(
        ["generate", "--model", str(good), "--plan", str(other), "--prompt", "To be", "--max-tokens", "4"], capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt.gguf", "other.json"]


def test_bad_files_one_line_nothing_written(files, cache, tmp_path, capsys):
    """Each refused by every command in one line naming the problem, before any work: no plan, no traces, no
    folder in the cache."""
    bad = _bad_files(tmp_path, files["Q8_0"])
    plan = tmp_path / "plan.json"
    save_plan(template_plan(read_model_spec(str(files["Q8_0"])), "ample"), plan)
    made = set(cache.glob("gguf/*"))
    traces = tmp_path / "traces.npz"
    for case, needle in BAD.items():
        with pytest.raises(NpumoeError, match=needle):
            load_model(str(bad[case]))
        capsys.readouterr()
        for argv in (["run", "--model", str(bad[case]), "--plan", str(plan), "--max-tokens", "64"],
                     ["plan-template", "--model", str(bad[case]), "--out", str(tmp_path / "template.json")],
                     ["search", "--model", str(bad[case]), "--trials", "5", "--no-gate", "--traces", str(traces),
                      "--out", str(tmp_path / "searched.json")]):
            code = main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            assert code == 2 and len(err) == 1 and needle in err[0], (case, argv[0], err)
    assert set(cache.glob("gguf/*")) == made and not list(cache.glob("gguf/.tmp-*"))
    assert not traces.exists() and not (tmp_path / "template.json").exists()


def test_commands_take_the_file(files, tmp_path, capsys):
    path = str(files["Q4_0"])
    plan = tmp_path / "plan.json"
    save_plan(template_plan(read_model_spec(path), "ample"), plan)
    capsys.readouterr()
    for argv in (["run", "--max-tokens", "256", "--json"], ["evaluate", "--max-tokens", "256", "--json"],
                 ["generate", "--prompt", "def main():", "--max-tokens", "4", "--json"]):
        assert main([argv[0], "--model", path, "--plan", str(plan), *argv[1:]]) == 0, capsys.readouterr().err
        json.loads(capsys.readouterr().out)
    assert main(["calibrate", "--model", path, "--engine", "mlx", "--out", str(tmp_path / "t.npz")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a GGUF file, which mlx-lm does not load here" in err[0], err


def test_the_mlx_engine_names_itself_on_a_file(files, tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    plan = tmp_path / "plan.json"
    save_plan(template_plan(read_model_spec(str(files["Q8_0"])), "ample"), plan)
    for cmd in (["run", "--plan", str(plan), "--max-tokens", "64"], ["generate", "--prompt", "To be"]):
        assert "--engine mlx loads a model folder through mlx-lm; " in one_line_exit_2(
            [cmd[0], "--model", str(files["Q8_0"]), "--engine", "mlx", *cmd[1:]], capsys)


def test_missing_package_one_line(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_gguf(name, *a, **k):
        if name == "gguf" or name.startswith("gguf."):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_gguf)
    path = tmp_path / "x.gguf"
    shutil.copy(Path(__file__), path)
    with pytest.raises(NpumoeError, match=r"pip install 'npumoe\[gguf\]'"):
        GGUFFile(path)


def test_qk_rows_put_back_as_the_converter_permuted_them():
    config = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    w = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    order = qk_row_order(ARCHS["llama"], config, "model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_array_equal(permute_for_llama_cpp(w, 4)[order], w)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_other_architectures_read_back(family, tmp_path):
    """A file of each other architecture we run (llama with experts: Mixtral, its q/k rows permuted for llama.cpp's
    rope; qwen2moe: attention biases and a gated shared expert; olmoe: q/k norms over the whole projection), written
    as llama.cpp names its tensors: read back, the model is the one written, routed as llama.cpp routes it."""
    model = load_model(f"random:{family}")[0]
    path = write_tiny_moe_gguf(tmp_path / f"{family}.gguf", "F32", arch=ARCH_OF[family],
                               tensors=model_tensors(model), metadata=model_metadata(model))
    ours, _ = load_model(str(path), "float32")
    assert ours.config.model_type == family and not ours.config.tie_word_embeddings
    if family != "mixtral":  # Mixtral's router always renormalises its top-k (no flag)
        assert ours.config.norm_topk_prob is False
    x = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(input_ids=x).logits - model(input_ids=x).logits).abs().max().item() < 1e-4


def test_tokenizer_from_the_folder_beside(files, reference, tmp_path):
    """A file without a vocabulary takes the tokenizer files beside it; with neither, one line and nothing kept."""
    no_vocab = {k: (None, "") for k in tiny_moe_metadata() if k.startswith("tokenizer.ggml.") and "_id" not in k}
    path = write_tiny_moe_gguf(tmp_path / "t.gguf", "F16", metadata=no_vocab)
    with pytest.raises(NpumoeError, match="holds no vocabulary.*put the model's tokenizer.json beside the file"):
        load_model(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MOE_DIR / name, tmp_path / name)
    model, tok = load_model(str(path), "float32")
    text = "class A:\n    pass  # <|endoftext|>"
    assert tok.encode(text) == reference[1].encode(text)
    x = torch.tensor([reference[2][:128]])
    with torch.no_grad():  # an F16 file: its head tied to the whole embedding (it stayed on the meta device once)
        assert (model(input_ids=x).logits - reference[0](input_ids=x).logits).abs().max().item() < 1e-3


def test_converted_a_block_of_rows_at_a_time(files, reference, monkeypatch):
    """A vocabulary head is converted in blocks of rows (a bounded temporary), into the same weights."""
    from runtime.loading import gguf_reader

    whole, _ = load_model(str(files["Q4_0"]), "float32")
    monkeypatch.setattr(gguf_reader, "BLOCK_VALUES", 256 * 100)  # 41 blocks of the 4,096-row embedding
    blocked, _ = load_model(str(files["Q4_0"]), "float32")
    for (name, a), (_, b) in zip(whole.state_dict().items(), blocked.state_dict().items()):
        assert torch.equal(a, b), name
