"""The backend registry: one `BackendInfo` per backend, holding every fact npumoe needs about it, built-ins and
plugins alike. Plugins are found through Python entry points (group `npumoe.backends`): a distribution declaring

    [project.entry-points."npumoe.backends"]
    my-backend = "my_module:MyBackend"

adds `my-backend` with no edit to npumoe. The entry point names a factory called with no arguments (a class
implementing `StaticBackend`), or a `BackendInfo` for a backend that states more facts (fallback, limits, options).
Built-ins state theirs in their own modules (`BUILTIN_MODULES`, each holding a `BACKENDS` tuple).
"""
from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from runtime.errors import NpumoeError

if TYPE_CHECKING:
    import torch

    from runtime.backends.protocol import DenseSpec, ExactPath, StaticBackend

log = logging.getLogger("npumoe")

ENTRY_POINT_GROUP = "npumoe.backends"
BUILTIN_MODULES = ("runtime.cpu.cpu_backends", "runtime.coreml.coreml_backends", "runtime.coreai.coreai_backends",
                   "runtime.mlx.mlx_backends")
# The two backends with a role of their own: the reference static backend, which is always available and where
# every other backend's groups end up when nothing in its fallback chain is available; and the exact path.
REFERENCE, EXACT = "cpu-static", "cpu-exact"
CPU_ENERGY = "cpu_total_mj"  # the energy meters' field for work on the CPU

ProfileCall = Callable[["torch.nn.Module", Sequence[int], int], Callable[[], object]]
# How the profiler times one of a backend's dense functions (a `DenseSpec` over synthetic modules): one call.
ProfileDense = Callable[["DenseSpec"], Callable[[], object]]


@dataclass(frozen=True)
class BackendInfo:
    """Everything npumoe knows about one backend, read by the plan's validation, the runtime, the profiler, the
    cost model and the search; nothing else names a backend."""
    name: str
    # Makes the runtime backend (a `StaticBackend`; an `ExactPath` for an exact path), given as keywords the
    # registry options it declares in `options`; None for backends that only the profiler runs (Core ML on the CPU).
    factory: Callable[..., StaticBackend | ExactPath] | None
    overlaps_cpu: bool = False  # calls run off the CPU: the exact path runs meanwhile (executor, cost model)
    # As a dense host, computes in a lazy graph (MLX): work no output reads is never computed (the cost model's
    # `LazyLast`: a cache-only prefill chunk's last decoder layer past its keys and values)
    lazy: bool = False
    fallback: str | None = REFERENCE  # where its groups run when it is unavailable; None: always available
    options: tuple[str, ...] = ()  # registry options its factory takes (the ANE: `package`)
    # Hard limits of one group's program: (capacities, hidden, ffn, compression) -> how far past them, 0 within.
    limits: Callable[[Sequence[int], int, int, str], float] | None = None
    exact: bool = False  # the exact path: profiled and costed, never named by a plan's group
    dtype_bytes: int = 4  # bytes per weight and activation the cost model charges its calls
    cpu_torch: bool = False  # torch on this process's threads: timed on the CPU clock; profiling it measures the
    #                          executor's host-side costs too
    energy_field: str = CPU_ENERGY  # the energy meter's field that measures its calls
    # How the profiler times one call; None: through the StaticBackend protocol on synthetic groups.
    profile_call: ProfileCall | None = None
    # How the profiler times its dense functions (q/k/v, o_proj, the attention core); None: it has none to time
    profile_dense: ProfileDense | None = None
    # Whether the profiler can run it here, when that differs from the runtime backend's `available()`.
    profile_available: Callable[[], tuple[bool, str]] | None = None
    # Where its profiled calls run when the name does not say (mlx-exact: "gpu", or "cpu" for MLX's CPU device off a
    # Mac), marked on its profile records as `device`.
    profile_device: Callable[[], str] | None = None
    # Refuses (NpumoeError, one line) a model folder whose weights it cannot run as stored, when a plan is made for
    # it (`plan-template --exact`): mlx-exact runs an MLX folder's own packed experts.
    check_weights: Callable[[Path], None] | None = None
    compiles_per_shape: bool = False  # each new shape is compiled (seconds): the profiler measures fewer shapes
    profiled_by_default: bool = True  # measured by `profile-device` without --backends (where it can run)
    # The built artifact its `package` option names (`autotune build`): its suffix, and how it is opened and checked
    # against a plan and model before the plan runs: (path, plan, `runtime.packages.PackageTarget`) -> the
    # backend over it (`bind_package` checks the plan against the model first).
    # The backends it replaces on this host, when both are fitted (the search plans on it instead): () by default.
    supersedes: Callable[[], tuple[str, ...]] | None = None
    package_suffix: str = ""
    open_package: Callable[[str, Any, Any], StaticBackend] | None = None

    @property
    def plannable(self) -> bool:
        """Whether a plan's group may name it."""
        return self.factory is not None and not self.exact

    def create(self, options: dict[str, Any] | None = None) -> StaticBackend | ExactPath:
        """The runtime backend, given the options it declares (absent or None ones left out)."""
        if self.factory is None:
            raise NpumoeError(f"backend {self.name!r} is profiled only: nothing runs a plan's groups on it")
        kwargs = {k: v for k, v in (options or {}).items() if k in self.options and v is not None}
        return self.factory(**kwargs)

    def available_to_profile(self) -> tuple[bool, str]:
        if self.profile_available is not None:
            return self.profile_available()
        if self.factory is None:
            return True, "torch on the CPU"
        return self.create().available()


