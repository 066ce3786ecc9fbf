"""Energy windows (zeus-apple-silicon's counters, faked here: the real ones exist on macOS only) and how the
executor totals a backend's measured energy."""
from collections import Counter, defaultdict
from types import SimpleNamespace

import torch
from helpers import random_model

from autotune.searching.templates import template_plan
from runtime.apple_energy import energy_window
from runtime.backends import REFERENCE
from runtime.cpu.cpu_backends import CpuStaticBackend
from runtime.executor import PlanExecutor
from runtime.loading.model_loader import model_spec


class FakeMonitor:
    """zeus's window API: begin/end by key; a reading has mJ fields, None where a unit is not measured."""

    def __init__(self) -> None:
        self.open: dict[str, int] = {}

    def begin_window(self, key: str, restart: bool = False) -> None:
        self.open[key] = len(self.open)

    def end_window(self, key: str) -> SimpleNamespace:
        del self.open[key]
        return SimpleNamespace(ane_mj=2.5, cpu_total_mj=4, gpu_mj=None, dram_mj=1.0)


def test_a_window_reads_each_measured_unit_once_the_block_exits():
    monitor = FakeMonitor()
    with energy_window(monitor, "a") as used:
        assert used == {} and monitor.open == {"a": 0}
    assert used == {"ane_mj": 2.5, "cpu_total_mj": 4.0, "dram_mj": 1.0} and monitor.open == {}


class MeteredBackend(CpuStaticBackend):
    """cpu-static that counts its calls in an `energy` dict, as a measuring backend does."""

    def __init__(self) -> None:
        self.energy: dict[str, Counter] = defaultdict(Counter)

    def prepare(self, group):
        fn = super().prepare(group)

        def run(packed: torch.Tensor) -> torch.Tensor:
            self.energy[f"{group.layer}/{group.index}"].update(ane_mj=0.5, calls=1)
            return fn(packed)

        return run


def test_executor_totals_measured_energy_per_backend_and_reset_clears_it():
    model, tok = random_model("random:qwen3_moe")
    plan = template_plan(model_spec(model), "ample", "drop", chunk_tokens=32)
    executor = PlanExecutor(model, plan, backends={REFERENCE: MeteredBackend()})
    with executor, torch.inference_mode():
        model(input_ids=torch.tensor([tok.encode("energy " * 8)[:32]]))
    calls = executor.stats.total().calls_per_backend[REFERENCE]
    assert calls > 0 and executor.energy() == {REFERENCE: {"ane_mj": 0.5 * calls, "calls": calls}}
    executor.reset()
    assert executor.energy() == {}
