"""Fitting the cost model to a profile's records: per backend the analytic form by non-negative least squares on
relative error and its residual learner, the host's packing costs, the dense ops' fits; and the held-out error of
every part (k-fold cross-validation)."""
from __future__ import annotations

import numpy as np

from autotune.costing.costmodel import (
    PARAMS,
    BackendModel,
    CostModel,
    HostCosts,
    Residual,
    ffn_work,
    host_features,
    matmul_work,
)
from autotune.costing.dense_prices import RECORD_OP, fit_dense, record_ms
from autotune.costing.fit_range import fit_ranges, record_kind, record_shape
from runtime.backends import registry


# --- fitting -----------------------------------------------------------------------------------------------------
def record_features(rec: dict, dtype_bytes: int) -> np.ndarray:
    """(calls, experts, GFLOP, MB) of one record: what the backend did during the timed call."""
    kind = rec["kind"]
    if kind == "ffn":
        g, mb = ffn_work(rec["tokens"], rec["hidden"], rec["ffn"], dtype_bytes)
        return np.array([0.0, 1.0, g, mb])
    if kind in ("group", "call"):
        caps = np.asarray(rec["capacities"], dtype=np.float64)
        g, mb = ffn_work(caps, rec["hidden"], rec["ffn"], dtype_bytes)
        return np.array([1.0, len(caps), g.sum(), mb.sum()])
    if kind == "matmul":
        g, mb = matmul_work(rec["m"], rec["n"], rec["k"], dtype_bytes)
        return np.array([1.0, 0.0, g, mb])
    raise ValueError(f"record kind {kind!r} has no backend features")


def predict_record(model: BackendModel, rec: dict) -> float:
    """The model's latency (ms) for what a record timed."""
    kind = rec["kind"]
    if kind == "ffn":
        return float(model.ffn_ms(rec["tokens"], rec["hidden"], rec["ffn"]))
    if kind in ("group", "call"):
        return model.call_ms + float(np.sum(model.ffn_ms(np.asarray(rec["capacities"]), rec["hidden"], rec["ffn"])))
    return float(model.analytic(*record_features(rec, model.dtype_bytes)))


