"""The fidelity gate of `autotune search`: a plan is written only after its accuracy was measured.

The search judges plans by a proxy (held-out overflow counted on routing traces). The gate takes the search's
cheapest candidates that meet the proxy, runs each on held-out text with its `ane` groups on `ane-sim` (what the
ANE function computes: fp16, compressed weights as Core ML stores them), and measures it against the unmodified
model: perplexity delta, top-1 next-token agreement, mean KL divergence. The plan written is the cheapest candidate
within the limits. Candidates come in rounds of `--gate-candidates`: when a round holds none within the limits, the
gate measures the next (autotune/searching/gate_candidates.py orders them, at most 4 rounds, the all-CPU plan last:
it runs what the model runs, so its figures are exact and it passes by construction, with the experts as loaded; where
the plan's exact path is off the CPU, every expert on that path just before it).
Quantized CPU experts run the plan's kernels; a round that passes none after a kernel that rounds the rows too ran
(int_mm, int_mm_gate_up) is measured again with the one that rounds fewer in its place (int_mm_gate_up, then
dequant) before the next round. Only when every candidate fails is nothing written, and the closest is named.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice

import torch

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.calibration.workload import encode_text
from autotune.costing.memory import ModelSize, stage_memory
from autotune.evaluation.fidelity import compare_plans
from runtime.coreml.ane_sim import AneSimBackend
from runtime.cpu.allocator import temporaries_returned
from runtime.errors import NpumoeError
from runtime.executor import PlanExecutor
from runtime.loading.checkpoints import check_token_ids
from runtime.loading.model_loader import moe_layers
from runtime.loading.model_record import ModelRecord
from runtime.plan import Plan
from runtime.resources import peak_rss_mb

CANDIDATES = 4  # the cheapest candidates meeting the proxy that the gate measures
MAX_PPL_DELTA = 0.01  # perplexity of the plan / of the unmodified model - 1, at most
MIN_TOP1 = 0.99  # top-1 next-token agreement with the unmodified model, at least
GATE_TOKENS = 4096  # held-out tokens each candidate runs
GATE_TEXT = DEFAULT_EVAL_TEXT
PROMPT_TOKENS = 1024  # as `autotune evaluate` prompts: its figures and the gate's are comparable


@dataclass(frozen=True)
class GateLimits:
    max_ppl_delta: float = MAX_PPL_DELTA
    min_top1: float = MIN_TOP1

    def passes(self, ppl_delta: float, top1: float) -> bool:
        return ppl_delta <= self.max_ppl_delta and top1 >= self.min_top1

    def shortfall(self, ppl_delta: float, top1: float) -> float:
        """How far past the limits, each relative to its own slack (<= 0 within both)."""
        return max((ppl_delta - self.max_ppl_delta) / max(self.max_ppl_delta, 1e-9),
                   (self.min_top1 - top1) / max(1.0 - self.min_top1, 1e-9))


@dataclass(frozen=True)
class GateSettings:
    """What `autotune search` gates with (`--gate-candidates`, `--max-ppl-delta`, `--min-top1`, `--gate-tokens`,
    `--gate-text`)."""
    candidates: int = CANDIDATES
    limits: GateLimits = GateLimits()
    tokens: int = GATE_TOKENS
    text: str = GATE_TEXT


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    predicted_ms: float  # what the search minimised (its whole prefill of one prompt), predicted by the cost model


def _summary(plan: Plan) -> dict:
    """What a candidate puts where: static groups per backend, compressed groups per kind, and the experts in no
    group per exact path (all layers)."""
    groups = [g for lp in plan.layers for g in lp.groups]
    backends, compress = {}, {}
    for g in groups:
        backends[g.backend] = backends.get(g.backend, 0) + 1
        if g.compression != "none":
            compress[g.compression] = compress.get(g.compression, 0) + 1
    exact: dict[str, int] = {}
    for lp in plan.layers:
        for e in lp.cpu_exact:
            path = lp.exact_path_of(e, plan.exact_path)
            exact[path] = exact.get(path, 0) + 1
    return {"static_groups": backends, "compressed_groups": compress, "exact_experts": exact,
            "overflow": plan.overflow, "chunk_tokens": plan.chunk_tokens}


@contextmanager
def _silenced(logger: logging.Logger) -> Iterator[None]:
    """The gate's text is its own choice, not the user's workload: routing that differs from the calibration text
    is expected there, so the drift monitor's alert would be noise."""
    disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = disabled


