"""The dense ops of a decoder layer, timed on this host's CPU as the runtime runs them in torch: matmuls (the
attention projections, router and lm_head shapes), the attention core (sdpa with a mask, k/v repeated to the query
heads as transformers does) at several (rows, context) points, and one layer's elementwise work per token (two RMS
norms, rope on q and k, two residual adds). Records `dense_matmul`, `attention` and `elementwise`, fitted by
`autotune.costing.dense_prices.fit_dense`."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm

from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_call
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


# tiny-moe's (runtime/assets/tiny-moe/config.json) and Qwen3-30B-A3B's (scripts/make_shape_twin.py); lm_head's
# vocabulary is capped: a GEMV streams its weights, and 32k rows fit the bandwidth term as well as 152k.
DENSE_SHAPES = {"tiny-moe": DenseShape(256, 4, 2, 64, 16, 4096),
                "qwen3-30b-a3b": DenseShape(2048, 32, 4, 128, 128, 32768)}
ROWS = (1, 64, 256, 1024)  # chunk rows (1: a decode step)
ATTENTION_POINTS = ((256, 256), (256, 1024), (1024, 1024), (1024, 2048), (1024, 4096), (256, 4096))
ATTENTION_POINTS_QUICK = ((256, 256), (1024, 1024), (1024, 4096), (256, 2048))


def matmul_cases(shape: DenseShape) -> list[tuple[int, int, int]]:
    """(m, n, k) of the projections (q, k/v, fused q/k/v, o), the router and lm_head (one row, and a chunk's rows:
    a run that scores every position) at each of ROWS."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out = [(m, n, k) for m in ROWS for n, k in ((q, shape.hidden), (kv, shape.hidden), (q + 2 * kv, shape.hidden),
                                                (shape.hidden, q), (shape.experts, shape.hidden))]
    return out + [(1, shape.vocab, shape.hidden), (256, shape.vocab, shape.hidden)]


def matmul_call(m: int, n: int, k: int):
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    return lambda: F.linear(x, w)


def _attention(shape: DenseShape, rows: int, context: int):
    q = torch.randn(1, shape.heads, rows, shape.head_dim)
    k = torch.randn(1, shape.kv_heads, context, shape.head_dim)
    v = torch.randn(1, shape.kv_heads, context, shape.head_dim)
    mask = torch.ones(rows, context, dtype=torch.bool).tril(context - rows)[None, None]
    rep = shape.heads // shape.kv_heads

    def run():
        kk = k[:, :, None].expand(1, shape.kv_heads, rep, context, shape.head_dim).reshape(1, -1, context,
                                                                                          shape.head_dim)
        vv = v[:, :, None].expand(1, shape.kv_heads, rep, context, shape.head_dim).reshape(1, -1, context,
                                                                                          shape.head_dim)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)

    return run


def _elementwise(shape: DenseShape, rows: int):
    x, r = torch.randn(rows, shape.hidden), torch.randn(rows, shape.hidden)
    w = torch.ones(shape.hidden)
    cos, sin = torch.randn(rows, shape.head_dim), torch.randn(rows, shape.head_dim)
    q = torch.randn(rows, shape.heads, shape.head_dim)
    kk = torch.randn(rows, shape.kv_heads, shape.head_dim)

    def norm(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def rope(t):
        half = t.shape[-1] // 2
        rot = torch.cat((-t[..., half:], t[..., :half]), dim=-1)
        return t * cos[:, None] + rot * sin[:, None]

    def run():
        h = norm(x)
        rope(q), rope(kk)
        y = r + h
        return norm(y) + y

    return run


def dense_records(s: Settings, clock: str = "cpu", progress: bool = True) -> list[dict]:
    """Time every dense case on the CPU (the exact path's backend prices CPU work), fp32, on `clock`."""
    cases = []
    for name, shape in DENSE_SHAPES.items():
        cases += [({"kind": "dense_matmul", "m": m, "n": n, "k": k}, matmul_call(m, n, k))
                  for m, n, k in matmul_cases(shape)]
        points = ATTENTION_POINTS_QUICK if s.quick else ATTENTION_POINTS
        cases += [({"kind": "attention", "rows": r, "context": c, "heads": shape.heads, "kv_heads": shape.kv_heads,
                    "head_dim": shape.head_dim}, _attention(shape, r, c)) for r, c in points]
        cases += [({"kind": "elementwise", "rows": r, "hidden": shape.hidden}, _elementwise(shape, r))
                  for r in ROWS[1:]]
    records = []
    with torch.inference_mode():
        for rec, fn in tqdm(cases, desc="profile-device dense", unit="rec", disable=not progress):
            records.append({**rec, "backend": EXACT, "dtype_bytes": 4, **time_call(fn, s, clock=clock)})
    return records
