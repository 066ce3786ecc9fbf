"""The attention core through transformers' attention interface: registered as the `npumoe` implementation, with
sdpa's masks, so transformers keeps its KV cache, rope and mask building. A layer with a planned core runs a full
chunk whose context fits a bucket on the static function of the smallest such bucket (keys padded to the bucket,
the padding masked); everything else (a partial chunk, a decode step, a context past the last bucket, a batch of
several sequences, a layer without a planned core) runs on sdpa, exactly as transformers would.
"""
from __future__ import annotations

from collections import Counter

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from runtime.backends import EXACT, DenseFn

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


class AttentionCore:
    """One layer's planned attention core: the prepared function of each bucket (shared by every layer)."""

    def __init__(self, chunk: int, fns: dict[int, DenseFn], backend: str, scaling: float,
                 calls: Counter | None = None) -> None:
        self.chunk, self.fns, self.backend, self.scaling = chunk, fns, backend, scaling
        self.buckets = sorted(fns)
        self.calls = Counter() if calls is None else calls  # ("attention", backend name); cpu-exact: sdpa

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                 scaling: float | None) -> torch.Tensor | None:
        """The chunk's attention output `[1, queries, heads, d]` on the static function, or None (run sdpa)."""
        batch, _, queries, _ = query.shape
        keys = key.shape[2]
        bucket = next((b for b in self.buckets if b >= keys), None)
        if batch != 1 or queries != self.chunk or bucket is None or (scaling or self.scaling) != self.scaling:
            return None
        allowed = allowed_keys(mask, queries, keys, bucket)
        if allowed is None:
            return None
        k = key.new_zeros(key.shape[1], bucket, key.shape[3])
        v = value.new_zeros(value.shape[1], bucket, value.shape[3])
        k[:, :keys], v[:, :keys] = key[0], value[0]
        out = self.fns[bucket](query[0], k, v, allowed)
        self.calls[("attention", self.backend)] += 1
        return out.unsqueeze(0).transpose(1, 2).contiguous()
