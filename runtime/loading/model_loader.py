"""Loading MoE models (local directories and built-in names) and describing their MoE shape.

Built-in names:
- `tiny-moe`: the embedded trained Qwen3Moe shipped in `runtime/assets/tiny-moe` (no network).
- `random:<family>`: tiny seeded random models of the five transformers MoE families, for tests.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import NpumoeError
from runtime.loading.checkpoints import (
    check_checkpoint,
    check_loading_info,
    check_tokenizer_files,
    load_error,
    quiet_transformers,
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

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_CHOICES = ("auto", *DTYPES)  # auto: the checkpoint's own dtype (config.json `dtype` / `torch_dtype`)
# Where a checkpoint may store a router weight, for a router module at `...mlp.gate` or `...mlp.router`:
# transformers 5 keeps the original (per-expert, `block_sparse_moe` for Mixtral/Phimoe) key layout on disk.
_ROUTER_KEY_FORMS = (".mlp.gate.", ".mlp.router.", ".block_sparse_moe.gate.", ".block_sparse_moe.router.")


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


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise NpumoeError(f"cannot read {path / 'config.json'}: {e}") from None


def checkpoint_dtype(name: str) -> torch.dtype:
    """The dtype a model's weights are stored in: config.json's `dtype` (or older `torch_dtype`); random
    models are made in float32. Unknown or absent: float32."""
    if name.startswith(RANDOM_PREFIX):
        return torch.float32
    config = _read_config(_resolve_dir(name))
    return DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), torch.float32)


def resolve_dtype(name: str, dtype: str | torch.dtype) -> torch.dtype:
    """A `--dtype` value (auto | bfloat16 | float16 | float32, or a torch dtype) as the torch dtype to load in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return checkpoint_dtype(name)
    if dtype not in DTYPES:
        raise NpumoeError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPE_CHOICES)}")
    return DTYPES[dtype]


# Per-expert key layouts of published checkpoints for a fused experts parameter `<layer>.mlp.experts.<leaf>`: the
# block the experts sit under and the per-expert parts stacked along dim 1, in order (as transformers fuses them).
_EXPERT_LAYOUTS = {
    "gate_up_proj": ((".mlp.", ("gate_proj", "up_proj")), (".block_sparse_moe.", ("w1", "w3"))),
    "down_proj": ((".mlp.", ("down_proj",)), (".block_sparse_moe.", ("w2",))),
}
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def _tensor_sources(name: str, shape: torch.Size, keys: dict[str, Path]) -> list[str] | None:
    """The checkpoint keys that make module parameter `name`, in the order they fill it; None if not all found."""
    if name in keys:
        return [name]
    for old in _ROUTER_KEY_FORMS:
        for new in _ROUTER_KEY_FORMS:
            if old in name and name.replace(old, new) in keys:
                return [name.replace(old, new)]
    leaf = name.rsplit(".", 1)[-1]
    if ".mlp.experts." in name and leaf in _EXPERT_LAYOUTS:
        for block, parts in _EXPERT_LAYOUTS[leaf]:
            base = name[:-len(".mlp.experts." + leaf)] + block + "experts"
            found = [f"{base}.{e}.{part}.weight" for e in range(shape[0]) for part in parts]
            if all(k in keys for k in found):
                return found
    return None


