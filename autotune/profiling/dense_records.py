"""The dense ops of a decoder layer, timed on this host's CPU as the runtime runs them in torch: matmuls (the
attention projections, router and lm_head shapes), the attention core as a run's `attention_core` part times it
(rope, the KV cache's update, transformers' sdpa forward) at several (rows, context) points, chunks with nothing
cached before them (causal) and later ones (masked), and one layer's elementwise work per token outside the attention
block (two RMS norms, two residual adds) and the q/k norms per head, each run in the cache state a forward leaves
(`cache_state`). Records `dense_matmul`, `attention` and `elementwise`, fitted by
`autotune.costing.dense_prices.fit_dense`."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from autotune.profiling.cache_state import Call, ForwardCaches
from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_in_forward
from runtime.backends import EXACT


@dataclass(frozen=True)
class DenseShape:
    """The attention shape of a model size the profile measures."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    vocab: int
    lm_head_rows: tuple[int, ...] = (1, 256, 1024)
    mlp_ffn: int = 0  # a shared expert's or dense layers' MLP (its two matmuls timed at each row count); 0: none
    rows: tuple[int, ...] = (1, 64, 256, 1024)  # chunk rows the projections and the router are timed at
    norm: str = "rms"  # the family's input norms (runtime.dense.families): "rms" or "layer" (a fused kernel)


# tiny-moe's (runtime/assets/tiny-moe/config.json) and Qwen3-30B-A3B's (scripts/make_shape_twin.py); lm_head's
# vocabulary is capped: a GEMV streams its weights, and 32k rows fit the bandwidth term as well as 152k. lm_head runs
# at one row and at a chunk's rows (a run scores every position); tiny-moe's 2048 rows of logits (32 MiB) and
# Qwen's 1024 are the fresh buffers (`dense_prices.fresh_mb`) the fit learns their page faults from.
DENSE_SHAPES = {"tiny-moe": DenseShape(256, 4, 2, 64, 16, 4096, (1, 256, 1024, 2048)),
                "qwen3-30b-a3b": DenseShape(2048, 32, 4, 128, 128, 32768)}
ELEMENTWISE_ROWS = (64, 256, 1024, 4096)  # 4096 rows of Qwen's hidden: 32 MiB buffers
# (rows, context): a first chunk (rows == context: sdpa's causal kernel) up to a whole 4096-token prompt in one chunk,
# and later chunks (masked) at the contexts of a 4096-token prompt
ATTENTION_POINTS = ((256, 256), (512, 512), (1024, 1024), (2048, 2048), (4096, 4096), (256, 1024), (256, 2048),
                    (256, 4096), (512, 2048), (1024, 2048), (1024, 4096), (2048, 4096))
ATTENTION_POINTS_QUICK = ((256, 256), (1024, 1024), (2048, 2048), (4096, 4096), (256, 1024), (256, 2048),
                          (1024, 2048), (1024, 4096))


def matmul_cases(shape: DenseShape) -> list[tuple[int, int, int]]:
    """(m, n, k) of the projections (q, k/v, fused q/k/v, o), the router and the MLP (where the shape has one) at each
    of the shape's rows, and lm_head at its rows (one, and a chunk's: a run that scores every position)."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    mlp = ((2 * shape.mlp_ffn, shape.hidden), (shape.hidden, shape.mlp_ffn)) if shape.mlp_ffn else ()
    out = [(m, n, k) for m in shape.rows for n, k in ((q, shape.hidden), (kv, shape.hidden),
                                                      (q + 2 * kv, shape.hidden), (shape.hidden, q),
                                                      (shape.experts, shape.hidden), *mlp)]
    return out + [(m, shape.vocab, shape.hidden) for m in shape.lm_head_rows]


def matmul_call(m: int, n: int, k: int) -> Call:
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    return Call(lambda: F.linear(x, w), (x,))


def _rotated(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope as the families compute it (rotate_half)."""
    half = t.shape[-1] // 2
    return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin


