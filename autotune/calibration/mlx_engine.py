"""Calibration through mlx-lm: its own model of the folder (`mlx_lm.load`) prefills the text with every MoE block's
router observed, on the GPU on a Mac (MLX's CPU elsewhere), and writes the same traces as the torch engine.

Each MoE block of mlx-lm's families computes `gates = self.gate(x)`, picks the top-k experts and calls
`self.switch_mlp(x, inds)`. The recorder wraps both: the router's logits, and the expert ids the block handed its
experts with the hidden state they got (so the ids are the model's own choice, never re-derived). The router weight
the traces store (what the experts' outputs are weighted by, as torch's experts module receives it) follows from
the logits by the family's rule (`WEIGHT_RULES`: softmax over the experts, the chosen ones' probabilities,
renormalised over the k where the block does), and each token's k assignments are ordered by that weight, largest
first, as torch's top-k orders them.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from autotune.calibration.traces import Recording, Traces, check_prompts, record_chunks
from autotune.calibration.workload import encode_text
from runtime.errors import NpumoeError
from runtime.loading.checkpoint_reader import is_mlx_checkpoint, read_config
from runtime.loading.checkpoints import check_tokenizer_files
from runtime.loading.gguf_reader import is_gguf_path
from runtime.loading.model_loader import RANDOM_PREFIX, model_dir, open_checkpoint, read_model_spec

log = logging.getLogger("npumoe")

ENGINES = ("torch", "mlx", "auto")
# model_type -> whether the block renormalises the k chosen probabilities (None: as the block's `norm_topk_prob`
# says); every family here routes by a softmax over the router's logits
WEIGHT_RULES: dict[str, bool | None] = {"qwen3_moe": None, "olmoe": None, "qwen2_moe": False, "mixtral": True}


def unavailable(name: str) -> str | None:
    """Why `--engine mlx` cannot calibrate `name` here (None: it can): MLX and mlx-lm importable, a model folder, a
    family whose routing the recorder knows."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError:
        return "MLX and mlx-lm are not installed (pip install mlx-lm; on Linux mlx[cpu])"
    if name.startswith(RANDOM_PREFIX):
        return f"{name} is built by transformers here, not a folder mlx-lm can load"
    if is_gguf_path(name):  # GGUF hook (issue 57): our reader runs it (torch engine)
        return f"{name} is a GGUF file, which mlx-lm does not load here"
    family = read_config(model_dir(name)).get("model_type")
    if family not in WEIGHT_RULES:
        return f"the recorder does not know {family!r} routing (it knows {', '.join(WEIGHT_RULES)})"
    return None


def choose_engine(engine: str, name: str) -> str:
    """The engine `calibrate --engine` runs: torch and mlx as named (mlx refused in one line where it cannot run);
    auto: mlx for an MLX folder mlx-lm can run (its packed weights, on the GPU on a Mac), else torch."""
    if engine == "torch":
        return "torch"
    reason = unavailable(name)
    if engine == "mlx":
        if reason:
            raise NpumoeError(f"--engine mlx: {reason}; give --engine torch")
        return "mlx"
    mlx_folder = reason is None and is_mlx_checkpoint(model_dir(name))
    return "mlx" if mlx_folder else "torch"


class MlxRecorder(Recording):
    """Wraps the router (`gate`) and the experts (`switch_mlp`) of every MoE block of an mlx-lm model; after each
    chunk's forward, `collect` evaluates what they saw and records it."""

    def __init__(self, model, name: str) -> None:
        super().__init__(read_model_spec(name))
        self.model, self.seen = model, {}
        family = read_config(model_dir(name))["model_type"]
        self.blocks = moe_blocks(model)
        if sorted(self.blocks) != list(self.spec.moe_layers):
            raise NpumoeError(f"mlx-lm's model of {name} has MoE blocks at layers {sorted(self.blocks)}, the "
                              f"checkpoint at {self.spec.moe_layers}")
        rule = WEIGHT_RULES[family]
        self.renormalise = {i: bool(getattr(b, "norm_topk_prob", False)) if rule is None else rule
                            for i, b in self.blocks.items()}

    def __enter__(self) -> "MlxRecorder":
        for i, block in self.blocks.items():
            block.gate = _Observed(block.gate, self, i, "logits")
            block.switch_mlp = _Observed(block.switch_mlp, self, i, "inds")
        return self

    def __exit__(self, *exc) -> None:
        for block in self.blocks.values():
            block.gate, block.switch_mlp = block.gate.inner, block.switch_mlp.inner

    def collect(self, out) -> None:
        """Evaluate the chunk's forward `out` with what the routers saw, and record it."""
        import mlx.core as mx

        arrays = {}
        for i, seen in self.seen.items():
            probs = mx.softmax(seen["logits"].astype(mx.float32), axis=-1, precise=True)
            k = seen["inds"].shape[-1]
            arrays[i] = (seen["inds"].reshape(-1, k), mx.take_along_axis(probs, seen["inds"], axis=-1).reshape(-1, k),
                         mx.linalg.norm(seen["x"].astype(mx.float32), axis=-1).reshape(-1))
        mx.eval(out, *(a for v in arrays.values() for a in v))
        self.seen = {}
        for n, (i, (inds, weight, norm)) in enumerate(sorted(arrays.items())):
            inds, weight = np.array(inds), np.array(weight)
            if self.renormalise[i]:
                weight = weight / weight.sum(-1, keepdims=True)
            order = np.argsort(-weight, axis=-1, kind="stable")  # largest first, as torch's top-k
            if n == 0:
                self.open_chunk(inds.shape[0])
            self.add(i, np.take_along_axis(inds, order, -1), np.take_along_axis(weight, order, -1), np.array(norm))


