"""A built package bound to a plan, on either spine: what `autotune build` wrote (a Core ML package or a split
build's manifest, a Core AI asset) is opened by the backend whose artifact it is (`registry.package_backend`, by its
suffix; its `open_package`) and checked on any host, before the plan runs, against the plan's groups and dense
functions on that backend and the weights they were built from. A spine says what it holds (`PackageTarget`): the
torch spine its transformers model (`torch_target`), the MLX spine torch views of mlx-lm's experts."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from runtime.backends.protocol import DenseSpec, GroupSpec, StaticBackend
from runtime.backends.registry import registry
from runtime.dense.specs import backend_specs
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.plan import ModelSpec, Plan, check_plan_matches


@dataclass(frozen=True)
class PackageTarget:
    """What a package is checked against: the model's spec, each MoE layer's experts module (by layer index: what
    the package's functions were built from) and, where the spine runs dense functions on a static backend, their
    specs (`dense(plan, backend)`; None: it runs none)."""
    spec: ModelSpec
    experts: dict[int, torch.nn.Module]
    dense: Callable[[Plan, str], list[DenseSpec]] | None = None

    def groups(self, plan: Plan, backend: str) -> list[GroupSpec]:
        """Every group the plan puts on `backend`, as that backend prepares it."""
        return [GroupSpec(index, gi, tuple(g.experts), tuple(g.capacities), module, g.compression)
                for index, module in self.experts.items()
                for gi, g in enumerate(plan.layer(index).groups) if g.backend == backend]

    def dense_specs(self, plan: Plan, backend: str) -> list[DenseSpec]:
        """Every dense function the plan puts on `backend` (`runtime.dense.specs.backend_specs`)."""
        return [] if self.dense is None else self.dense(plan, backend)


def torch_target(model: torch.nn.Module) -> PackageTarget:
    """A transformers model as a package's target."""
    return PackageTarget(model_spec(model), {layer.index: layer.experts for layer in moe_layers(model)},
                         partial(backend_specs, model))


def bind_package(package: str | None, plan: Plan, target: PackageTarget,
                 plan_path: str = "") -> dict[str, StaticBackend] | None:
    """The ready backends a run takes (`PlanRun`'s `backends`): the package's, opened and checked against `target`
    (whether or not it can run here: else its groups run where it falls back); None without a package."""
    if not package:
        return None
    check_plan_matches(plan, target.spec, plan_path)  # a plan for another model names the plan first
    opened = registry.package_backend(package).open_package(package, plan, target)
    return {opened.name: opened}
