"""Chunked prefill: several prompts, each from an empty cache, into one logits tensor."""
import torch

from runtime.loading.model_loader import load_model
from runtime.prefill import prefill_logits, prefill_prompts_last_logits, prefill_prompts_logits


def _ids(tok, n):
    return torch.tensor(tok.encode("Mixture of experts prefill on a neural engine. " * 10)[:n])


def test_prefill_of_several_prompts_is_each_prompt_from_an_empty_cache():
    model, tok = load_model("random:olmoe")
    ids = _ids(tok, 150)
    got = prefill_prompts_logits(model, ids, 32, prompt_tokens=64)
    want = torch.cat([prefill_logits(model, ids[s:s + 64], 32) for s in range(0, 150, 64)])
    assert got.shape == (150, model.config.vocab_size) and torch.equal(got, want)
    assert torch.equal(prefill_prompts_logits(model, ids, 32), prefill_logits(model, ids, 32))


def test_last_logits_are_each_prompts_last_row_of_the_full_prefill():
    model, tok = load_model("random:olmoe")
    ids = _ids(tok, 150)
    full = prefill_prompts_logits(model, ids, 32, prompt_tokens=64)
    last = prefill_prompts_last_logits(model, ids, 32, prompt_tokens=64)
    assert last.shape == (3, model.config.vocab_size) and last.dtype == torch.float32
    assert torch.allclose(last, full[[63, 127, 149]], rtol=1e-5, atol=1e-6)


def test_last_logits_run_the_head_on_one_row_per_prompt():
    """Each chunk before a prompt's last computes no logits: the head (a packed one dequantizes its whole weight
    per call, 2.6 s for a 4-bit 152k vocabulary on one core) runs once per prompt, not once per chunk."""
    model, tok = load_model("random:olmoe")
    rows = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[-2]))
    prefill_prompts_last_logits(model, _ids(tok, 150), 32, prompt_tokens=64)
    assert rows == [0, 1, 0, 1, 1]  # chunks of 32 in prompts of 64, 64 and 22 tokens (one chunk)