def _info_from_entry_point(name: str, obj: Any) -> BackendInfo:
    """A plugin's BackendInfo: the object itself, or one made for a factory (its facts read off the class, or off an
    instance when the class does not state them)."""
    if isinstance(obj, BackendInfo):
        info = obj
    elif callable(obj):
        probe = obj if hasattr(obj, "name") and hasattr(obj, "overlaps_cpu") else obj()
        if probe.name != name:
            raise NpumoeError(f"its backend is named {probe.name!r}, not {name!r}")
        info = BackendInfo(name, obj, overlaps_cpu=bool(probe.overlaps_cpu))
    else:
        raise NpumoeError(f"{obj!r} is neither a backend factory nor a BackendInfo")
    if info.name != name:
        raise NpumoeError(f"its BackendInfo is named {info.name!r}, not {name!r}")
    return info


class BackendRegistry:
    """Built-in backends (imported on first use, so a plain import stays light) and plugins (found again whenever
    `sys.path` changes)."""

    def __init__(self, builtin_modules: Sequence[str] = BUILTIN_MODULES, group: str = ENTRY_POINT_GROUP) -> None:
        self._builtin_modules, self._group = tuple(builtin_modules), group
        self._infos: dict[str, BackendInfo] = {}
        self._found_for: tuple[str, ...] | None = None  # the sys.path the plugins were found on

    def _builtins(self) -> dict[str, BackendInfo]:
        return {info.name: info for module in self._builtin_modules
                for info in importlib.import_module(module).BACKENDS}

    def _plugins(self, taken: dict[str, BackendInfo]) -> dict[str, BackendInfo]:
        plugins: dict[str, BackendInfo] = {}
        for ep in entry_points(group=self._group):
            if ep.name in taken or ep.name in plugins:
                log.warning("backend plugin %s = %s ignored: a backend of that name is already registered",
                            ep.name, ep.value)
                continue
            try:
                plugins[ep.name] = _info_from_entry_point(ep.name, ep.load())
            except Exception as e:  # noqa: BLE001 - a broken plugin is reported and left out, never fatal
                log.warning("backend plugin %s = %s left out: %s", ep.name, ep.value, e)
        return plugins

    def infos(self) -> dict[str, BackendInfo]:
        """Every registered backend by name: built-ins first, then plugins (found again when sys.path changed)."""
        path = tuple(sys.path)
        if path != self._found_for:
            builtins = self._builtins()
            self._infos, self._found_for = {**builtins, **self._plugins(builtins)}, path
        return self._infos

    def get(self, name: str) -> BackendInfo | None:
        return self.infos().get(name)

    def exact_paths(self) -> list[str]:
        """The exact paths a plan may name (`Plan.exact`, `LayerPlan.exact_split`)."""
        return [name for name, info in self.infos().items() if info.exact]

    def plannable(self) -> list[str]:
        """The backends a plan's group may name."""
        return [name for name, info in self.infos().items() if info.plannable]

    def fallbacks(self, name: str) -> list[str]:
        """`name`, then where its groups run when it is unavailable, in order (ends at an always available one)."""
        chain = [name]
        info = self.get(name)
        while info is not None and info.fallback is not None and info.fallback not in chain:
            chain.append(info.fallback)
            info = self.get(info.fallback)
        if info is None or info.fallback is not None:
            chain.append(REFERENCE)  # an unknown name, or a cycle: the reference is always there
        return chain

    def package_backend(self, path: str) -> BackendInfo:
        """The backend whose built artifact `path` is, by its suffix (a build's manifest: by its first package's)."""
        name = str(path)
        if name.endswith(".json"):
            from runtime.fileio import read_versioned_json

            packages = read_versioned_json(name, "manifest", 1).get("packages")
            first = packages[0] if isinstance(packages, list) and packages and isinstance(packages[0], dict) else {}
            name = str(first.get("path", ""))
        for info in self.infos().values():
            if info.package_suffix and name.rstrip("/").endswith(info.package_suffix):
                return info
        known = ", ".join(sorted(i.package_suffix for i in self.infos().values() if i.package_suffix))
        raise NpumoeError(f"{path}: no backend runs this kind of package (packages end in {known})")

    def check_options(self, options: dict[str, Any]) -> None:
        """Refuse an option no registered backend takes."""
        known = {o for info in self.infos().values() for o in info.options}
        for key in options:
            if key not in known:
                raise NpumoeError(f"no backend takes the option {key!r} (backends take: "
                                  f"{', '.join(sorted(known)) or 'none'})")

    def instances(self, options: dict[str, Any] | None = None,
                  names: Sequence[str] | None = None) -> dict[str, StaticBackend]:
        """Runtime backends by name, made with `options` (e.g. `{"package": path}`): those named, or by default
        every backend that takes one of the options given (the rest are made on demand by `resolve`)."""
        options = {k: v for k, v in (options or {}).items() if v is not None}
        self.check_options(options)
        infos = self.infos()
        if names is None:
            names = [n for n, info in infos.items() if info.plannable and set(info.options) & set(options)]
        return {n: infos[n].create(options) for n in names}

    def resolve(self, name: str, given: dict[str, StaticBackend] | None = None,
                options: dict[str, Any] | None = None) -> StaticBackend:
        """The backend to run `name`'s groups on: the given or registered one if available, else the first available
        one along its fallbacks (said once, with the reason)."""
        given = given or {}

        def make(candidate: str, info: BackendInfo | None) -> StaticBackend | None:
            if candidate in given:
                return given[candidate]
            return info.create(options) if info is not None and info.plannable else None

        return self._first_available(name, make, "backend", "groups")

    def resolve_exact(self, name: str) -> ExactPath:
        """The exact path to run what a plan places on exact path `name`: it if available, else the first available
        one along its fallbacks (cpu-exact at the end), said once, with the reason."""
        def make(candidate: str, info: BackendInfo | None) -> ExactPath | None:
            return info.create() if info is not None and info.exact and info.factory is not None else None

        return self._first_available(name, make, "exact path", "experts")

    def _first_available(self, name: str, make: Callable[[str, BackendInfo | None], Any], kind: str, work: str):
        """`name`, or the first available one along its fallbacks, made by `make` (None: not implemented here); a
        fallback is said once, with the reason the ones before it could not run."""
        reason = ""
        for candidate in self.fallbacks(name):
            made = make(candidate, self.get(candidate))
            if made is None:
                reason = reason or f"{kind} {candidate!r} is not implemented here"
                continue
            ok, why = made.available()
            if ok:
                if candidate != name:
                    log.warning("plan names %s %r but it is unavailable (%s): running its %s on %s",
                                kind, name, reason, work, candidate)
                return made
            reason = reason or why
        raise NpumoeError(f"no {kind} to run {name!r} on: {reason}")

registry = BackendRegistry()
