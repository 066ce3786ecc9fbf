"""What a search writes into the plan beside its layers: how many layers store their weights each way, the gate's
measurement of the chosen plan, and the dense functions' field."""
from __future__ import annotations

from autotune.costing.whole_prefill import DecoderShape
from autotune.searching.dense_choice import dense_plan
from autotune.searching.objective import placement
from autotune.searching.optimizer import SearchOutcome, Solution
from runtime.backends import EXACT


def dense_of(outcome: SearchOutcome, shape: DecoderShape, sol: Solution) -> dict | None:
    """The plan's `dense` field for a solution: where it runs its dense functions as the search priced it
    (`objective.placement`: its own, or the choice at its chunk size but for the all-exact plans and a solution
    keeping more experts resident than fit the ANE's window beside the choice's functions). The host (the GPU where
    the profile prices one) is written whatever the functions: the prediction priced the dense half there, so the
    runtime must run it there, or say it does not. None: no choice and no placement of its own (all on the CPU)."""
    choice = outcome.dense.get(sol.chunk_tokens)
    if choice is None and sol.dense is None:
        return None
    return dense_plan(placement(sol, choice, EXACT), shape)


def compress_counts(configs) -> dict[str, int]:
    """How many layers' static groups store their weights each way (layers without residents not counted)."""
    out: dict[str, int] = {}
    for c in configs:
        if c.resident:
            out[c.compress] = out.get(c.compress, 0) + 1
    return out


def gate_meta(gated: dict) -> dict:
    """The chosen candidate's measured fidelity, as the plan keeps it."""
    chosen = gated["chosen"]
    return {"label": gated["label"], "tokens": gated["tokens"], "text": gated["text"],
            **{k: chosen[k] for k in ("ppl_delta", "top1", "kl")}}
