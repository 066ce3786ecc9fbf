"""Shape twins: random-weight checkpoints with the real config of a published MoE model, fewer layers.

    python scripts/make_shape_twin.py --like qwen3-30b-a3b --layers 2 [--out DIR]

Writes a transformers checkpoint (config.json, safetensors shards + index, a small BPE tokenizer) in bfloat16,
tensor by tensor: the model is built on the meta device (no memory), every tensor is drawn in bf16 on its own
and written in shards of about 1 GB, so the script never holds more than one shard. Expert weights are stored
per expert under the key names the published checkpoints use (transformers fuses them on load), router weights
have std 0.5 so random routing is decisive (skewed), like the built-in `random:` models. The tokenizer is a BPE
of 4,096 tokens trained on the built-in `builtin:pydoc-calib` text (the model's real vocabulary size is kept:
ids past the tokenizer's are simply never used). Default output: ~/.cache/npumoe/twins/<like>-L<layers>
($NPUMOE_CACHE overrides ~/.cache/npumoe). Twins are measurement material: never commit one.

Configs below are the published config.json values (except num_hidden_layers). Where the search tools held the
model's own config.json or a direct copy of it, that is the source named; otherwise the values are the
well-known published ones, said so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROUTER_STD, WEIGHT_STD, EMBED_STD = 0.5, 0.02, 0.02
SHARD_BYTES = 1 << 30
TOKENIZER_VOCAB = 4096

TWINS: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B config.json. Source: the config.json of Qwen3-Coder-30B-A3B (same architecture numbers:
    # hidden 2048, 48 layers, 128 experts of 768, top-8, 32 heads / 4 KV heads of 128, vocab 151936) and
    # MindSpeed-RL configs/model/qwen3_30b_a3b.yaml (rotary base 1e6, 40960 positions, untied embeddings);
    # the Qwen/Qwen3-30B-A3B repository itself was not in the search index.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645),
    # Qwen/Qwen3-235B-A22B config.json: well-known published values (94 layers, 128 experts of 1536, top-8, hidden
    # 4096, 64 heads / 4 KV heads of 128, vocab 151936, rope base 1e6, 40960 positions, untied embeddings); the
    # same numbers as a copy of its config in a test of a public repository (`_QWEN3_MOE_CONFIG`, named
    # Qwen/Qwen3-235B-A22B). The repository itself was not in the search index.
    "qwen3-235b-a22b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, attention_bias=False,
        bos_token_id=151643, eos_token_id=151645),
    # microsoft/Phi-3.5-MoE-instruct config.json: well-known published values (16 experts of 6400, top-2, hidden
    # 4096, 32 layers, 32 heads / 8 KV heads, vocab 32064, attention and lm_head biases, 131072 positions; the
    # transformers PhimoeConfig defaults are documented as this model's). Its LongRoPE scaling is left out (a
    # rope detail that does not change any weight shape). The repository was not in the search index.
    "phi-3.5-moe": dict(
        model_type="phimoe", vocab_size=32064, hidden_size=4096, intermediate_size=6400, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=16, num_experts_per_tok=2,
        max_position_embeddings=131072, sliding_window=131072, rms_norm_eps=1e-5, attention_bias=True,
        lm_head_bias=True, tie_word_embeddings=False, input_jitter_noise=0.0, router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=32000),
    # microsoft/Phi-tiny-MoE-instruct config.json. Source: the config.json of its fine-tune
    # huggingface.co/rkumar1999/phi-tiny-moe-math-lean-sft (same shapes: hidden 4096, 16 experts of 448, top-2,
    # 32 layers, 16 heads / 4 KV heads of 128, vocab 32064, sliding window 2047, lm_head bias).
    "phi-tiny-moe": dict(
        model_type="phimoe", vocab_size=32064, hidden_size=4096, intermediate_size=448, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_local_experts=16, num_experts_per_tok=2,
        max_position_embeddings=4096, sliding_window=2047, rms_norm_eps=1e-5, attention_bias=True,
        lm_head_bias=True, tie_word_embeddings=False, input_jitter_noise=0.0, router_jitter_noise=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, bos_token_id=1, eos_token_id=32000),
    # allenai/OLMoE-1B-7B-0924 config.json: well-known published values (64 experts of 1024, top-8, hidden 2048,
    # 16 layers, 16 heads, vocab 50304, 4096 positions, no top-k renormalisation). Not in the search index.
    "olmoe-1b-7b": dict(
        model_type="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
        norm_topk_prob=False, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, clip_qkv=None, bos_token_id=None,
        eos_token_id=50279, pad_token_id=1),
    # mistralai/Mixtral-8x7B-v0.1 config.json: well-known published values (8 experts of 14336, top-2, hidden 4096,
    # 32 layers, 32 heads / 8 KV heads, vocab 32000, rope theta 1e6, 32768 positions). Not in the search index.
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2),
}
# Families whose published checkpoints keep the MoE block under `block_sparse_moe` with w1 (gate), w3 (up),
# w2 (down); the others use `mlp.experts.<e>.{gate,up,down}_proj`.
_BLOCK_SPARSE = {"mixtral", "phimoe"}


def default_dir(like: str, layers: int) -> Path:
    root = Path(os.environ.get("NPUMOE_CACHE") or Path.home() / ".cache" / "npumoe")
    return root / "twins" / f"{like}-L{layers}"


def twin_config(like: str, layers: int, **overrides):
    """The transformers config of a twin: the published values, `layers` decoder layers, bf16."""
    import transformers

    values = {**TWINS[like], **overrides, "num_hidden_layers": layers}
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    config.dtype = torch.bfloat16
    return config


def _checkpoint_tensors(name: str, shape: tuple[int, ...], model_type: str):
    """(checkpoint key, shape, role) of the tensors a module parameter is stored as on disk."""
    if ".experts.gate_up_proj" in name or ".experts.down_proj" in name:
        layer = name.split(".experts.")[0].replace(".mlp", ".block_sparse_moe" if model_type in _BLOCK_SPARSE
                                                   else ".mlp")
        e, rows, cols = shape
        if name.endswith("gate_up_proj"):
            f = rows // 2
            names = ("w1", "w3") if model_type in _BLOCK_SPARSE else ("gate_proj", "up_proj")
            for i in range(e):
                for n in names:
                    yield f"{layer}.experts.{i}.{n}.weight", (f, cols), "weight"
        else:
            n = "w2" if model_type in _BLOCK_SPARSE else "down_proj"
            for i in range(e):
                yield f"{layer}.experts.{i}.{n}.weight", (rows, cols), "weight"
        return
    if name.endswith((".mlp.gate.weight", ".mlp.router.weight")):
        key = name
        if model_type in _BLOCK_SPARSE:
            key = name.replace(".mlp.gate.", ".block_sparse_moe.gate.").replace(".mlp.router.",
                                                                               ".block_sparse_moe.gate.")
        yield key, shape, "router"
        return
    role = ("embed" if "embed_tokens" in name else "bias" if name.endswith(".bias")
            else "norm" if "norm" in name else "weight")
    yield name, shape, role


def _draw(shape: tuple[int, ...], role: str, gen: torch.Generator) -> torch.Tensor:
    if role == "norm":
        return torch.ones(shape, dtype=torch.bfloat16)
    if role == "bias":
        return torch.zeros(shape, dtype=torch.bfloat16)
    std = {"router": ROUTER_STD, "embed": EMBED_STD}.get(role, WEIGHT_STD)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=gen)


def write_weights(config, out: Path, seed: int = 0, progress: bool = True) -> int:
    """Random bf16 weights for `config`, in safetensors shards of ~1 GB with an index. Returns bytes written."""
    import transformers
    from safetensors.torch import save_file
    from tqdm import tqdm

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    tensors = [t for name, p in skeleton.named_parameters()
               for t in _checkpoint_tensors(name, tuple(p.shape), config.model_type)]
    gen = torch.Generator().manual_seed(seed)
    total = sum(2 * torch.Size(s).numel() for _, s, _ in tensors)
    weight_map, shard, shard_bytes, files = {}, {}, 0, []

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            fname = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            files.append(fname)
            weight_map.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    with tqdm(total=total, unit="B", unit_scale=True, desc="writing weights", disable=not progress,
              file=sys.stderr) as bar:
        for key, shape, role in tensors:
            t = _draw(shape, role, gen)
            shard[key] = t
            shard_bytes += t.numel() * 2
            bar.update(t.numel() * 2)
            if shard_bytes >= SHARD_BYTES:
                flush()
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def write_tokenizer(out: Path, vocab: int = TOKENIZER_VOCAB) -> None:
    """A byte-level BPE trained on the built-in calibration text, saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from autotune.calibration.texts import DEFAULT_CALIB_TEXT, read_text

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = read_text(DEFAULT_CALIB_TEXT)
    tok.train_from_iterator((text[i:i + 10_000] for i in range(0, len(text), 10_000)), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(out))