class _Observed:
    """Stands in for a block's router or experts: calls it and keeps its output (the router's logits) or its
    inputs (the experts' hidden state and expert ids) for the recorder. A plain object, not an mlx Module: mlx-lm's
    block only calls it (its module leaves the parameter tree while observed; `MlxRecorder.__exit__` puts it
    back)."""

    def __init__(self, inner, recorder: MlxRecorder, layer: int, what: str) -> None:
        self.inner, self.recorder, self.layer, self.what = inner, recorder, layer, what

    def __call__(self, x, *args):
        out = self.inner(x, *args)
        seen = self.recorder.seen.setdefault(self.layer, {})
        if self.what == "logits":
            seen["logits"] = out
        else:
            seen["x"], seen["inds"] = x, args[0]
        return out


def moe_blocks(model) -> dict[int, object]:
    """{decoder layer: its MoE block} of an mlx-lm model: the blocks with a router `gate` and experts
    `switch_mlp`."""
    inner = getattr(model, "model", model)
    blocks = {}
    for i, layer in enumerate(inner.layers):
        block = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if block is not None and hasattr(block, "gate") and hasattr(block, "switch_mlp"):
            blocks[i] = block
    return blocks


def load_mlx(name: str, dtype: str):
    """(mlx-lm's model of the folder, its tokenizer). `dtype` other than auto casts its floating parameters (the
    scales of packed weights included: float32 widens mlx-lm's bf16 exactly); a packed router is then dequantized
    in float32 first and its weight cast, as our torch loader holds routers (`runtime.loading.mlx_checkpoint`
    `dequantized`), so both engines route on the same numbers."""
    import mlx.core as mx
    import mlx.nn as nn
    import mlx_lm
    from mlx.utils import tree_map

    path = model_dir(name)
    open_checkpoint(path)  # its files whole and its config agreeing, as the torch engine checks: one line, not mlx's
    check_tokenizer_files(path)
    config = read_config(path)
    # transformers 5 keeps rope_theta under rope_parameters only; mlx-lm reads it at the top level
    rope = {"rope_theta": config["rope_parameters"]["rope_theta"]} if "rope_theta" not in config and "rope_theta" in (
        config.get("rope_parameters") or {}) else {}
    try:
        model, tokenizer = mlx_lm.load(str(path), model_config=rope)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise NpumoeError(f"--engine mlx: mlx-lm cannot load {name}: {str(e).splitlines()[0][:160]}") from None
    dtype = cpu_dtype(model, name, dtype)
    if dtype != "auto":
        to = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype]
        for block in moe_blocks(model).values():
            gate = block.gate
            if isinstance(gate, nn.QuantizedLinear):
                biases = gate.get("biases")
                weight = mx.dequantize(gate.weight, gate.scales.astype(mx.float32),
                                       None if biases is None else biases.astype(mx.float32), gate.group_size,
                                       gate.bits, gate.mode)
                block.gate = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in gate)
                block.gate.update({"weight": weight, **({"bias": gate.bias} if "bias" in gate else {})})
        model.update(tree_map(lambda a: a.astype(to) if mx.issubdtype(a.dtype, mx.floating) else a,
                              model.parameters()))
    return model, tokenizer


def cpu_dtype(model, name: str, dtype: str) -> str:
    """The dtype mlx-lm's model of `name` computes in: as asked, except on MLX's CPU with full-width experts, whose
    gather_mm multiplies float32 only: there auto computes in float32 (said once) and a half dtype is refused
    (packed experts run gather_qmm, which takes their own dtype)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    packed = all(any(k.endswith("scales") for k, _ in tree_flatten(b.switch_mlp.parameters()))
                 for b in moe_blocks(model).values())
    if mx.default_device() != mx.cpu or packed or dtype == "float32":
        return dtype
    if dtype != "auto":
        raise NpumoeError(f"--engine mlx --dtype {dtype}: MLX's CPU multiplies {name}'s full-width experts in "
                          "float32 only (its gather_mm); give --dtype float32 or auto")
    log.warning(f"--engine mlx: {name}'s full-width experts computed in float32 (MLX's CPU gather_mm takes no other)")
    return "float32"


def record_mlx_traces(name: str, text: str, chunk_tokens: int, prompt_tokens: int, max_tokens: int,
                      dtype: str = "auto", progress: bool = True) -> tuple[Traces, int]:
    """(traces of mlx-lm's model of `name` on `text`, as `traces.record_traces` records torch's, the decoder stack
    alone per chunk with mlx-lm's KV cache; the token count)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load_mlx(name, dtype)
    ids = encode_text(tokenizer, text, max_tokens)
    check_prompts(len(ids), prompt_tokens, text)
    stack = getattr(model, "model", model)  # the decoder stack: no LM head, as the torch engine
    cache = None

    def forward(chunk: torch.Tensor, first: bool) -> None:
        nonlocal cache
        if first:
            cache = make_prompt_cache(model)
        recorder.collect(stack(mx.array(chunk.numpy()[None]), cache=cache))

    with MlxRecorder(model, name) as recorder:
        traces = record_chunks(recorder, forward, ids, chunk_tokens, prompt_tokens, text, progress,
                               engine="mlx", device=str(mx.default_device()))
    return traces, len(ids)


def peak_memory_gb() -> float:
    """MLX's peak memory (its allocator's: the GPU's on a Mac) in GB."""
    import mlx.core as mx

    return round(mx.get_peak_memory() / 1e9, 4)

