"""The cost model: per backend, latency of a call = fixed cost + compute time of its matmuls; layers compose calls.

Per backend the analytic part is linear in four features, fitted by non-negative least squares on relative error:

    t = calls * call_ms + experts * expert_ms + GFLOP * ms_per_gflop + MB * ms_per_mb

`calls` counts backend invocations (dispatch + sync), `experts` counts per-expert op launches inside a call (the
CPU backends launch two matmuls and a gate per expert; a compiled ANE graph launches nothing per expert), FLOPs and
bytes are those of the expert's gated FFN (gate_up [2F, H], down [H, F]; weights read once per call). Where the
analytic form misfits (GEMM kernels switch with M, so time is not even monotonic in M; weights in cache or not) a
scikit-learn k-nearest-neighbours learner over (log2 M, log2 H, log2 F) corrects the compute part multiplicatively;
its training points live in the profile, so the model is rebuilt exactly from JSON. Energy = measured power x busy
time; without measured power it is None, never guessed.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from autotune.costing import evaluator
from autotune.costing.dense_prices import (
    DenseFit,
    attention_work,
    elementwise_work,
    features,
    norm_work,
)
from autotune.costing.dense_prices import matmul_work as dense_matmul_work
from autotune.costing.evaluator import LayerWork, Totals
from autotune.costing.fit_range import Ranges
from autotune.costing.residual import Residual
from runtime.backends import EXACT, REFERENCE, registry
from runtime.coreml import ane_limits
from runtime.cpu.cpu_backends import call_rows
from runtime.errors import NpumoeError

PARAMS = ("call_ms", "expert_ms", "ms_per_gflop", "ms_per_mb")  # coefficients of calls, experts, GFLOP, MB
LUT_TOKENS = 8192  # ffn_ms is tabulated for 0..LUT_TOKENS-1 tokens per (backend, H, F): the search calls it a lot


def ffn_work(tokens: Any, hidden: int, ffn: int, dtype_bytes: float,
             weight_bytes: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(GFLOP, MB) of one expert's gated FFN over `tokens` rows: weights read once (`weight_bytes` each, default
    `dtype_bytes`: less where they are stored compressed), activations in and out."""
    m = np.asarray(tokens, dtype=np.float64)
    gflop = 6.0 * m * hidden * ffn / 1e9  # 2*M*(2F*H) for gate_up + 2*M*(H*F) for down
    weights = 3.0 * hidden * ffn
    acts = m * (hidden + 2 * ffn) + m * (ffn + hidden)  # gate_up in/out, down in/out
    mb = ((dtype_bytes if weight_bytes is None else weight_bytes) * weights + dtype_bytes * acts) / 1e6
    return gflop, mb


