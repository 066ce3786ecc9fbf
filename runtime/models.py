"""Loading MoE models (local directories and built-in names) and describing their MoE shape.

Built-in names:
- `tiny-moe`: the embedded trained Qwen3Moe shipped in `runtime/assets/tiny-moe` (no network).
- `random:<family>`: tiny seeded random models of the five transformers MoE families, for tests.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .errors import NpumoeError

ASSETS = Path(__file__).parent / "assets"
TINY_MOE_DIR = ASSETS / "tiny-moe"
RANDOM_PREFIX = "random:"

# Per family: config class name and the kwargs that make a tiny model (4 layers, 8 experts, top-2).
_RANDOM_FAMILIES: dict[str, tuple[str, dict]] = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, moe_intermediate_size=48, intermediate_size=96,
                                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, moe_intermediate_size=48, intermediate_size=96,
                                          shared_expert_intermediate_size=64, decoder_sparse_step=1,
                                          mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, intermediate_size=48)),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, intermediate_size=48)),
    "phimoe": ("PhimoeConfig", dict(num_local_experts=8, intermediate_size=48, input_jitter_noise=0.0,
                                     router_jitter_noise=0.0)),
}
RANDOM_MODELS = [RANDOM_PREFIX + f for f in _RANDOM_FAMILIES]
BUILTIN_MODELS = ["tiny-moe", *RANDOM_MODELS]


@dataclass(frozen=True)
class ModelSpec:
    """The MoE shape of a model, as the plan records it."""
    architecture: str
    model_type: str
    num_layers: int
    moe_layers: list[int]
    num_experts: int
    top_k: int
    hidden_size: int
    expert_ffn_size: int
    fingerprint: str

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class MoELayer:
    """One MoE block: its decoder-layer index, the fused experts module and the router module."""
    index: int
    experts: torch.nn.Module
    router: torch.nn.Module


class ByteTokenizer:
    """Stand-in tokenizer for the random models: UTF-8 bytes folded into the vocabulary."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


def _random_model(family: str) -> torch.nn.Module:
    import transformers

    if family not in _RANDOM_FAMILIES:
        raise NpumoeError(f"unknown random model family {family!r}; choose from {', '.join(RANDOM_MODELS)}")
    config_name, extra = _RANDOM_FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        max_position_embeddings=4096, tie_word_embeddings=False, **extra)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger router weights than the init default, so that random models route decisively (more skew).
    with torch.no_grad():
        for layer in moe_layers(model):
            layer.router.weight.normal_(0.0, 0.5)
    return model.eval()


def _resolve_dir(name: str) -> Path:
    if name == "tiny-moe":
        if not (TINY_MOE_DIR / "config.json").exists():
            raise NpumoeError(f"the built-in model tiny-moe is missing from {TINY_MOE_DIR}; "
                              "rebuild it with scripts/train_tiny_moe.py")
        return TINY_MOE_DIR
    path = Path(name)
    if not (path / "config.json").exists():
        raise NpumoeError(f"--model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                          "nor a local transformers model directory with a config.json")
    return path


def load_model(name: str, dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """Return (model in eval mode, tokenizer with `.encode(text) -> list[int]`). Never touches the network."""
    if name.startswith(RANDOM_PREFIX):
        model = _random_model(name[len(RANDOM_PREFIX):])
        return model.to(dtype), ByteTokenizer(model.config.vocab_size)
    import transformers

    path = _resolve_dir(name)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()  # a bar per load clutters every command's output
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise NpumoeError(f"cannot load model from {path}: {str(e).splitlines()[0]}") from None
    if not moe_layers(model):
        raise NpumoeError(f"model {name!r} has no MoE layers with fused experts (transformers 5.x MoE families)")
    return model.eval(), tokenizer


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """The MoE blocks of a transformers 5.x model, in layer order."""
    layers = []
    for index, decoder_layer in enumerate(model.model.layers):
        mlp = getattr(decoder_layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
        if experts is not None and hasattr(experts, "gate_up_proj") and router is not None:
            layers.append(MoELayer(index, experts, router))
    return layers


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Shape and fingerprint (config shape + router weights) of an MoE model."""
    cfg = model.config
    layers = moe_layers(model)
    first = layers[0].experts
    spec = dict(architecture=type(model).__name__, model_type=cfg.model_type, num_layers=cfg.num_hidden_layers,
                moe_layers=[l.index for l in layers], num_experts=int(first.num_experts),
                top_k=int(cfg.num_experts_per_tok), hidden_size=int(first.hidden_dim),
                expert_ffn_size=int(first.intermediate_dim))
    h = hashlib.sha256(json.dumps(spec, sort_keys=True).encode())
    for layer in layers:
        h.update(layer.router.weight.detach().to(torch.float32).contiguous().numpy().tobytes())
    return ModelSpec(**spec, fingerprint="sha256:" + h.hexdigest()[:32])
