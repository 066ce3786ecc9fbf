"""Routing traces `npumoe.traces/1`: what the router chose on real text, per layer and chunk.

Stored as a numpy `.npz` (no pickle): a JSON header (schema, the `ModelSpec`, text, chunking, split) and per MoE layer
every assignment's expert id, router weight and the token's hidden-state norm (the inputs of both saliency
rules), with the chunk each token belongs to and whether that chunk is calibration or held-out. Whole prompts go
to one split, so held-out chunks come from text the calibration part never saw.
"""
from __future__ import annotations

import io
import json
import os
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from pydantic import ValidationError
from tqdm import tqdm

from runtime.cpu.allocator import release_freed_heap
from runtime.errors import FileFormatError, NpumoeError
from runtime.fileio import atomic_write_bytes, check_schema, validation_error
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.plan import ModelSpec

SCHEMA, KIND, VERSION = "npumoe.traces/1", "traces", 1
HELDOUT_EVERY = 5  # every 5th prompt is held out


@dataclass
class Traces:
    """Per-layer assignments plus the header. `counts(layer, split)` is the sufficient summary the search uses."""
    header: dict
    layers: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)  # idx [N,k], weight [N,k], norm [N]
    chunk: np.ndarray | None = None  # [N] chunk id of each token
    heldout_chunks: np.ndarray | None = None  # [n_chunks] bool
    _counts: dict = field(default_factory=dict, repr=False)

    @property
    def spec(self) -> dict:
        return self.header["model"]

    @property
    def n_chunks(self) -> int:
        return int(self.header["n_chunks"])

    @property
    def prompt_tokens(self) -> int:
        return int(self.header.get("prompt_tokens") or self.header["chunk_tokens"])

    def workload(self, chunk_tokens: int, prompt_tokens: int | None = None) -> "Workload":
        """The traced tokens as prompts of `prompt_tokens` (default: as traced) prefilled in chunks of
        `chunk_tokens`; see `Workload`."""
        return Workload.cut(self, chunk_tokens, prompt_tokens or self.prompt_tokens)

    def counts(self, layer: int, split: str) -> np.ndarray:
        """[chunks in split, E] assignments per expert per chunk (split: calib | heldout | all)."""
        key = (layer, split)
        if key not in self._counts:
            if "counts" in self.layers[layer]:  # synthetic traces hold only the summary
                full = self.layers[layer]["counts"]
            else:
                e = self.spec["num_experts"]
                idx = self.layers[layer]["idx"]
                k = idx.shape[1]
                flat = np.repeat(self.chunk, k) * e + idx.reshape(-1).astype(np.int64)
                full = np.bincount(flat, minlength=self.n_chunks * e).reshape(self.n_chunks, e)
            mask = {"calib": ~self.heldout_chunks, "heldout": self.heldout_chunks,
                    "all": np.ones(self.n_chunks, bool)}[split]
            self._counts[key] = full[mask]
        return self._counts[key]


