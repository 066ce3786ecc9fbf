"""Session set-up shared by every test file: offline hub, one torch thread, the `macos` marker's skip, fixtures."""
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tests never depend on timing; one thread keeps them steady on shared 2-core hosts

from helpers import apple_like, ring_file  # noqa: E402

from autotune.cli import main  # noqa: E402
from autotune.profiling.profile import Profile, save_profile  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked `macos` need Core ML's runtime, the Neural Engine or Apple's energy counters."""
    if sys.platform == "darwin":
        return
    skip = pytest.mark.skip(reason="needs macOS (Core ML prediction, the Neural Engine, energy counters)")
    for item in items:
        if "macos" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("Static capacity tiers, grouped experts and load-aware residency. " * 40)
    return str(p)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A profile file and calibrated traces of a random model, shared by the CLI tests."""
    d = tmp_path_factory.mktemp("search")
    save_profile(Profile(host={"id": "test-device", "description": "hand-made ANE-like device"},
                         cost_model=apple_like(), records=[], heldout={"method": "none", "mape": {}},
                         measured_by="hand-made for tests"), d / "profile.json")
    text = d / "text.txt"
    text.write_text("Routing skews toward a few experts; the rest idle. " * 300)
    assert main(["calibrate", "--model", "random:qwen3_moe", "--text", str(text), "--chunk", "64",
                 "--prompt-tokens", "256", "--out", str(d / "traces.npz"), "--json"]) == 0
    return d


@pytest.fixture
def a_rank(monkeypatch, tmp_path):
    """This process as rank 0 of a two-rank ring nobody listens on: whatever is refused is refused before joining
    it (joining would wait for rank 1)."""
    hostfile, _ = ring_file(tmp_path)
    monkeypatch.setenv("MLX_RANK", "0")
    monkeypatch.setenv("MLX_HOSTFILE", str(hostfile))
    return tmp_path
