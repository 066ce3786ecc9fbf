"""Prices of a decoder layer's dense ops on one backend: matmuls (attention projections, router, shared expert or
dense MLP, lm_head), the attention core at a (rows, context) shape, and elementwise host work per token (norms,
rope, residual adds).

Each op's compute time is linear in its work: `ms_per_gflop * GFLOP + ms_per_mb * MB + ms_per_weight_mb * weight MB
+ ms_per_fresh_mb * fresh MB` (a matmul's weights apart from its activations: a GEMV streams them, a GEMM reuses them
from cache; fresh MB: the op's new buffers of 32 MiB or more, which glibc serves by mmap every time, so each of their
pages faults on first touch, e.g. a whole chunk's logits), fitted from the
profile's `dense_matmul`, `attention` and `elementwise` records where `profile-device` measured them on this host;
where it did not (the published profile, or a profile made before these records), the op is priced with the
backend's fitted matmul throughput (`BackendModel`) and says so (`DenseFit.source`: "derived"). A static
function's call cost (dispatch + sync) is the backend's `call_ms`, added once per function by the prefill
composition (`autotune.costing.whole_prefill`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from autotune.costing.residual import Residual
from runtime.backends import EXACT

OPS = ("matmul", "attention", "elementwise")
RECORD_OP = {"dense_matmul": "matmul", "attention": "attention", "elementwise": "elementwise"}
# Elementwise passes per token over the hidden state in one decoder layer outside the attention block, each a read and
# a write: two norms, two residual adds (what `elementwise` records time together; rope is the attention core's).
ELEMENTWISE_PASSES = 4
# The residual learner's weight per feature axis (`Residual.scale`): a matmul's rows weigh as much as its shape (a
# GEMV's misfit says nothing of a GEMM's); the attention core's head shape weighs most (a neighbour of another head
# shape is a worse guess than one at another context).
RESIDUAL_SCALE = {"matmul": (4.0, 4.0, 4.0), "attention": (1.0, 1.0, 4.0), "elementwise": (1.0, 4.0, 4.0)}
MMAP_BYTES = 32 * 2**20  # glibc's dynamic mmap threshold stops here: buffers this large are mapped (and faulted) anew


def fresh_mb(*buffers: Any) -> np.ndarray:
    """MB of the buffers (bytes each) that are MMAP_BYTES or more: pages faulted on first touch, every call."""
    return sum(np.where(np.asarray(b, dtype=np.float64) >= MMAP_BYTES, np.asarray(b, dtype=np.float64), 0.0)
               for b in buffers) / 1e6


def attention_work(rows: Any, context: Any, heads: int, kv_heads: int, head_dim: int, dtype_bytes: float,
                   sdpa: bool = False, masked: bool = False,
                   skips: bool = False) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(GFLOP, MB, 0 weight MB, fresh MB) of the attention core for `rows` queries over `context` keys.

    `sdpa`: as the CPU runs it in torch (what a run's `attention_core` part times): rope on q and k, the KV cache's
    concatenation, then sdpa, which for a chunk with nothing cached before it runs causal (the masked half skipped,
    grouped heads read in place) and otherwise computes the whole block under a bool mask (made an additive float
    mask), k and v repeated to the query heads; `masked`: a chunk with nothing cached before it that gets a mask all
    the same (a sliding window shorter than its context: on an AMX host such a 4,096-token chunk took 2.3x the causal
    kernel's time); `skips`: a kernel whose causal loop stops at each query block's diagonal at the chunk's offset
    into the keys, so a chunk with keys cached before it runs causal too, its queries over the keys before them
    (MLX's sdpa on Metal under mlx-lm's `mask="causal"`: `steel_attention.h` bounds its key loop by `qL_off`).
    Else a static function's: the whole padded block under its mask,
    QK^T and PV, the scores (in the backend's element size) written, normalised and read."""
    m, n = np.asarray(rows, dtype=np.float64), np.asarray(context, dtype=np.float64)
    qo = 2 * m * heads * head_dim  # q in, the output out
    if not sdpa:
        gflop = 4.0 * m * n * heads * head_dim / 1e9
        return gflop, dtype_bytes * (qo + 2 * n * kv_heads * head_dim + 3 * m * n * heads) / 1e6, 0.0, 0.0 * m
    causal = ((m >= n) | skips) & (not masked)
    gflop = np.where(causal, (n - m / 2) / n, 1.0) * 4.0 * m * n * heads * head_dim / 1e9  # m = n: the half
    rope = 4 * m * (heads + kv_heads) * head_dim  # read, rotate, multiply-add, write
    cache = 2 * 2 * n * kv_heads * head_dim  # k and v: the cache read and the concatenation written
    kv = np.where(causal, 2 * n * kv_heads * head_dim, 2 * 2 * n * heads * head_dim)  # read; repeated: written too
    mask = np.where(causal, 0.0, 2 * m * n)  # the float mask written and read
    mb = dtype_bytes * (2 * qo + rope + cache + kv + mask) / 1e6  # the output made contiguous: q and o twice
    q_sized, kv_sized = dtype_bytes * m * heads * head_dim, dtype_bytes * n * kv_heads * head_dim
    # new buffers: rope's (rotated half, products, sum) on q and k, the concatenated cache, k/v repeated, the float
    # mask, sdpa's output and its contiguous copy
    fresh = (5 * fresh_mb(q_sized) + 5 * fresh_mb(dtype_bytes * m * kv_heads * head_dim) + 2 * fresh_mb(kv_sized)
             + np.where(causal, 0.0, 2 * fresh_mb(kv_sized * heads / kv_heads) + fresh_mb(dtype_bytes * m * n))
             + 2 * fresh_mb(q_sized))
    return gflop, mb, 0.0, fresh


