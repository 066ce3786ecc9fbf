"""The prefix cache on disk: a prefix stored by one server is reused by the next (same tokens as without it), an
entry of another plan or a corrupt one (any changed byte) is ignored (said once, naming it) and replaced, the
folder's bound evicts the least recently used."""
import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from autotune.searching.templates import template_plan
from runtime.generation import Generation
from runtime.loading.model_loader import model_spec
from runtime.serving.disk_prefix_cache import DiskPrefixCache

CHUNK = 8


@pytest.fixture(scope="module")
def setup():
    loaded = runtime.load("tiny-moe", dtype="float32")
    spec = model_spec(loaded.model)
    plan = template_plan(spec, "tight", "spill", chunk_tokens=CHUNK)
    other = template_plan(spec, "tight", "drop", chunk_tokens=CHUNK)
    planned = runtime.load("tiny-moe", plan=plan, dtype="float32")
    ids = torch.tensor(planned.tokenizer.encode("Static groups for the prompt, the exact path for every new "
                                                "token. " * 2, add_special_tokens=False))
    return planned, plan, other, ids


def _run(loaded, ids, prefix=None, keep_at=None):
    gen = Generation(loaded, ids, 6, 0.0, 0, CHUNK, prefix=prefix, keep_at=keep_at)
    list(gen.token_ids())
    return gen


