"""Conformance of every registered static backend to the protocol (docs/backends.md), as Optuna tests every
sampler: the availability answer, the group function's shape, its parity with the torch reference, padding rows
that leave real rows alone; and the exact-path worker thread that `uninstall()` stops."""
import threading

import pytest
import torch
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime.backends import GroupSpec, expert_ffn, registry
from runtime.cpu.cpu_backends import CpuStaticBackend
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec, moe_layers
from runtime.prefill import max_rel_diff, prefill_logits

MODEL = "random:qwen3_moe"
CAPS = (5, 3, 8)
NAMES = sorted(registry.plannable())
TOLERANCE = {"ane": 1e-2, "ane-sim": 1e-2}  # fp16 on the Neural Engine (or as it); others in the model's dtype


def _group(model) -> GroupSpec:
    layer = moe_layers(model)[0]
    return GroupSpec(layer.index, 0, (1, 4, 6), CAPS, layer.experts)


def _backend(name: str, model, tmp_path):
    if name == "ane":  # the registered factory has no package: build the group's package (macOS only)
        from runtime.coreml.ane import AneBackend
        from runtime.coreml.converter import build_package

        plan = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16)
        out = tmp_path / "g.mlpackage"
        build_package({lay.index: lay.experts for lay in moe_layers(model)}, plan, out, cache_dir=tmp_path / "c")
        return AneBackend(str(out))
    return registry.get(name).create()


def test_the_built_in_backends_are_registered():
    assert {"ane", "cpu-static"} <= set(NAMES) and "cpu-exact" in registry.infos() and "cpu-exact" not in NAMES


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.macos) if n == "ane" else n for n in NAMES])
@torch.no_grad()
def test_backend_conforms(name, tmp_path):
    model, _ = random_model(MODEL)
    backend = _backend(name, model, tmp_path)
    assert backend.name == name and isinstance(backend.overlaps_cpu, bool)
    ok, why = backend.available()
    assert isinstance(ok, bool) and isinstance(why, str) and why
    if not ok:
        pytest.skip(f"{name} unavailable here: {why}")
    group = _group(model)
    if name == "ane":  # the template plan's first group of the first layer is what was built
        g = template_plan(model_spec(model), "ample", backend="ane", chunk_tokens=16).layers[0].groups[0]
        group = GroupSpec(group.layer, 0, tuple(g.experts), tuple(g.capacities), group.module)
    fn = backend.prepare(group)
    torch.manual_seed(0)
    packed = torch.randn(sum(group.capacities), model.config.hidden_size)
    got = fn(packed)
    assert got.shape == packed.shape
    ref = CpuStaticBackend().prepare(group)(packed)
    assert max_rel_diff(got, ref) <= TOLERANCE.get(name, 1e-6)
    # each expert's rows depend on its own rows only: zeroing the others' (padding) leaves them unchanged
    first = group.capacities[0]
    padded = packed.clone()
    padded[first:] = 0
    assert max_rel_diff(fn(padded)[:first], got[:first]) <= TOLERANCE.get(name, 1e-6)
    want = expert_ffn(group.module, group.experts[0], packed[:first])
    assert max_rel_diff(got[:first], want) <= TOLERANCE.get(name, 1e-6)


class _OffCpu(CpuStaticBackend):
    """cpu-static that declares its calls off the CPU, so the executor overlaps the exact path on a worker."""
    name = "ane"
    overlaps_cpu = True


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("npumoe-exact") and t.is_alive()]


def test_overlapping_backend_runs_exact_on_a_worker_that_uninstall_stops():
    """One worker for the plan's layers (not one per layer: each thread's malloc arena would keep its layer's
    temporaries), stopped by uninstall, back on install."""
    model, tok = random_model(MODEL)
    plan = template_plan(model_spec(model), "tight", "spill", backend="ane", chunk_tokens=16)
    ids = torch.tensor(tok.encode("groups off the CPU, the rest exact on a worker thread " * 3)[:64])
    ref = prefill_logits(model, ids, 16)
    before = len(_workers())
    with PlanExecutor(model, plan, {"ane": _OffCpu()}) as ex:
        got = prefill_logits(model, ids, 16)
        assert len(ex.layers) > 1 and all(layer.pool is ex.worker for layer in ex.layers.values())
        assert len(_workers()) == before + 1
    assert ex.worker is None and all(layer.pool is None for layer in ex.layers.values())
    assert len(_workers()) == before
    assert ex.stats.total().spilled > 0 and max_rel_diff(got, ref) <= 1e-5
    with ex:  # installs again: the workers come back
        assert max_rel_diff(prefill_logits(model, ids, 16), ref) <= 1e-5
        assert len(_workers()) == before + 1
    assert len(_workers()) == before
