"""`autotune search --in-flight 2`: the plan chosen for two prefill chunks in flight on the MLX spine
(`runtime/mlx/overlap.py`), as the whole prefill's report chooses it (`prefill_report.whole_prefill_choice`): the
schedule's chunking (an uneven one as the plan's `chunk_rows`), its dense half and its experts (the search's pick
from then on). Where something measured or assessed the pick's experts (the fidelity gate, `--measure`,
`--robust`), the schedule keeps them (`prefill_report.pick_candidates`) and chooses only the chunking and the dense
half; else any candidate the report weighs."""
from __future__ import annotations

from dataclasses import dataclass

from autotune.costing.whole_prefill import DecoderShape
from autotune.searching.dense_choice import dense_plan
from autotune.searching.optimizer import SearchOutcome, Solution
from autotune.searching.overlap_choice import Overlapped
from autotune.searching.prefill_report import whole_prefill_choice
from autotune.searching.scoring import Scorer


@dataclass
class Flight:
    """The two-in-flight choice: the whole prefill's figures (`whole_prefill`'s, the schedule's makespan its
    `predicted_prefill_ms`) and the schedule chosen."""
    whole: dict
    chosen: Overlapped

    @property
    def chunk_tokens(self) -> int:
        return self.chosen.candidate.chunk

    @property
    def solution(self) -> Solution:
        """The experts' solution (the search's pick from here on)."""
        return self.chosen.candidate.solution

    def dense(self, shape: DecoderShape) -> dict | None:
        """The plan's `dense` field: the dense half as the schedule placed it."""
        return dense_plan(self.chosen.placement, shape)

    def fields(self) -> dict:
        """What else the plan says of the schedule: `in_flight`, an uneven chunking's `chunk_rows`."""
        rows = self.chosen.candidate.rows
        return {"in_flight": 2, **({"chunk_rows": list(rows)} if rows else {})}

    def predicted(self) -> dict:
        """The plan's `predicted` figures of the schedule (the makespan is `predicted_prefill_ms`)."""
        return {"in_flight": 2, "predicted_schedule": self.whole["predicted_schedule"],
                "predicted_one_in_flight_ms": self.whole["one_in_flight_ms"]}


def choose_flight(outcome: SearchOutcome, scorer: Scorer, shape: DecoderShape, prompt_tokens: int,
                  pick_only: bool) -> Flight:
    """The schedule's choice for two chunks in flight (`pick_only`: of the search's pick's experts alone)."""
    return Flight(*whole_prefill_choice(outcome, scorer, shape, prompt_tokens, 2, pick_only=pick_only))
