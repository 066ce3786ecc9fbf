"""Prices of a decoder layer's dense ops on one backend: matmuls (attention projections, router, shared expert or
dense MLP, lm_head), the attention core at a (rows, context) shape, and elementwise host work per token (norms,
rope, residual adds).

Each op's compute time is linear in its work: `ms_per_gflop * GFLOP + ms_per_mb * MB + ms_per_weight_mb * weight MB`
(a matmul's weights apart from its activations: a GEMV streams them, a GEMM reuses them from cache), fitted from the
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

OPS = ("matmul", "attention", "elementwise")
RECORD_OP = {"dense_matmul": "matmul", "attention": "attention", "elementwise": "elementwise"}
# Elementwise passes per token over the hidden state in one decoder layer, each a read and a write: two norms,
# rope on q and k, two residual adds (what `elementwise` records time together).
ELEMENTWISE_PASSES = 6


def attention_work(rows: Any, context: Any, heads: int, kv_heads: int, head_dim: int, dtype_bytes: float
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(GFLOP, MB) of the attention core for `rows` queries over `context` keys: QK^T and PV (the masked part is
    computed too, as sdpa with a mask and a static function do), q and the output, k and v, and the scores (in the
    backend's element size) written, normalised and read."""
    m, n = np.asarray(rows, dtype=np.float64), np.asarray(context, dtype=np.float64)
    gflop = 4.0 * m * n * heads * head_dim / 1e9
    tensors = dtype_bytes * (2 * m * heads * head_dim + 2 * n * kv_heads * head_dim)
    mb = (tensors + 3 * dtype_bytes * m * n * heads) / 1e6
    return gflop, mb


def elementwise_work(rows: Any, hidden: int, dtype_bytes: float) -> tuple[np.ndarray, np.ndarray]:
    """(GFLOP, MB) of one layer's elementwise work on `rows` tokens (a few FLOPs per element: bandwidth-bound)."""
    elems = np.asarray(rows, dtype=np.float64) * hidden * ELEMENTWISE_PASSES
    return 4.0 * elems / 1e9, 2.0 * dtype_bytes * elems / 1e6


def matmul_work(m: Any, n: int, k: int, dtype_bytes: float, weight_bytes: float | None = None
                ) -> tuple[np.ndarray, np.ndarray, float]:
    """(GFLOP, activation MB, weight MB) of [m, k] x [k, n]: weights read once (`weight_bytes` each, default
    `dtype_bytes`), activations in and out."""
    m = np.asarray(m, dtype=np.float64)
    w = dtype_bytes if weight_bytes is None else weight_bytes
    return 2.0 * m * n * k / 1e9, dtype_bytes * m * (k + n) / 1e6, w * n * k / 1e6


def features(kind: str, **shape: Any) -> np.ndarray:
    """[n, 3] log2 features of a dense op for the residual learner: a matmul's (m, n, k), the attention core's
    (rows, context, heads x head_dim), elementwise work's (rows, hidden, 1)."""
    cols = {"matmul": ("m", "n", "k"), "attention": ("rows", "context", "width"),
            "elementwise": ("rows", "hidden", None)}[kind]
    vals = [np.asarray(shape[c] if c else 1, dtype=np.float64) for c in cols]
    return np.log2(np.maximum(np.stack(np.broadcast_arrays(*vals), axis=-1).reshape(-1, 3), 1.0))


