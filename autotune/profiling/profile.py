"""The profile file `npumoe.profile/1`: host facts, raw benchmark records, the fitted cost model, its held-out error.

Measured profiles are written by `autotune profile-device`; shipped ones live in the top-level `profiles/` folder,
installed as package data `autotune/profiles/` (one is built from published Apple figures and says so), so an
installed wheel finds them. Loading validates the structure and raises one `FileFormatError` naming the field; a
measured profile from another host loads with a `ProfileHostWarning` that names both hosts (a published one is no
mismatch: the command that uses it says once that its figures are published, `published_note`).
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import socket
import statistics
import subprocess
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from autotune.costing.costmodel import CostModel
from autotune.costing.fit_range import fit_ranges
from autotune.costing.fitting import DTYPE, DTYPE_BYTES, dtype_records, fit_cost_model, heldout_errors
from runtime.backends import registry
from runtime.errors import FileFormatError
from runtime.fileio import atomic_write_json, cache_root, check_schema, read_versioned_json, validation_error

SCHEMA = "npumoe.profile/1"
KIND, VERSION = "profile", 1
# A wheel installs the top-level profiles/ as autotune/profiles/ (pyproject package-dir); a checkout has it on top.
SHIPPED_PROFILES = next((d for d in (Path(__file__).resolve().parents[i] / "profiles" for i in (1, 2)) if d.is_dir()),
                        Path(__file__).resolve().parents[2] / "profiles")
RECORD_KINDS = ("ffn", "group", "call", "matmul", "pack", "exact_host", "dense_matmul", "attention", "elementwise")


# What each kind of record must carry, besides kind, backend and median_ms: the shape the cost model predicts.
_RECORD_FIELDS = {"ffn": ("tokens", "hidden", "ffn"), "group": ("capacities", "hidden", "ffn"),
                  "call": ("capacities", "hidden", "ffn"), "matmul": ("m", "n", "k"),
                  "pack": ("assignments", "hidden", "slots"), "exact_host": ("assignments", "hidden"),
                  "dense_matmul": ("m", "n", "k"), "attention": ("rows", "context", "heads", "kv_heads", "head_dim"),
                  "elementwise": ("rows", "hidden")}


class ProfileHostWarning(UserWarning):
    """The profile was measured (or compiled) for another host than the one loading it."""


# --- validation schema ---------------------------------------------------------------------------------------------
class _Loose(BaseModel):
    """Unknown keys are kept (newer writers may add some); known ones are strictly typed: "0.25" is not a number,
    nor is true, and NaN or infinity is no measurement."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class _Host(_Loose):
    id: StrictStr
    description: StrictStr


class _Record(_Loose):
    kind: Literal[RECORD_KINDS]
    backend: StrictStr
    median_ms: float = Field(gt=0)


class _Residual(_Loose):
    kind: Literal["knn"]
    X: list[list[float]]
    y: list[float]


class _BackendModel(_Loose):
    call_ms: float = Field(ge=0)
    expert_ms: float = Field(ge=0)
    ms_per_gflop: float = Field(ge=0)
    ms_per_mb: float = Field(ge=0)
    dtype_bytes: int = Field(4, gt=0)
    overlaps_cpu: bool = False
    power_w: float | None = Field(None, gt=0)
    residual: _Residual | None = None


class _CostModel(_Loose):
    backends: dict[str, _BackendModel] = Field(min_length=1)
    host: dict[str, Any] | None = None


class _DtypeModels(_Loose):
    cost_model: _CostModel
    cost_model_in_cache: _CostModel | None = None


class _Heldout(_Loose):
    method: StrictStr
    mape: dict[str, float | None]


class _Profile(_Loose):
    schema_: Literal["npumoe.profile/1"] = Field(alias="schema")
    measured_by: StrictStr
    host: _Host
    records: list[_Record]
    cost_model: _CostModel
    cost_model_in_cache: _CostModel | None = None
    cost_model_by_dtype: dict[Literal[tuple(DTYPE_BYTES)], _DtypeModels] | None = None
    heldout: _Heldout


