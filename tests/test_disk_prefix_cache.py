"""The prefix cache on disk: a prefix stored by one server is reused by the next (same tokens as without it), an
entry of another plan or a corrupt one is ignored (said once) and replaced, the folder's bound evicts the least
recently used."""
import logging
import shutil

import pytest
import torch

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
