"""What a search writes into the plan beside its layers: how many layers store their weights each way, the gate's
measurement of the chosen plan, and the dense functions' field."""
from __future__ import annotations

from autotune.costing.whole_prefill import DensePlacement
from autotune.searching.dense_choice import dense_plan
from autotune.searching.model_record import ModelRecord
from autotune.searching.optimizer import SearchOutcome, Solution, resident_bytes


def dense_of(outcome: SearchOutcome, record: ModelRecord, sol: Solution) -> dict | None:
    """The plan's `dense` field for a solution: the dense functions chosen at its chunk size, except for the all-CPU
    plan (the unmodified model's computation, the gate's last resort) and a solution keeping more experts resident
    than the choice was made beside, past the ANE's window with them: their dense functions stay on the host. The
    host (the GPU where the profile prices one) is written whatever the functions: the prediction priced the dense
    half there, so the runtime must run it there, or say it does not."""
    choice = outcome.dense.get(sol.chunk_tokens)
    if choice is None:
        return None
    host_only = DensePlacement(host=choice.placement.host)
    if not any(cfg.resident for cfg in sol.configs):
        return dense_plan(host_only, record.shape)
    if not choice.fits_beside(resident_bytes(sol, record.spec.hidden_size, record.spec.expert_ffn_size)):
        return dense_plan(host_only, record.shape)
    return dense_plan(choice.placement, record.shape)


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
