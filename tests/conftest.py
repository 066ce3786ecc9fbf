import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)  # tests never depend on timing; one thread keeps them steady on shared 2-core hosts

from runtime.models import load_model  # noqa: E402

_MODELS: dict = {}


def random_model(name: str):
    """Random models are seeded; cache them per session (they are only read)."""
    if name not in _MODELS:
        _MODELS[name] = load_model(name)
    return _MODELS[name]


@pytest.fixture
def text_file(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text("Static capacity tiers, grouped experts and load-aware residency. " * 40)
    return str(p)