def elementwise_work(rows: Any, hidden: int, dtype_bytes: float) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(GFLOP, MB, 0 weight MB, fresh MB) of one layer's elementwise work on `rows` tokens (a few FLOPs per element:
    bandwidth-bound; each pass writes a new buffer)."""
    rows = np.asarray(rows, dtype=np.float64)
    elems = rows * hidden * ELEMENTWISE_PASSES
    return 4.0 * elems / 1e9, 2.0 * dtype_bytes * elems / 1e6, 0.0, 2 * ELEMENTWISE_PASSES * fresh_mb(
        dtype_bytes * rows * hidden)  # a norm writes two: its square and its product


def norm_work(rows: Any, width: int, length: int, dtype_bytes: float
              ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(GFLOP, MB, 0 weight MB, fresh MB) of one RMS norm over `rows` x `width` elements in vectors of `length` (the
    q/k norms: per head of head_dim, or over the whole projection; the final norm: over hidden): its square, its
    product and the weight's product, each a new buffer."""
    elems = np.asarray(rows, dtype=np.float64) * width
    return 4.0 * elems / 1e9, 2.0 * 3 * dtype_bytes * elems / 1e6, 0.0, 3 * fresh_mb(dtype_bytes * elems)


def matmul_work(m: Any, n: int, k: int, dtype_bytes: float, weight_bytes: float | None = None
                ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray]:
    """(GFLOP, activation MB, weight MB, fresh MB) of [m, k] x [k, n]: weights read once (`weight_bytes` each,
    default `dtype_bytes`), activations in and out, the output a new buffer."""
    m = np.asarray(m, dtype=np.float64)
    w = dtype_bytes if weight_bytes is None else weight_bytes
    return 2.0 * m * n * k / 1e9, dtype_bytes * m * (k + n) / 1e6, w * n * k / 1e6, fresh_mb(dtype_bytes * m * n)


def features(kind: str, **shape: Any) -> np.ndarray:
    """[n, 3] log2 features of a dense op for the residual learner: a matmul's (m, n, k), the attention core's
    (rows, 1 + the keys cached before the chunk, heads x head_dim: a chunk with none cached runs another kernel),
    elementwise work's (rows, hidden, 1), a norm's (rows, width, its vectors' length)."""
    if kind == "attention":
        before = np.asarray(shape["context"], dtype=np.float64) - np.asarray(shape["rows"], dtype=np.float64)
        shape = {**shape, "before": 1.0 + np.maximum(before, 0.0)}
    cols = {"matmul": ("m", "n", "k"), "attention": ("rows", "before", "width"),
            "elementwise": ("rows", "hidden", "length" if "length" in shape else None)}[kind]
    vals = [np.asarray(shape[c] if c else 1, dtype=np.float64) for c in cols]
    return np.log2(np.maximum(np.stack(np.broadcast_arrays(*vals), axis=-1).reshape(-1, 3), 1.0))