@contextmanager
def _said_once(logger: logging.Logger) -> Iterator[None]:
    """Each distinct message once: K candidates falling back the same way are one line, not K."""
    seen: set[str] = set()

    def once(record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        new = msg not in seen
        seen.add(msg)
        return new

    logger.addFilter(once)
    try:
        yield
    finally:
        logger.removeFilter(once)


@contextmanager
def cpu_storage_beside(model: torch.nn.Module, kind: str, group_size: int | None,
                       kernel_rows: dict[str, int] | None = None) -> Iterator[list]:
    """For the block, the CPU's experts also held as `kind` (runtime.cpu.cpu_weights), beside the full-width ones: a
    plan's exact path and CPU groups run that storage (`expert_ffn`) with the plan's `kernel_rows` (None: the
    defaults), while the unmodified model (transformers' kernels) and the ANE groups (whose packages are built from
    the full-width checkpoint) read the full-width weights, as on a Mac. Yields the stores made (their kernels and
    call counts); bf16, or experts already packed: nothing changes, none made."""
    from runtime.cpu.cpu_weights import quantized_store

    layers = [l for l in moe_layers(model) if kind != "bf16" and not hasattr(l.experts, "npumoe_weights")]
    for layer in layers:
        layer.experts.npumoe_weights = quantized_store(layer.experts, kind, group_size or 64, kernel_rows)
    try:
        yield [layer.experts.npumoe_weights for layer in layers]
    finally:
        for layer in layers:
            del layer.experts.npumoe_weights


def run_gate(record: ModelRecord, candidates: Iterable[Candidate],
             settings: GateSettings = GateSettings(), *, progress: bool = True,
             cpu_weights: tuple[str, int | None] = ("bf16", None), kernel_rows: dict[str, int] | None = None) -> dict:
    """Measure the candidates in order, `settings.candidates` at a time (a round), on the first `settings.tokens` tokens
    of `settings.text` against the unmodified model, until a round holds one within the limits, on the model `record`
    describes (loaded once, in its dtype). Returns the gate's JSON: `candidates` (every one measured: predicted_ms,
    ppl_delta, top1, kl, passed, ...), `chosen` (the first passing one, with its `index`; None when none passes),
    `rounds` and what the gate cost. `cpu_weights`: the CPU storage (kind, int4 group) the candidates run their CPU
    experts in (`cpu_storage_beside`), with their kernels from `kernel_rows` rows (None: the defaults), measured against
    the unmodified model. Where no candidate of a round passes and a kernel that also rounds the rows ran (int_mm,
    int_mm_gate_up), the round is measured again with the kernel that rounds fewer in its place (`fallback_kernel_rows`:
    int_mm -> int_mm_gate_up -> dequant), step by step, before the next round: each row says the `kernel_rows` it ran,
    its round's `kernel_calls` (expert calls per kernel, the runtime's own counts, every candidate of the round
    together), and its `candidate` (the position in `candidates`; `index` numbers the rows, a remeasured one also has
    `retry_of`, the row it repeats)."""
    from runtime.cpu.cpu_weights import fallback_kernel_rows, kernel_calls

    t0 = time.perf_counter()
    loaded, tokenizer = record.loaded()
    limits, text = settings.limits, settings.text
    ids = encode_text(tokenizer, text, settings.tokens)
    check_token_ids(loaded, ids)
    size = ModelSize.of(loaded)  # as loaded, before the CPU's storage beside it
    rows, tokens, rounds, taken, pending, measured_rounds = [], 0, 0, 0, iter(candidates), []
    # the gate's blocks back to the OS as freed (nothing of it is timed): its peak is its own, not the heap's luck
    with _said_once(logging.getLogger("npumoe")), _silenced(logging.getLogger("npumoe.drift")), \
            temporaries_returned(), cpu_storage_beside(loaded, *cpu_weights, kernel_rows) as stores:
        planned = dict(stores[0].kernel_rows) if stores else None  # the plan's, or the runtime's defaults

        def measure(batch: list[Candidate], kernels: dict[str, int] | None, sim: dict) -> list[dict]:
            nonlocal tokens
            for store in stores:
                store.kernel_rows, store.calls = dict(kernels), Counter()
            executors = [PlanExecutor(loaded, c.plan, sim) for c in batch]
            measured = []
            for c, ex, f in zip(batch, executors, compare_plans(executors, ids, PROMPT_TOKENS, progress)):
                total, tokens = ex.stats.total(), f["tokens"]
                measured.append({"index": len(rows) + len(measured), "predicted_ms": c.predicted_ms,
                                 "ppl_delta": f["ppl_delta_rel"], "top1": f["top1_agreement"], "kl": f["kl_mean"],
                                 "passed": limits.passes(f["ppl_delta_rel"], f["top1_agreement"]),
                                 "drop_rate": total.dropped / max(1, total.assignments),
                                 "calls_per_backend": dict(total.calls_per_backend), **_summary(c.plan),
                                 "kernel_rows": kernels, "kernel_calls": kernel_calls(stores),
                                 "candidate": taken - len(batch) + len(measured)})
            return measured

        while not any(r["passed"] for r in rows) and (batch := list(islice(pending, settings.candidates))):
            rounds, taken = rounds + 1, taken + len(batch)
            chunk = max(c.plan.chunk_tokens for c in batch)
            if ids.numel() < chunk:  # no full chunk: every candidate would run exactly, passing as the model
                raise NpumoeError(f"the fidelity gate has {ids.numel()} tokens of {text}, less than one chunk of "
                                  f"the candidates' ({chunk} tokens): it would run none of their static groups; "
                                  f"give --gate-tokens {chunk} or more")
            # a simulator per round, its weights prepared once for the round's candidates and their remeasures:
            # the rounds' weights never add up (a 2-layer Qwen3-30B-A3B twin's gate held 1.04 GB of them by its
            # third round with one simulator for all)
            sim = {AneSimBackend.name: AneSimBackend()}
            measured_rounds.append([c.plan for c in batch])
            rows += measure(batch, planned, sim)
            kernels = planned or {}
            while not any(r["passed"] for r in rows) and (fallback := fallback_kernel_rows(kernels)) \
                    and set(rows[-1]["kernel_calls"]) - set(fallback):
                rows += [dict(r, retry_of=r["index"] - len(batch)) for r in measure(batch, fallback, sim)]
                kernels = fallback
    if not rows:
        raise NpumoeError("the fidelity gate has no candidate to measure")
    chosen = next((r for r in rows if r["passed"]), None)
    storage = f"int4:{cpu_weights[1] or 64}" if cpu_weights[0] == "int4" else cpu_weights[0]
    return {"label": f"measured: {tokens} tokens of {text}, ane groups on ane-sim, CPU experts in {storage}, "
                     "against the unmodified model; predicted_ms by the cost model",
            "text": text, "cpu_weights": storage, "tokens": tokens,
            "limits": {"max_ppl_delta": limits.max_ppl_delta, "min_top1": limits.min_top1},
            "candidates": rows, "chosen": chosen, "rounds": rounds, "seconds": round(time.perf_counter() - t0, 2),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "predicted_peak_mb": round(predicted_gate_peak(size, measured_rounds) / 2**20, 1)}


def predicted_gate_peak(size: ModelSize, rounds: list[list[Plan]]) -> int:
    """The gate's predicted peak memory (bytes): its largest round, the unmodified model beside the round's
    candidates (`costing.memory.stage_memory`'s search stage)."""
    return max(stage_memory(size, "search", max(p.chunk_tokens for p in plans), PROMPT_TOKENS,
                            gate_candidates=len(plans), plan=plans).total for plans in rounds)


def refusal(gate: dict) -> NpumoeError:
    """The one line a search without a passing candidate ends on, naming the closest one and its figures."""
    limits = GateLimits(**gate["limits"])
    closest = min(gate["candidates"], key=lambda r: limits.shortfall(r["ppl_delta"], r["top1"]))
    return NpumoeError(
        f"no candidate passes the fidelity gate (perplexity delta <= {limits.max_ppl_delta:.2%}, top-1 >= "
        f"{limits.min_top1:.3f}) over {gate['tokens']} tokens of {gate['text']}: the closest, candidate "
        f"{closest['index']} (predicted {closest['predicted_ms']:.4f} ms), measured perplexity delta "
        f"{closest['ppl_delta']:+.2%}, top-1 {closest['top1']:.4f}, mean KL {closest['kl']:.4g}; no plan written "
        "(a lower --drop-budget, looser --max-ppl-delta/--min-top1, or --no-gate)")