def matmul_work(m: Any, n: int, k: int, dtype_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """(GFLOP, MB) of one dense matmul [m, k] x [k, n] (the paper's (M, N, K) records)."""
    m = np.asarray(m, dtype=np.float64)
    return 2.0 * m * n * k / 1e9, dtype_bytes * (n * k + m * k + m * n) / 1e6


@dataclass
class BackendModel:
    """One backend's latency (ms) and power (W) model."""
    name: str
    call_ms: float
    expert_ms: float
    ms_per_gflop: float
    ms_per_mb: float
    dtype_bytes: int = 4
    overlaps_cpu: bool = False
    power_w: float | None = None
    power_source: str | None = None
    residual: Residual | None = None
    note: str | None = None
    # ms per MB of stored weights to expand each compression kind, per call (measured or cited); absent: none known
    decompress_ms_per_mb: dict[str, float] | None = None
    # the experts held in another CPU storage than the fit's (costing/cpu_storage.StoragePrice): compute x its factor
    storage: Any = None

    def analytic(self, calls: Any, experts: Any, gflop: Any, mb: Any) -> np.ndarray:
        return (self.call_ms * np.asarray(calls) + self.expert_ms * np.asarray(experts)
                + self.ms_per_gflop * np.asarray(gflop) + self.ms_per_mb * np.asarray(mb))

    def ffn_ms(self, tokens: Any, hidden: int, ffn: int, compress: str = "none") -> np.ndarray:
        """One expert's FFN over `tokens` rows, its weights stored as `compress` (ane_limits.BYTES_PER_WEIGHT:
        fewer bytes streamed per call, plus the profile's decompression cost where it has one)."""
        m = np.asarray(tokens, dtype=np.float64)
        stored = None if compress == "none" else ane_limits.BYTES_PER_WEIGHT[compress]
        gflop, mb = ffn_work(m, hidden, ffn, self.dtype_bytes, stored)
        compute = self.analytic(0.0, 0.0, gflop, mb)
        if self.residual is not None:  # corrects the compute; the per-expert launch cost stays additive
            compute = compute * self.residual(m, hidden, ffn).reshape(m.shape)
        if self.storage is not None:
            compute = compute * self.storage.factor(m)
        if stored is not None and self.decompress_ms_per_mb and compress in self.decompress_ms_per_mb:
            compute = compute + self.decompress_ms_per_mb[compress] * ane_limits.expert_weight_bytes(
                hidden, ffn, compress) / 1e6
        return np.where(m > 0, self.expert_ms + compute, 0.0)

    def ffn_key(self) -> tuple:
        """What `ffn_ms` reads: two models with the same key cost every FFN the same (their call costs or powers
        may differ)."""
        return (self.expert_ms, self.ms_per_gflop, self.ms_per_mb, self.dtype_bytes, id(self.residual),
                tuple(sorted((self.decompress_ms_per_mb or {}).items())), getattr(self.storage, "key", None))

    def to_json(self) -> dict:
        out = {"call_ms": self.call_ms, "expert_ms": self.expert_ms, "ms_per_gflop": self.ms_per_gflop,
               "ms_per_mb": self.ms_per_mb, "dtype_bytes": self.dtype_bytes, "overlaps_cpu": self.overlaps_cpu,
               "power_w": self.power_w, "power_source": self.power_source,
               "residual": self.residual.to_json() if self.residual else None}
        if self.note:
            out["note"] = self.note
        if self.decompress_ms_per_mb:
            out["decompress_ms_per_mb"] = self.decompress_ms_per_mb
        return out

    @classmethod
    def from_json(cls, name: str, obj: dict) -> "BackendModel":
        return cls(name=name, call_ms=float(obj["call_ms"]), expert_ms=float(obj["expert_ms"]),
                   ms_per_gflop=float(obj["ms_per_gflop"]), ms_per_mb=float(obj["ms_per_mb"]),
                   dtype_bytes=int(obj.get("dtype_bytes", 4)), overlaps_cpu=bool(obj.get("overlaps_cpu", False)),
                   power_w=None if obj.get("power_w") is None else float(obj["power_w"]),
                   power_source=obj.get("power_source"), residual=Residual.from_json(obj.get("residual")),
                   note=obj.get("note"), decompress_ms_per_mb=obj.get("decompress_ms_per_mb"))


HOST_TERMS = ("fixed_ms", "per_assignment_ms", "per_assignment_kelem_ms", "per_slot_kelem_ms",
              "per_assignment_kelem_large_ms", "per_slot_kelem_large_ms")
# glibc serves allocations of 32 MiB and more by mmap every time (its dynamic threshold stops there), so buffers that
# large pay page faults on each chunk: a separate, steeper per-element cost. The threshold is in bytes: a bf16 buffer
# reaches it at twice the elements of a float32 one (counted in elements at fp32's 4 bytes, a bf16 fit's large term
# learnt from buffers glibc never mapped, and priced Phi-tiny's 8,192 x 4,096 gather at half its time).
LARGE_BYTES = 32 * 2**20


def host_features(assignments: Any, hidden: Any, slots: Any = 0, dtype_bytes: int = 4) -> np.ndarray:
    """[..., 6]: 1, A, A x H / 1000, S x H / 1000, and the last two again for buffers of LARGE_BYTES or more in
    `dtype_bytes` elements (gather/scatter per assignment; zeroing and copying padded slots)."""
    a, h, s = np.broadcast_arrays(*(np.asarray(v, dtype=np.float64) for v in (assignments, hidden, slots)))
    ah, sh = a * h, s * h
    large = LARGE_BYTES / dtype_bytes
    return np.stack([np.ones_like(a), a, ah / 1e3, sh / 1e3, np.where(ah >= large, ah, 0.0) / 1e3,
                     np.where(sh >= large, sh, 0.0) / 1e3], axis=-1)


@dataclass
class HostCosts:
    """Host-side work of the executor, per chunk: packing for static groups, the exact path's gather/scatter.

    Each is linear in `host_features`. None when the profile has no measurement (published figures): the cost
    is then left out (0), and the profile says so.
    """
    pack: tuple[float, ...] | None = None
    exact: tuple[float, ...] | None = None
    dtype_bytes: int = 4  # the element size of the rows the records moved (a bf16 model's: 2)

    @staticmethod
    def evaluate(coef: tuple[float, ...] | None, assignments: Any, hidden: int, slots: Any = 0,
                 dtype_bytes: int = 4) -> np.ndarray:
        a = np.asarray(assignments, dtype=np.float64)
        if coef is None:
            return np.zeros_like(a)
        return np.where(a > 0, host_features(a, hidden, slots, dtype_bytes) @ np.asarray(coef), 0.0)

    def to_json(self) -> dict:
        out = {k: (dict(zip(HOST_TERMS, v)) if v is not None else None) for k, v in
               (("pack", self.pack), ("exact", self.exact))}
        return out if self.dtype_bytes == 4 else {**out, "dtype_bytes": self.dtype_bytes}

    @classmethod
    def from_json(cls, obj: dict | None) -> "HostCosts":
        obj = obj or {}

        def get(d: dict | None) -> tuple | None:
            return None if not d else tuple(float(d.get(k, 0.0)) for k in HOST_TERMS)

        return cls(pack=get(obj.get("pack")), exact=get(obj.get("exact")), dtype_bytes=int(obj.get("dtype_bytes", 4)))


@dataclass
class ExactLanes:
    """A chunk's exact paths composed (`CostModel.exact_lanes`), per chunk: the lanes' latency side by side, the CPU
    lane's busy time and their energy (mJ; None where a power is unknown)."""
    latency: np.ndarray
    cpu: np.ndarray
    mj: np.ndarray | None


@dataclass
class CostModel:
    """Latency (ms) and energy (mJ) predictions for calls and MoE layers on one device. All outputs are predicted."""
    models: dict[str, BackendModel]
    host: HostCosts = field(default_factory=HostCosts)
    default_hidden: int = 1024  # used by pack_ms when the caller gives no hidden size
    dense: dict[str, dict[str, DenseFit]] = field(default_factory=dict)  # measured dense-op fits, by backend and op
    bus_ms_per_mb: float | None = None  # the memory bus the lanes share (ms per MB); None: not known, no floor
    ranges: Ranges = field(default_factory=dict)  # each fit's shape range (`fit_range`): where it interpolates
    exact_path: str | None = None  # the plan's exact path where a search pins it (`with_exact`); None: `plan_exact`'s
    _lut: dict = field(default_factory=dict, repr=False)

    @property
    def backends(self) -> list[str]:
        return sorted(self.models)

    def _model(self, backend: str) -> BackendModel:
        """The backend's model; a static backend the profile lacks is costed as its fallbacks (the registry's: where
        the runtime would run it), then as the reference cpu-static (what every static group computes on the CPU)."""
        if backend in self.models:
            return self.models[backend]
        for fallback in [*registry.fallbacks(backend)[1:], REFERENCE]:
            if fallback in self.models:
                return self.models[fallback]
        raise KeyError(f"the cost model has no backend {backend!r} (it has {', '.join(self.backends)})")

    # --- calls -------------------------------------------------------------------------------------------------
    def call_ms(self, backend: str) -> float:
        return float(self._model(backend).call_ms)

    def decompresses(self, backend: str) -> bool:
        """Whether the profile charges this backend for expanding compressed weights (a measured or cited cost)."""
        return bool(self._model(backend).decompress_ms_per_mb)
    def backend_model(self, backend: str) -> BackendModel:
        """The model a backend is costed with (its own, or its fallback's: see `_model`)."""
        return self._model(backend)

    def with_cpu_storage(self, price: Any, quantized_at_load: bool = True) -> "CostModel":
        """This cost model with the CPU's experts held as `price` says (`costing.cpu_storage.StoragePrice`): the
        exact path and the CPU's static groups run that storage's kernels (None: as fitted, bf16). The exact paths
        off the CPU (mlx-exact) run the checkpoint's own weights and cannot read a storage quantized at load, which
        the runtime refuses beside them: such a storage leaves them out (`quantized_at_load` False: the checkpoint's
        own packed storage, which they read)."""
        if price is None:
            return self
        models = {name: m for name, m in self.models.items()
                  if not (quantized_at_load and name != EXACT and self.is_exact(name) and m.overlaps_cpu)}
        for backend in (EXACT, REFERENCE):
            if backend in models:
                models[backend] = dataclasses.replace(models[backend], storage=price)
        return dataclasses.replace(self, models=models, _lut={})

    @staticmethod
    def is_exact(backend: str) -> bool:
        """Whether `backend` is an exact path (the registry's: cpu-exact, mlx-exact, plugins), not a static one."""
        info = registry.get(backend)
        return info is not None and info.exact

    @staticmethod
    def is_lazy(backend: str) -> bool:
        """Whether `backend`, as the dense host, computes in a lazy graph (MLX: work no output reads never runs)."""
        info = registry.get(backend)
        return info is not None and info.lazy

    def plan_exact(self) -> str:
        """The exact path the search gives a plan (`Plan.exact`): the one pinned (`with_exact`), else an exact path
        off the CPU that this profile prices (the GPU's, mlx-exact), else cpu-exact."""
        if self.exact_path is not None:
            return self.exact_path
        return next((name for name, m in sorted(self.models.items()) if name != EXACT and m.overlaps_cpu
                     and self.is_exact(name)), EXACT)

    def with_exact(self, path: str) -> "CostModel":
        """This cost model with the plan's exact path pinned to `path`, one it prices from its own records, wherever
        they ran (mlx-exact timed on MLX's CPU device, for a run on the MLX spine there: a lane on this process's
        CPU, not beside it)."""
        if path not in self.models:
            raise NpumoeError(f"the profile has no {path} records to price the plan's exact path with (it prices "
                              f"{', '.join(self.backends)}): run `autotune profile-device --backends ...,{path}`")
        return dataclasses.replace(self, exact_path=path, _lut={})

    def overlaps(self, backend: str) -> bool:
        """Whether the backend's calls run off the CPU (the exact path overlaps them)."""
        return self._model(backend).overlaps_cpu

    def ffn_ms(self, backend: str, tokens: Any, hidden: int, ffn: int, compress: str = "none") -> Any:
        """Compute time of one expert's FFN over `tokens` rows (0 rows cost nothing), its weights stored as
        `compress`; int or ndarray."""
        model = self._model(backend)
        rows = call_rows if self.runs_call_rows(backend) else (lambda m: m)
        key = (model.name, int(hidden), int(ffn), compress)
        lut = self._lut.get(key)
        if lut is None:
            lut = self._lut[key] = model.ffn_ms(rows(np.arange(LUT_TOKENS)), hidden, ffn, compress)
        m = np.asarray(tokens)
        if np.issubdtype(m.dtype, np.integer) and (m.size == 0 or (m.min() >= 0 and m.max() < LUT_TOKENS)):
            out = lut[m]
        else:
            out = model.ffn_ms(rows(m) if np.issubdtype(m.dtype, np.integer) else m, hidden, ffn, compress)
        return float(out) if np.ndim(out) == 0 else out

    def runs_call_rows(self, backend: str) -> bool:
        """Whether the runtime runs this backend's expert calls at `call_rows` rows: torch's exact path on the CPU in
        half precision (its records, timed at row counts that are already such sizes, price those rows; a storage
        with its own kernels runs every count as it is)."""
        model, info = self._model(backend), registry.get(backend)
        return (info is not None and info.exact and info.cpu_torch and model.dtype_bytes == 2
                and model.storage is None)

    def group_call_ms(self, backend: str, capacities: Sequence[int], hidden: int, ffn: int,
                      compress: str = "none") -> float:
        """One static group call: fixed cost plus every expert's slice computed at full capacity (padding too)."""
        caps = np.asarray(capacities, dtype=np.int64)
        return float(self.static_ms(backend, np.sum(self.ffn_ms(backend, caps, hidden, ffn, compress)), 1))

    def exact_ms(self, counts: np.ndarray, hidden: int, ffn: int, path: str = EXACT) -> Any:
        """One exact path (default cpu-exact) over per-expert counts ([E] -> float, [chunks, E] -> array), incl. its
        call and the host's costs."""
        c = np.asarray(counts, dtype=np.int64)
        t = self.exact_lanes([self.path_work(path, c, hidden, ffn)], hidden).latency
        return float(t) if np.ndim(t) == 0 else t

    def path_work(self, path: str, counts: np.ndarray, hidden: int, ffn: int) -> tuple:
        """(path, FFN ms, assignments, MB) of an exact path over per-expert counts ([..., E]): what `exact_lanes`
        composes."""
        c = np.asarray(counts, dtype=np.int64)
        return (path, np.sum(self.ffn_ms(path, c, hidden, ffn), axis=-1), c.sum(axis=-1),
                np.sum(self.ffn_mb(path, c, hidden, ffn), axis=-1))

    def ffn_mb(self, backend: str, tokens: Any, hidden: int, ffn: int) -> np.ndarray:
        """MB one expert's FFN over `tokens` rows moves on `backend` (0 rows move nothing): the memory bus's share."""
        m = np.asarray(tokens, dtype=np.float64)
        return np.where(m > 0, ffn_work(m, hidden, ffn, self.dtype_bytes(backend))[1], 0.0)

    def exact_lanes(self, work: Sequence[tuple], hidden: int) -> ExactLanes:
        """A chunk's exact paths side by side, from `work`: (path, its experts' FFN ms, assignments, MB) per chunk,
        a path listed more than once adding up. Paths on the CPU share one lane (the cpu-exact thread), with the
        host's gather/scatter of every exact assignment; paths off the CPU (the GPU) the other, each path paying
        its call where any assignment takes it. The lanes overlap each other (and the ANE's calls: the evaluator);
        both stream their experts' weights over one memory bus, so the pair takes at least the bus's time for their
        bytes together (`bus_ms_per_mb`; the ANE's stream is left out: its own rate keeps it under a tenth of the
        bus). Energy: each lane's busy time at its device's power (None where one is unknown)."""
        paths: dict[str, list] = {}
        for path, ms, n, mb in work:
            acc = paths.setdefault(path, [0.0, 0.0, 0.0])
            acc[0], acc[1], acc[2] = acc[0] + np.asarray(ms, dtype=np.float64), acc[1] + np.asarray(n), acc[2] + mb
        n_all = sum(acc[1] for acc in paths.values())
        cpu = HostCosts.evaluate(self.host.exact, n_all, hidden, 0, self.host.dtype_bytes)
        off, bytes_mb = np.zeros_like(cpu), np.zeros_like(cpu)
        cpu_w = self.power_w(EXACT) if EXACT in self.models else None
        off_mj: Any = 0.0
        for path, (ms, n, mb) in paths.items():
            t = np.where(np.asarray(n) > 0, ms + self.call_ms(path), 0.0)
            bytes_mb = bytes_mb + mb
            if self.overlaps(path):
                off = off + t
                w = self.power_w(path)
                off_mj = None if off_mj is None or w is None else off_mj + w * t
            else:
                cpu = cpu + t
        latency = np.maximum(cpu, off)
        if self.bus_ms_per_mb:
            latency = np.maximum(latency, self.bus_ms_per_mb * bytes_mb)
        mj = None if cpu_w is None or off_mj is None else cpu_w * cpu + off_mj
        return ExactLanes(latency, cpu, mj)

    def static_ms(self, backend: str, ffn_ms: Any, calls: Any) -> np.ndarray:
        """Static calls on `backend` whose experts' slices take `ffn_ms` (every slot computed, padding too)."""
        return np.asarray(ffn_ms) + np.asarray(calls) * self.call_ms(backend)

    def pack_ms(self, assignments: Any, hidden: int | None = None, slots: Any = 0) -> Any:
        """Host-side pack/unpack of one chunk's static groups: routing bookkeeping, gathering `assignments` rows
        into `slots` padded rows (the groups' summed capacities) and the weighted combine. `hidden` defaults to
        the profile's middle measured hidden size."""
        t = HostCosts.evaluate(self.host.pack, assignments, hidden or self.default_hidden, slots,
                               self.host.dtype_bytes)
        return float(t) if np.ndim(t) == 0 else t

    def power_w(self, backend: str) -> float | None:
        return self._model(backend).power_w

    # --- dense ops (autotune.costing.dense_prices) ------------------------------------------------------------
    def dense_fit(self, backend: str, op: str) -> DenseFit:
        """The price of a dense op kind on a backend: measured where the profile has its records, else derived from
        the backend's fitted matmul throughput (labelled so)."""
        model = self._model(backend)
        fit = self.dense.get(model.name, {}).get(op)
        return fit or DenseFit(model.ms_per_gflop, model.ms_per_mb,
                               f"derived from {model.name}'s fitted matmul throughput (no {op} records)")

    def dtype_bytes(self, backend: str) -> int:
        return self._model(backend).dtype_bytes

    def matmul_ms(self, backend: str, m: Any, n: int, k: int, weight_bytes: float | None = None) -> np.ndarray:
        """Compute time of [m, k] x [k, n] on `backend` (no call cost; 0 rows cost nothing)."""
        t = self.dense_fit(backend, "matmul").ms(*dense_matmul_work(m, n, k, self.dtype_bytes(backend), weight_bytes),
                                                 at=features("matmul", m=m, n=n, k=k))
        return np.where(np.asarray(m) > 0, t, 0.0)

    def stored_matmul_ms(self, backend: str, m: Any, n: int, k: int, compress: str = "none") -> np.ndarray:
        """`matmul_ms` of a static function whose [k, n] weights are stored as `compress`
        (ane_limits.BYTES_PER_WEIGHT: fewer bytes streamed per call, plus the profile's decompression cost where it
        has one), as `ffn_ms` prices an expert's."""
        if compress == "none":
            return self.matmul_ms(backend, m, n, k)
        per_weight = ane_limits.BYTES_PER_WEIGHT[compress]
        t = self.matmul_ms(backend, m, n, k, per_weight)
        rate = (self._model(backend).decompress_ms_per_mb or {}).get(compress, 0.0)
        return np.where(np.asarray(m) > 0, t + rate * n * k * per_weight / 1e6, 0.0)

    def attention_ms(self, backend: str, rows: Any, context: Any, heads: int, kv_heads: int, head_dim: int,
                     masked: bool = False) -> np.ndarray:
        """Compute time of the attention core over `context` keys for `rows` queries on `backend`; `masked`: a first
        chunk that still gets a mask (a sliding window shorter than its context), so the CPU's sdpa computes the
        whole block as a later chunk's."""
        # an exact path prices its sdpa (causal, no padding); a static one, its padded masked function; MLX off the
        # CPU (Metal) skips the blocks past each query's diagonal in a later chunk too, MLX's CPU device does not
        work = attention_work(rows, context, heads, kv_heads, head_dim, self.dtype_bytes(backend),
                              sdpa=self.is_exact(backend), masked=masked,
                              skips=self.is_lazy(backend) and self.overlaps(backend))
        before = np.asarray(context) + np.asarray(rows) if masked else context  # priced as a masked chunk's
        return self.dense_fit(backend, "attention").ms(*work, at=features("attention", rows=rows, context=before,
                                                                            width=heads * head_dim))

    def elementwise_ms(self, backend: str, rows: Any, hidden: int) -> np.ndarray:
        """One layer's norms and residual adds on `rows` tokens (rope is the attention core's)."""
        return self.dense_fit(backend, "elementwise").ms(*elementwise_work(rows, hidden, self.dtype_bytes(backend)),
                                                         at=features("elementwise", rows=rows, hidden=hidden))

    def norm_ms(self, backend: str, rows: Any, width: int, length: int) -> np.ndarray:
        """One RMS norm over `rows` x `width` elements in vectors of `length` (the q/k norms, the final norm)."""
        return self.dense_fit(backend, "elementwise").ms(*norm_work(rows, width, length, self.dtype_bytes(backend)),
                                                         at=features("elementwise", rows=rows, hidden=width,
                                                                     length=length))

    # --- layers ------------------------------------------------------------------------------------------------
    def layer_work(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int, overflow: str,
                   exact: str = EXACT) -> LayerWork:
        """One layer plan's busy parts over chunks of `counts` ([chunks, E]) as the evaluator's one row: static calls
        split by whether their backend runs off the CPU, the exact paths (cold experts on the path `exact_split`
        names, else the plan's `exact`; the overflow under `spill` on `exact`) as lanes, and packing per chunk."""
        c = np.asarray(counts, dtype=np.int64).reshape(-1, np.shape(counts)[-1])
        on_path: dict[str, np.ndarray] = {}

        def put(path: str, experts: list[int], values: np.ndarray) -> None:
            into = on_path.setdefault(path, np.zeros_like(c))
            into[:, experts] += values

        for e in layer_plan.cpu_exact:
            put(layer_plan.exact_path_of(e, exact), [e], c[:, [e]])
        static: dict[str, float] = {}  # by the model that costs each group's backend
        for g in layer_plan.groups:
            name = self._model(g.backend).name
            static[name] = static.get(name, 0.0) + self.group_call_ms(g.backend, g.capacities, hidden, ffn,
                                                                       g.compression)
            if overflow == "spill":
                idx, caps = list(g.experts), np.asarray(g.capacities)
                put(exact, idx, np.maximum(c[:, idx] - caps, 0))
        on_cpu = sum(t for b, t in static.items() if not self.models[b].overlaps_cpu)
        off_cpu = sum(t for b, t in static.items() if self.models[b].overlaps_cpu)
        powers = [self.models[b].power_w for b in static]
        mj = None if None in powers else sum(p * t for p, t in zip(powers, static.values()))
        slots = sum(g.slots for g in layer_plan.groups)
        pack = self.pack_ms(c.sum(axis=-1), hidden, slots) if layer_plan.groups else np.zeros(len(c))
        lanes = self.exact_lanes([self.path_work(p, v, hidden, ffn) for p, v in on_path.items()]
                                 or [self.path_work(exact, np.zeros_like(c), hidden, ffn)], hidden)
        one = np.zeros(1, dtype=np.int64)
        row = lambda a: None if a is None else np.asarray(a, dtype=np.float64).reshape(1, -1)  # noqa: E731
        return LayerWork(np.array([on_cpu]), np.array([off_cpu]), row(lanes.latency), row(pack), one, one,
                         None if mj is None else np.array([mj]), self.power_w(EXACT) if EXACT in self.models else None,
                         row(lanes.cpu), row(lanes.mj))

    def _per_chunk(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int, overflow: str,
                   exact: str = EXACT) -> Totals:
        return evaluator.per_chunk(self.layer_work(layer_plan, counts, hidden, ffn, overflow, exact))

    @staticmethod
    def _shaped(values: np.ndarray, counts: np.ndarray) -> Any:
        """A row of per-chunk figures as the counts were given: [E] -> float, [chunks, E] -> [chunks]."""
        return float(values[0, 0]) if np.ndim(counts) == 1 else values[0]

    def layer_times(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int, overflow: str,
                    exact: str = EXACT) -> tuple[Any, Any]:
        """Predicted (latency, CPU-busy time) in ms of one MoE layer for one chunk ([E] counts -> floats;
        [chunks, E] -> arrays), composed by the evaluator (`autotune.costing.evaluator`); `exact`: the plan's exact
        path."""
        t = self._per_chunk(layer_plan, counts, hidden, ffn, overflow, exact)
        return self._shaped(t.latency_ms, counts), self._shaped(t.cpu_ms, counts)

    def layer_ms(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int, overflow: str,
                 exact: str = EXACT) -> Any:
        """Predicted latency of one MoE layer for one chunk (see `layer_times`)."""
        return self.layer_times(layer_plan, counts, hidden, ffn, overflow, exact)[0]

    def layer_cpu_ms(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int, overflow: str) -> Any:
        """Predicted CPU-busy time of one MoE layer for one chunk (see `layer_times`): the paper's CPU cycles, in
        ms of the profile's CPU threads."""
        return self.layer_times(layer_plan, counts, hidden, ffn, overflow)[1]

    def layer_energy_mj(self, layer_plan: Any, counts: np.ndarray, hidden: int, ffn: int,
                        overflow: str, exact: str = EXACT) -> Any | None:
        """Predicted energy (mJ = W x ms) of the layer's busy parts; None if any part's power was not measured."""
        e = self._per_chunk(layer_plan, counts, hidden, ffn, overflow, exact).energy_mj
        return None if e is None else self._shaped(e, counts)

    def static_break_even(self, layer_plans: Sequence[Any], mean_counts: Sequence[np.ndarray], chunk_tokens: int,
                          hidden: int, ffn: int, overflow: str, exact: str = EXACT) -> int:
        """Smallest chunk (tokens) at which the plans' static groups are predicted to beat running every assignment
        exactly, summed over layers; a chunk of n tokens gets n/chunk_tokens of each expert's mean load. At least 2
        (a decode step never calls a static group), at most `chunk_tokens` (full chunks run the plan)."""
        n = np.arange(1, chunk_tokens + 1)
        static = np.zeros(n.size)
        every = np.zeros(n.size)
        for lp, mean in zip(layer_plans, mean_counts):
            counts = np.rint(np.outer(n, np.asarray(mean, dtype=float) / chunk_tokens)).astype(np.int64)
            static += self.layer_ms(lp, counts, hidden, ffn, overflow, exact)
            every += self.exact_ms(counts, hidden, ffn, exact)
        pays = np.nonzero(static <= every)[0]
        return int(max(2, min(n[pays[0]] if pays.size else chunk_tokens, chunk_tokens)))

    @property
    def has_energy(self) -> bool:
        return all(m.power_w is not None for m in self.models.values())

    # --- serialization -----------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"form": "calls*call_ms + experts*expert_ms + GFLOP*ms_per_gflop + MB*ms_per_mb, x residual",
                "backends": {n: m.to_json() for n, m in sorted(self.models.items())},
                "host": self.host.to_json(), "default_hidden": self.default_hidden,
                **({"bus_ms_per_mb": self.bus_ms_per_mb} if self.bus_ms_per_mb else {}),
                **({"dense": {b: {op: f.to_json() for op, f in fits.items()} for b, fits in self.dense.items()}}
                   if self.dense else {}), **({"ranges": self.ranges} if self.ranges else {})}

    @classmethod
    def from_json(cls, obj: dict) -> "CostModel":
        return cls({n: BackendModel.from_json(n, m) for n, m in obj["backends"].items()},
                   HostCosts.from_json(obj.get("host")), int(obj.get("default_hidden", 1024)),
                   {b: {op: DenseFit.from_json(f) for op, f in fits.items()}
                    for b, fits in (obj.get("dense") or {}).items()},
                   None if obj.get("bus_ms_per_mb") is None else float(obj["bus_ms_per_mb"]), obj.get("ranges") or {})