@dataclass
class DenseFit:
    """One backend's price of one op kind: ms = ms_per_gflop * GFLOP + ms_per_mb * MB + ms_per_weight_mb * weight MB
    + ms_per_fresh_mb * fresh MB, times the residual learner's correction at the op's shape where measured records
    trained one."""
    ms_per_gflop: float
    ms_per_mb: float
    source: str  # "measured (N records)" or "derived from the backend's matmul fit"
    ms_per_weight_mb: float | None = None  # None: as ms_per_mb
    residual: Residual | None = None
    ms_per_fresh_mb: float = 0.0  # 0: not measured (a derived price, or a profile made before the term)

    def ms(self, gflop: Any, mb: Any, weight_mb: Any = 0.0, fresh_mb: Any = 0.0, at: np.ndarray | None = None
           ) -> np.ndarray:
        """The op's time for its work (`*_work`); `at`: its `features` (the residual's correction, where there is
        one)."""
        per_weight = self.ms_per_mb if self.ms_per_weight_mb is None else self.ms_per_weight_mb
        t = (self.ms_per_gflop * np.asarray(gflop) + self.ms_per_mb * np.asarray(mb)
             + per_weight * np.asarray(weight_mb) + self.ms_per_fresh_mb * np.asarray(fresh_mb))
        if self.residual is not None and at is not None:
            t = t * self.residual.at(at).reshape(np.shape(t))
        return t

    def to_json(self) -> dict:
        out = {"ms_per_gflop": self.ms_per_gflop, "ms_per_mb": self.ms_per_mb, "source": self.source}
        if self.ms_per_weight_mb is not None:
            out["ms_per_weight_mb"] = self.ms_per_weight_mb
        if self.ms_per_fresh_mb:
            out["ms_per_fresh_mb"] = self.ms_per_fresh_mb
        return out if self.residual is None else {**out, "residual": self.residual.to_json()}

    @classmethod
    def from_json(cls, obj: dict) -> "DenseFit":
        w = obj.get("ms_per_weight_mb")
        return cls(float(obj["ms_per_gflop"]), float(obj["ms_per_mb"]), str(obj.get("source", "measured")),
                   None if w is None else float(w), Residual.from_json(obj.get("residual")),
                   float(obj.get("ms_per_fresh_mb", 0.0)))


def record_features(rec: dict) -> np.ndarray:
    """A dense record's `features` (one row)."""
    op = RECORD_OP[rec["kind"]]
    if op == "attention":
        return features(op, rows=rec["rows"], context=rec["context"], width=rec["heads"] * rec["head_dim"])
    return features(op, **{k: rec[k] for k in ("m", "n", "k", "rows", "hidden", "length") if k in rec})


def record_ms(fit: "DenseFit", rec: dict) -> float:
    """The fit's time for what a dense record timed."""
    return float(fit.ms(*record_work(rec), at=record_features(rec)))


def record_work(rec: dict) -> tuple[float, ...]:
    """(GFLOP, MB, weight MB, fresh MB) of what one dense record timed (in its `dtype_bytes`, default fp32)."""
    kind, dtype_bytes = rec["kind"], rec.get("dtype_bytes", 4)
    if kind == "dense_matmul":
        work = matmul_work(rec["m"], rec["n"], rec["k"], dtype_bytes)
    elif kind == "attention":  # the CPU's run path (sdpa), or a static backend's padded function (attention_ms)
        work = attention_work(rec["rows"], rec["context"], rec["heads"], rec["kv_heads"], rec["head_dim"],
                              dtype_bytes, sdpa=rec.get("backend", EXACT) == EXACT)
    elif kind == "elementwise" and "length" in rec:  # one norm (the q/k norms)
        work = norm_work(rec["rows"], rec["hidden"], rec["length"], dtype_bytes)
    elif kind == "elementwise":
        work = elementwise_work(rec["rows"], rec["hidden"], dtype_bytes)
    else:
        raise ValueError(f"record kind {kind!r} is not a dense op")
    return tuple(float(v) for v in work)


def fit_dense(records: list[dict]) -> dict[str, DenseFit]:
    """Per op kind, the non-negative least-squares fit (on relative error) of its records."""
    from sklearn.linear_model import LinearRegression

    out = {}
    for kind, op in RECORD_OP.items():
        rs = [r for r in records if r["kind"] == kind and not r.get("excluded")]
        if len(rs) < 2:
            continue
        A = np.array([record_work(r) for r in rs])
        used = [i for i in range(A.shape[1]) if A[:, i].any()]
        t = np.array([r["median_ms"] for r in rs], dtype=np.float64)
        reg = LinearRegression(fit_intercept=False, positive=True).fit(A[:, used] / t[:, None], np.ones_like(t))
        coef = np.zeros(A.shape[1])
        coef[used] = reg.coef_
        fit = DenseFit(float(coef[0]), float(coef[1]), f"measured ({len(rs)} records)",
                       float(coef[2]) if op == "matmul" else None, ms_per_fresh_mb=float(coef[3]))
        base = np.array([float(fit.ms(*a)) for a in A])
        ok = base > 0
        if ok.sum() >= 2:  # the form's misfit by shape (small matmuls run below the big ones' rate)
            fit.residual = Residual(np.concatenate([record_features(r) for r in rs])[ok], np.log(t[ok] / base[ok]),
                                    scale=RESIDUAL_SCALE[op])
        out[op] = fit
    return out
