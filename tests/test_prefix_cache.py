"""The prefix cache: whole chunks only, the longest match, least recently used out first, bounded in bytes; a run
that starts from a reused prefix gives the tokens of a run without it."""
import pytest
import torch
from transformers import Qwen3MoeConfig
from transformers.cache_utils import DynamicCache

import runtime
from runtime.errors import NpumoeError
from runtime.generation import Generation, Loaded
from runtime.serving.prefix_cache import PrefixCache, common_prefix, keeps_tail, reusable
from runtime.serving.serving_spine import TorchServing

CHUNK = 4
LAYERS, HEADS, DIM = 2, 1, 2


class _Model:
    """Enough of a model for the prefix cache: a config with two full-attention layers."""
    config = Qwen3MoeConfig(num_hidden_layers=LAYERS)


def _spine(model=None) -> TorchServing:
    """The torch spine's prefix caches of `model` (default: the two-layer config above)."""
    return TorchServing(Loaded(model or _Model(), None))


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
    pc = PrefixCache(_spine(), CHUNK, 1 << 20)
    _store(pc, [1, 2, 3, 4, 5, 6, 7, 8])
    _store(pc, [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9])
    hit = pc.lookup(torch.tensor([1, 2, 3, 4, 9, 9, 9, 9, 9, 0]))
    assert hit.get_seq_length() == 8  # from the second entry: 9 tokens shared, 8 of them whole chunks
    assert hit.layers[1].values[0, 0, :, 0].tolist() == [x + 0.5 for x in range(8)]
    assert pc.lookup(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])).get_seq_length() == 4  # one token left to prefill
    assert pc.lookup(torch.tensor([1, 2, 3, 0, 0, 0])) is None  # under one chunk
    assert pc.lookup(torch.tensor([1, 2, 3, 4])) is None


def test_an_entry_that_extends_another_replaces_it_and_a_covered_one_is_not_stored():
    pc = PrefixCache(_spine(), CHUNK, 1 << 20)
    _store(pc, [1, 2, 3, 4])
    _store(pc, [1, 2, 3, 4, 5, 6, 7, 8])
    assert len(pc.entries) == 1 and pc.nbytes == _bytes(8)
    _store(pc, [1, 2, 3, 4])
    assert len(pc.entries) == 1 and pc.nbytes == _bytes(8)


def test_least_recently_used_goes_first_within_the_byte_bound():
    pc = PrefixCache(_spine(), CHUNK, _bytes(8))
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
    assert _spine(loaded.model).reuse_off() is None
    save_plan(template_plan(model_spec(loaded.model), "tight", "drop", chunk_tokens=8), tmp_path / "p.json")
    loaded = runtime.load("random:qwen3_moe", plan=tmp_path / "p.json")
    pc = PrefixCache(_spine(loaded.model), 8, 1 << 24)
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


def test_the_tail_rule_reuses_an_exact_tail_only_where_the_prompt_would_run_it_exactly():
    """chunk 8, exact_below 5: an entry of 11 tokens (a chunk, then a 3-token exact tail) serves a prompt past its
    boundary only where the prompt's own last chunk is partial and shorter than 5 tokens."""
    entry = torch.arange(100, 111)  # 11 tokens
    assert keeps_tail(11, 8, 5) and not keeps_tail(13, 8, 5) and not keeps_tail(16, 8, 5) and not keeps_tail(7, 8, 5)
    same10 = torch.cat([entry[:10], torch.tensor([7, 7])])  # shares 10, 12 tokens: its chunk [8, 12) is exact
    assert reusable(same10, entry, 8, 5) == 10
    assert reusable(entry[:11], entry, 8, 5) == 10  # the whole entry again: one token left to prefill
    assert reusable(torch.cat([entry[:10], torch.tensor([7, 7, 7])]), entry, 8, 5) == 8  # 13: its chunk of 5 is not
    assert reusable(torch.cat([entry[:10], torch.tensor([7] * 7)]), entry, 8, 5) == 8  # 17: [8, 16) is a whole chunk
    whole = torch.arange(100, 116)  # an entry of two whole chunks: positions 8-15 ran in a whole (static) chunk
    assert reusable(same10, whole, 8, 5) == 8
    assert reusable(torch.arange(100, 120), whole, 8, 5) == 16
    pc = PrefixCache(_spine(), 8, 1 << 20, exact_below=5)
    _store(pc, entry.tolist())
    assert pc.lookup(same10).get_seq_length() == 10
    with pytest.raises(AssertionError):  # a prompt whose partial chunk ran on the static groups is not kept whole
        _store(pc, list(range(100, 113)))


def test_a_run_from_a_reused_exact_tail_gives_the_same_tokens(tmp_path):
    """tiny-moe (float32) under a spill plan of 8-token chunks, exact below 6 tokens: a 13-token prompt (a chunk,
    then a 5-token exact tail) kept whole; a later 13-token prompt sharing 12 reuses 12 and generates what it
    generates alone; one of 15 tokens (its partial chunk of 7 runs the static groups) reuses 8 only."""
    from autotune.searching.templates import template_plan
    from runtime.loading.model_loader import model_spec

    base = runtime.load("tiny-moe", dtype="float32")
    plan = template_plan(model_spec(base.model), "tight", "spill", chunk_tokens=8).model_copy(
        update={"exact_below_tokens": 6})
    loaded = runtime.load("tiny-moe", plan=plan, dtype="float32")
    pc = PrefixCache(_spine(loaded.model), 8, 1 << 24, exact_below=6)
    ids = torch.tensor(loaded.tokenizer.encode("Static groups for the prompt, the exact path for every new "
                                               "token. " * 3, add_special_tokens=False))

    def run(prompt, keep=False):
        prefix = pc.lookup(prompt)
        gen = Generation(loaded, prompt, 8, 0.0, 0, 8, prefix=prefix, keep_at=prompt.numel() if keep else None)
        list(gen.token_ids())
        if keep:
            pc.store(prompt, gen.kept)
        return gen

    first = run(ids[:13], keep=True)
    assert len(pc.entries) == 1 and pc.entries[0].tokens.numel() == 13
    later = torch.cat([ids[:12], ids[20:21]])
    alone = Generation(loaded, later, 8, 0.0, 0, 8)
    list(alone.token_ids())
    reused = run(later)
    assert reused.cached == 12 and reused.tokens == alone.tokens
    longer = torch.cat([ids[:12], ids[20:23]])  # 15 tokens: [8, 15) is 7 tokens, on the static groups
    alone = Generation(loaded, longer, 8, 0.0, 0, 8)
    list(alone.token_ids())
    reused = run(longer)
    assert reused.cached == 8 and reused.tokens == alone.tokens
    with pytest.raises(NpumoeError):  # a prefix into a static partial chunk is refused by generation itself
        Generation(loaded, longer, 8, 0.0, 0, 8, prefix=pc.lookup(later))
    assert first.tokens