def add_published_names(path: Path, like: str) -> None:
    """The saved config.json with the published values transformers 5 renames or folds on save (Qwen3-MoE's
    `num_experts`, every family's top-level `rope_theta`) written back as the published files hold them: their
    readers (mlx_lm.convert) look for those names."""
    config = json.loads(path.read_text())
    if "num_experts" in TWINS[like] and "num_experts" not in config:
        config["num_experts"] = config["num_local_experts"]
    config.setdefault("rope_theta", config["rope_parameters"]["rope_theta"])
    path.write_text(json.dumps(config, indent=2))


def make_twin(like: str, layers: int, out: Path, seed: int = 0, progress: bool = True, **overrides) -> int:
    """Write the whole twin into `out` (created; written into a temp dir and renamed, so never half-made)."""
    import shutil
    import tempfile

    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        config = twin_config(like, layers, **overrides)
        config.save_pretrained(str(work))
        add_published_names(work / "config.json", like)
        total = write_weights(config, work, seed, progress)
        write_tokenizer(work)
        (work / "TWIN.json").write_text(json.dumps({"like": like, "layers": layers, "seed": seed,
                                                    "router_std": ROUTER_STD, "weight_bytes": total}))
        if out.exists():
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--like", required=True, choices=sorted(TWINS), help="the published model whose shapes to copy")
    p.add_argument("--layers", type=int, default=1, metavar="N", help="decoder layers (default 1)")
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (default ~/.cache/npumoe/twins/...)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="weights seed (default 0)")
    p.add_argument("--force", action="store_true", help="rewrite an existing twin")
    args = p.parse_args(argv)
    if args.layers < 1:
        p.error("--layers must be >= 1")
    out = args.out or default_dir(args.like, args.layers)
    if (out / "TWIN.json").exists() and not args.force:
        print(f"{out}: exists (use --force to rewrite)")
        return 0
    total = make_twin(args.like, args.layers, out, args.seed)
    print(f"wrote {out}: {args.like} with {args.layers} layer(s), {total / 1e9:.2f} GB of bf16 weights")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