def test_a_prefix_survives_a_restart_and_keeps_the_output(setup, tmp_path):
    loaded, plan, _, ids = setup
    cold = _run(loaded, ids, keep_at=len(ids) // CHUNK * CHUNK)
    DiskPrefixCache(tmp_path, 1 << 30, loaded.model, plan).store(ids[:cold.keep_at], cold.kept)
    restarted = DiskPrefixCache(tmp_path, 1 << 30, loaded.model, plan)  # a new server on the same folder
    prefix = restarted.lookup(ids)
    assert prefix is not None and prefix.get_seq_length() == cold.keep_at
    assert _run(loaded, ids, prefix).tokens == cold.tokens
    assert restarted.lookup(ids[:CHUNK]) is None  # no whole chunk with a token after it


def test_a_foreign_or_corrupt_entry_is_ignored_once_and_replaced(setup, tmp_path, caplog):
    loaded, plan, other, ids = setup
    n = len(ids) // CHUNK * CHUNK
    gen = _run(loaded, ids, keep_at=n)
    theirs, ours = DiskPrefixCache(tmp_path / "a", 1 << 30, loaded.model, other), \
        DiskPrefixCache(tmp_path / "b", 1 << 30, loaded.model, plan)
    theirs.store(ids[:n], gen.kept)
    (tmp_path / "b").mkdir(exist_ok=True)
    shutil.copy(theirs._path(ids[:n]), ours._path(ids[:n]))  # another plan's entry under our name
    with caplog.at_level(logging.WARNING, logger="npumoe.serve"):
        assert ours.lookup(ids) is None and ours.lookup(ids) is None
    assert len([r for r in caplog.records if "ignoring" in r.message]) == 1
    ours.store(ids[:n], gen.kept)
    assert ours.lookup(ids) is not None
    ours._path(ids[:n]).write_bytes(b"\x00garbage")
    fresh = DiskPrefixCache(tmp_path / "b", 1 << 30, loaded.model, plan)
    assert fresh.lookup(ids) is None
    fresh.store(ids[:n], gen.kept)
    assert fresh.lookup(ids).get_seq_length() == n


def test_the_bound_evicts_the_least_recently_used(setup, tmp_path):
    loaded, plan, _, ids = setup
    gen = _run(loaded, ids, keep_at=CHUNK)
    one = sum(k.numel() * k.element_size() * 2 for k, _ in gen.kept)
    cache = DiskPrefixCache(tmp_path, int(2.5 * one) + 4096, loaded.model, plan)
    prompts = [torch.cat([torch.tensor([t] * CHUNK), ids[CHUNK:]]) for t in (11, 12, 13)]
    for p in prompts[:2]:
        cache.store(p[:CHUNK], _run(loaded, p, keep_at=CHUNK).kept)
    assert cache.lookup(prompts[0]) is not None  # touched: the second is now the least recently used
    cache.store(prompts[2][:CHUNK], _run(loaded, prompts[2], keep_at=CHUNK).kept)
    assert cache.nbytes <= cache.max_bytes
    assert [cache.lookup(p) is not None for p in prompts] == [True, False, True]


def test_an_exact_tail_survives_a_restart_where_the_rule_allows(setup, tmp_path):
    """exact below 5 tokens, chunk 8: a 12-token prompt is kept whole (a chunk, then a 4-token exact tail) in its
    whole chunk's file; after a restart a 12-token prompt sharing 11 reuses 11, one of 14 (a 6-token partial chunk,
    on the static groups) only the chunk, and a later whole-chunk store of the same chunk keeps the tail."""
    loaded, plan, _, ids = setup
    plan = plan.model_copy(update={"exact_below_tokens": 5})
    planned = runtime.load("tiny-moe", plan=plan, dtype="float32")
    cold = _run(planned, ids[:12], keep_at=12)
    DiskPrefixCache(tmp_path, 1 << 30, planned.model, plan).store(ids[:12], cold.kept)
    restarted = DiskPrefixCache(tmp_path, 1 << 30, planned.model, plan)
    restarted.store(ids[:8], [(k[:, :, :8], v[:, :, :8]) for k, v in cold.kept])  # held already: no overwrite
    later = torch.cat([ids[:11], ids[20:21]])
    prefix = restarted.lookup(later)
    assert prefix is not None and prefix.get_seq_length() == 11
    assert _run(planned, later, prefix).tokens == _run(planned, later).tokens
    assert restarted.lookup(torch.cat([ids[:11], ids[20:23]])).get_seq_length() == 8
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def _header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def test_an_entry_whose_tensors_are_overwritten_is_ignored_named_and_replaced(setup, tmp_path, caplog):
    """The header and the prefix's tokens intact, the key/value bytes random: before the digest this entry was
    served (a wrong cache, a wrong text); now it is ignored in one line naming it, recomputed, and replaced."""
    loaded, plan, _, ids = setup
    n = len(ids) // CHUNK * CHUNK
    cold = _run(loaded, ids, keep_at=n)
    DiskPrefixCache(tmp_path, 1 << 30, loaded.model, plan).store(ids[:n], cold.kept)
    restarted = DiskPrefixCache(tmp_path, 1 << 30, loaded.model, plan)
    path = restarted._path(ids[:n])
    data = bytearray(path.read_bytes())
    kv = data.index(ids[:n].to(torch.int64).numpy().tobytes())  # the tokens tensor: keep it as it was
    start, tokens_end = _header_end(data), kv + n * 8
    for i in range(start, len(data)):
        if not kv <= i < tokens_end:
            data[i] = torch.randint(0, 256, ()).item()
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="npumoe.serve"):
        assert restarted.lookup(ids) is None and restarted.lookup(ids) is None
    lines = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0] and "sha256" in lines[0]
    again = _run(loaded, ids, keep_at=n)  # recomputed: the same tokens as before the damage
    assert again.tokens == cold.tokens
    restarted.store(ids[:n], again.kept)  # replaces the damaged file
    prefix = DiskPrefixCache(tmp_path, 1 << 30, loaded.model, plan).lookup(ids)
    assert prefix is not None and _run(loaded, ids, prefix).tokens == cold.tokens


@pytest.fixture(scope="module")
def stored_entry(setup, tmp_path_factory):
    loaded, plan, _, ids = setup
    folder = tmp_path_factory.mktemp("entry")
    cache = DiskPrefixCache(folder, 1 << 30, loaded.model, plan)
    cache.store(ids[:CHUNK], _run(loaded, ids, keep_at=CHUNK).kept)
    return cache, cache._path(ids[:CHUNK]).read_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(draw=st.data(), flip=st.integers(1, 255))
def test_any_single_changed_byte_of_an_entry_is_detected(stored_entry, draw, flip):
    cache, data = stored_entry
    i = draw.draw(st.integers(0, len(data) - 1), label="byte")
    bad = bytearray(data)
    bad[i] ^= flip
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "entry.safetensors"
        path.write_bytes(data)
        assert cache._read(path) is not None  # the entry as stored reads back
        path.write_bytes(bytes(bad))
        assert cache._read(path) is None, f"byte {i} ^ {flip} went unnoticed"
