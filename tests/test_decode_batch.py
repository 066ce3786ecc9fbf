"""The batched decode step: each padded row's logits equal its own step's bitwise (bf16, where a masked padded
softmax rounded differently and greedy decoding flipped on a near tie)."""
import torch

import runtime
from runtime.generation import Generation
from runtime.serving.decode_batch import ROWS, DecodeBatch


def test_a_padded_batched_step_gives_each_row_its_own_logits_bitwise():
    loaded = runtime.load("tiny-moe", dtype="bfloat16")
    ids = torch.tensor(loaded.tokenizer.encode("Static groups for the prompt, the exact path for every new token. "
                                               * 4, add_special_tokens=False))
    gens = []
    for n in (9, 17, 30, 12):  # different lengths: every row but the longest is left-padded
        gen = Generation(loaded, ids[:n], 8, 0.0, 0, None)
        for _ in gen.prefill_steps():
            pass
        gen.accept()
        gens.append(gen)
    alone = []
    for gen in gens:
        with torch.inference_mode():
            out = loaded.model(input_ids=torch.tensor([[gen.tokens[-1]]]), cache=gen.cache, use_cache=True,
                               logits_to_keep=1)
        alone.append(out.logits[0, -1].clone())
        gen.cache.crop(-1)
    batch = DecodeBatch(loaded)
    assert loaded.model.config._attn_implementation == ROWS
    for gen in gens:
        batch.add(gen)
    assert any(batch.pads) and not all(batch.pads)  # padded
    got = []
    for gen in gens:
        gen.sample = got.append
    batch.step()
    assert loaded.model.dtype == torch.bfloat16 and len(got) == 4
    for own, batched in zip(alone, got):
        assert torch.equal(own, batched)
