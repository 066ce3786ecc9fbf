"""The dense functions a static backend runs (q/k/v with the input norm and q/k norms, o_proj, the attention core),
timed on the backends whose registry entry says how (`BackendInfo.profile_dense`: Core ML's builds the builder's own
program of each and predicts on its compute units). Recorded as the cost model's `dense_matmul` (a projection's
[rows, in] x [in, out]) and `attention` (rows over a padded bucket of keys) records of that backend, so its dense
prices are measured instead of extrapolated from its expert fit (`autotune.costing.dense_prices`)."""
from __future__ import annotations

import torch
from tqdm import tqdm

from autotune.profiling.dense_records import ATTENTION_POINTS, ATTENTION_POINTS_QUICK, DENSE_SHAPES, DenseShape
from autotune.profiling.energy import EnergyMeter
from autotune.profiling.settings import Settings
from autotune.profiling.timing import time_call
from runtime.backends import BackendInfo, DenseForm, DenseSpec


def attention_modules(shape: DenseShape, seed: int = 0) -> dict[str, torch.nn.Module]:
    """Qwen3Moe's attention projections and norms at `shape`, random weights (what the functions' time depends on)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    torch.manual_seed(seed)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    linear = lambda i, o: torch.nn.Linear(i, o, bias=False).eval().requires_grad_(False)  # noqa: E731
    return {"norm": Qwen3MoeRMSNorm(shape.hidden), "q": linear(shape.hidden, q), "k": linear(shape.hidden, kv),
            "v": linear(shape.hidden, kv), "q_norm": Qwen3MoeRMSNorm(shape.head_dim),
            "k_norm": Qwen3MoeRMSNorm(shape.head_dim), "o": linear(q, shape.hidden)}


def static_dense_cases(shape: DenseShape, quick: bool) -> list[tuple[dict, DenseSpec]]:
    """(record, function) of every dense function timed at `shape`: q/k/v and o_proj at each of the shape's rows from
    64 (a static function's: a multiple of the ANE's preferred 64), the attention core at each (rows, context) point
    with the context as its bucket."""
    m = attention_modules(shape)
    form = DenseForm(qk_norm="head", head_dim=shape.head_dim)
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    qkv = {r: m[r] for r in ("norm", "q", "k", "v", "q_norm", "k_norm")}
    cases = []
    for rows in (r for r in shape.rows if r >= 64):
        cases.append(({"kind": "dense_matmul", "function": "qkv", "m": rows, "n": q + 2 * kv, "k": shape.hidden},
                      DenseSpec("qkv", 0, rows, qkv, form, (q, kv, kv))))
        cases.append(({"kind": "dense_matmul", "function": "o_proj", "m": rows, "n": shape.hidden, "k": q},
                      DenseSpec("o_proj", 0, rows, {"o": m["o"]}, form, (shape.hidden,))))
    for rows, context in ATTENTION_POINTS_QUICK if quick else ATTENTION_POINTS:
        cases.append(({"kind": "attention", "function": "attention", "rows": rows, "context": context,
                       "heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim},
                      DenseSpec("attention", -1, rows, form=form, keys=context, heads=shape.heads,
                                kv_heads=shape.kv_heads, scaling=shape.head_dim ** -0.5)))
    return cases


def static_dense_records(s: Settings, info: BackendInfo, meter: EnergyMeter | None = None,
                         progress: bool = True) -> list[dict]:
    """Time every dense function of `s`'s shapes on `info`'s backend (wall clock: it runs off the CPU)."""
    cases = [case for name in s.dense_shapes or DENSE_SHAPES
             for case in static_dense_cases(DENSE_SHAPES[name], s.quick)]
    records = []
    for rec, spec in tqdm(cases, desc=f"profile-device {info.name} dense", unit="rec", disable=not progress):
        call = info.profile_dense(spec)
        timed = time_call(call, s, meter, energy_field=info.energy_field, clock="wall")
        records.append({**rec, "backend": info.name, "dtype_bytes": info.dtype_bytes, **timed})
    return records
