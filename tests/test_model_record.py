"""The model a command works on is described once (runtime/loading/model_record.py): one search reads the model's
config.json once, from the project's own code."""
import builtins
import shutil
import traceback
from collections import Counter
from pathlib import Path

import pytest
import torch

from autotune.cli import main
from autotune.costing.memory import model_size
from autotune.costing.whole_prefill import decoder_shape
from runtime.loading.model_loader import TINY_MOE_DIR, context_length, load_model, model_spec, resolve_dtype
from runtime.loading.model_record import read_model_spec, resolve_model

ROOT = Path(__file__).resolve().parents[1]
CONFIG = TINY_MOE_DIR / "config.json"


@pytest.fixture
def config_opens(monkeypatch) -> Counter:
    """Each open of tiny-moe's config.json (`open`, `Path.read_text`) whose caller is the project's code (not a
    test, not transformers), counted by the caller's file and function."""
    opens: Counter = Counter()
    real_open, real_read_text = builtins.open, Path.read_text

    def note(file) -> None:
        caller = traceback.extract_stack(limit=3)[0]
        inside = caller.filename.startswith((str(ROOT / "autotune"), str(ROOT / "runtime")))
        if inside and Path(str(file)).resolve() == CONFIG.resolve():
            opens[f"{Path(caller.filename).relative_to(ROOT)}:{caller.name}"] += 1

    def counted_open(file, *args, **kwargs):
        note(file)
        return real_open(file, *args, **kwargs)

    def counted_read_text(self, *args, **kwargs):
        note(self)
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counted_open)
    monkeypatch.setattr(Path, "read_text", counted_read_text)
    return opens


def test_one_search_reads_config_json_once(tmp_path, monkeypatch, config_opens):
    """`autotune search --model tiny-moe --profile apple-m2-ultra-published --trials 5 --no-gate` on recorded
    traces: before the record, 16 opens from four files (the loaders each redid `model_dir`, `compute_dtype` was
    resolved on each read)."""
    monkeypatch.chdir(tmp_path)
    traces = tmp_path / "traces.npz"
    assert main(["calibrate", "--model", "tiny-moe", "--out", str(traces), "--max-tokens", "2560",
                 "--prompt-tokens", "512", "--json"]) == 0
    config_opens.clear()
    assert main(["search", "--model", "tiny-moe", "--profile", "apple-m2-ultra-published", "--trials", "5",
                 "--no-gate", "--traces", str(traces), "--out", "plan.json", "--json"]) == 0
    assert dict(config_opens) == {"runtime/loading/model_config.py:read_config": 1}


def test_the_record_agrees_with_the_loaders():
    """What the record holds is what the name-based loaders say, field by field (a checkpoint read from its files,
    a random model built once), and its views are the memory and whole-prefill models' own."""
    record = resolve_model("tiny-moe", "float32")
    model = load_model("tiny-moe", "float32")[0]
    assert record.spec == model_spec(model) == read_model_spec("tiny-moe")
    assert record.context == context_length("tiny-moe") == 4096 and record.compute_dtype == torch.float32
    size = model_size(record)
    assert (size.hidden, size.heads, size.head_dim, size.layers) == (256, 4, 64, 4)
    held = sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert (size.dtype_bytes, size.weight_bytes) == (4, 4 * held)
    shape = decoder_shape(record)
    assert (shape.hidden, shape.head_dim, shape.num_experts, shape.moe_layers) == (256, 64, 16, (0, 1, 2, 3))
    assert resolve_model("tiny-moe").compute_dtype == resolve_dtype("tiny-moe", "auto")
    rand = resolve_model("random:olmoe")
    assert rand.loaded()[0] is rand.skeleton and rand.spec == model_spec(rand.skeleton)


def test_a_config_that_is_no_json_object_is_one_line(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY_MOE_DIR, folder)
    (folder / "config.json").write_text("[1, 2]")
    from runtime.errors import NpumoeError

    with pytest.raises(NpumoeError, match=r"config.json: a model config is a JSON object, got list"):
        resolve_model(str(folder))
