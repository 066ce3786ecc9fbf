"""Reading a transformers MoE model's weights straight from its safetensors files: which stored tensors make each
module parameter (the key layouts of published checkpoints: fused, per-expert under `mlp.experts.N` or
`block_sparse_moe.experts.N`, routers under `gate` or `router`), and reading them into place with plain file reads.
Beside `checkpoints.py`, which checks the files before anything reads them."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from runtime.errors import NpumoeError
from runtime.loading.checkpoints import CONFIG_ERRORS, safetensors_header
from runtime.loading.model_config import mlx_quantization, read_config

# Where a checkpoint may store a router weight, for a router module at `...mlp.gate` or `...mlp.router`:
# transformers 5 keeps the original (per-expert, `block_sparse_moe` for Mixtral/Phimoe) key layout on disk.
ROUTER_KEY_FORMS = (".mlp.gate.", ".mlp.router.", ".block_sparse_moe.gate.", ".block_sparse_moe.router.")
# Per-expert key layouts of published checkpoints for a fused experts parameter `<layer>.mlp.experts.<leaf>`: the
# block the experts sit under and the per-expert parts stacked along dim 1, in order (as transformers fuses them).
EXPERT_LAYOUTS = {
    "gate_up_proj": ((".mlp.", ("gate_proj", "up_proj")), (".block_sparse_moe.", ("w1", "w3"))),
    "down_proj": ((".mlp.", ("down_proj",)), (".block_sparse_moe.", ("w2",))),
}
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
QUANT_KEYS = ("quantization", "quantization_config")  # mlx's tables in config.json (runtime.loading.mlx_checkpoint)


def tensor_sources(name: str, shape: torch.Size, keys: dict[str, Path]) -> list[str] | None:
    """The checkpoint keys that make module parameter `name`, in the order they fill it; None if not all found."""
    if name in keys:
        return [name]
    for old in ROUTER_KEY_FORMS:
        for new in ROUTER_KEY_FORMS:
            if old in name and name.replace(old, new) in keys:
                return [name.replace(old, new)]
    leaf = name.rsplit(".", 1)[-1]
    if ".mlp.experts." in name and leaf in EXPERT_LAYOUTS:
        for block, parts in EXPERT_LAYOUTS[leaf]:
            base = name[:-len(".mlp.experts." + leaf)] + block + "experts"
            found = [f"{base}.{e}.{part}.weight" for e in range(shape[0]) for part in parts]
            if all(k in keys for k in found):
                return found
    return None


def fits(shape: torch.Size, stored: list[list[int]]) -> bool:
    """Whether the stored tensors fill a parameter exactly: one of its shape, or per-expert blocks of rows."""
    if len(stored) == 1:
        return list(shape) == list(stored[0])
    parts = len(stored) // shape[0]
    return len(stored) == parts * shape[0] and all(
        list(s) == [shape[1] // parts, *shape[2:]] for s in stored) and shape[1] % parts == 0


def read_tensor_into(f, start: int, entry: dict, dest: torch.Tensor) -> None:
    """Read one stored tensor into `dest` with plain file reads (no mmap: mapped pages would count as resident
    memory until the file is closed), straight into `dest` when the dtypes agree."""
    src = SAFETENSORS_DTYPES[entry["dtype"]]
    a, b = entry["data_offsets"]
    f.seek(start + a)
    if src == dest.dtype and dest.is_contiguous():
        f.readinto(dest.view(-1).view(torch.uint8).numpy())
    else:
        dest.copy_(torch.frombuffer(bytearray(f.read(b - a)), dtype=src).reshape(dest.shape))


def read_weights(path: Path, dtype: torch.dtype,
                 on_experts: Callable[[torch.nn.Module], None] | None = None) -> torch.nn.Module | None:
    """The model with every parameter read from the safetensors files into its place, in `dtype`: memory is the
    model itself (transformers' loader holds a layer's experts a second time while it fuses them). None where a
    parameter, or a stored tensor, does not map one to one: the caller then loads with transformers.

    `on_experts(module)` is called on each fused experts module as soon as both its parameters are read (the
    parameters are allocated but not touched before: quantizing and dropping them there keeps one layer's
    experts at full width at a time)."""
    import transformers
    from transformers.initialization import no_init_weights

    keys = tensor_index(path)
    if not keys:
        return None
    headers = {file: safetensors_header(file) for file in set(keys.values())}
    if any(t.get("dtype") not in SAFETENSORS_DTYPES for h in headers.values() for k, t in h.items()
           if k != "__metadata__"):
        return None
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    with no_init_weights():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    tied = set(getattr(model, "_tied_weights_keys", None) or ()) if config.get_text_config().tie_word_embeddings \
        else set()
    sources = {n: (p, tensor_sources(n, p.shape, keys)) for n, p in model.named_parameters()}
    if any(src is None and n not in tied for n, (_, src) in sources.items()):
        return None
    if {k for _, src in sources.values() for k in src or ()} != set(keys):
        return None  # stored tensors the model has no place for: transformers' loader reports them
    if not all(fits(p.shape, [headers[keys[k]][k]["shape"] for k in src]) for p, src in sources.values() if src):
        return None  # shapes that disagree with config.json: transformers' loader reports them
    starts = {}
    for file in headers:
        with open(file, "rb") as f:
            starts[file] = 8 + int.from_bytes(f.read(8), "little")
    experts = {id(p): m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")
               for p in (m.gate_up_proj, m.down_proj)}
    pending = {id(m): 2 for m in experts.values()}
    handles = {file: open(file, "rb") for file in headers}  # noqa: SIM115 (closed below)
    try:
        with torch.no_grad():
            for name in list(sources):
                p, src = sources.pop(name)  # no reference kept past its read: quantized experts free theirs
                parts = len(src) // p.shape[0] if len(src or ()) > 1 else 0  # per-expert tensors per expert
                for i, key in enumerate(src or ()):
                    entry = headers[keys[key]][key]
                    if parts:  # expert i // parts, part i % parts: a block of rows of the fused parameter
                        e, j = divmod(i, parts)
                        rows = entry["shape"][0]
                        dest = p[e, j * rows:(j + 1) * rows]
                    else:
                        dest = p
                    read_tensor_into(handles[keys[key]], starts[keys[key]], entry, dest)
                module = experts.get(id(p))
                if module is not None and on_experts is not None:
                    pending[id(module)] -= 1
                    if not pending[id(module)]:
                        del p, dest
                        on_experts(module)
    finally:
        for f in handles.values():
            f.close()
    if tied:
        model.tie_weights()
    return model


def tensor_index(path: Path) -> dict[str, Path]:
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


def read_router(files: dict[str, Path], module_key: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for old in ROUTER_KEY_FORMS:
        if old not in module_key:
            continue
        for new in ROUTER_KEY_FORMS:
            key = module_key.replace(old, new)
            if key in files:
                with safe_open(files[key], "pt") as f:
                    return f.get_tensor(key)
    return None


def is_mlx_checkpoint(path: Path) -> bool:
    """A folder mlx-lm quantized (`model_config.mlx_quantization`)."""
    return mlx_quantization(read_config(path)) is not None


def transformers_config(path: Path, config: dict) -> object:
    """The transformers config of the folder's `config` (its config.json), without mlx's quantization tables
    (transformers would look for a quantizer) and with `rope_theta` where mlx-lm put it at the top level only."""
    import transformers

    config = {k: v for k, v in config.items() if k not in QUANT_KEYS}
    model_type = config.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise NpumoeError(f"{path / 'config.json'}: model_type {model_type!r} is not a transformers model type")
    if "rope_theta" in config and "rope_parameters" not in config:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}
    return transformers.CONFIG_MAPPING[model_type].from_dict(config)


def meta_skeleton(path: Path, config: dict) -> torch.nn.Module:
    """The model's module tree from its `config` (config.json) on the meta device: parameter names and shapes, no
    memory."""
    import transformers

    try:
        config = transformers_config(path, config)  # from the dict read once, not config.json again
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except CONFIG_ERRORS as e:
        raise NpumoeError(f"cannot load model from {path}: {(str(e).splitlines() or [type(e).__name__])[0]}") from None