def _fits(shape: torch.Size, stored: list[list[int]]) -> bool:
    """Whether the stored tensors fill a parameter exactly: one of its shape, or per-expert blocks of rows."""
    if len(stored) == 1:
        return list(shape) == list(stored[0])
    parts = len(stored) // shape[0]
    return len(stored) == parts * shape[0] and all(
        list(s) == [shape[1] // parts, *shape[2:]] for s in stored) and shape[1] % parts == 0


def _read_tensor_into(f, start: int, entry: dict, dest: torch.Tensor) -> None:
    """Read one stored tensor into `dest` with plain file reads (no mmap: mapped pages would count as resident
    memory until the file is closed), straight into `dest` when the dtypes agree."""
    src = _SAFETENSORS_DTYPES[entry["dtype"]]
    a, b = entry["data_offsets"]
    f.seek(start + a)
    if src == dest.dtype and dest.is_contiguous():
        f.readinto(dest.view(-1).view(torch.uint8).numpy())
    else:
        dest.copy_(torch.frombuffer(bytearray(f.read(b - a)), dtype=src).reshape(dest.shape))


def _load_weights_by_reading(path: Path, dtype: torch.dtype):
    """The model with every parameter read from the safetensors files into its place, in `dtype`: memory is the
    model itself (transformers' loader holds a layer's experts a second time while it fuses them). None where a
    parameter, or a stored tensor, does not map one to one: the caller then loads with transformers."""
    import transformers
    from transformers.initialization import no_init_weights

    from runtime.loading.checkpoints import safetensors_header

    keys = _safetensors_files(path)
    if not keys:
        return None
    headers = {file: safetensors_header(file) for file in set(keys.values())}
    if any(t.get("dtype") not in _SAFETENSORS_DTYPES for h in headers.values() for k, t in h.items()
           if k != "__metadata__"):
        return None
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.get_text_config().tie_word_embeddings \
        else set()
    sources = {n: (p, _tensor_sources(n, p.shape, keys)) for n, p in model.named_parameters()}
    if any(src is None and n not in tied for n, (_, src) in sources.items()):
        return None
    if {k for _, src in sources.values() for k in src or ()} != set(keys):
        return None  # stored tensors the model has no place for: transformers' loader reports them
    if not all(_fits(p.shape, [headers[keys[k]][k]["shape"] for k in src]) for p, src in sources.values() if src):
        return None  # shapes that disagree with config.json: transformers' loader reports them
    starts = {}
    for file in headers:
        with open(file, "rb") as f:
            starts[file] = 8 + int.from_bytes(f.read(8), "little")
    handles = {file: open(file, "rb") for file in headers}  # noqa: SIM115 (closed below)
    try:
        with torch.no_grad():
            for p, src in sources.values():
                parts = len(src) // p.shape[0] if len(src or ()) > 1 else 0  # per-expert tensors per expert
                for i, key in enumerate(src or ()):
                    entry = headers[keys[key]][key]
                    if parts:  # expert i // parts, part i % parts: a block of rows of the fused parameter
                        e, j = divmod(i, parts)
                        rows = entry["shape"][0]
                        dest = p[e, j * rows:(j + 1) * rows]
                    else:
                        dest = p
                    _read_tensor_into(handles[keys[key]], starts[keys[key]], entry, dest)
    finally:
        for f in handles.values():
            f.close()
    if tied:
        model.tie_weights()
    return model


def load_model(name: str, dtype: str | torch.dtype = torch.float32) -> tuple[torch.nn.Module, object]:
    """Return (model in eval mode, tokenizer with `.encode(text) -> list[int]`). Never touches the network.

    The weights are loaded straight into `dtype` ("auto": the checkpoint's dtype), never through an fp32 copy."""
    dtype = resolve_dtype(name, dtype)
    if name.startswith(RANDOM_PREFIX):
        model = _random_model(name[len(RANDOM_PREFIX):])
        return model.to(dtype), ByteTokenizer(model.config.vocab_size)
    import transformers

    path = _resolve_dir(name)
    check_checkpoint(path)
    check_tokenizer_files(path)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.utils.logging.disable_progress_bar()  # a bar per load clutters every command's output
    try:
        model, info = _load_weights_by_reading(path, dtype), {}
        if model is None:
            with quiet_transformers():
                model, info = transformers.AutoModelForCausalLM.from_pretrained(
                    path, dtype=dtype, local_files_only=True, use_safetensors=True, output_loading_info=True)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise load_error(path, e) from None
    check_loading_info(path, info)
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


def _spec_fields(model: torch.nn.Module, layers: list[MoELayer]) -> dict:
    cfg, first = model.config, layers[0].experts
    return dict(architecture=type(model).__name__, model_type=cfg.model_type, num_layers=cfg.num_hidden_layers,
                moe_layers=[l.index for l in layers], num_experts=int(first.num_experts),
                top_k=int(cfg.num_experts_per_tok), hidden_size=int(first.hidden_dim),
                expert_ffn_size=int(first.intermediate_dim))


def _fingerprint(fields: dict, routers: list[torch.Tensor]) -> ModelSpec:
    """Config shape + router weights. Routers are hashed rounded to bfloat16, so that one checkpoint loaded in
    any --dtype (and its routers read alone from the files) has one fingerprint."""
    h = hashlib.sha256(json.dumps(fields, sort_keys=True).encode())
    for w in routers:
        h.update(w.detach().to(torch.bfloat16).view(torch.int16).contiguous().numpy().tobytes())
    return ModelSpec(**fields, fingerprint="sha256:" + h.hexdigest()[:32])


def model_spec(model: torch.nn.Module) -> ModelSpec:
    """Shape and fingerprint (config shape + router weights) of a loaded MoE model."""
    layers = moe_layers(model)
    return _fingerprint(_spec_fields(model, layers), [l.router.weight for l in layers])


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the .safetensors file holding it (single file or a sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return {k: path / v for k, v in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        return {}
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _read_router(files: dict[str, Path], module_key: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for old in _ROUTER_KEY_FORMS:
        if old not in module_key:
            continue
        for new in _ROUTER_KEY_FORMS:
            key = module_key.replace(old, new)
            if key in files:
                with safe_open(files[key], "pt") as f:
                    return f.get_tensor(key)
    return None


def read_model_spec(name: str) -> ModelSpec:
    """The same ModelSpec as `model_spec(load_model(name)[0])`, reading only config.json and the router weights
    (tensor by tensor from the safetensors files): what plan-template and search need, at a fraction of the
    memory. Falls back to a full load where the routers cannot be found in safetensors files."""
    if name.startswith(RANDOM_PREFIX):
        return model_spec(load_model(name)[0])
    import transformers

    path = _resolve_dir(name)
    check_checkpoint(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):  # the module tree without memory: names and shapes only
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise NpumoeError(f"cannot load model from {path}: {str(e).splitlines()[0]}") from None
    layers = moe_layers(skeleton)
    if not layers:
        raise NpumoeError(f"model {name!r} has no MoE layers with fused experts (transformers 5.x MoE families)")
    names = {id(p): n for n, p in skeleton.named_parameters()}
    files = _safetensors_files(path)
    routers = [_read_router(files, names[id(l.router.weight)]) for l in layers]
    if any(r is None for r in routers):
        return model_spec(load_model(name, "auto")[0])
    return _fingerprint(_spec_fields(skeleton, layers), routers)
