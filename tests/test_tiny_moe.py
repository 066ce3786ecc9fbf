"""The embedded model `tiny-moe`: offline loading, quality, skewed and shifting routing on the built-in texts.

Quality and routing are measured on the first tokens of each text (caps below) to keep this file fast on a
2-core CI machine; the model card reports the same figures on longer slices (scripts/train_tiny_moe.py).
"""
import json
import os

import numpy as np
import pytest
from safetensors import safe_open

from autotune.calibration import modelstats, texts, workload
from runtime.drift import tv_distance
from runtime.loading.model_loader import TINY_MOE_DIR, load_model, model_spec

PPL_TOKENS = 8192  # held-out slice for the perplexity comparison
ROUTING_TOKENS = 12288  # slice of each text for the routing figures
MAX_SHIPPED_BYTES = 30_000_000


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-moe")


@pytest.fixture(scope="module")
def ids(tiny):
    _, tokenizer = tiny
    return {name: workload.encode(tokenizer, texts.read_text(name)) for name in texts.BUILTIN_TEXTS}


@pytest.fixture(scope="module")
def shares(tiny, ids):
    model, _ = tiny
    return {n: modelstats.shares(modelstats.expert_counts(model, v[:ROUTING_TOKENS])) for n, v in ids.items()}


# ------------------------------------------------------------------------------------- the shipped files


def test_shipped_model_is_small_bf16_and_complete():
    files = {p.name: p.stat().st_size for p in TINY_MOE_DIR.rglob("*") if p.is_file()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "MODEL_CARD.md"} <= set(files)
    assert sum(files.values()) <= MAX_SHIPPED_BYTES, files
    with safe_open(str(TINY_MOE_DIR / "model.safetensors"), "pt") as f:
        dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    assert dtypes <= {"BF16", "F16"}, dtypes
    config = json.loads((TINY_MOE_DIR / "config.json").read_text())
    assert config["num_experts"] == 16 and config["num_experts_per_tok"] == 2
    card = (TINY_MOE_DIR / "MODEL_CARD.md").read_text()
    for needle in ("parameters", "perplexity", "skew", "TV", "public domain", "PSF"):
        assert needle in card


def test_loads_offline_as_fp32_with_the_expected_shape(tiny):
    model, tokenizer = tiny
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    spec = model_spec(model)
    assert (spec.architecture, spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size) == \
        ("Qwen3MoeForCausalLM", 4, 16, 2, 256)
    assert spec.moe_layers == [0, 1, 2, 3]
    n = sum(p.numel() for p in model.parameters())
    assert 12e6 < n < 15e6
    assert all(p.dtype.is_floating_point and p.element_size() == 4 for p in model.parameters())
    assert tokenizer.vocab_size == 4096


def test_tokenizer_round_trips_and_adds_no_special_tokens(tiny):
    _, tokenizer = tiny
    for name in texts.BUILTIN_TEXTS:
        sample = texts.read_text(name)[:5000]
        ids = tokenizer.encode(sample)  # the plain call equals workload.encode (no special tokens)
        assert tokenizer.decode(ids) == sample
        assert ids == workload.encode(tokenizer, sample)
    sample = "π ≈ 3.14159 — naïve café\n\tdef f(x): return x ** 2\n"
    assert tokenizer.decode(tokenizer.encode(sample)) == sample


# -------------------------------------------------------------------------------------- quality, routing


def test_heldout_perplexity_is_at_most_half_the_unigram(tiny, ids):
    model, tokenizer = tiny
    heldout = ids[texts.DEFAULT_EVAL_TEXT][:PPL_TOKENS]
    ppl = modelstats.perplexity(model, heldout)
    unigram = modelstats.unigram_perplexity(ids[texts.DEFAULT_CALIB_TEXT], heldout, tokenizer.vocab_size)
    print(f"held-out perplexity {ppl:.2f}, unigram {unigram:.2f}")
    assert unigram > 50  # the baseline is a real one, not a degenerate fit
    assert ppl <= 0.5 * unigram


def test_the_4096_position_context_changes_no_logits_within_2048(tiny, ids, tmp_path):
    """The context was raised from the 2,048 positions tiny-moe was trained and shipped with to 4,096: its RoPE is
    the default (no scaling, nothing computed from max_position_embeddings), so a prompt within 2,048 tokens gets
    the logits it got under the 2,048-position config, bit for bit."""
    import torch

    config = json.loads((TINY_MOE_DIR / "config.json").read_text())
    assert config["max_position_embeddings"] == 4096 and config["rope_parameters"]["rope_type"] == "default"
    for f in TINY_MOE_DIR.iterdir():
        (tmp_path / f.name).symlink_to(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    before, _ = load_model(str(tmp_path))
    assert before.config.max_position_embeddings == 2048
    model, _ = tiny
    with torch.no_grad():
        for n in (64, 2048):
            x = torch.tensor(ids[texts.DEFAULT_EVAL_TEXT][:n])[None]
            assert torch.equal(model(input_ids=x).logits, before(input_ids=x).logits), n


@pytest.mark.slow
def test_routing_is_skewed_in_every_layer_on_the_calibration_text(shares):
    share = shares[texts.DEFAULT_CALIB_TEXT]
    assert np.allclose(share.sum(axis=1), 1.0)
    skew = modelstats.skew(share)
    print("skew per layer on pydoc-calib:", np.round(skew, 2))
    assert (skew >= 1.5).all(), skew


@pytest.mark.slow
def test_shifted_text_moves_routing_in_at_least_half_the_layers(shares):
    tv = tv_distance(shares[texts.DEFAULT_EVAL_TEXT], shares[texts.SHIFTED_TEXT])
    print("TV(pydoc-heldout, stdlib-code) per layer:", np.round(tv, 3))
    assert (tv >= 0.1).sum() >= len(tv) / 2, tv
    # ...while the two halves of the same domain stay close: the shift is the domain, not noise.
    same = tv_distance(shares[texts.DEFAULT_EVAL_TEXT], shares[texts.DEFAULT_CALIB_TEXT])
    assert same.mean() < tv.mean()


