"""The prefix cache on disk (`--prefix-cache-dir`): whole-chunk prefixes' KV caches that survive a restart.

One safetensors file per prefix, named by the sha256 of (model digest, plan digest, the prefix's whole-chunk token
ids), holding per layer the keys and values, the token ids (the whole chunks, then maybe an exact tail: the tail
rule of `prefix_cache`), and in its metadata the schema, both digests, the chunk size and the sha256 of the file
itself (`fileio.seal`: every byte, header and tensors, so a flipped bit is caught). A lookup tries the
prompt's chunk boundaries longest first (the file there may also serve the tail past it, by `reusable`); an
entry is used only when every one of those matches (a file made under another model or plan, or a corrupt one, is
ignored, said once in the log naming it, recomputed and replaced by the next store). Bounded in bytes
(`--prefix-cache-disk-gb`): the least recently used files go first (a hit touches its file). Writes are atomic
(temp file, rename).

The model digest hashes the model's spec fingerprint (shape and routers), its dtype and a sample of every
parameter (the first and last 4,096 values of each): enough to tell checkpoints apart without reading 60 GB.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from transformers.cache_utils import DynamicCache

from runtime.fileio import DIGEST_SLOT, atomic_write_bytes, seal, sealed_ok
from runtime.loading.model_loader import model_spec
from runtime.plan import Plan
from runtime.serving.prefix_cache import reusable

log = logging.getLogger("npumoe.serve")

SCHEMA = "npumoe.prefix/2"  # 2: a sha256 over the whole file (header and tensors)
SAMPLE = 4096


def model_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256(model_spec(model).fingerprint.encode())
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        h.update(name.encode() + str(p.dtype).encode())
        for part in (flat[:SAMPLE], flat[-SAMPLE:]):
            h.update(part.float().numpy().tobytes())
    return h.hexdigest()


def plan_digest(plan: Plan) -> str:
    return hashlib.sha256(plan.model_dump_json().encode()).hexdigest()


class DiskPrefixCache:
    def __init__(self, folder: str | os.PathLike, max_bytes: int, model: torch.nn.Module, plan: Plan) -> None:
        self.folder, self.max_bytes, self.model = Path(folder), max_bytes, model
        self.chunk, self.exact_below = plan.chunk_tokens, plan.exact_below
        self.meta = {"schema": SCHEMA, "model": model_digest(model), "plan": plan_digest(plan),
                     "chunk_tokens": str(self.chunk)}
        self.folder.mkdir(parents=True, exist_ok=True)
        self.warned: set[Path] = set()

    def _path(self, tokens: torch.Tensor) -> Path:
        """The file of the prefix whose whole chunks are `tokens`' whole chunks (its tail, if any, inside)."""
        h = hashlib.sha256(f"{self.meta['model']}:{self.meta['plan']}:".encode())
        h.update(tokens[:tokens.numel() // self.chunk * self.chunk].to(torch.int64).numpy().tobytes())
        return self.folder / f"{h.hexdigest()}.safetensors"

    def _ignore(self, path: Path, why: str) -> None:
        if path not in self.warned:  # one line per entry, not one per lookup that meets it
            log.warning("prefix cache on disk: ignoring %s (%s); it is replaced by the next store", path, why)
            self.warned.add(path)

    def _read(self, path: Path) -> dict[str, torch.Tensor] | None:
        """The entry's tensors when the file is ours (model, plan, format) and every byte matches its digest;
        otherwise None, said once in the log."""
        try:
            data = path.read_bytes()
            meta = _metadata(data)
        except (OSError, ValueError) as e:
            self._ignore(path, f"unreadable: {e}")
            return None
        digest = meta.pop("sha256", None)
        if meta != self.meta:
            self._ignore(path, "made under another model, plan or format")
            return None
        if not isinstance(digest, str) or not sealed_ok(data, digest):
            self._ignore(path, "corrupt: its bytes do not match its sha256")
            return None
        try:
            return load_tensors(data)
        except SafetensorError as e:
            self._ignore(path, f"unreadable: {e}")
            return None

    def lookup(self, ids: torch.Tensor, longer_than: int = 0) -> DynamicCache | None:
        """A cache holding the longest prefix of `ids` on disk (whole chunks, or past them by the tail rule; at
        least one token left to prefill; longer than `longer_than`), or None."""
        for n in range((ids.numel() - 1) // self.chunk * self.chunk, longer_than - 1, -self.chunk):
            path = self._path(ids[:n])
            if n == 0 or not path.exists():
                continue
            tensors = self._read(path)
            if tensors is None:
                continue
            tokens = tensors.get("tokens", torch.empty(0, dtype=torch.int64))
            if not torch.equal(tokens[:n], ids[:n].to(torch.int64)) or tokens.numel() // self.chunk * self.chunk != n:
                self._ignore(path, "its tokens are not this prefix")
                continue
            use = reusable(ids, tokens, self.chunk, self.exact_below)
            if use <= longer_than:
                continue
            cache = DynamicCache(config=self.model.config)
            layers = len([k for k in tensors if k.startswith("k")])
            for i in range(layers):
                cache.update(tensors[f"k{i}"][:, :, :use], tensors[f"v{i}"][:, :, :use], i)
            _touch(path)
            return cache
        return None

    def store(self, tokens: torch.Tensor, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep `tokens`' KV (whole chunks, or a prompt ending in an exact tail) on disk, in the file of its whole
        chunks (replacing another tail there: the most recent wins), then bound the folder."""
        path = self._path(tokens)
        if path.exists() and self._holds(path, tokens):
            _touch(path)
            return
        tensors = {"tokens": tokens.to(torch.int64).contiguous()}
        for i, (k, v) in enumerate(layers):
            tensors[f"k{i}"], tensors[f"v{i}"] = k.contiguous(), v.contiguous()
        data = seal(save_tensors(tensors, metadata={**self.meta, "sha256": DIGEST_SLOT}))
        if len(data) > self.max_bytes:
            return
        atomic_write_bytes(path, data)
        _touch(path)
        self.warned.discard(path)  # a new entry: should it go bad in turn, say so again
        self._bound()

    def _holds(self, path: Path, tokens: torch.Tensor) -> bool:
        """Whether the file is ours, whole, and holds `tokens` (or a longer prefix starting with them)."""
        held = (self._read(path) or {}).get("tokens")
        return held is not None and held.numel() >= tokens.numel() and \
            torch.equal(held[:tokens.numel()], tokens.to(torch.int64))

    def _bound(self) -> None:
        files = sorted(self.folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files:
            if total <= self.max_bytes:
                break
            total -= p.stat().st_size
            p.unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(p.stat().st_size for p in self.folder.glob("*.safetensors"))


def _touch(path: Path) -> None:
    """Mark the file most recently used. The clock is the fine one: a write's own mtime comes from the kernel's
    coarse clock (a few ms), so a hit right after a store could tie with it and the eviction order be arbitrary."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


def _metadata(data: bytes) -> dict:
    """A safetensors file's metadata (its JSON header's `__metadata__`)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("a header past the end of the file")
    header = json.loads(data[8:8 + n])
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise ValueError("no metadata in its header")
    return meta
