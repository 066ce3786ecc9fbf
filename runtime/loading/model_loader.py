"""Loading MoE models (local directories and built-in names) and describing their MoE shape. The weights are read
from the safetensors files by `checkpoint_reader` where they map one to one, else by transformers' loader.

Built-in names:
- `tiny-moe`: the embedded trained Qwen3Moe shipped in `runtime/assets/tiny-moe` (no network).
- `random:<family>`: tiny seeded random models of the five transformers MoE families, for tests.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from runtime.cpu.allocator import return_temporaries_to_the_os, reuse_temporaries
from runtime.cpu.cpu_backends import PACKED_IMPLEMENTATION
from runtime.errors import NpumoeError
from runtime.loading.checkpoint_reader import is_mlx_checkpoint, read_router, read_weights, tensor_index
from runtime.loading.checkpoints import (
    CONFIG_ERRORS,
    check_checkpoint,
    check_finite,
    check_loading_info,
    check_tokenizer_files,
    load_error,
    quiet_transformers,
    safetensors_files,
    safetensors_header,
)
from runtime.loading.compute_dtype import auto_dtype_for, resolved_dtype
from runtime.loading.gguf_reader import (  # GGUF hook (issue 57)
    check_gguf_view,
    gguf_router,
    gguf_view,
    is_gguf_path,
    is_gguf_view,
    read_gguf_model,
)
from runtime.loading.mlx_checkpoint import check_mlx_checkpoint, dequantized_router, read_mlx_model
from runtime.loading.model_config import (  # noqa: F401 - DTYPES, DTYPE_CHOICES: the loader's options
    DTYPE_CHOICES,
    DTYPES,
    context_of,
    mlx_quantization,
    read_config,
    stored_dtype,
)
from runtime.plan import ModelSpec

ASSETS = Path(__file__).resolve().parents[1] / "assets"
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes; there are no special tokens to add (the option is there to match HF tokenizers)."""
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Bytes back to text; an incomplete or invalid UTF-8 sequence shows as U+FFFD."""
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


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


def model_dir(name: str) -> Path:
    if name == "tiny-moe":
        if not (TINY_MOE_DIR / "config.json").exists():
            raise NpumoeError(f"the built-in model tiny-moe is missing from {TINY_MOE_DIR}; "
                              "rebuild it with scripts/train_tiny_moe.py")
        return TINY_MOE_DIR
    if is_gguf_path(name):  # GGUF hook (issue 57): the checked file's description folder
        return gguf_view(name)
    path = Path(name)
    if not (path / "config.json").exists():
        raise NpumoeError(f"--model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) "
                          "nor a local transformers model directory with a config.json")
    return path


def checkpoint_dtype(name: str) -> torch.dtype:
    """The dtype a model's weights are stored in (`model_config.stored_dtype`); random models are made in float32."""
    return torch.float32 if name.startswith(RANDOM_PREFIX) else stored_dtype(read_config(model_dir(name)))


def context_length(name: str) -> int | None:
    """The longest sequence the model takes (`model_config.context_of`)."""
    if name.startswith(RANDOM_PREFIX):
        return int(load_model(name)[0].config.max_position_embeddings)
    return context_of(read_config(model_dir(name)))


def stored_parameters(headers: dict[Path, dict]) -> int:
    """The weights a safetensors checkpoint holds, counted from its files' tensor tables."""
    return sum(math.prod(t["shape"]) for header in headers.values() for k, t in header.items() if k != "__metadata__")


def checkpoint_parameters(name: str) -> int:
    """The weights a safetensors checkpoint holds, counted from its headers (nothing else is read)."""
    return stored_parameters({f: safetensors_header(f) for f in safetensors_files(model_dir(name))})


def auto_dtype_of(name: str) -> tuple[torch.dtype, str]:
    """What `--dtype auto` loads `name` in on this host, and why (`compute_dtype.auto_dtype_for`)."""
    if name.startswith(RANDOM_PREFIX):
        return torch.float32, "the checkpoint's own float32"
    return auto_dtype_for(read_config(model_dir(name)), lambda: checkpoint_parameters(name))


