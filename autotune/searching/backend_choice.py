"""Which static backend a search plans on: one of the backends a plan may name (the registry's) that the profile
has fitted (or the one `search --backend` pins); a backend superseded on this host by another fitted one is left out
(Core ML's `ane` where Core AI runs on the Neural Engine: macOS 27). Where there are several: a backend off the CPU
first (the ANE: what the plan is for; the search still
leaves every expert on cpu-exact where its groups don't pay), then plans within every hard limit, then the one under
which the paper's heuristic plan is predicted fastest (one score per layer and backend: cheap)."""
from __future__ import annotations

from typing import Callable

from autotune.costing.costmodel import CostModel
from autotune.searching.decisions import heuristic_config
from autotune.searching.layer_data import LayerData
from autotune.searching.scoring import Scorer
from runtime.backends import registry
from runtime.errors import NpumoeError


def fitted_static_backends(cost: CostModel) -> list[str]:
    """The backends a plan's groups may name that `cost` has a model of, in registry order."""
    return [b for b in registry.plannable() if b in cost.models]


def choose_static_backend(cost: CostModel, layers: list[LayerData], scorer_for: Callable[[str], Scorer],
                          pinned: str | None = None) -> str:
    """The static backend to search on (see the module docstring); `scorer_for(backend)` makes the search's
    scorer for it; `pinned`: that one (`search --backend`), which the profile must fit."""
    candidates = fitted_static_backends(cost)
    if pinned is not None and pinned not in candidates:
        raise NpumoeError(f"--backend {pinned}: the profile fits no model of it (it fits "
                          f"{', '.join(candidates) or 'none a plan can name'}): profile it with autotune "
                          f"profile-device --backends {pinned}")
    if not candidates:
        raise NpumoeError(f"the profile fits no backend a plan's group can run on (it has {', '.join(cost.backends)};"
                          f" plans take {', '.join(registry.plannable())}): profile one with autotune profile-device "
                          "--backends")
    # a backend that supersedes another here (Core AI over Core ML on macOS 27: the registry's `supersedes`) wins
    superseded = {old for b in candidates for old in (registry.get(b).supersedes or tuple)()}
    candidates = [pinned] if pinned is not None else [b for b in candidates if b not in superseded]
    if len(candidates) == 1:
        return candidates[0]

    def rank(backend: str) -> tuple[bool, bool, float]:
        scorer = scorer_for(backend)
        scores = [scorer.score(d, heuristic_config(d)) for d in layers]
        return (not cost.models[backend].overlaps_cpu, any(s.violation > 0 for s in scores),
                sum(s.latency_ms for s in scores))

    return min(candidates, key=rank)
