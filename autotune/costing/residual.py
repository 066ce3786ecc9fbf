"""The residual learner of the cost model: a multiplicative correction of an analytic form's compute time, where
the form misfits (GEMM kernels switch with the shape), from the records' own errors."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Residual:
    """Multiplicative correction exp(r) of the compute time, learned from log(measured / analytic) by k-nearest
    neighbours (distance-weighted: an exact match returns its own record)."""
    X: np.ndarray  # [n, 3]: log2 of (tokens, hidden, ffn) for an expert FFN; a dense op's own three (dense_prices)
    y: np.ndarray  # [n]: log(measured / analytic)
    k: int = 3
    # Each axis's weight in the distance. By default the shape axes weigh more than the token axis: a neighbour of
    # another shape is a worse guess than one of another M of the same shape.
    scale: tuple[float, ...] = (1.0, 4.0, 4.0)

    def __post_init__(self) -> None:
        from sklearn.neighbors import KNeighborsRegressor

        self.X, self.y = np.asarray(self.X, dtype=np.float64).reshape(-1, 3), np.asarray(self.y, dtype=np.float64)
        self._scale = np.asarray(self.scale, dtype=np.float64)
        self._knn = KNeighborsRegressor(n_neighbors=min(self.k, len(self.y)), weights="distance")
        self._knn.fit(self.X * self._scale, self.y)

    def __call__(self, tokens: np.ndarray, hidden: int, ffn: int) -> np.ndarray:
        m = np.maximum(np.asarray(tokens, dtype=np.float64).reshape(-1), 1.0)
        return self.at(np.stack([np.log2(m), np.full_like(m, np.log2(hidden)), np.full_like(m, np.log2(ffn))], 1))

    def at(self, q: np.ndarray) -> np.ndarray:
        """The correction at feature rows `q` ([n, 3], as `X`)."""
        return np.exp(self._knn.predict(np.asarray(q, dtype=np.float64).reshape(-1, 3) * self._scale))

    def to_json(self) -> dict:
        return {"kind": "knn", "k": self.k, "features": ["log2 tokens", "log2 hidden", "log2 ffn"],
                "scale": list(self.scale), "X": np.round(self.X, 6).tolist(), "y": np.round(self.y, 6).tolist()}

    @classmethod
    def from_json(cls, obj: dict | None) -> "Residual | None":
        return None if not obj else cls(np.array(obj["X"]), np.array(obj["y"]), int(obj.get("k", 3)),
                                        tuple(float(v) for v in obj.get("scale", (1.0, 4.0, 4.0))))