def resolve_dtype(name: str, dtype: str | torch.dtype) -> torch.dtype:
    """A `--dtype` value (auto | bfloat16 | float16 | float32, or a torch dtype) as the torch dtype to load in
    (auto: `auto_dtype_of`)."""
    return resolved_dtype(dtype, lambda: auto_dtype_of(name)[0])


def load_model(name: str, dtype: str | torch.dtype = torch.float32, cpu_weights: str = "bf16",
               group_size: int = 64, kernel_rows: dict[str, int] | None = None) -> tuple[torch.nn.Module, object]:
    """Return (model in eval mode, tokenizer with `.encode(text) -> list[int]`). Never touches the network.

    The weights are loaded straight into `dtype` ("auto": `auto_dtype_of`), never through an fp32 copy.
    `cpu_weights` int8 | int4 (groups of `group_size`): every layer's experts quantized at load, one expert at a
    time (`runtime.cpu.cpu_weights`), running their kernels from `kernel_rows` rows (None: the defaults); bf16 keeps
    them as loaded."""
    dtype = resolve_dtype(name, dtype)
    quantize = None
    if cpu_weights != "bf16":
        from runtime.cpu.cpu_weights import quantize_experts

        if not name.startswith(RANDOM_PREFIX) and (is_mlx_checkpoint(model_dir(name))
                                                    or is_gguf_view(model_dir(name))):  # GGUF hook (issue 57)
            raise NpumoeError(f"--cpu-weights {cpu_weights}: {name} is already quantized (an MLX or GGUF "
                              "checkpoint, kept packed as stored); give a full-width checkpoint")
        quantize = partial(quantize_experts, kind=cpu_weights, group_size=group_size, kernel_rows=kernel_rows)
    model, tokenizer = _load(name, dtype, quantize)
    if quantize is not None or any(hasattr(l.experts, "npumoe_weights") for l in moe_layers(model)):
        return_temporaries_to_the_os()
    else:
        reuse_temporaries()
    if quantize is not None:
        for layer in moe_layers(model):  # those the streaming read did not quantize (transformers' loader)
            if not hasattr(layer.experts, "npumoe_weights"):
                quantize(layer.experts)
        model.set_experts_implementation(PACKED_IMPLEMENTATION)
    return model, tokenizer