def _positive_lsq(A: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Non-negative least squares on relative error (rows divided by the measured time)."""
    from sklearn.linear_model import LinearRegression

    reg = LinearRegression(fit_intercept=False, positive=True)
    reg.fit(A / t[:, None], np.ones_like(t))
    return reg.coef_


def fit_backend(name: str, records: list[dict], dtype_bytes: int = 4, overlaps_cpu: bool | None = None,
                fixed: dict[str, float] | None = None, residual: bool = True, power_w: float | None = None,
                power_source: str | None = None) -> BackendModel:
    """Fit one backend's analytic form to its records, then the residual learner on single-expert records.

    `fixed` pins coefficients (e.g. a cited fixed cost per call) instead of fitting them. `overlaps_cpu` defaults
    to the backend's registry entry (False for a backend not registered here, or whose records say they ran on the
    CPU: `device` "cpu")."""
    fixed = fixed or {}
    A = np.stack([record_features(r, dtype_bytes) for r in records])
    t = np.array([r["median_ms"] for r in records], dtype=np.float64)
    unknown = set(fixed) - set(PARAMS)
    if unknown:
        raise ValueError(f"cannot pin {sorted(unknown)}: the parameters are {PARAMS}")
    free = [i for i, p in enumerate(PARAMS) if p not in fixed and A[:, i].any()]
    pinned = np.array([fixed.get(p, 0.0) for p in PARAMS])
    rest = np.maximum(t - A @ pinned, 1e-6 * t)
    coef = pinned.copy()
    if free:
        coef[free] = _positive_lsq(A[:, free], rest)
    if overlaps_cpu is None:  # calls that ran on this process's CPU (mlx-exact on MLX's CPU device) overlap nothing
        overlaps_cpu = _overlaps_cpu(name) and not any(r.get("device") == "cpu" for r in records)
    model = BackendModel(name, float(coef[0]), float(coef[1]), float(coef[2]), float(coef[3]), dtype_bytes,
                         overlaps_cpu, power_w, power_source)
    if residual:
        X, y = [], []
        for r in records:
            caps = r.get("capacities") or []
            if r["kind"] == "ffn" or (r["kind"] == "group" and len(caps) == 1):
                m = r["tokens"] if r["kind"] == "ffn" else caps[0]
                compute = r["median_ms"] - model.expert_ms - (model.call_ms if r["kind"] == "group" else 0.0)
                base = float(model.ffn_ms(m, r["hidden"], r["ffn"])) - model.expert_ms
                if compute > 0 and base > 0:
                    X.append([np.log2(max(m, 1)), np.log2(r["hidden"]), np.log2(r["ffn"])])
                    y.append(np.log(compute / base))
        if len(y) >= 2:
            model.residual = Residual(np.array(X), np.array(y))
    return model


def _overlaps_cpu(name: str) -> bool:
    info = registry.get(name)
    return info is not None and info.overlaps_cpu


def record_bytes(rec: dict) -> int:
    """The element size of the dtype a record was timed in."""
    return DTYPE_BYTES[rec.get("dtype", DTYPE)]


def fit_host(records: list[dict]) -> tuple[float, ...] | None:
    """Host cost coefficients (HOST_TERMS) from pack/exact_host records."""
    if not records:
        return None
    A = np.stack([host_features(r["assignments"], r["hidden"], r.get("slots", 0), record_bytes(r)) for r in records])
    t = np.array([r["median_ms"] for r in records], dtype=np.float64)
    used = [i for i in range(A.shape[1]) if A[:, i].any()]
    coef = np.zeros(A.shape[1])
    coef[used] = _positive_lsq(A[:, used], t)
    return tuple(float(c) for c in coef)


def _host_predict(coef: tuple[float, ...], rec: dict) -> float:
    return float(HostCosts.evaluate(coef, rec["assignments"], rec["hidden"], rec.get("slots", 0), record_bytes(rec)))


def fit_cost_model(records: list[dict], backend_options: dict[str, dict] | None = None) -> CostModel:
    """Fit every backend found in `records` (plus host costs from pack/exact_host records)."""
    backend_options = backend_options or {}
    by_backend: dict[str, list[dict]] = {}
    dense_by_backend: dict[str, list[dict]] = {}
    for r in records:
        if r["kind"] in RECORD_OP:
            dense_by_backend.setdefault(r["backend"], []).append(r)
        elif r["kind"] not in ("pack", "exact_host") and not r.get("excluded"):
            by_backend.setdefault(r["backend"], []).append(r)
    models = {b: fit_backend(b, rs, **backend_options.get(b, {})) for b, rs in sorted(by_backend.items())}
    dense = {b: fits for b, rs in sorted(dense_by_backend.items()) if b in models
             and (fits := fit_dense(rs))}
    hosts = [r for r in records if r["kind"] in ("pack", "exact_host")]
    host = HostCosts(pack=fit_host([r for r in hosts if r["kind"] == "pack"]),
                     exact=fit_host([r for r in hosts if r["kind"] == "exact_host"]),
                     dtype_bytes=record_bytes(hosts[0]) if hosts else 4)
    hiddens = sorted({int(r["hidden"]) for r in records if "hidden" in r})
    return CostModel(models, host, hiddens[len(hiddens) // 2] if hiddens else 1024, dense, ranges=fit_ranges(records))


DTYPE = "float32"  # what a record without a `dtype` was timed in (profile-device's default shapes)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # what a record's `dtype` may be


def record_part(rec: dict) -> str:
    """Which part of the model a record measures: a backend, a backend's dense op (`cpu-exact-matmul`), or the
    host's packing / exact-path work (`host-pack`, `host-exact`)."""
    if rec["kind"] in RECORD_OP:
        return f"{rec['backend']}-{RECORD_OP[rec['kind']]}"
    return {"pack": "host-pack", "exact_host": "host-exact"}.get(rec["kind"], rec["backend"])


def record_group(rec: dict) -> str:
    """The part and the dtype its record was timed in: `cpu-exact`, or `cpu-exact@bfloat16` (its own fit)."""
    dtype = rec.get("dtype", DTYPE)
    return record_part(rec) + ("" if dtype == DTYPE else f"@{dtype}")


def dtype_records(records: list[dict], dtype: str) -> list[dict]:
    """What a fit in `dtype` learns from: the records timed in it, and the float32 ones of every part it has none
    of (the backends' dispatch costs, a backend or op not timed in it)."""
    own = [r for r in records if r.get("dtype", DTYPE) == dtype]
    if dtype == DTYPE:
        return own
    parts = {record_part(r) for r in own}
    return own + [r for r in records if r.get("dtype", DTYPE) == DTYPE
                  and (r["kind"] == "call" or record_part(r) not in parts)]


def predicted_ms(model: CostModel, rec: dict) -> float:
    """The fitted model's time for what a record timed (nan for a part it does not model)."""
    if rec["kind"] in RECORD_OP:
        return record_ms(model.dense_fit(rec["backend"], RECORD_OP[rec["kind"]]), rec)
    backend = model.models.get(rec["backend"])
    return predict_record(backend, rec) if backend else float("nan")


def record_groups(records: list[dict]) -> dict[str, list[dict]]:
    """The records each part of the model is fitted to (`record_group`), excluded ones left out."""
    groups: dict[str, list[dict]] = {}
    for r in records:
        if not r.get("excluded"):
            groups.setdefault(record_group(r), []).append(r)
    return groups


