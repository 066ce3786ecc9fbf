"""`--model file.gguf`: a GGUF file (llama.cpp, Ollama, LM Studio) run as our model, its quantized weights kept packed.

The file is checked once (`gguf_model.check_tensors`: architecture, metadata types, tensor types, shapes, extent),
then described by a small folder in the cache (config.json from its metadata, the tokenizer from its vocabulary or
from the folder beside it, and `gguf-source.json` naming the file): every command that reads a model folder's
config reads that one, and the loader reads the weights from the file itself. A bad file writes nothing.

Weights: every quantized matrix (experts, attention, embedding, head) becomes a `PackedWeight` in mlx's affine format
at group 32 (`gguf_quants`: exact for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q5_K up to fp16 scale rounding, measured; other
types requantized to 8 bits, their error measured; scales and biases that are not finite refuse the file as corrupt);
a layer's experts a `QuantizedExperts`, never at full width but one expert per call. F32/F16/BF16 tensors are read
whole into the model's dtype.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from runtime.cpu.cpu_backends import PACKED_IMPLEMENTATION
from runtime.cpu.quantized import PackedWeight, QuantizedEmbedding, QuantizedExperts, QuantizedLinear
from runtime.errors import NpumoeError
from runtime.loading.gguf_file import GGUFFile
from runtime.loading.gguf_model import EXPERT_PARTS, architecture, check_tensors, gguf_name, hf_config, qk_row_order
from runtime.loading.gguf_quants import EXACT, GROUP, HALF_WIDTHS, convert_exact, held_bytes, requantize
from runtime.loading.gguf_tokenizer import write_tokenizer

SUFFIX = ".gguf"
SOURCE = "gguf-source.json"
VIEW_VERSION = 2  # bump when what a view folder holds, or what is checked before it is made, changes
BLOCK_VALUES = 1 << 22  # values converted at once (their float32 temporaries: tens of MB)


def is_gguf_path(name: str) -> bool:
    return name.lower().endswith(SUFFIX)


def is_gguf_view(path: Path) -> bool:
    return (Path(path) / SOURCE).exists()


def view_root() -> Path:
    base = os.environ.get("NPUMOE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                          os.path.expanduser("~/.cache"), "npumoe")
    return Path(base) / "gguf"


def gguf_view(name: str) -> Path:
    """The folder describing GGUF file `name` (made once, after the file passes every check)."""
    path = Path(name).expanduser().resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise NpumoeError(f"--model {name}: cannot read the GGUF file: {e.strerror or e}") from None
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{VIEW_VERSION}".encode()).hexdigest()[:20]
    view = view_root() / key
    if is_gguf_view(view):
        return view
    file = GGUFFile(path)
    config = hf_config(file)
    quantization = check_tensors(file, skeleton_of(config))
    view.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=view.parent))
    try:
        write_tokenizer(file, tmp)
        (tmp / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        tensors = {n: [t, int(np.prod(shape))] for n, (t, shape, _, _) in file.tensors.items()}
        (tmp / SOURCE).write_text(json.dumps({"gguf": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                              "quantization": quantization, "tensors": tensors}), encoding="utf-8")
        os.replace(tmp, view)
    except OSError:
        if not is_gguf_view(view):  # another process made it first: theirs stands
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return view


def _source(view: Path) -> dict:
    return json.loads((Path(view) / SOURCE).read_text(encoding="utf-8"))


def check_gguf_view(view: Path) -> str:
    """The file behind a view is the one checked (same size and time); returns its tensor types as canonical JSON
    (what the model fingerprint covers)."""
    source = _source(view)
    try:
        st = Path(source["gguf"]).stat()
    except OSError as e:
        raise NpumoeError(f"{source['gguf']}: cannot read the GGUF file: {e.strerror or e}") from None
    if (st.st_size, st.st_mtime_ns) != (source["size"], source["mtime_ns"]):
        raise NpumoeError(f"{source['gguf']}: changed since it was checked; give --model the file again")
    return source["quantization"]


def skeleton_of(config: dict) -> torch.nn.Module:
    """The model a config dict describes, on the meta device."""
    import transformers

    cfg = transformers.CONFIG_MAPPING[config["model_type"]].from_dict(config)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def held_sizes(view: Path, dtype_bytes: int) -> tuple[int, int]:
    """(all weights, experts) in bytes as `read_gguf_model` holds them in a model of `dtype_bytes` (predicted from
    the tensor table: packed codes with fp16 scales and biases, or whole)."""
    tensors = _source(view)["tensors"]
    sizes = {n: held_bytes(t, numel, dtype_bytes) for n, (t, numel) in tensors.items()}
    experts = sum(b for n, b in sizes.items() if n.rsplit(".", 2)[-2] in EXPERT_PARTS)
    return sum(sizes.values()), experts


def gguf_router(view: Path, param: str) -> torch.Tensor | None:
    """A router weight at full width (float32) read from the file alone, for the model spec; None where absent."""
    tensors = _tensors_of(str(view))
    if param not in tensors:
        return None
    shape = tensors.file.tensors[gguf_name(param)][1]
    return tensors.read(param, torch.empty(shape, dtype=torch.float32))


@functools.lru_cache(maxsize=4)
def _tensors_of(view: str) -> _Tensors:
    """The file behind a view, its header parsed once per process (a spec reads every layer's router)."""
    config = json.loads((Path(view) / "config.json").read_text(encoding="utf-8"))
    return _Tensors(GGUFFile(Path(_source(Path(view))["gguf"]), arrays=False), config)


class _Tensors:
    """The file's tensors by transformers parameter name: read whole into a parameter (`read`, the interface
    `mlx_checkpoint.fill_whole` takes) or converted to a packed weight (`packed`), each conversion's figures kept
    in `report` (GGUF tensor -> type, bits, fp16 rounding, requantization error)."""

    def __init__(self, file: GGUFFile, config: dict) -> None:
        self.file, self.config = file, config
        self.arch = architecture(file)[1]
        self.report: dict[str, dict] = {}

    def __contains__(self, param: str) -> bool:
        return gguf_name(param) in self.file.tensors

    def is_packed(self, param: str) -> bool:
        return param in self and self.file.tensors[gguf_name(param)][0] not in HALF_WIDTHS

    def read(self, param: str, dest: torch.Tensor) -> torch.Tensor:
        """Tensor of `param` read whole into `dest`, a block of rows at a time (q/k rows of a llama file put back)."""
        name = gguf_name(param)
        order = qk_row_order(self.arch, self.config, param)
        rows, n = self.file.rows(name), self.file.tensors[name][1][-1]
        flat = dest.view(rows, n)
        for a, b in _blocks(rows, n) if order is None else [(0, rows)]:
            values = self.file.read_values(name, rows=(a, b))
            flat[a:b] = torch.from_numpy(values if order is None else np.ascontiguousarray(values[order]))
        return dest

    def convert(self, name: str, index: int | None = None, rows: tuple[int, int] | None = None):
        """Rows [a, b) of GGUF tensor `name` (or of its expert `index`) in the affine format, its figures kept."""
        type_name = self.file.tensors[name][0]
        with np.errstate(all="ignore"):  # a corrupt block's factors overflow: refused once below, not warned per block
            if type_name in EXACT:
                out = convert_exact(self.file.read_bytes(name, index, rows), type_name)
            else:
                out = requantize(self.file.read_values(name, index, rows))
        if not out.finite():
            raise NpumoeError(f"{self.file.path}: tensor {name} has scales that are not finite (NaN or inf): the file "
                              "is corrupt")
        entry = self.report.setdefault(name, {"type": type_name, "bits": out.bits, "exact": type_name in EXACT,
                                              "fp16_rounding": 0.0, "requant_error": 0.0})
        entry["fp16_rounding"] = max(entry["fp16_rounding"], out.fp16_rounding)
        entry["requant_error"] = max(entry["requant_error"], out.requant_error)
        return out

    def packed(self, param: str) -> PackedWeight:
        """The matrix of `param` packed, a block of rows at a time (no full-width copy of a vocabulary head)."""
        name = gguf_name(param)
        weight = self._packed(name, [None])
        order = qk_row_order(self.arch, self.config, param)
        if order is not None:
            index = torch.from_numpy(order)
            weight = PackedWeight(weight.packed[index], weight.scales[index], weight.biases[index], weight.bits,
                                  GROUP)
        return weight

    def packed_experts(self, name: str) -> PackedWeight:
        """A 3D expert tensor [E, rows, n] packed one expert (and block of rows) at a time into its place."""
        return self._packed(name, list(range(self.file.tensors[name][1][0])))

    def _packed(self, name: str, experts: list[int | None]) -> PackedWeight:
        rows, n = self.file.rows(name), self.file.tensors[name][1][-1]
        lead = [] if experts == [None] else [len(experts)]
        first = self.convert(name, experts[0], _blocks(rows, n)[0])
        packed = torch.empty((*lead, rows, first.packed.shape[-1]), dtype=torch.int32)
        scales = torch.empty((*lead, rows, n // GROUP), dtype=torch.float16)
        biases = torch.empty_like(scales)
        for e in experts:
            dest = [t if e is None else t[e] for t in (packed, scales, biases)]
            for a, b in _blocks(rows, n):
                out = first if (e, a) == (experts[0], 0) else self.convert(name, e, (a, b))
                dest[0][a:b] = torch.from_numpy(out.packed.view(np.int32))
                dest[1][a:b], dest[2][a:b] = torch.from_numpy(out.scales), torch.from_numpy(out.biases)
        return PackedWeight(packed, scales, biases, first.bits, GROUP)


def _blocks(rows: int, n: int) -> list[tuple[int, int]]:
    """Row ranges of about BLOCK_VALUES values: what one conversion holds at full width at once."""
    step = max(1, BLOCK_VALUES // n)
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]


def _fill_experts(tensors: _Tensors, name: str, experts: torch.nn.Module, dtype: torch.dtype) -> None:
    """`<layer>.mlp.experts` from `blk.<layer>.ffn_{gate,up,down}_exps`: packed, or read whole (F16/F32/BF16)."""
    layer = name.split(".")[2]
    parts = [f"blk.{layer}.{p}.weight" for p in EXPERT_PARTS]
    whole = [tensors.file.tensors[p][0] in HALF_WIDTHS for p in parts]
    if not any(whole):
        del experts.gate_up_proj, experts.down_proj
        experts.npumoe_weights = QuantizedExperts(*(tensors.packed_experts(p) for p in parts))
        return
    if not all(whole):
        raise NpumoeError(f"{tensors.file.path}: blk.{layer}'s expert tensors are partly quantized, partly not")
    e, f, h = experts.num_experts, experts.intermediate_dim, experts.hidden_dim
    gate_up = torch.empty(e, 2 * f, h, dtype=dtype)
    down = torch.empty(e, h, f, dtype=dtype)
    for i in range(e):
        gate_up[i, :f] = torch.from_numpy(tensors.file.read_values(parts[0], i))
        gate_up[i, f:] = torch.from_numpy(tensors.file.read_values(parts[1], i))
        down[i] = torch.from_numpy(tensors.file.read_values(parts[2], i))
    experts.gate_up_proj = torch.nn.Parameter(gate_up, requires_grad=False)
    experts.down_proj = torch.nn.Parameter(down, requires_grad=False)


def read_gguf_model(view: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformers model of the GGUF file behind `view`, its quantized matrices kept packed (module
    docstring); `model.npumoe_gguf_report` holds each converted tensor's figures."""
    import transformers

    from runtime.loading.mlx_checkpoint import fill_whole, set_module

    config = json.loads((Path(view) / "config.json").read_text(encoding="utf-8"))
    tensors = _Tensors(GGUFFile(Path(_source(view)["gguf"]), arrays=False), config)
    cfg = transformers.AutoConfig.from_pretrained(view, local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    tied = cfg.get_text_config().tie_word_embeddings
    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if name.endswith(".mlp.experts") and hasattr(module, "gate_up_proj"):
                _fill_experts(tensors, name, module, dtype)
            elif isinstance(module, torch.nn.Embedding) and tensors.is_packed(name + ".weight"):
                set_module(model, name, QuantizedEmbedding(tensors.packed(name + ".weight"), dtype, module.padding_idx))
            elif isinstance(module, torch.nn.Linear) and tensors.is_packed(name + ".weight"):
                bias = tensors.read(name + ".bias", torch.empty(module.out_features, dtype=dtype)) \
                    if module.bias is not None else None
                set_module(model, name, QuantizedLinear(tensors.packed(name + ".weight"), bias))
        embedding = model.get_input_embeddings()
        if tied and isinstance(embedding, QuantizedEmbedding):
            model.lm_head = QuantizedLinear(embedding.weight_q)
        fill_whole(model, tensors, dtype, tied)
    if any(hasattr(m, "npumoe_weights") for m in model.modules()):
        model.set_experts_implementation(PACKED_IMPLEMENTATION)
    model.npumoe_gguf_report = tensors.report
    print(conversion_line(tensors.file.path, tensors.report), file=sys.stderr)
    return model.eval()


def conversion_line(path: Path, report: dict[str, dict]) -> str:
    """One line: how many tensors of each type were kept packed, exactly or requantized, and the largest error."""
    by_type: dict[str, list[dict]] = {}
    for entry in report.values():
        by_type.setdefault(entry["type"], []).append(entry)
    parts = []
    for type_name, entries in sorted(by_type.items()):
        e = entries[0]
        if e["exact"]:
            rounding = max(x["fp16_rounding"] for x in entries)
            how = f"exact at {e['bits']} bits" + (f", fp16 scales round weights by <= {rounding:.1e}"
                                                  if rounding else "")
        else:
            how = f"requantized to {e['bits']} bits, error <= {max(x['requant_error'] for x in entries):.1e}"
        parts.append(f"{len(entries)} {type_name} ({how})")
    return f"{path.name}: kept packed in groups of {GROUP}: " + ("; ".join(parts) or "none (full-width file)")
