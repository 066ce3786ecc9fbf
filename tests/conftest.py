"""Session set-up shared by every test file: offline hub, one torch thread, the `macos` marker's skip, fixtures."""
import os
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tests never depend on timing; one thread keeps them steady on shared 2-core hosts

from helpers import random_model  # noqa: E402,F401  (re-exported for tests that import it from conftest)


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