@dataclass
class Workload:
    """Traced tokens re-chunked: each split's tokens (calibration, held-out: whole traced prompts, so the split
    stays by prompt) in order, cut into prompts of `prompt_tokens` and each prompt into chunks of `chunk_tokens`,
    the last one partial where the prompt is not a multiple. Routing is per token, so re-chunking keeps it; a
    prompt longer than the traced ones joins traced prompts (routing recorded with the shorter context). An
    incomplete last calibration prompt is left out (every costed prompt has `prompt_tokens` tokens) unless it is
    the only one."""
    chunk_tokens: int
    prompt_tokens: int
    token_chunk: np.ndarray  # [traced tokens] the new chunk of each token, -1 where left out
    heldout: np.ndarray  # [chunks] bool
    sizes: np.ndarray  # [chunks] tokens

    @classmethod
    def cut(cls, traces: "Traces", chunk_tokens: int, prompt_tokens: int) -> "Workload":
        if traces.chunk is None:
            if (chunk_tokens, prompt_tokens) != (traces.header["chunk_tokens"], traces.prompt_tokens):
                raise NpumoeError("these traces hold counts per chunk only (synthetic); they cannot be re-chunked "
                                  f"to {chunk_tokens}-token chunks of {prompt_tokens}-token prompts")
            sizes = np.full(traces.n_chunks, traces.header["chunk_tokens"])
            return cls(chunk_tokens, prompt_tokens, np.arange(traces.n_chunks), traces.heldout_chunks, sizes)
        token_chunk = np.full(traces.chunk.size, -1, dtype=np.int64)
        heldout, sizes, start = [], [], 0
        for split in (False, True):
            tokens = np.nonzero(traces.heldout_chunks[traces.chunk] == split)[0]
            if not split and tokens.size > prompt_tokens:
                tokens = tokens[:tokens.size // prompt_tokens * prompt_tokens]
            j = np.arange(tokens.size)
            per_prompt = -(-prompt_tokens // chunk_tokens)
            ids, local = np.unique(j // prompt_tokens * per_prompt + j % prompt_tokens // chunk_tokens,
                                   return_inverse=True)
            token_chunk[tokens] = start + local
            sizes.append(np.bincount(local, minlength=ids.size))
            heldout += [split] * ids.size
            start += ids.size
        return cls(chunk_tokens, prompt_tokens, token_chunk, np.array(heldout, dtype=bool), np.concatenate(sizes))

    def counts(self, traces: "Traces", layer: int, split: str) -> np.ndarray:
        """[chunks in split, E] assignments per expert per chunk of this workload."""
        if traces.chunk is None:
            return traces.counts(layer, split)
        e = traces.spec["num_experts"]
        idx = traces.layers[layer]["idx"]
        keep = self.token_chunk >= 0
        flat = np.repeat(self.token_chunk[keep], idx.shape[1]) * e + idx[keep].reshape(-1).astype(np.int64)
        full = np.bincount(flat, minlength=self.sizes.size * e).reshape(self.sizes.size, e)
        return full[{"calib": ~self.heldout, "heldout": self.heldout}[split]]


class Recording:
    """Routing recorded chunk by chunk, per MoE layer: each assignment's expert id and router weight, and the token's
    hidden-state norm. The engines' recorders (`RoutingRecorder` here in torch, `mlx_engine.MlxRecorder` in mlx-lm)
    fill it; `traces` turns it into traces, whichever engine recorded."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.rec: dict[int, dict[str, list]] = {i: {"idx": [], "weight": [], "norm": []} for i in spec.moe_layers}
        self.chunk_ids: list[np.ndarray] = []

    def open_chunk(self, tokens: int) -> None:
        self.chunk_ids.append(np.full(tokens, len(self.chunk_ids), dtype=np.int32))

    def add(self, layer: int, idx: np.ndarray, weight: np.ndarray, norm: np.ndarray) -> None:
        """One chunk's routing at one MoE layer: idx, weight [tokens, k], norm [tokens]."""
        self.rec[layer]["idx"].append(idx.astype(np.int16))
        self.rec[layer]["weight"].append(weight.astype(np.float32))
        self.rec[layer]["norm"].append(norm.astype(np.float32))

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_ids)

    def expert_counts(self) -> np.ndarray:
        """Assignments recorded per (MoE layer, expert): shape [layers, experts]."""
        e = self.spec.num_experts
        return np.stack([np.bincount(np.concatenate(r["idx"]).reshape(-1), minlength=e) if r["idx"]
                         else np.zeros(e, dtype=np.int64) for r in self.rec.values()])

    def traces(self, heldout: np.ndarray, header: dict) -> Traces:
        """The recorded chunks as traces; `heldout[c]` says whether chunk c is held out; `header` adds to the
        schema, model, chunk count and token count."""
        if self.n_chunks == 0:
            raise NpumoeError("no routing was recorded (no tokens went through the model)")
        chunk = np.concatenate(self.chunk_ids)
        full = {"schema": SCHEMA, "model": self.spec.to_json(), "tokens": int(chunk.size),
                "n_chunks": self.n_chunks, **header}
        arrays = {i: {k: np.concatenate(v) for k, v in r.items()} for i, r in self.rec.items()}
        return Traces(full, arrays, chunk, np.asarray(heldout, dtype=bool))


class RoutingRecorder(Recording):
    """Records every MoE layer's routing through forward pre-hooks on its experts module, one model forward per
    chunk. Works under any experts implementation (the plan's executor included), so a run records the routing it
    saw."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model_spec(model))
        self.model, self.layers = model, moe_layers(model)
        self._hooks: list = []

    def _hook(self, mod, args, kwargs, i: int) -> None:
        x, idx, w = args if len(args) == 3 else (kwargs["hidden_states"], kwargs["top_k_index"],
                                                  kwargs["top_k_weights"])
        if i == self.layers[0].index:  # the first MoE layer opens a new chunk
            self.open_chunk(idx.shape[0])
        self.add(i, idx.numpy(), w.float().numpy(), x.float().norm(dim=-1).numpy())

    def __enter__(self) -> "RoutingRecorder":
        self._hooks = [layer.experts.register_forward_pre_hook(
            lambda mod, args, kwargs, i=layer.index: self._hook(mod, args, kwargs, i), with_kwargs=True)
            for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()


def record_chunks(recording: Recording, forward: Callable[[torch.Tensor, bool], None], ids: torch.Tensor,
                  chunk_tokens: int, prompt_tokens: int, text: str, progress: bool = True,
                  heldout_per: str = "prompt", **header) -> Traces:
    """Prefill `ids` as prompts of `prompt_tokens`, chunk by chunk (`forward(chunk ids, opens a prompt)`, one engine's
    forward that fills `recording`), and return the traces. Every HELDOUT_EVERY-th prompt is held out
    (`heldout_per="chunk"`: every HELDOUT_EVERY-th chunk, for a run that is often one long prompt); `header` adds to
    the traces header."""
    heldout = []
    starts = range(0, ids.numel(), prompt_tokens)
    for p, start in enumerate(tqdm(starts, desc="calibrate", unit="prompt", disable=not progress)):
        prompt = ids[start:start + prompt_tokens]
        for s in range(0, prompt.numel(), chunk_tokens):
            forward(prompt[s:s + chunk_tokens], s == 0)
            heldout.append((p if heldout_per == "prompt" else len(heldout)) % HELDOUT_EVERY == HELDOUT_EVERY - 1)
    return recording.traces(heldout, {"text": text, "chunk_tokens": chunk_tokens, "prompt_tokens": prompt_tokens,
                                      "heldout_rule": f"every {HELDOUT_EVERY}th {heldout_per}", **header})


def record_traces(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int, prompt_tokens: int,
                  text: str, progress: bool = True, heldout_per: str = "prompt", **header) -> Traces:
    """`record_chunks` in torch, under whatever experts implementation the model has (a plan's executor
    included)."""
    cache = None

    def forward(chunk: torch.Tensor, first: bool) -> None:
        nonlocal cache
        # The decoder stack only: routing is all calibration records, so the LM head's full-vocabulary logits
        # (most of the time on a large-vocabulary model) are never computed.
        cache = model.model(input_ids=chunk[None], cache=None if first else cache, use_cache=True).cache
        release_freed_heap()

    with RoutingRecorder(model) as recorder, torch.inference_mode():
        return record_chunks(recorder, forward, ids, chunk_tokens, prompt_tokens, text, progress, heldout_per,
                             **header)


TIE_TOLERANCE = 1e-4  # router weights closer than this are a tie: fp rounding picks between them


def routing_agreement(a: Traces, b: Traces, tol: float = TIE_TOLERANCE) -> dict:
    """How two recordings of the same tokens (two engines on one folder and text) agree, per MoE layer and in all:
    `tokens`; `agree`, tokens routed to the same k experts; `ties`, tokens routed apart where both recordings'
    sorted router weights still agree within `tol` (experts of equal weight swapped: fp rounding decided); `differ`,
    the rest. `max_weight_diff`: over the tokens routed to the same experts in the same order; `max_norm_rel_diff`:
    the hidden-state norms', over every token."""
    if a.chunk is None or b.chunk is None or not np.array_equal(a.chunk, b.chunk):
        raise NpumoeError("the two traces do not hold the same tokens in the same chunks: record one text, "
                          "chunking and prompt length with both")
    rows, total = {}, dict.fromkeys(("tokens", "agree", "ties", "differ"), 0)
    weight_diff, norm_diff = 0.0, 0.0
    for layer in a.layers:
        x, y = a.layers[layer], b.layers[layer]
        same = (np.sort(x["idx"], 1) == np.sort(y["idx"], 1)).all(1)
        level = (np.abs(np.sort(x["weight"], 1) - np.sort(y["weight"], 1)) <= tol).all(1)
        row = {"tokens": int(same.size), "agree": int(same.sum()), "ties": int((~same & level).sum()),
               "differ": int((~same & ~level).sum())}
        rows[str(layer)] = row
        total = {k: total[k] + row[k] for k in total}
        ordered = (x["idx"] == y["idx"]).all(1)
        weight_diff = max(weight_diff, float(np.abs(x["weight"] - y["weight"])[ordered].max(initial=0.0)))
        norm_diff = max(norm_diff, float((np.abs(x["norm"] - y["norm"]) / np.maximum(y["norm"], 1e-12)).max()))
    return {**total, "tie_tolerance": tol, "max_weight_diff": weight_diff, "max_norm_rel_diff": norm_diff,
            "layers": rows}


def check_prompts(tokens: int, prompt_tokens: int, text: str) -> None:
    """Refuse a text too short for a held-out prompt: every HELDOUT_EVERY-th prompt is held out."""
    prompts = -(-tokens // prompt_tokens)
    if prompts < HELDOUT_EVERY:
        raise NpumoeError(f"{tokens} tokens of {text} make {prompts} prompt(s) of {prompt_tokens} tokens; held-out "
                          f"chunks come from every {HELDOUT_EVERY}th prompt, so give at least "
                          f"{HELDOUT_EVERY * prompt_tokens} tokens (a longer --text, a larger --max-tokens or a "
                          "smaller --prompt-tokens)")


def require_recordable(tokens: int, chunk_tokens: int, prompt_tokens: int, remedy: str) -> None:
    """Refuse up front a recording that would hold no held-out chunk (every HELDOUT_EVERY-th chunk is held out, and
    `search` refuses traces without one), as `calibrate` refuses too short a text: `tokens` prefilled as prompts of
    `prompt_tokens`, each in chunks of `chunk_tokens`."""
    full, rest = divmod(tokens, prompt_tokens)
    chunks = full * -(-prompt_tokens // chunk_tokens) + -(-rest // chunk_tokens)
    if chunks < HELDOUT_EVERY:
        raise NpumoeError(f"--record-traces: {tokens} tokens make {chunks} chunk(s) of at most {chunk_tokens}; "
                          f"every {HELDOUT_EVERY}th chunk is held out, so a search needs at least "
                          f"{HELDOUT_EVERY * chunk_tokens} tokens: {remedy}")


def record_run_traces(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int, prompt_tokens: int, text: str,
                      path: str | os.PathLike, recorded_by: str) -> dict:
    """Record the routing of a planned run (untimed) as traces a search can re-tune on, and save them; returns
    the summary `--json` prints."""
    traces = record_traces(model, ids, chunk_tokens, prompt_tokens, text, progress=False, heldout_per="chunk",
                           recorded_by=recorded_by)
    save_traces(traces, path)
    return {"path": str(path), "chunks": traces.n_chunks, "heldout_chunks": int(traces.heldout_chunks.sum())}


def synthetic_traces(spec: dict, n_chunks: int, chunk_tokens: int, skew: float = 1.1, heldout_every: int = 5,
                     seed: int = 0, tokens: bool = False) -> Traces:
    """Traces with Zipf(skew) expert popularity, a different hot set per layer (for search tests and benchmarks at
    shapes we cannot run here, such as Qwen3-30B-A3B). Counts only, each chunk a prompt; with `tokens`, every
    token's experts (router weights 1/k, norms 1), each chunk a prompt too, so they re-chunk
    (`Traces.workload`) into any chunk up to `chunk_tokens`."""
    rng = np.random.default_rng(seed)
    e, k = spec["num_experts"], spec["top_k"]
    layers = {}
    for layer in spec["moe_layers"]:
        pop = rng.permutation(1.0 / np.arange(1, e + 1) ** skew)
        counts = np.zeros((n_chunks, e), dtype=np.int64)
        idx = np.zeros((n_chunks * chunk_tokens if tokens else 0, k), dtype=np.int16)
        for c in range(n_chunks):
            drift = pop * rng.lognormal(0.0, 0.3, e)  # chunk-to-chunk variation of the routing
            # top-k without replacement per token via Gumbel top-k on log-popularity
            g = np.log(drift)[None, :] + rng.gumbel(size=(chunk_tokens, e))
            chosen = np.argpartition(-g, k - 1, axis=1)[:, :k]
            counts[c] = np.bincount(chosen.reshape(-1), minlength=e)
            if tokens:
                idx[c * chunk_tokens:(c + 1) * chunk_tokens] = chosen
        layers[layer] = ({"idx": idx, "weight": np.full(idx.shape, 1.0 / k, dtype=np.float32),
                          "norm": np.ones(idx.shape[0], dtype=np.float32)} if tokens else {"counts": counts})
    header = {"schema": SCHEMA, "model": spec, "text": f"synthetic zipf({skew})", "chunk_tokens": chunk_tokens,
              "prompt_tokens": chunk_tokens, "tokens": n_chunks * chunk_tokens, "n_chunks": n_chunks,
              "heldout_rule": f"every {heldout_every}th chunk", "synthetic": True}
    heldout = np.arange(n_chunks) % heldout_every == heldout_every - 1
    chunk = np.repeat(np.arange(n_chunks, dtype=np.int32), chunk_tokens) if tokens else None
    return Traces(header, layers, chunk, heldout)


def save_traces(traces: Traces, path: str | os.PathLike) -> None:
    arrays = {"header": np.frombuffer(json.dumps(traces.header).encode(), dtype=np.uint8),
              "heldout_chunks": traces.heldout_chunks}
    if traces.chunk is not None:
        arrays["chunk"] = traces.chunk
    for i, layer in traces.layers.items():
        for name, a in layer.items():
            arrays[f"L{i}_{name}"] = a
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # an .npz is a zip archive of .npy arrays (the second: empty)
RECORDED = ("idx", "weight", "norm")  # per-layer arrays of recorded traces
SYNTHETIC = ("counts",)  # per-layer array of synthetic (counts-only) traces


def _read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    p = str(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except FileNotFoundError:
        raise FileFormatError(KIND, p, "file", "no such file") from None
    except OSError as e:
        raise FileFormatError(KIND, p, "file", f"cannot read: {e.strerror or e}") from None
    if magic not in ZIP_MAGICS:
        raise FileFormatError(KIND, p, "file", "not a traces file: not a readable .npz archive (as autotune "
                                               "calibrate writes)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
        raise FileFormatError(KIND, p, "file", f"truncated or corrupt .npz ({str(e)[:80]})") from None


def _check_header(header: object, p: str) -> None:
    check_schema(header, KIND, VERSION, p)
    for name in ("model", "n_chunks", "chunk_tokens"):
        if name not in header:
            raise FileFormatError(KIND, p, f"header.{name}", "missing")
    try:
        ModelSpec.model_validate(header["model"])  # the header's model is the plan's model spec
    except ValidationError as e:
        raise validation_error(KIND, p, e, within=("header", "model")) from None
    for name in ("n_chunks", "chunk_tokens"):
        if not isinstance(header[name], int) or header[name] < 1:
            raise FileFormatError(KIND, p, f"header.{name}", f"must be a positive integer, got {header[name]!r}")
    prompt = header.get("prompt_tokens")
    if isinstance(prompt, int) and header["chunk_tokens"] > prompt:
        raise FileFormatError(KIND, p, "header.chunk_tokens",
                              f"{header['chunk_tokens']} exceeds prompt_tokens {prompt}: no chunk can be that long")


def _split_arrays(data: dict[str, np.ndarray], header: dict, p: str) -> dict[int, dict[str, np.ndarray]]:
    """The per-layer arrays `L<layer>_<name>`: every MoE layer has either all of RECORDED or SYNTHETIC, and
    nothing else is in the file."""
    expected = {f"L{i}_{n}": (i, n) for i in header["model"]["moe_layers"] for n in RECORDED + SYNTHETIC}
    extra = sorted(set(data) - set(expected) - {"chunk", "heldout_chunks"})
    if extra:
        raise FileFormatError(KIND, p, extra[0], "unexpected array (not a layer of header.model.moe_layers)")
    layers: dict[int, dict[str, np.ndarray]] = {i: {} for i in header["model"]["moe_layers"]}
    for key, (i, name) in expected.items():
        if key in data:
            layers[i][name] = data[key]
    for i, arrays in layers.items():
        kind = SYNTHETIC if "counts" in arrays else RECORDED
        missing = [n for n in kind if n not in arrays]
        if missing or set(arrays) - set(kind):
            what = f"missing array L{i}_{missing[0]}" if missing else f"L{i} holds both recorded and counts arrays"
            raise FileFormatError(KIND, p, "layers", f"MoE layer {i}: {what}")
    return layers


def _check_recorded(layers: dict, chunk: np.ndarray | None, header: dict, p: str) -> None:
    e, k, n_chunks = header["model"]["num_experts"], header["model"]["top_k"], header["n_chunks"]
    if chunk is None:
        raise FileFormatError(KIND, p, "chunk", "missing (recorded traces name each token's chunk)")
    n = chunk.shape[0]
    if chunk.ndim != 1 or not np.issubdtype(chunk.dtype, np.integer) or (n and (chunk.min() < 0 or
                                                                               chunk.max() >= n_chunks)):
        raise FileFormatError(KIND, p, "chunk", f"must be 1-D chunk ids in [0, {n_chunks})")
    sizes = np.bincount(chunk, minlength=n_chunks)
    if sizes.max(initial=0) > header["chunk_tokens"]:
        raise FileFormatError(KIND, p, "chunk", f"a chunk holds {int(sizes.max())} tokens, more than "
                                                f"header.chunk_tokens {header['chunk_tokens']}")
    for i, a in layers.items():
        where = f"L{i}"
        if a["idx"].shape != (n, k) or not np.issubdtype(a["idx"].dtype, np.integer):
            raise FileFormatError(KIND, p, f"{where}_idx", f"must be integer [{n}, {k}], got {a['idx'].dtype} "
                                                           f"{list(a['idx'].shape)}")
        if n and (a["idx"].min() < 0 or a["idx"].max() >= e):
            raise FileFormatError(KIND, p, f"{where}_idx", f"expert ids must be in [0, {e}), got "
                                                           f"{int(a['idx'].min())}..{int(a['idx'].max())}")
        if a["weight"].shape != (n, k) or not np.isfinite(a["weight"]).all():
            raise FileFormatError(KIND, p, f"{where}_weight", f"must be [{n}, {k}] finite router weights")
        if a["norm"].shape != (n,) or not np.isfinite(a["norm"]).all() or (a["norm"] < 0).any():
            raise FileFormatError(KIND, p, f"{where}_norm", f"must be [{n}] finite, non-negative norms")


def _check_counts(layers: dict, header: dict, p: str) -> None:
    shape = (header["n_chunks"], header["model"]["num_experts"])
    for i, a in layers.items():
        c = a["counts"]
        if c.shape != shape or not np.issubdtype(c.dtype, np.integer) or (c < 0).any():
            raise FileFormatError(KIND, p, f"L{i}_counts", f"must be non-negative integer counts {list(shape)}")


def load_traces(path: str | os.PathLike) -> Traces:
    """Read and validate a traces file: every error names the file and the array or header field."""
    p = str(path)
    data = _read_npz(path)
    if "header" not in data:
        raise FileFormatError(KIND, p, "header", "missing")
    try:
        header = json.loads(data.pop("header").tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FileFormatError(KIND, p, "header", "not valid JSON") from None
    _check_header(header, p)
    layers = _split_arrays(data, header, p)
    heldout = data.get("heldout_chunks")
    if heldout is None or heldout.shape != (header["n_chunks"],):
        raise FileFormatError(KIND, p, "heldout_chunks", "missing or of the wrong length")
    synthetic = {i for i, a in layers.items() if "counts" in a}
    if synthetic and len(synthetic) < len(layers):
        raise FileFormatError(KIND, p, "layers", "mixes counts-only and recorded layers")
    if synthetic:
        _check_counts(layers, header, p)
    else:
        _check_recorded(layers, data.get("chunk"), header, p)
    return Traces(header, layers, data.get("chunk"), heldout.astype(bool))


def require_heldout(traces: Traces, path: str) -> None:
    """Held-out drop rates need held-out chunks: refuse traces without them, saying how to get some."""
    if not traces.heldout_chunks.any():
        prompts = traces.header.get("prompt_tokens", traces.header["chunk_tokens"])
        raise FileFormatError(KIND, path, "heldout_chunks",
                              f"none held out ({traces.n_chunks} chunks, {traces.header.get('heldout_rule')}): "
                              f"calibrate on a longer text or with --max-tokens >= {HELDOUT_EVERY * prompts}")


def default_traces_path(model_name: str) -> Path:
    safe = model_name.replace("/", "_").replace(":", "_")
    return Path("traces") / f"{safe}.npz"