def _heldout_preds(key: str, train: list[dict], test: list[dict], backend_options: dict[str, dict]) -> list[float]:
    """Predictions for `test` by the part `key`'s model fitted to `train` alone."""
    if key.startswith("host-"):
        coef = fit_host(train)
        return [_host_predict(coef, r) for r in test]
    if test[0]["kind"] in RECORD_OP:
        fit = fit_dense(train).get(RECORD_OP[test[0]["kind"]])
        return [record_ms(fit, r) if fit else float("nan") for r in test]
    model = fit_backend(key, train, **backend_options.get(key, {}))
    return [predict_record(model, r) for r in test]


def _mape(preds: list[float], test: list[dict]) -> float:
    return float(np.mean([abs(p - r["median_ms"]) / r["median_ms"] for p, r in zip(preds, test)]))


def width_axis(rec: dict) -> tuple[str, float]:
    """The shape axis a part's out-of-range error splits on, and the record's value: a model's width (the experts'
    and elementwise work's hidden, a matmul's input width, the attention core's heads x head_dim)."""
    if rec["kind"] in ("pack", "exact_host"):
        return "hidden", float(rec["hidden"])
    kind = record_kind(rec)
    axis = {"experts": "hidden", "matmul": "in", "attention": "width", "elementwise": "hidden"}[kind]
    return axis, max(record_shape(rec)[axis])


def out_of_range_errors(groups: dict[str, list[dict]], backend_options: dict[str, dict] | None = None) -> dict:
    """Each part's error past its fitting range: fitted to the records below the largest width its records hold
    (`width_axis`), tested on those at it (a form that only interpolates shows it here, not in the k-fold figure).
    None for a part whose records hold one width, or too few below it to fit."""
    backend_options = backend_options or {}
    mape: dict[str, float | None] = {}
    split: dict[str, str] = {}
    for key, rs in sorted(groups.items()):
        rs = [r for r in rs if r["kind"] != "call"]
        widths = [width_axis(r) for r in rs]
        top = max((w for _, w in widths), default=0.0)
        train = [r for r, (_, w) in zip(rs, widths) if w < top]
        test = [r for r, (_, w) in zip(rs, widths) if w == top]
        if len(train) < 2 or not test:
            mape[key] = None
            continue
        below = max(w for r, (_, w) in zip(rs, widths) if w < top)
        split[key] = f"{widths[0][0]} {top:g} (fitted to {widths[0][0]} <= {below:g})"
        mape[key] = _mape(_heldout_preds(key, train, test, backend_options), test)
    return {"method": "each part fitted to its records below the largest width it holds (experts and elementwise: "
                      "hidden; matmul: input width; attention: heads x head_dim), tested on those at it; MAPE = mean "
                      "|predicted - measured| / measured", "mape": mape, "split": split}


def heldout_errors(records: list[dict], backend_options: dict[str, dict] | None = None, folds: int = 5,
                   seed: int = 0) -> dict:
    """Mean absolute percentage error of each part of the model on records it was not fitted to (k-fold), and past
    its fitting range (`out_of_range_errors`: `out_of_range`).

    Returns {"method", "mape": {name: MAPE or None}, "n": {name: records}, "out_of_range"}; per record the k-fold
    held-out prediction is written into the record as `heldout_pred_ms`."""
    from sklearn.model_selection import KFold

    backend_options = backend_options or {}
    groups = record_groups(records)
    mape: dict[str, float | None] = {}
    used_k: set[str] = set()
    for key, rs in sorted(groups.items()):
        k = min(folds, len(rs))
        used_k.add("leave-one-out" if k == len(rs) else f"{k}-fold")
        if k < 2:
            mape[key] = None
            continue
        errs = []
        for train, test in KFold(k, shuffle=True, random_state=seed).split(rs):
            preds = _heldout_preds(key, [rs[i] for i in train], [rs[i] for i in test], backend_options)
            for i, p in zip(test, preds):
                if np.isfinite(p):  # nan: the fold left too few records to fit (a dense op needs two)
                    rs[i]["heldout_pred_ms"] = round(p, 6)
                errs.append(abs(p - rs[i]["median_ms"]) / rs[i]["median_ms"])
        mape[key] = float(np.mean(errs)) if np.isfinite(errs).all() else None
    return {"method": f"cross-validation per backend ({' / '.join(sorted(used_k)) or 'none'}): each record "
                      "predicted by a model fitted without it; MAPE = mean |predicted - measured| / measured",
            "mape": mape, "n": {k: len(v) for k, v in groups.items()},
            "out_of_range": out_of_range_errors(groups, backend_options), "float32_fit": float32_fit_errors(groups)}


def float32_fit_errors(groups: dict[str, list[dict]]) -> dict[str, float]:
    """Per part timed in another dtype (`<part>@<dtype>`), the error of the float32 fit of that part on its records:
    what pricing the model's dtype from float32's records would miss by."""
    return {key: _mape(_heldout_preds(part, groups[part], rs, {}), rs) for key, rs in sorted(groups.items())
            if "@" in key and (part := key.split("@")[0]) in groups and len(groups[part]) >= 2}
