"""A backend from outside npumoe, found through the `npumoe.backends` entry point: the module docs/backends.md shows,
with a `.dist-info` declaring it, on sys.path. It is profiled, planned on and run end to end through the commands;
and the registry's facts (fallback, options, the search's choice among fitted backends) hold for it."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from helpers import TINY_PROFILE, apple_like

from autotune.cli import main
from autotune.costing.costmodel import BackendModel, CostModel
from autotune.profiling import settings
from autotune.profiling.device import default_backends
from autotune.profiling.profile import load_profile
from autotune.searching.backend_choice import choose_static_backend
from autotune.searching.layer_data import LayerData
from autotune.searching.scoring import Scorer
from runtime.backends import REFERENCE, BackendInfo, registry
from runtime.errors import NpumoeError
from runtime.plan import load_plan

ROOT = Path(__file__).resolve().parent.parent
NAME = "cpu-twin"


def _docs_backend() -> str:
    """The out-of-tree backend module docs/backends.md shows."""
    return re.search(r"```python\n# cpu_twin\.py\n(.*?)```", (ROOT / "docs" / "backends.md").read_text(), re.S).group(1)


def _install(folder: Path, monkeypatch, module: str, source: str, entry: str) -> None:
    """A module and a .dist-info declaring `entry` under npumoe.backends, put on sys.path (taken off after)."""
    dist = folder / f"{module}-0.1.dist-info"
    dist.mkdir(parents=True)
    (folder / f"{module}.py").write_text(source)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[npumoe.backends]\n{entry}\n")
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, module, raising=False)


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    _install(tmp_path / "plugin", monkeypatch, "cpu_twin", _docs_backend(), f"{NAME} = cpu_twin:TwinBackend")
    return registry.get(NAME)


def test_the_registry_finds_the_plugin_and_gives_it_the_default_facts(plugin):
    assert plugin is not None and plugin.plannable and not plugin.overlaps_cpu and plugin.limits is None
    assert NAME in registry.plannable() and registry.fallbacks(NAME) == [NAME, REFERENCE]
    assert registry.resolve(NAME).name == NAME
    # profile-device measures it by default, with the built-ins this host can run (not the ANE simulation)
    assert NAME in default_backends() and "cpu-exact" in default_backends() and "ane-sim" not in default_backends()


def test_out_of_tree_backend_is_profiled_planned_and_run(plugin, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(settings, "settings_for", lambda quick: TINY_PROFILE)
    prof, plan = tmp_path / "p.json", tmp_path / "m.json"
    assert main(["profile-device", "--quick", "--backends", f"cpu-exact,{NAME}", "--out", str(prof),
                 "--no-progress"]) == 0
    fitted = load_profile(prof).cost_model
    assert fitted.backends == ["cpu-exact", NAME] and fitted.models[NAME].call_ms >= 0
    assert main(["plan-template", "--model", "tiny-moe", "--capacity", "ample", "--overflow", "spill", "--backend",
                 NAME, "--out", str(plan)]) == 0
    assert {g.backend for lp in load_plan(plan).layers for g in lp.groups} == {NAME}
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--reference", "--json", "--dtype", "float32",
                 "--max-tokens", "256"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_rel_diff_vs_reference"] <= 1e-5
    assert out["calls_per_backend"][NAME] > 0 and out["backend_fallbacks"] == {}
    assert out["tokens_per_backend"][NAME] == out["assignments"]  # ample capacity: every assignment in a group


def test_a_plan_on_a_backend_not_installed_is_refused_naming_the_field(tmp_path, capsys):
    plan = tmp_path / "m.json"
    assert main(["plan-template", "--model", "tiny-moe", "--out", str(plan)]) == 0
    text = plan.read_text().replace(f'"backend": "{REFERENCE}"', f'"backend": "{NAME}"')
    plan.write_text(text)
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--max-tokens", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "layers[0].groups[0].backend" in err[0] and NAME in err[0]


UNAVAILABLE = '''
from runtime.backends import BackendInfo
from runtime.cpu.cpu_backends import CpuStaticBackend


class Off(CpuStaticBackend):
    name = "npu-off"

    def __init__(self, device=None):
        self.device = device

    def available(self):
        return False, f"no NPU here (device {self.device})"


INFO = BackendInfo("npu-off", Off, overlaps_cpu=True, options=("device",))
'''


def test_a_plugin_stating_its_facts_gets_its_options_and_falls_back(tmp_path, monkeypatch, caplog):
    _install(tmp_path / "off", monkeypatch, "npu_off", UNAVAILABLE, "npu-off = npu_off:INFO")
    made = registry.instances(options={"device": "npu0"})
    assert list(made) == ["npu-off"] and made["npu-off"].device == "npu0"
    with caplog.at_level("WARNING", logger="npumoe"):
        assert registry.resolve("npu-off", options={"device": "npu0"}).name == REFERENCE
    assert "no NPU here (device npu0)" in caplog.text and "running its groups on cpu-static" in caplog.text
    with pytest.raises(NpumoeError, match="no backend takes the option 'colour'"):
        registry.instances(options={"colour": "red"})


def test_a_broken_or_misnamed_plugin_is_left_out_with_a_warning(tmp_path, monkeypatch, caplog):
    _install(tmp_path / "bad", monkeypatch, "misnamed", "class B:\n    name = 'other'\n    overlaps_cpu = False\n",
             "misnamed = misnamed:B\nane = misnamed:B\nmissing = misnamed:Nothing")
    with caplog.at_level("WARNING", logger="npumoe"):
        names = list(registry.infos())
    assert "misnamed" not in names and "missing" not in names
    assert registry.get("ane").factory.__name__ == "AneBackend"  # a plugin never replaces a built-in
    assert caplog.text.count("backend plugin") == 3


def _layers() -> list[LayerData]:
    import numpy as np

    rng = np.random.default_rng(0)
    calib = rng.poisson(rng.uniform(1, 40, size=16), size=(12, 16))
    return [LayerData(0, calib, calib[:4])]


def _scorer_for(cost: CostModel):
    return lambda backend: Scorer(cost, 256, 256, backend, 1e12)


def test_search_plans_on_the_fitted_static_backend_off_the_cpu_else_the_fastest(plugin):
    apple = apple_like()
    assert choose_static_backend(apple, _layers(), _scorer_for(apple)) == "ane"
    slow_ane = CostModel({**apple.models, "ane": BackendModel("ane", 5.0, 0.0, 3.0, 0.0, 2, True)})
    assert choose_static_backend(slow_ane, _layers(), _scorer_for(slow_ane)) == "ane"  # the search may still not use it
    cpu = apple.models[REFERENCE]
    faster = BackendModel(NAME, cpu.call_ms, cpu.expert_ms, cpu.ms_per_gflop / 4, 0.0, 2)
    twin = CostModel({REFERENCE: cpu, NAME: faster, "cpu-exact": apple.models["cpu-exact"]})
    assert choose_static_backend(twin, _layers(), _scorer_for(twin)) == NAME
    slower = CostModel({**twin.models, NAME: BackendModel(NAME, 1.0, cpu.expert_ms, cpu.ms_per_gflop * 4, 0.0, 2)})
    assert choose_static_backend(slower, _layers(), _scorer_for(slower)) == REFERENCE
    exact_only = CostModel({"cpu-exact": apple.models["cpu-exact"]})
    with pytest.raises(NpumoeError, match="fits no backend a plan's group can run on"):
        choose_static_backend(exact_only, _layers(), _scorer_for(exact_only))


def test_the_cost_model_costs_a_missing_backend_as_its_fallback(plugin):
    cost = CostModel({REFERENCE: apple_like().models[REFERENCE]})
    assert cost.call_ms(NAME) == cost.call_ms("ane") == cost.call_ms(REFERENCE)
    assert isinstance(registry.get("ane"), BackendInfo)