@dataclass
class DenseFit:
    """One backend's price of one op kind: ms = ms_per_gflop * GFLOP + ms_per_mb * MB + ms_per_weight_mb * weight MB,
    times the residual learner's correction at the op's shape where measured records trained one."""
    ms_per_gflop: float
    ms_per_mb: float
    source: str  # "measured (N records)" or "derived from the backend's matmul fit"
    ms_per_weight_mb: float | None = None  # None: as ms_per_mb
    residual: Residual | None = None

    def ms(self, gflop: Any, mb: Any, weight_mb: Any = 0.0, at: np.ndarray | None = None) -> np.ndarray:
        """The op's time; `at`: its `features` (the residual's correction, where there is one)."""
        per_weight = self.ms_per_mb if self.ms_per_weight_mb is None else self.ms_per_weight_mb
        t = self.ms_per_gflop * np.asarray(gflop) + self.ms_per_mb * np.asarray(mb) + per_weight * np.asarray(
            weight_mb)
        if self.residual is not None and at is not None:
            t = t * self.residual.at(at).reshape(np.shape(t))
        return t

    def to_json(self) -> dict:
        out = {"ms_per_gflop": self.ms_per_gflop, "ms_per_mb": self.ms_per_mb, "source": self.source}
        if self.ms_per_weight_mb is not None:
            out["ms_per_weight_mb"] = self.ms_per_weight_mb
        return out if self.residual is None else {**out, "residual": self.residual.to_json()}

    @classmethod
    def from_json(cls, obj: dict) -> "DenseFit":
        w = obj.get("ms_per_weight_mb")
        return cls(float(obj["ms_per_gflop"]), float(obj["ms_per_mb"]), str(obj.get("source", "measured")),
                   None if w is None else float(w), Residual.from_json(obj.get("residual")))


def record_features(rec: dict) -> np.ndarray:
    """A dense record's `features` (one row)."""
    op = RECORD_OP[rec["kind"]]
    if op == "attention":
        return features(op, rows=rec["rows"], context=rec["context"], width=rec["heads"] * rec["head_dim"])
    return features(op, **{k: rec[k] for k in ("m", "n", "k", "rows", "hidden") if k in rec})


def record_ms(fit: "DenseFit", rec: dict) -> float:
    """The fit's time for what a dense record timed."""
    return float(fit.ms(*record_work(rec), at=record_features(rec)))


def record_work(rec: dict) -> tuple[float, float, float]:
    """(GFLOP, MB, weight MB) of what one dense record timed (in its `dtype_bytes`, default fp32)."""
    kind, dtype_bytes = rec["kind"], rec.get("dtype_bytes", 4)
    if kind == "dense_matmul":
        return tuple(float(v) for v in matmul_work(rec["m"], rec["n"], rec["k"], dtype_bytes))
    if kind == "attention":
        g, mb = attention_work(rec["rows"], rec["context"], rec["heads"], rec["kv_heads"], rec["head_dim"],
                               dtype_bytes)
        return float(g), float(mb), 0.0
    if kind == "elementwise":
        g, mb = elementwise_work(rec["rows"], rec["hidden"], dtype_bytes)
        return float(g), float(mb), 0.0
    raise ValueError(f"record kind {kind!r} is not a dense op")


def fit_dense(records: list[dict]) -> dict[str, DenseFit]:
    """Per op kind, the non-negative least-squares fit (on relative error) of its records."""
    from sklearn.linear_model import LinearRegression

    out = {}
    for kind, op in RECORD_OP.items():
        rs = [r for r in records if r["kind"] == kind and not r.get("excluded")]
        if len(rs) < 2:
            continue
        A = np.array([record_work(r) for r in rs])
        used = [i for i in range(3) if A[:, i].any()]
        t = np.array([r["median_ms"] for r in rs], dtype=np.float64)
        reg = LinearRegression(fit_intercept=False, positive=True).fit(A[:, used] / t[:, None], np.ones_like(t))
        coef = np.zeros(3)
        coef[used] = reg.coef_
        fit = DenseFit(float(coef[0]), float(coef[1]), f"measured ({len(rs)} records)",
                       float(coef[2]) if op == "matmul" else None)
        base = np.array([float(fit.ms(*a)) for a in A])
        ok = base > 0
        if ok.sum() >= 2:  # the form's misfit by shape (small matmuls run below the big ones' rate)
            fit.residual = Residual(np.concatenate([record_features(r) for r in rs])[ok], np.log(t[ok] / base[ok]))
        out[op] = fit
    return out