# --- host facts ----------------------------------------------------------------------------------------------------
def cpu_model() -> str:
    """The CPU's marketing name (e.g. "Apple M2 Ultra"), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        import subprocess

        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.processor()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or "unknown CPU"


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "numpy", "transformers", "scikit-learn", "coremltools", "zeus-apple-silicon", "npumoe"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def host_id(cpu: str | None = None, cores: int | None = None) -> str:
    """The hardware a profile describes: OS, architecture, CPU model and core count (not the hostname, which
    containers change at will)."""
    cpu = cpu or cpu_model()
    cores = cores or os.cpu_count() or 1
    slug = re.sub(r"[^a-z0-9]+", "-", f"{platform.system()}-{platform.machine()}-{cpu}-{cores}c".lower()).strip("-")
    return slug[:80]


def last_level_cache_bytes() -> int | None:
    """The CPU's largest cache (Linux: sysfs; macOS: sysctl, the L3 where reported, else the performance cores'
    L2); None where neither says."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip().upper()
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    if sizes:
        return max(sizes)
    if platform.system() == "Darwin":
        for key in ("hw.l3cachesize", "hw.perflevel0.l2cachesize", "hw.l2cachesize"):
            try:
                out = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True, timeout=5).stdout
            except OSError:
                return None
            if out.strip().isdigit() and int(out) > 0:
                return int(out)
    return None


def host_facts(threads: int | None = None) -> dict:
    cpu, cores = cpu_model(), os.cpu_count() or 1
    description = f"{cpu}, {cores} cores, {platform.system()} {platform.machine()}"
    facts = {"id": host_id(cpu, cores), "description": description,
             "hostname": socket.gethostname(), "cpu_model": cpu, "logical_cores": cores,
             "os": f"{platform.system()} {platform.release()}", "platform": platform.platform(),
             "machine": platform.machine(), "libraries": _versions(),
             "last_level_cache_bytes": last_level_cache_bytes()}
    if threads is not None:
        facts["threads"] = threads
    return facts


def host_profile_path() -> Path:
    """Where this host's measured profile is saved: $NPUMOE_CACHE/profiles/<host-id>.json
    (default ~/.cache/npumoe)."""
    return cache_root() / "profiles" / f"{host_id()}.json"


def shipped_profiles() -> dict[str, Path]:
    """Profiles shipped with npumoe, by name (file stem)."""
    return {p.stem: p for p in sorted(SHIPPED_PROFILES.glob("*.json"))}


# --- the profile ---------------------------------------------------------------------------------------------------
@dataclass
class Profile:
    host: dict
    cost_model: CostModel
    records: list[dict]
    heldout: dict  # {"method": str, "mape": {backend: float | None}, ...}
    measured_by: str
    settings: dict = field(default_factory=dict)
    energy: dict = field(default_factory=dict)
    created: str = ""
    path: str = ""
    extra: dict = field(default_factory=dict)
    # fitted to the records' back-to-back figures (`warm_median_ms`); None where the profile has none
    cost_model_in_cache: CostModel | None = None
    # per dtype other than float32 that records were timed in (a model's own, `profile-device --model`): its
    # (cost model, in-cache one), fitted to those records and the float32 ones of the parts they lack
    by_dtype: dict[str, tuple[CostModel, CostModel | None]] = field(default_factory=dict)

    def cost_model_for(self, layer_bytes: int, dtype: str = DTYPE) -> tuple[CostModel, str]:
        """The cost model for a model of `layer_bytes` of weights per decoder layer (`ModelSize.layer_bytes`)
        computing in `dtype`, and what it prices: the fit of that dtype's records where the profile has some (else
        float32's); the in-cache one where a layer's weights take at most half the host's last-level cache (the rest
        holds its activations), else the evicted one (`profiling/cache_state.py`)."""
        model, in_cache = self.by_dtype.get(dtype, (self.cost_model, self.cost_model_in_cache))
        timed = f"{dtype} records" if dtype == DTYPE or dtype in self.by_dtype else \
            f"float32 records: the profile timed nothing in {dtype}"
        llc = self.host.get("last_level_cache_bytes")
        if in_cache is not None and llc and layer_bytes <= llc // 2:
            return in_cache, (f"in cache: a layer's {layer_bytes / 2**20:.0f} MiB of weights fit half of the host's "
                              f"{llc / 2**20:.0f} MiB last-level cache; {timed}")
        return model, f"evicted caches, as a forward leaves them to a model whose layers do not fit; {timed}"

    @property
    def heldout_mape(self) -> dict[str, float | None]:
        return dict(self.heldout.get("mape", {}))

    @property
    def published(self) -> bool:
        return not self.measured_by.startswith("autotune profile-device")

    @property
    def measured_here(self) -> bool:
        """Measured by `profile-device` on this host's hardware (its figures describe this host)."""
        return not self.published and self.host.get("id") == host_id()

    def to_json(self) -> dict:
        out = {"schema": SCHEMA, "measured_by": self.measured_by, "created": self.created or utc_now(),
               "host": self.host, "settings": self.settings, "energy": self.energy,
               "cost_model": self.cost_model.to_json(), "heldout": self.heldout, "records": self.records}
        if self.cost_model_in_cache is not None:
            out["cost_model_in_cache"] = self.cost_model_in_cache.to_json()
        if self.by_dtype:
            out["cost_model_by_dtype"] = {d: {"cost_model": m.to_json(),
                                              "cost_model_in_cache": None if c is None else c.to_json()}
                                          for d, (m, c) in self.by_dtype.items()}
        out.update(self.extra)
        return out


