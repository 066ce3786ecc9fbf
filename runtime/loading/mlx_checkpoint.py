"""MLX checkpoints as `mlx_lm.convert -q` writes them, read without mlx and kept packed: uint32 codes with per-group
`scales` and `biases` (affine mode), the format in config.json's `quantization` (defaults, and per-module entries
that override them or say `false`), experts under `mlp.switch_mlp.{gate,up,down}_proj` (`block_sparse_moe` in place
of `mlp` for Mixtral and PhiMoE, as mlx-lm names their block, router included), quantized embeddings, heads and
routers.

The model is built on the meta device and every module filled from the files: a quantized linear layer becomes a
`QuantizedLinear`, the embedding a `QuantizedEmbedding` (a tied head shares its table), a layer's experts a
`QuantizedExperts` (`runtime.cpu.quantized`); routers, small, are dequantized into their weight (the routing then is the
same matrix mlx multiplies by). Nothing is ever held at full width but one call's weight. Bad files fail in one line
naming the tensor or the module.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from runtime.cpu.cpu_backends import PACKED_IMPLEMENTATION
from runtime.cpu.quantized import (
    PackedWeight,
    QuantizedEmbedding,
    QuantizedExperts,
    QuantizedLinear,
    check_format,
    check_packed,
)
from runtime.errors import NpumoeError
from runtime.loading.checkpoint_reader import (
    ROUTER_KEY_FORMS,
    SAFETENSORS_DTYPES,
    read_tensor_into,
    tensor_index,
    transformers_config,
)
from runtime.loading.checkpoints import check_finite, safetensors_header
from runtime.loading.model_config import read_config

# mlx-lm's names of a layer's MoE block (transformers 5 says `mlp` for every family) and of its experts' parts.
MOE_BLOCKS = (".mlp.", ".block_sparse_moe.")
SWITCH_PARTS = ("gate_proj", "up_proj", "down_proj")
RAW_DTYPES = {"U32": torch.int32, "I32": torch.int32, **SAFETENSORS_DTYPES}  # codes are kept as int32 words


class _Files:
    """The checkpoint's tensor table, read tensor by tensor with plain file reads; remembers what was used."""

    def __init__(self, path: Path) -> None:
        self.keys = tensor_index(path)
        self.headers = {f: safetensors_header(f) for f in set(self.keys.values())}
        self.used: set[str] = set()

    def __contains__(self, key: str) -> bool:
        return key in self.keys

    def shape(self, key: str) -> list[int] | None:
        return self.headers[self.keys[key]][key]["shape"] if key in self.keys else None

    def dtype(self, key: str) -> str:
        return self.headers[self.keys[key]][key]["dtype"]

    def read(self, key: str, dest: torch.Tensor | None = None) -> torch.Tensor:
        """The stored tensor (codes as int32 words), or read into `dest` converting its dtype."""
        file = self.keys[key]
        entry = self.headers[file][key]
        if entry["dtype"] not in RAW_DTYPES:
            raise NpumoeError(f"{file}: tensor {key} has dtype {entry['dtype']}, which this reader does not take")
        with open(file, "rb") as f:
            start = 8 + int.from_bytes(f.read(8), "little")
            if dest is None:
                dest = torch.empty(entry["shape"], dtype=RAW_DTYPES[entry["dtype"]])
                f.seek(start + entry["data_offsets"][0])
                f.readinto(dest.view(-1).view(torch.uint8).numpy())
            else:
                read_tensor_into(f, start, entry, dest)
        self.used.add(key)
        return dest


class _Formats:
    """config.json's `quantization`: defaults and per-module overrides (a dict, or false for a module left whole)."""

    def __init__(self, table: dict) -> None:
        self.table = table
        self.default = (table.get("bits", 4), table.get("group_size", 64), table.get("mode", "affine"))

    def of(self, module: str) -> tuple[int, int, str] | None:
        entry = self.table.get(module, True)
        if entry is False:
            return None
        if isinstance(entry, dict):
            return (entry.get("bits", self.default[0]), entry.get("group_size", self.default[1]),
                    entry.get("mode", self.default[2]))
        return self.default


def expert_formats(path: Path) -> dict[str, tuple[int, int, str]]:
    """The (bits, group size, mode) each packed expert projection of MLX folder `path` states, by module prefix
    (`default` for those no per-module entry overrides): what an exact path running the packed codes must take."""
    formats = _Formats(read_config(path)["quantization"])
    out = {"default": formats.default}
    for module in formats.table:
        if "switch_mlp" in module:
            fmt = formats.of(module)
            if fmt is not None:
                out[module] = fmt
    return out


