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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from pydantic import ValidationError

from runtime.errors import FileFormatError, NpumoeError
from runtime.fileio import atomic_write_bytes, check_schema, validation_error
from runtime.models import model_spec, moe_layers
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


class RoutingRecorder:
    """Records every MoE layer's routing through forward pre-hooks on its experts module, one model forward per
    chunk: each assignment's expert id and router weight, and the token's hidden-state norm. Works under any
    experts implementation (the plan's executor included), so a run records the routing it saw."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.spec = model, model_spec(model)
        self.layers = moe_layers(model)
        self.rec: dict[int, dict[str, list]] = {l.index: {"idx": [], "weight": [], "norm": []} for l in self.layers}
        self.chunk_ids: list[np.ndarray] = []
        self.enabled = True
        self._hooks: list = []

    def _hook(self, mod, args, kwargs, i: int) -> None:
        if not self.enabled:
            return
        x, idx, w = args if len(args) == 3 else (kwargs["hidden_states"], kwargs["top_k_index"],
                                                  kwargs["top_k_weights"])
        if i == self.layers[0].index:  # the first MoE layer opens a new chunk
            self.chunk_ids.append(np.full(idx.shape[0], len(self.chunk_ids), dtype=np.int32))
        self.rec[i]["idx"].append(idx.to(torch.int16).numpy().copy())
        self.rec[i]["weight"].append(w.float().numpy().copy())
        self.rec[i]["norm"].append(x.float().norm(dim=-1).numpy().copy())

    def __enter__(self) -> "RoutingRecorder":
        self._hooks = [layer.experts.register_forward_pre_hook(
            lambda mod, args, kwargs, i=layer.index: self._hook(mod, args, kwargs, i), with_kwargs=True)
            for layer in self.layers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_ids)

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


def record_traces(model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int, prompt_tokens: int,
                  text: str, progress: bool = True) -> Traces:
    """Prefill `ids` as prompts of `prompt_tokens`, chunk by chunk, recording every layer's routing."""
    heldout = []
    starts = range(0, ids.numel(), prompt_tokens)
    with RoutingRecorder(model) as recorder, torch.inference_mode():
        for p, start in enumerate(tqdm(starts, desc="calibrate", unit="prompt", disable=not progress)):
            prompt = ids[start:start + prompt_tokens].reshape(1, -1)
            cache = None
            for s in range(0, prompt.shape[1], chunk_tokens):
                # The decoder stack only: routing is all calibration records, so the LM head's full-vocabulary
                # logits (most of the time on a large-vocabulary model) are never computed.
                cache = model.model(input_ids=prompt[:, s:s + chunk_tokens], cache=cache, use_cache=True).cache
                heldout.append(p % HELDOUT_EVERY == HELDOUT_EVERY - 1)
    return recorder.traces(heldout, {"text": text, "chunk_tokens": chunk_tokens, "prompt_tokens": prompt_tokens,
                                     "heldout_rule": f"every {HELDOUT_EVERY}th prompt"})


CHUNK_HELDOUT_RULE = f"every {HELDOUT_EVERY}th chunk"


def heldout_every_nth_chunk(n_chunks: int) -> np.ndarray:
    """The held-out rule for a run's recording (one long prompt is common there): every HELDOUT_EVERY-th chunk."""
    return np.arange(n_chunks) % HELDOUT_EVERY == HELDOUT_EVERY - 1


def synthetic_traces(spec: dict, n_chunks: int, chunk_tokens: int, skew: float = 1.1, heldout_every: int = 5,
                     seed: int = 0) -> Traces:
    """Counts-only traces with Zipf(skew) expert popularity, a different hot set per layer (for search tests and
    benchmarks at shapes we cannot run here, such as Qwen3-30B-A3B)."""
    rng = np.random.default_rng(seed)
    e, k = spec["num_experts"], spec["top_k"]
    layers = {}
    for layer in spec["moe_layers"]:
        pop = rng.permutation(1.0 / np.arange(1, e + 1) ** skew)
        counts = np.zeros((n_chunks, e), dtype=np.int64)
        for c in range(n_chunks):
            drift = pop * rng.lognormal(0.0, 0.3, e)  # chunk-to-chunk variation of the routing
            # top-k without replacement per token via Gumbel top-k on log-popularity
            g = np.log(drift)[None, :] + rng.gumbel(size=(chunk_tokens, e))
            chosen = np.argpartition(-g, k - 1, axis=1)[:, :k]
            counts[c] = np.bincount(chosen.reshape(-1), minlength=e)
        layers[layer] = {"counts": counts}
    header = {"schema": SCHEMA, "model": spec, "text": f"synthetic zipf({skew})", "chunk_tokens": chunk_tokens,
              "prompt_tokens": chunk_tokens, "tokens": n_chunks * chunk_tokens, "n_chunks": n_chunks,
              "heldout_rule": f"every {heldout_every}th chunk", "synthetic": True}
    heldout = np.arange(n_chunks) % heldout_every == heldout_every - 1
    return Traces(header, layers, None, heldout)


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


def load_traces(path: str | os.PathLike) -> Traces:
    p = str(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {k: z[k] for k in z.files}
    except FileNotFoundError:
        raise FileFormatError(KIND, p, "file", "no such file") from None
    except (OSError, ValueError, EOFError) as e:
        raise FileFormatError(KIND, p, "file", f"not a readable .npz ({str(e)[:80]})") from None
    if "header" not in data:
        raise FileFormatError(KIND, p, "header", "missing")
    try:
        header = json.loads(data.pop("header").tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise FileFormatError(KIND, p, "header", "not valid JSON") from None
    check_schema(header, KIND, VERSION, p)
    for name in ("model", "n_chunks", "chunk_tokens"):
        if name not in header:
            raise FileFormatError(KIND, p, f"header.{name}", "missing")
    try:
        ModelSpec.model_validate(header["model"])  # the header's model is the plan's model spec
    except ValidationError as e:
        raise validation_error(KIND, p, e, within=("header", "model")) from None
    layers: dict[int, dict[str, np.ndarray]] = {}
    for key, a in data.items():
        if key.startswith("L"):
            li, name = key[1:].split("_", 1)
            layers.setdefault(int(li), {})[name] = a
    missing = sorted(set(header["model"]["moe_layers"]) - set(layers))
    if missing:
        raise FileFormatError(KIND, p, "layers", f"MoE layers {missing} have no trace")
    heldout = data.get("heldout_chunks")
    if heldout is None or heldout.shape != (header["n_chunks"],):
        raise FileFormatError(KIND, p, "heldout_chunks", "missing or of the wrong length")
    return Traces(header, layers, data.get("chunk"), heldout.astype(bool))


def default_traces_path(model_name: str) -> Path:
    safe = model_name.replace("/", "_").replace(":", "_")
    return Path("traces") / f"{safe}.npz"
