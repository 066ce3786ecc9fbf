"""The attention core through transformers' attention interface: registered as the `npumoe` implementation, with
sdpa's masks, so transformers keeps its KV cache, rope and mask building. A layer with a planned core runs a full
chunk whose context fits a bucket on the static function of the smallest such bucket (keys padded to the bucket,
the padding masked); everything else (a partial chunk, a decode step, a context past the last bucket, a batch of
several sequences, a layer without a planned core) runs on sdpa, exactly as transformers would. Split by rows
(`Split`), the function takes a full chunk's first queries and the CPU the rest at the same time. In causal blocks
(`block`), the static queries run block by block, each on the function of the smallest bucket holding its keys (a
causal chunk's first queries need only the first keys).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime.backends import EXACT, DenseFn
from runtime.plan import static_reads

IMPLEMENTATION = "npumoe"


def _npumoe_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    core = getattr(module, "_npumoe_attention", None)
    out = core(query, key, value, attention_mask, kwargs.get("scaling")) if core is not None else None
    if out is not None:
        return out, None
    if core is not None:
        core.calls[("attention", EXACT)] += 1
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(IMPLEMENTATION, _npumoe_attention)
AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)  # the masks sdpa gets, so the fallback is sdpa's own


def allowed_keys(mask: torch.Tensor | None, queries: int, keys: int, bucket: int) -> torch.Tensor | None:
    """`[queries, bucket]` bool: which (padded) keys each query of the chunk attends to. sdpa's mask where
    transformers built one (bool `[1, 1, queries, keys]`), else causal with the chunk as the last queries."""
    allowed = torch.zeros(queries, bucket, dtype=torch.bool)
    if mask is None:
        pos = torch.arange(keys - queries, keys)
        allowed[:, :keys] = torch.arange(keys)[None, :] <= pos[:, None]
    elif mask.dtype == torch.bool and mask.shape[-2:] == (queries, keys):
        allowed[:, :keys] = mask.reshape(-1, queries, keys)[0]
    else:
        return None
    return allowed


CPU_SHARE = "cpu-share"  # the calls counter's name for a split function's rows computed on the CPU


def _in_modes(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """`call` under this thread's autograd modes (a worker thread starts with its own)."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def run() -> torch.Tensor:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return call()

    return run


@dataclass
class Split:
    """A dense function split by rows: its static function takes the first `rows` rows (queries) of a chunk, `cpu`
    (the exact reference) the rest. Where `pool` is set (the backend runs off the CPU), the static call waits on its
    worker while this thread computes the CPU's rows."""
    rows: int
    cpu: Callable[..., torch.Tensor]
    pool: ThreadPoolExecutor | None = None

    def run(self, static: Callable[[], torch.Tensor], cpu: Callable[..., torch.Tensor], rest: torch.Tensor,
            dtype: torch.dtype, calls: Counter, part: str, *args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the static call's output, the CPU's on `rest`), both in `dtype`."""
        future = self.pool.submit(_in_modes(static)) if self.pool is not None else None
        mine = cpu(rest, *args)
        calls[(part, CPU_SHARE)] += 1
        theirs = future.result() if future is not None else static()
        return theirs.to(dtype), mine.to(dtype)


class AttentionCore:
    """One layer's planned attention core: the prepared function of each bucket (shared by every layer). With a
    `block`, a full chunk's static queries run in causal blocks of that many, each on the smallest bucket holding
    its keys."""

    def __init__(self, chunk: int, fns: dict[int, DenseFn], backend: str, scaling: float,
                 calls: Counter | None = None, split: Split | None = None, block: int | None = None) -> None:
        self.chunk, self.fns, self.backend, self.scaling, self.split = chunk, fns, backend, scaling, split
        self.buckets, self.block = sorted(fns), block
        self.calls = Counter() if calls is None else calls  # ("attention", backend name); cpu-exact: sdpa

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float | None) -> torch.Tensor | None:
        """The chunk's attention output `[1, queries, heads, d]` on the static function, or None (run sdpa)."""
        batch, _, queries, _ = query.shape
        keys = key.shape[2]
        if batch != 1 or queries != self.chunk or (scaling or self.scaling) != self.scaling:
            return None
        static = self.split.rows if self.split is not None else queries
        reads = static_reads(self.buckets, self.chunk, keys - queries, static, self.block)
        if reads is None:
            return None
        width = max(keys, reads[-1])
        allowed = allowed_keys(mask, queries, keys, width)
        per = static // len(reads)
        calls = [(i * per, b) for i, b in enumerate(reads)]
        if allowed is None or any(allowed[r:r + per, b:].any() for r, b in calls):  # a key past its block's bucket
            return None
        k = key.new_zeros(key.shape[1], width, key.shape[3])
        v = value.new_zeros(value.shape[1], width, value.shape[3])
        k[:, :keys], v[:, :keys] = key[0], value[0]
        q = query[0]

        def run_static() -> torch.Tensor:
            return torch.cat([self.fns[b](q[:, r:r + per], k[:, :b], v[:, :b], allowed[r:r + per, :b])
                              for r, b in calls], dim=1)

        if self.split is None:
            out = run_static().to(query.dtype)
        else:
            out = torch.cat(self.split.run(run_static, self.split.cpu, q[:, static:], query.dtype, self.calls,
                                           "attention", key[0], value[0], allowed[static:, :keys]), dim=1)
        self.calls[("attention", self.backend)] += len(calls)
        return out.unsqueeze(0).transpose(1, 2).contiguous()