def _load(name: str, dtype: torch.dtype, on_experts=None) -> tuple[torch.nn.Module, object]:
    if name.startswith(RANDOM_PREFIX):
        model = _random_model(name[len(RANDOM_PREFIX):])
        return model.to(dtype), ByteTokenizer(model.config.vocab_size)
    import transformers

    path = model_dir(name)
    quantization = open_checkpoint(path, read_config(path))[1]
    check_tokenizer_files(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()  # a bar per load clutters every command's output
    try:
        model, info = (read_gguf_model(path, dtype) if is_gguf_view(path)  # GGUF hook (issue 57)
                       else read_mlx_model(path, dtype) if is_mlx_checkpoint(path)
                       else read_weights(path, dtype, on_experts)), {}
        if model is None:
            with quiet_transformers():
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, local_files_only=True, use_safetensors=True, output_loading_info=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except CONFIG_ERRORS as e:
        raise load_error(path, e) from None
    check_loading_info(path, info)
    if not moe_layers(model):
        raise NpumoeError(f"model {name!r} has no MoE layers with fused experts (transformers 5.x MoE families)")
    check_finite(str(path), small_weights(model))
    model.npumoe_quantization = quantization  # what the fingerprint covers beside the shape and the routers
    return model.eval(), tokenizer


def small_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights a finite check reads whole, being small: norms and biases (1D) and the routers. The large
    matrices are not passed over (a 30B model's would cost a pass over every weight); a quantized checkpoint's scales
    and biases are checked as they are read (`mlx_checkpoint`, `gguf_quants.Converted.finite`)."""
    routers = {id(layer.router.weight) for layer in moe_layers(model)}
    return ((n, p) for n, p in model.named_parameters() if p.ndim == 1 or id(p) in routers)


def open_checkpoint(path: Path, config: dict) -> tuple[dict[Path, dict], str | None]:
    """Check a checkpoint folder once, before any command works on it: its files whole and its `config`
    (config.json) agreeing with them, and an MLX folder's quantization, dtypes and packed shapes
    (`check_mlx_checkpoint`). Returns its files' tensor tables, and the MLX quantization table in canonical form
    (None for a full-width checkpoint; a GGUF file's tensor types)."""
    if is_gguf_view(path):  # GGUF hook (issue 57): the file was checked whole when its folder was made
        return {}, check_gguf_view(path)
    headers = check_checkpoint(path, config)
    table = mlx_quantization(config)
    return headers, None if table is None else check_mlx_checkpoint(path, table)


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """The MoE blocks of a transformers 5.x model, in layer order."""
    layers = []
    for index, decoder_layer in enumerate(model.model.layers):
        mlp = getattr(decoder_layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        router = getattr(mlp, "gate", None) or getattr(mlp, "router", None)
        fused = hasattr(experts, "gate_up_proj") or hasattr(experts, "npumoe_weights")  # or packed (quantized.py)
        if experts is not None and fused and router is not None:
            layers.append(MoELayer(index, experts, router))
    return layers


def _spec_fields(model: torch.nn.Module, layers: list[MoELayer]) -> dict:
    cfg, first = model.config, layers[0].experts
    return dict(architecture=type(model).__name__, model_type=cfg.model_type, num_layers=cfg.num_hidden_layers,
                moe_layers=[l.index for l in layers], num_experts=int(first.num_experts),
                top_k=int(cfg.num_experts_per_tok), hidden_size=int(first.hidden_dim),
                expert_ffn_size=int(first.intermediate_dim))


def _fingerprint(fields: dict, routers: list[torch.Tensor], quantization: str | None = None) -> ModelSpec:
    """Config shape + router weights (+ an MLX checkpoint's quantization table: a plan for one format is not taken
    for another). Routers are hashed rounded to bfloat16, so that one checkpoint loaded in any --dtype (and its
    routers read alone from the files) has one fingerprint."""
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    if quantization is not None:
        h.update(b"quantization:" + quantization.encode())
    for w in routers:
        h.update(w.detach().to(torch.bfloat16).view(torch.int16).contiguous().numpy().tobytes())
    return ModelSpec(**fields, fingerprint="sha256:" + h.hexdigest()[:32])


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Shape and fingerprint (config shape + router weights) of a loaded MoE model."""
    layers = moe_layers(model)
    return _fingerprint(_spec_fields(model, layers), [l.router.weight for l in layers],
                        getattr(model, "npumoe_quantization", None))


def checkpoint_spec(name: str, path: Path, config: dict, skeleton: torch.nn.Module,
                    quantization: str | None) -> ModelSpec:
    """The same ModelSpec as `model_spec(load_model(name)[0])`, from the folder's `config` (config.json), its meta
    `skeleton` and its router weights alone (tensor by tensor from the safetensors files), at a fraction of the
    memory. Falls back to a full load where the routers cannot be found in safetensors files."""
    layers = moe_layers(skeleton)
    if not layers:
        raise NpumoeError(f"model {name!r} has no MoE layers with fused experts (transformers 5.x MoE families)")
    names = {id(p): n for n, p in skeleton.named_parameters()}
    files = tensor_index(path)
    table = mlx_quantization(config)
    read = read_router if table is None else partial(dequantized_router, quantization=table)
    if is_gguf_view(path):  # GGUF hook (issue 57): the routers read from the file
        files, read = path, gguf_router
    routers = [read(files, names[id(l.router.weight)]) for l in layers]
    if any(r is None for r in routers):
        return model_spec(load_model(name, "auto")[0])
    check_finite(str(path), ((names[id(l.router.weight)], r) for l, r in zip(layers, routers)))
    return _fingerprint(_spec_fields(skeleton, layers), routers, quantization)