def _packed(files: _Files, formats: _Formats, module: str, inputs: int) -> PackedWeight | None:
    """The packed weight of mlx module `module` (None where it is stored whole), checked against its format."""
    weight = f"{module}.weight"
    if f"{module}.scales" not in files and f"{module}.biases" not in files:
        if weight in files and files.dtype(weight) in ("U32", "I32"):
            raise NpumoeError(f"{weight}: quantized weight without its {module}.scales")
        return None
    fmt = formats.of(module) or formats.default
    bits, group, mode = fmt
    check_format(module, bits, group, mode)
    check_packed(weight, files.shape(weight), files.shape(f"{module}.scales"), files.shape(f"{module}.biases"),
                 inputs, bits, group)
    factors = {f"{module}.{k}": files.read(f"{module}.{k}") for k in ("scales", "biases")}
    check_finite(str(files.keys[weight]), factors.items())  # a NaN scale makes its group's weights NaN
    return PackedWeight(files.read(weight), *factors.values(), bits, group)


def _stored(files: _Files, name: str, suffix: str = ".weight") -> str:
    """Where the checkpoint stores transformers' `name` (a module, or a parameter with `suffix` ""): mlx-lm keeps
    Mixtral's and PhiMoE's MoE block as `block_sparse_moe` and PhiMoE's router as `gate`, where transformers 5 says
    `mlp` and `router`."""
    if f"{name}{suffix}" in files:
        return name
    dotted = f"{name}."
    for old in (*ROUTER_KEY_FORMS, MOE_BLOCKS[0]):
        for new in (*ROUTER_KEY_FORMS, MOE_BLOCKS[1]):
            other = dotted.replace(old, new, 1)[:-1]
            if old in dotted and (f"{other}{suffix}" in files or f"{other}.scales" in files):
                return other
    return name


def set_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _fill_experts(files: _Files, formats: _Formats, name: str, experts: torch.nn.Module, dtype: torch.dtype) -> None:
    """`<layer>.mlp.experts` from `<layer>.{mlp|block_sparse_moe}.switch_mlp.<part>`: packed, or stacked whole."""
    layer, parts = name[:-len(".mlp.experts")], SWITCH_PARTS
    base = _stored(files, f"{layer}.mlp.switch_mlp", f".{parts[0]}.weight")
    if f"{base}.{parts[0]}.weight" not in files:
        raise NpumoeError(f"{name}: no {layer}.{{{'|'.join(b.strip('.') for b in MOE_BLOCKS)}}}.switch_mlp."
                          f"{parts[0]}.weight in the checkpoint")
    h, f = experts.hidden_dim, experts.intermediate_dim
    packed = [_packed(files, formats, f"{base}.{p}", n) for p, n in zip(parts, (h, h, f))]
    if all(p is not None for p in packed):
        del experts.gate_up_proj, experts.down_proj
        experts.npumoe_weights = QuantizedExperts(*packed)
        return
    if any(p is not None for p in packed):
        raise NpumoeError(f"{base}: some expert projections are quantized and some are not")
    e = experts.num_experts
    experts.gate_up_proj = torch.nn.Parameter(torch.empty(e, 2 * f, h, dtype=dtype), requires_grad=False)
    experts.down_proj = torch.nn.Parameter(torch.empty(e, h, f, dtype=dtype), requires_grad=False)
    files.read(f"{base}.{parts[0]}.weight", experts.gate_up_proj[:, :f])
    files.read(f"{base}.{parts[1]}.weight", experts.gate_up_proj[:, f:])
    files.read(f"{base}.{parts[2]}.weight", experts.down_proj)


