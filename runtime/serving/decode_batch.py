"""Continuous batching's decode side: every active generation's next token in one forward.

The rows' KV caches (each prefilled alone, in the plan's chunks) are left-padded into one transformers
`DynamicCache` of shape [rows, heads, length, head_dim]; an attention mask hides each row's padding and
`position_ids` give each row its own position (its real tokens so far), so each row attends to what it would
alone. A row joins once its prefill is done and leaves when it ends; the columns every row pads are trimmed then.
The executor is told how many sequences a step holds, so each one-token row stays on the exact path
(`exact_below_tokens` counts per sequence).

Attention of a padded row runs on that row's own keys and values (`ROWS`, wrapping the model's sdpa attention):
a masked, padded softmax rounds differently from the row's own (up to 0.06 in a bf16 logit, tiny-moe), and greedy
decoding then flips on near ties; row by row, every logit of a padded batched step equals the row's own step
bitwise (measured, bf16 and float32: the batched linear layers and experts already did). Rows of one length (no
padding) run as one call.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from runtime.generation import Generation, Loaded, batched_step

ROWS = "npumoe-rows"  # attention row by row over each row's own keys (a padded batched decode step)
WRAPS = ("sdpa",)  # the implementations it wraps (a plan's dense attention, runtime/dense, installs its own)
_padding = threading.local()  # per thread: each row's padded columns during its batched step, else unset


def _rows_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    inner = ALL_ATTENTION_FUNCTIONS[module.config.npumoe_rows_inner]
    pads = getattr(_padding, "pads", None)
    if pads is None or query.shape[0] != len(pads):
        return inner(module, query, key, value, attention_mask, **kwargs)
    return torch.cat([inner(module, query[i:i + 1], key[i:i + 1, :, p:], value[i:i + 1, :, p:], None, **kwargs)[0]
                      for i, p in enumerate(pads)]), None


AttentionInterface.register(ROWS, _rows_attention)
AttentionMaskInterface.register(ROWS, sdpa_mask)


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _cache(model: torch.nn.Module, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _left_pad(t: torch.Tensor, length: int) -> torch.Tensor:
    """[rows, heads, n, dim] padded on the left of the sequence axis to `length`."""
    return F.pad(t, (0, 0, length - t.shape[2], 0))


class DecodeBatch:
    def __init__(self, loaded: Loaded) -> None:
        self.loaded = loaded
        self.rows: list[Generation] = []
        self.cache: DynamicCache | None = None
        self.pads: list[int] = []  # each row's padded columns, on the left of the cache's `length`
        self.length = 0
        self.widest = 0  # the most rows one step has run (what a test of batching reads)
        model = loaded.model
        if model.config._attn_implementation in WRAPS:
            model.config.npumoe_rows_inner = model.config._attn_implementation
            model.set_attn_implementation(ROWS)

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, gen: Generation) -> None:
        """A generation whose prefill is done (its first token taken) joins the batch."""
        layers, n = _layers(gen.cache), gen.cache.get_seq_length()
        if not self.rows:
            self.cache, self.pads, self.length = gen.cache, [0], n
        else:
            length = max(n, self.length)
            merged = [(torch.cat([_left_pad(k, length), _left_pad(k1, length)]),
                       torch.cat([_left_pad(v, length), _left_pad(v1, length)]))
                      for (k, v), (k1, v1) in zip(_layers(self.cache), layers)]
            self.cache = _cache(self.loaded.model, merged)
            self.pads = [p + length - self.length for p in self.pads] + [length - n]
            self.length = length
        gen.cache = None  # the batch holds it now
        self.rows.append(gen)

    def remove(self, gen: Generation) -> None:
        i = self.rows.index(gen)
        self.rows.pop(i)
        self.pads.pop(i)
        if not self.rows:
            self.cache, self.pads, self.length = None, [], 0
            return
        keep = torch.tensor([j for j in range(len(self.rows) + 1) if j != i])
        first = min(self.pads)  # columns every remaining row pads go
        self.pads = [p - first for p in self.pads]
        self.length -= first
        self.cache = _cache(self.loaded.model, [(k[keep, :, first:], v[keep, :, first:])
                                                for k, v in _layers(self.cache)])

    def step(self) -> None:
        """One decode step for every row: each row's next token pending (its own sampling), its step time kept.
        Rows that pad nothing (one row, or rows of one length) step as one generation alone does: no mask, their
        positions the cache's length."""
        self.widest = max(self.widest, len(self.rows))
        with batched_step(self.loaded, self.rows):
            ids = torch.tensor([[gen.tokens[-1]] for gen in self.rows])
            padded = any(self.pads)
            self.length += 1
            mask = positions = None
            if padded:  # each row's real tokens: its own positions, its padding masked
                pads = torch.tensor(self.pads)
                mask = (torch.arange(self.length) >= pads[:, None]).long()
                positions = (self.length - 1 - pads)[:, None]
            try:
                with torch.inference_mode():
                    _padding.pads = self.pads if padded else None
                    out = self.loaded.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                                            cache=self.cache, use_cache=True, logits_to_keep=1)
                    for gen, logits in zip(self.rows, out.logits[:, -1]):
                        gen.sample(logits)
            finally:
                _padding.pads = None
            self.cache = out.cache
