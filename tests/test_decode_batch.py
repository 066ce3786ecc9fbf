"""The batched decode step: each padded row's logits equal its own step's bitwise (bf16, where a masked padded
softmax rounded differently and greedy decoding flipped on a near tie)."""
import torch
from helpers import prefilled_with_own_steps

import runtime
from runtime.serving.decode_batch import ROWS, DecodeBatch


def test_a_padded_batched_step_gives_each_row_its_own_logits_bitwise():
    loaded = runtime.load("tiny-moe", dtype="bfloat16")
    ids = torch.tensor(loaded.tokenizer.encode("Static groups for the prompt, the exact path for every new token. "
                                               * 4, add_special_tokens=False))
    gens, alone = prefilled_with_own_steps(loaded, ids, (9, 17, 30, 12))  # every row but the longest left-padded
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