def read_mlx_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of an MLX checkpoint folder, its quantized weights kept packed (module docstring)."""
    import transformers

    table = read_config(path)
    config, formats = transformers_config(path, table), _Formats(table["quantization"])
    files = _Files(path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    experts = {n: m for n, m in model.named_modules() if n.endswith(".mlp.experts") and hasattr(m, "gate_up_proj")}
    routers = {id(m) for n, m in model.named_modules() if n.endswith((".mlp.gate", ".mlp.router"))
               and isinstance(getattr(m, "weight", None), torch.nn.Parameter)}
    tied = config.get_text_config().tie_word_embeddings
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if name in experts:
                _fill_experts(files, formats, name, module, dtype)
            elif isinstance(module, torch.nn.Embedding):
                packed = _packed(files, formats, name, module.embedding_dim)
                if packed is not None:
                    set_module(model, name, QuantizedEmbedding(packed, dtype, module.padding_idx))
            elif isinstance(module, torch.nn.Linear) or id(module) in routers:
                source = _stored(files, name)
                if tied and name == "lm_head" and "lm_head.weight" not in files:
                    continue  # shares the embedding, below
                inputs = module.weight.shape[1]
                packed = _packed(files, formats, source, inputs)
                if packed is None:
                    continue
                if id(module) in routers:  # small: dequantized in float32 (`dequantized_router`), then in the run's
                    # dtype; float32 rows meet it as mlx's quantized matmul does (bf16 rounding flips experts there)
                    module.weight = torch.nn.Parameter(dequantized(packed).to(dtype), requires_grad=False)
                else:
                    bias = files.read(f"{source}.bias", torch.empty(module.out_features, dtype=dtype)) \
                        if module.bias is not None else None
                    set_module(model, name, QuantizedLinear(packed, bias))
        if tied and hasattr(model, "lm_head") and "lm_head.weight" not in files:
            embedding = model.get_input_embeddings()
            if isinstance(embedding, QuantizedEmbedding):
                model.lm_head = QuantizedLinear(embedding.weight_q)
        fill_whole(model, files, dtype, tied)
    if any(hasattr(m, "npumoe_weights") for m in experts.values()):
        model.set_experts_implementation(PACKED_IMPLEMENTATION)
    unused = sorted(set(files.keys) - files.used)
    if unused:
        raise NpumoeError(f"{path}: the checkpoint holds tensors the model has no place for (first: {unused[0]})")
    return model.eval()


def fill_whole(model: torch.nn.Module, files: _Files, dtype: torch.dtype, tied: bool) -> None:
    """Every parameter still on the meta device, read whole; buffers made by a module's constructor (rotary
    frequencies) made again on the CPU."""
    for name, p in list(model.named_parameters()):
        if not p.is_meta:
            continue
        key = _stored(files, name, "")
        if key not in files and tied and name == "lm_head.weight":
            model.tie_weights()
            continue
        if key not in files:
            raise NpumoeError(f"{name}: not in the checkpoint's safetensors files")
        value = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype)
        files.read(key, value)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, torch.nn.Parameter(value, requires_grad=False))
    head = getattr(model, "lm_head", None)
    if tied and getattr(getattr(head, "weight", None), "is_meta", False):
        # a whole tied head never shows in named_parameters (shared with the meta embedding): share it again
        head.weight = model.get_input_embeddings().weight
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            remade = type(module)(config=model.config)
            set_module(model, name, remade)


def dequantized_router(files: dict[str, Path], module_key: str, quantization: dict) -> torch.Tensor | None:
    """A router weight of an MLX checkpoint at full width (float32), for the model spec; None where not stored.
    `quantization`: config.json's table."""
    path = next(iter(files.values())).parent
    table = _Files(path)
    formats = _Formats(quantization)
    module = module_key[:-len(".weight")]
    if f"{module}.scales" not in table:
        return table.read(module_key, torch.empty(table.shape(module_key))) if module_key in table else None
    fmt = formats.of(module) or formats.default
    shape = table.shape(module_key)
    check_packed(module_key, shape, table.shape(f"{module}.scales"), table.shape(f"{module}.biases"),
                 shape[-1] * 32 // fmt[0], fmt[0], fmt[1])
    return dequantized(PackedWeight(table.read(module_key), table.read(f"{module}.scales"),
                                    table.read(f"{module}.biases"), fmt[0], fmt[1]))


def dequantized(weight: PackedWeight) -> torch.Tensor:
    """A packed router at full width, computed in float32 (or wider scales'): one value whatever the run's dtype,
    so the model's fingerprint (its routers rounded to bf16) is one for every dtype and for the files alone."""
    return weight.full(torch.promote_types(weight.scales.dtype, torch.float32))


def check_mlx_checkpoint(path: Path, table: dict) -> str:
    """An MLX folder checked from config.json and the tensor headers alone, before any command works on it: every
    format its `quantization` names (the default and each module's) is one we decode, every tensor's dtype one we
    read, and every packed weight's shape fits its format. Returns the format each packed module is stored in, as
    canonical JSON (what the model fingerprint covers: however the table spells it). Each failure is one line
    naming config.json, the module or the tensor. `table`: config.json's `quantization`."""
    formats = _Formats(table)
    check_format(str(path / "config.json"), *formats.default)
    for module, entry in table.items():
        if isinstance(entry, dict):
            check_format(f"{path / 'config.json'} quantization.{module}", *formats.of(module))
    files = _Files(path)
    applied = {}
    for key in files.keys:
        if files.dtype(key) not in RAW_DTYPES:
            raise NpumoeError(f"{files.keys[key]}: tensor {key} has dtype {files.dtype(key)}, which this reader "
                              "does not take")
        module = key.rpartition(".")[0]
        if key.endswith(".weight") and files.dtype(key) in ("U32", "I32") and f"{module}.scales" not in files:
            raise NpumoeError(f"{key}: quantized weight without its {module}.scales")
        if key.endswith(".scales"):
            bits, group, _ = applied[module] = formats.of(module) or formats.default
            weight, scales = f"{module}.weight", files.shape(key)
            if weight not in files:
                raise NpumoeError(f"{key}: scales without their quantized weight {weight}")
            check_packed(weight, files.shape(weight), scales, files.shape(f"{module}.biases"),
                         scales[-1] * group if scales else 0, bits, group)
    return json.dumps(applied, sort_keys=True)
