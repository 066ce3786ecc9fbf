"""The prefix cache: whole chunks only, the longest match, least recently used out first, bounded in bytes; a run
that starts from a reused prefix gives the tokens of a run without it."""
import torch
from transformers import Qwen3MoeConfig
from transformers.cache_utils import DynamicCache

import runtime
from runtime.generation import Generation
from runtime.serving.prefix_cache import PrefixCache, common_prefix, supports_prefix_reuse

CHUNK = 4
LAYERS, HEADS, DIM = 2, 1, 2


class _Model:
    """Enough of a model for the prefix cache: a config with two full-attention layers."""
    config = Qwen3MoeConfig(num_hidden_layers=LAYERS)


def _cache(n: int) -> DynamicCache:
    cache = DynamicCache(config=_Model.config)
    for i in range(LAYERS):
        kv = torch.arange(n, dtype=torch.float32).reshape(1, 1, n, 1).expand(1, HEADS, n, DIM).contiguous()
        cache.update(kv, kv + 0.5, i)
    return cache


def _bytes(n: int) -> int:
    return LAYERS * 2 * HEADS * n * DIM * 4


def _store(pc: PrefixCache, tokens: list[int]) -> None:
    pc.store(torch.tensor(tokens), [(layer.keys, layer.values) for layer in _cache(len(tokens)).layers])


def test_common_prefix():
    assert common_prefix(torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4, 5])) == 2
    assert common_prefix(torch.tensor([1, 2]), torch.tensor([1, 2, 4])) == 2
    assert common_prefix(torch.tensor([7]), torch.tensor([1])) == 0


def test_lookup_takes_the_longest_whole_chunk_match_and_leaves_a_token_to_prefill():
    pc = PrefixCache(_Model(), CHUNK, 1 << 20)
    _store(pc, [1, 2, 3, 4, 5, 6, 7, 8])
    _store(pc, [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9])
    hit = pc.lookup(torch.tensor([1, 2, 3, 4, 9, 9, 9, 9, 9, 0]))
    assert hit.get_seq_length() == 8  # from the second entry: 9 tokens shared, 8 of them whole chunks
    assert hit.layers[1].values[0, 0, :, 0].tolist() == [x + 0.5 for x in range(8)]
    assert pc.lookup(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])).get_seq_length() == 4  # one token left to prefill
    assert pc.lookup(torch.tensor([1, 2, 3, 0, 0, 0])) is None  # under one chunk
    assert pc.lookup(torch.tensor([1, 2, 3, 4])) is None


def test_an_entry_that_extends_another_replaces_it_and_a_covered_one_is_not_stored():
    pc = PrefixCache(_Model(), CHUNK, 1 << 20)
    _store(pc, [1, 2, 3, 4])
    _store(pc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(pc.entries) == 1 and pc.nbytes == _bytes(8)
    _store(pc, [1, 2, 3, 4])
    assert len(pc.entries) == 1 and pc.nbytes == _bytes(8)


def test_least_recently_used_goes_first_within_the_byte_bound():
    pc = PrefixCache(_Model(), CHUNK, _bytes(8))
    _store(pc, [1, 1, 1, 1])
    _store(pc, [2, 2, 2, 2])
    assert pc.lookup(torch.tensor([1, 1, 1, 1, 0])) is not None  # entry 1 is now the most recent
    _store(pc, [3, 3, 3, 3])
    assert [e.tokens[0].item() for e in pc.entries.values()] == [1, 3] and pc.nbytes == _bytes(8)
    _store(pc, [4] * 12)  # larger than the whole bound: not kept, nothing evicted for it
    assert len(pc.entries) == 2


def test_a_run_from_a_reused_prefix_gives_the_same_tokens(tmp_path):
    from autotune.searching.templates import template_plan
    from runtime.loading.model_loader import model_spec
    from runtime.plan import save_plan

    loaded = runtime.load("random:qwen3_moe")
    assert supports_prefix_reuse(loaded.model)
    save_plan(template_plan(model_spec(loaded.model), "tight", "drop", chunk_tokens=8), tmp_path / "p.json")
    loaded = runtime.load("random:qwen3_moe", plan=tmp_path / "p.json")
    pc = PrefixCache(loaded.model, 8, 1 << 24)
    ids = torch.arange(30, 60)

    def run(prompt, prefix=None):
        gen = Generation(loaded, prompt, 6, 0.0, 0, 8, prefix=prefix, keep_at=24)
        list(gen.token_ids())
        if gen.kept is not None:
            pc.store(prompt[:24], gen.kept)
        return gen.tokens

    first = run(ids)
    assert len(pc.entries) == 1
    other = torch.cat([ids[:20], torch.arange(5, 12)])
    cold = run(other)
    assert run(other, pc.lookup(other)) == cold and run(ids, pc.lookup(ids)) == first
    assert loaded.stats.total().dropped > 0  # the plan dropped overflow, per chunk, in every run
