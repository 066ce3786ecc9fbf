"""Where a plan prices each part of the model (`runtime.stats.PARTS`), in the lane names `Executed` uses, and which
parts a run executed elsewhere. The search prices the experts on the groups' backends and the exact paths, each dense
function on its static backend, and everything no static function takes (rows past a split, partial chunks, the core
past the buckets, norms, router, lm_head) on the dense host (`DensePlan.exact`: the CPU in torch when absent, MLX's
dense ops on this device for an MLX exact path). A backend the runtime runs on a stand-in (`ane` on `ane-sim` off a
Mac) is priced on the stand-in's lane, and said as such."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.backends.registry import EXACT, registry
from runtime.plan import Plan
from runtime.stats import DENSE_PARTS, PARTS, lane_of

if TYPE_CHECKING:
    from runtime.executor import PlanRun

DENSE_HOST_PARTS = tuple(p for p in PARTS if p != "experts")  # every part the dense host may take some of


@dataclass
class PricedLanes:
    """Per part, the lanes the plan prices it on; `stand_ins`: each backend the plan names that runs on another here
    (its name -> the stand-in's), so its part is priced on the stand-in's lane."""
    parts: dict[str, set[str]] = field(default_factory=dict)
    stand_ins: dict[str, str] = field(default_factory=dict)

    def add(self, part: str, lane: str) -> None:
        self.parts.setdefault(part, set()).add(lane)

    def to_json(self) -> dict[str, list[str]]:
        return {part: sorted(self.parts[part]) for part in PARTS if part in self.parts}

    def off(self, executed: dict) -> list[dict]:
        """The parts `executed` (`Executed.to_json()`) ran on a lane the plan does not price them on, with those
        lanes, in `PARTS` order; [] when every part ran as priced."""
        out = []
        for part in PARTS:
            lanes = sorted(set(executed.get(part, {})) - self.parts.get(part, set()))
            if lanes:
                out.append({"part": part, "lanes": lanes})
        return out


def dense_host_lane(name: str) -> str:
    """The lane of the dense work a plan's dense host (an exact path) takes: MLX's dense ops on this device
    (`mlx-gpu` on a Mac, `mlx-cpu` elsewhere) for an MLX exact path where MLX runs, torch on the CPU for cpu-exact
    (and for an MLX path where MLX does not import: its fallback)."""
    info = registry.get(name)
    if info is not None and info.profile_device is not None and "mlx" in name:
        ok = info.available_to_profile()[0]
        return f"mlx-{info.profile_device()}" if ok else lane_of(EXACT)
    return lane_of(name)


def priced_lanes(plan: Plan, engine: PlanRun) -> PricedLanes:
    """Where `plan` prices each part, on the runtime `engine` loaded it on (a `runtime.executor.PlanRun`: its
    `fallbacks` name the stand-ins of groups' backends and exact paths, its `dense` those of dense functions')."""
    out = PricedLanes()
    fallbacks, dense = engine.fallbacks, getattr(engine, "dense", None)  # each spine's `DenseExecutor`, or None

    def ran_on(name: str, dense_function: bool = False) -> str:
        stand_in = dense.ran_on(name) if dense_function and dense is not None else fallbacks.get(name, name)
        if stand_in != name:
            out.stand_ins[name] = stand_in
        return lane_of(stand_in)

    exact = {plan.exact_path, *(p for lp in plan.layers for p in (lp.exact_split or {}))}
    for name in sorted(exact | {g.backend for lp in plan.layers for g in lp.groups}):
        out.add("experts", ran_on(name))
    host = dense_host_lane((plan.dense.exact if plan.dense else None) or EXACT)
    for part in DENSE_HOST_PARTS:
        out.add(part, host)
    for dl in plan.dense.layers if plan.dense else ():
        for kind in ("qkv", "o_proj", "mlp"):
            if (fn := getattr(dl, kind)) is not None:
                out.add(DENSE_PARTS[kind], ran_on(fn.backend, True))
        if dl.attention is not None:
            out.add(DENSE_PARTS["attention"], ran_on(dl.attention, True))
    return out


def executed_as_priced(plan: Plan, engine: PlanRun, executed: dict) -> dict[str, object]:
    """`executed` (`Executed.to_json()`) beside where the plan prices each part (`priced`), the stand-ins those lanes
    name (`priced_stand_ins`: backend -> stand-in) and the parts it ran elsewhere (`off_priced`): what `autotune run
    --json` reports under those keys."""
    priced = priced_lanes(plan, engine)
    return {"executed": executed, "priced": priced.to_json(), "priced_stand_ins": priced.stand_ins,
            "off_priced": priced.off(executed)}