def utc_now() -> str:
    """Now, in UTC, as the profile's `created` stamp (ISO 8601, seconds)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def power_by_backend(records: list[dict]) -> dict[str, float | None]:
    """Median measured power per backend (W), None where no record carries power."""
    out: dict[str, float | None] = {}
    for r in records:
        out.setdefault(r["backend"], None)
    for b in out:
        p = [r["power_w"] for r in records if r["backend"] == b and r.get("power_w")]
        out[b] = float(statistics.median(p)) if p else None
    return out


def build_profile(records: list[dict], host: dict, measured_by: str, settings_json: dict, energy: dict,
                  backend_options: dict[str, dict] | None = None) -> Profile:
    """Fit the cost model to the records, measure its held-out error, and wrap it all as a Profile."""
    power = power_by_backend(records)
    options = {b: dict(backend_options.get(b, {}) if backend_options else {}) for b in power if b != "host"}
    for b, opt in options.items():
        if power[b] is not None:
            opt.setdefault("power_w", power[b])
            opt.setdefault("power_source", energy.get("source"))
    dtypes = sorted({r["dtype"] for r in records if r.get("dtype", DTYPE) != DTYPE})
    by_dtype_options = {d: {b: {**opt, "dtype_bytes": DTYPE_BYTES[d]} if registry.get(b) and registry.get(b).cpu_torch
                            else opt for b, opt in options.items()} for d in dtypes}
    heldout = heldout_errors(records, {**options, **{f"{b}@{d}": opt for d, opts in by_dtype_options.items()
                                                     for b, opt in opts.items()}})
    model, in_cache = _fit_pair(dtype_records(records, DTYPE), options)
    return Profile(host=host, cost_model=model, records=records, heldout=heldout, measured_by=measured_by,
                   settings=settings_json, energy=energy, created=utc_now(), cost_model_in_cache=in_cache,
                   by_dtype={d: _fit_pair(dtype_records(records, d), by_dtype_options[d]) for d in dtypes})


def _fit_pair(records: list[dict], options: dict[str, dict]) -> tuple[CostModel, CostModel | None]:
    """The cost model fitted to the records, and the in-cache one fitted to their back-to-back figures (None where
    none has them)."""
    warm = [{**r, "median_ms": r["warm_median_ms"]} if "warm_median_ms" in r else r for r in records]
    return (fit_cost_model(records, options),
            fit_cost_model(warm, options) if any("warm_median_ms" in r for r in records) else None)


def profile_from_json(obj: Any, path: str = "", check_host: bool = True) -> Profile:
    """Validate a decoded profile; raises FileFormatError naming the first bad field."""
    check_schema(obj, KIND, VERSION, path)
    try:
        _Profile.model_validate(obj)
    except ValidationError as e:
        raise validation_error(KIND, path, e) from None
    for i, rec in enumerate(obj["records"]):
        for name in _RECORD_FIELDS[rec["kind"]]:
            if not isinstance(rec.get(name), (int, float, list)) or isinstance(rec.get(name), bool):
                raise FileFormatError(KIND, path, f"records[{i}].{name}",
                                      f"missing or not a number (a {rec['kind']} record needs {name})")
    models = {}
    nested = {f"cost_model_by_dtype.{d}.{k}": (d, v) for d, pair in (obj.get("cost_model_by_dtype") or {}).items()
              for k, v in pair.items() if k in ("cost_model", "cost_model_in_cache")}
    for key, (dtype, value) in {**{k: (DTYPE, obj.get(k)) for k in ("cost_model", "cost_model_in_cache")},
                                **nested}.items():
        try:
            models[key] = CostModel.from_json(value) if value is not None else None
        except (KeyError, TypeError, ValueError) as e:
            raise FileFormatError(KIND, path, key, f"cannot rebuild the cost model: {e}") from None
        if models[key] is not None and not models[key].ranges:  # written before the fits' ranges were kept
            models[key].ranges = fit_ranges(dtype_records(obj["records"], dtype))
    cost_model = models["cost_model"]
    by_dtype = {d: (models[f"cost_model_by_dtype.{d}.cost_model"],
                    models.get(f"cost_model_by_dtype.{d}.cost_model_in_cache"))
                for d in obj.get("cost_model_by_dtype") or {}}
    known = {"schema", "measured_by", "created", "host", "settings", "energy", "cost_model", "cost_model_in_cache",
             "cost_model_by_dtype", "heldout", "records"}
    prof = Profile(host=obj["host"], cost_model=cost_model, records=obj["records"], heldout=obj["heldout"],
                   measured_by=obj["measured_by"], settings=obj.get("settings") or {},
                   energy=obj.get("energy") or {}, created=obj.get("created", ""), path=path,
                   extra={k: v for k, v in obj.items() if k not in known},
                   cost_model_in_cache=models["cost_model_in_cache"], by_dtype=by_dtype)
    # published figures describe no host of ours: no mismatch to warn of
    if check_host and not prof.published and not prof.measured_here:
        warnings.warn(f"profile {path or '(in memory)'} is for host {prof.host['id']!r} "
                      f"({prof.host['description']}), not this host {host_id()!r} "
                      f"({host_facts()['description']}): its figures describe that host",
                      ProfileHostWarning, stacklevel=3)
    return prof


def published_note(profile: Profile, name: str) -> str | None:
    """The one line a command shows when it proceeds on a published profile (None for a measured one)."""
    if not profile.published:
        return None
    return f"note: profile {name} holds published figures ({profile.host.get('description')}), not measurements"


def load_profile(path_or_name: str | os.PathLike, check_host: bool = True) -> Profile:
    """A profile from a file path, a shipped profile's name (e.g. `apple-m2-ultra-published`), or `host`
    (this host's saved profile)."""
    p = Path(path_or_name)
    if str(path_or_name) == "host":
        p = host_profile_path()
        if not p.exists():
            from runtime.errors import NpumoeError

            raise NpumoeError(f"this host has no saved profile at {p}; run `autotune profile-device` first")
    elif not p.exists() and str(path_or_name) in shipped_profiles():
        p = shipped_profiles()[str(path_or_name)]
    elif not p.exists() and p.suffix == "" and p.name == str(path_or_name):
        from runtime.errors import NpumoeError

        names = ", ".join(sorted(shipped_profiles())) or "none"
        raise NpumoeError(f"no profile file {str(path_or_name)!r} and no shipped profile of that name "
                          f"(shipped: {names}; `host` is this host's saved profile)")
    return profile_from_json(read_versioned_json(p, KIND, VERSION), str(p), check_host=check_host)


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    atomic_write_json(path, profile.to_json())