def attention_call(shape: DenseShape, rows: int, context: int) -> Call:
    """What a run's `attention_core` part times (runtime.dense.parts: the attention block less its projections):
    rope on q and k, the KV cache's update (transformers' DynamicCache concatenates), then transformers' sdpa
    forward, which dispatches as in the run: a chunk with nothing cached before it gets no mask (causal, sdpa's
    kernel skips the masked half, grouped heads without a copy); a later chunk gets sdpa's bool mask and k/v
    repeated to the query heads."""
    q = torch.randn(1, shape.heads, rows, shape.head_dim)
    k, v = torch.randn(1, shape.kv_heads, rows, shape.head_dim), torch.randn(1, shape.kv_heads, rows, shape.head_dim)
    past_k = torch.randn(1, shape.kv_heads, context - rows, shape.head_dim)
    past_v = torch.randn(1, shape.kv_heads, context - rows, shape.head_dim)
    cos, sin = torch.randn(1, 1, rows, shape.head_dim), torch.randn(1, 1, rows, shape.head_dim)
    mask = None if context == rows else torch.ones(rows, context, dtype=torch.bool).tril(context - rows)[None, None]
    module = SimpleNamespace(num_key_value_groups=shape.heads // shape.kv_heads, is_causal=True)

    def run():
        keys = torch.cat([past_k, _rotated(k, cos, sin)], dim=-2)
        values = torch.cat([past_v, v], dim=-2)
        out, _ = sdpa_attention_forward(module, _rotated(q, cos, sin), keys, values, mask,
                                        scaling=shape.head_dim ** -0.5)
        return out.reshape(rows, -1).contiguous()

    return Call(run, (q, k, v, cos, sin))


def _elementwise(shape: DenseShape, rows: int) -> Call:
    """One layer's elementwise work outside the attention block: two norms of the family's kind (RMS, in torch's
    ops as the families write it; layer norm, torch's fused kernel: 0.43x the RMS pair's time at 4,096 x 4,096 in
    bf16) and two residual adds (rope is timed with the attention core, where a run's parts count it)."""
    x, r = torch.randn(rows, shape.hidden), torch.randn(rows, shape.hidden)
    w, b = torch.ones(shape.hidden), torch.zeros(shape.hidden)

    def norm(t):
        if shape.norm == "layer":
            return F.layer_norm(t, (shape.hidden,), w, b)
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def run():
        y = r + norm(x)
        return norm(y) + y

    return Call(run, (x, r))


def qk_norm_call(shape: DenseShape, rows: int) -> Call:
    """The q and k norms of the families that have them per head (qwen3_moe), as a run's projections part counts
    them: an RMS norm over each head's head_dim."""
    q, k = torch.randn(rows, shape.heads, shape.head_dim), torch.randn(rows, shape.kv_heads, shape.head_dim)
    w = torch.ones(shape.head_dim)

    def run():
        return [t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w for t in (q, k)]

    return Call(run, (q, k))


def dense_records(s: Settings, clock: str = "cpu", progress: bool = True,
                  shapes: dict[str, DenseShape] | None = None) -> list[dict]:
    """Time every dense case on the CPU (the exact path's backend prices CPU work) in torch's default dtype (fp32
    unless a model's records set it), on `clock`, at `shapes` (default: the settings' `dense_shapes` of
    DENSE_SHAPES)."""
    cases = []
    for name, shape in (shapes or {n: DENSE_SHAPES[n] for n in s.dense_shapes or DENSE_SHAPES}).items():
        first = len(cases)
        cases += [({"kind": "dense_matmul", "m": m, "n": n, "k": k}, matmul_call(m, n, k))
                  for m, n, k in matmul_cases(shape)]
        points = ATTENTION_POINTS_QUICK if s.quick else ATTENTION_POINTS
        cases += [({"kind": "attention", "rows": r, "context": c, "heads": shape.heads, "kv_heads": shape.kv_heads,
                    "head_dim": shape.head_dim}, attention_call(shape, r, c)) for r, c in points]
        cases += [({"kind": "elementwise", "rows": r, "hidden": shape.hidden,
                    **({"norm": shape.norm} if shape.norm != "rms" else {})}, _elementwise(shape, r))
                  for r in ELEMENTWISE_ROWS]
        width = (shape.heads + shape.kv_heads) * shape.head_dim
        cases += [({"kind": "elementwise", "rows": r, "hidden": width, "length": shape.head_dim},
                   qk_norm_call(shape, r)) for r in ELEMENTWISE_ROWS]
        for rec, _ in cases[first:]:
            rec["shape"] = name
    records, caches = [], ForwardCaches()
    with torch.inference_mode():
        for rec, op in tqdm(cases, desc="profile-device dense", unit="rec", disable=not progress):
            timed = time_in_forward(op, s, clock=clock, caches=caches)
            records.append({**rec, "backend": EXACT, "dtype_bytes": torch.get_default_dtype().itemsize, **timed})
    return records
