"""One search, as one value: `SearchConfig` holds every option of `autotune search` under its flag's name, with the
command's defaults, so `search_plan(model, SearchConfig())` is exactly `autotune search --model M` (the command
only parses into it; its argparse defaults are read from here)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from autotune.costing.cpu_storage import parse_storage
from autotune.evaluation import gate
from runtime.errors import NpumoeError
from runtime.plan import COMPRESSIONS

DEFAULT_COMPRESS_GATED = COMPRESSIONS  # with the gate: every storage, a group kept compressed only where it holds
DEFAULT_COMPRESS_UNGATED = ("none",)  # without it: fp16, as nothing measures what compression costs

IN_FLIGHT = (1, 2)  # prefill chunks in flight a plan may be chosen for (runtime/mlx/overlap.py runs 2)


def check_in_flight(in_flight: int, engine: str) -> None:
    """`--in-flight`: 1 or 2, and 2 only for the spine that runs it (`--engine mlx`)."""
    if in_flight not in IN_FLIGHT:
        raise NpumoeError(f"--in-flight {in_flight}: give 1 (one chunk at a time) or 2 (two chunks in flight)")
    if in_flight > 1 and engine != "mlx":
        raise NpumoeError(f"--in-flight {in_flight}: two chunks in flight run on the MLX spine only; give "
                          "--engine mlx")


@dataclass(frozen=True)
class SearchConfig:
    """`autotune search`'s options (`--drop-budget` -> `drop_budget`, ...). `compress` None is the command's default
    policy (`compress_kinds`); `max_ppl_delta` is in percent, as the flag."""
    profile: str | None = None
    traces: str | os.PathLike | None = None
    out: str | os.PathLike | None = None
    drop_budget: float = 0.10
    objective: str = "latency"
    trials: int = 120
    storage: str | None = None
    resident_mb: float = 16384
    prompt_tokens: int | None = None
    compress: tuple[str, ...] | None = None
    memory_gb: float | None = None
    saliency: str = "router_weight"
    seed: int = 0
    threads: int | None = None
    robust: bool = False
    no_gate: bool = False
    no_dense: bool = False  # the experts alone: every dense op stays on the CPU (the experts-only search)
    no_measure: bool = False  # price the model on the profile as it is, its shapes measured into it or not
    gate_candidates: int = gate.CANDIDATES
    max_ppl_delta: float = 100 * gate.MAX_PPL_DELTA
    min_top1: float = gate.MIN_TOP1
    gate_tokens: int = gate.GATE_TOKENS
    dtype: str = "auto"
    cpu_weights: str | None = None  # bf16, int8 or int4[:group]: pins the CPU's expert storage (None: searched)
    backend: str | None = None  # pins the static backend the plan's groups name (None: chosen, backend_choice)
    engine: str = "auto"  # mlx: the plan's exact path and dense host are mlx-exact (run on the MLX spine)
    measure: int | None = None  # candidates timed on this host after the gate (None: 8 on a profile measured here)
    in_flight: int = 1  # prefill chunks in flight the plan is chosen for (2: --engine mlx; searching/flight_plan.py)

    def __post_init__(self) -> None:
        check_in_flight(self.in_flight, self.engine)
        if self.cpu_weights is not None:
            parse_storage(self.cpu_weights)
        if self.compress is not None:
            object.__setattr__(self, "compress", tuple(self.compress))
            unknown = [k for k in self.compress if k not in COMPRESSIONS]
            if unknown:
                raise NpumoeError(f"--compress {','.join(unknown)}: not a weight storage (one of "
                                  f"{', '.join(COMPRESSIONS)})")

    @property
    def compress_kinds(self) -> tuple[str, ...]:
        """The weight storages the search may give a layer's ANE groups: `compress`, or by default all of them
        with the gate (which measures them) and none without it."""
        if self.compress is not None:
            return self.compress
        return DEFAULT_COMPRESS_UNGATED if self.no_gate else DEFAULT_COMPRESS_GATED

    def gate_settings(self) -> gate.GateSettings | None:
        """What the fidelity gate measures with; None with `no_gate`."""
        if self.no_gate:
            return None
        return gate.GateSettings(self.gate_candidates, gate.GateLimits(self.max_ppl_delta / 100, self.min_top1),
                                 self.gate_tokens)

    def check_gate_tokens(self, smallest_chunk: int) -> None:
        """The gate runs each candidate on `gate_tokens` tokens: under one chunk of the smallest chunk searched it
        would run no candidate's static groups (a partial chunk runs exactly) and pass them all as the model."""
        if not self.no_gate and self.gate_tokens < smallest_chunk:
            raise NpumoeError(f"--gate-tokens {self.gate_tokens} is less than one chunk of the smallest chunk "
                              f"searched ({smallest_chunk} tokens): the gate would run none of the candidates' "
                              f"static groups; give --gate-tokens {smallest_chunk} or more, or --no-gate")

    def replace(self, **changes) -> "SearchConfig":
        return dataclasses.replace(self, **changes)


DEFAULTS = SearchConfig()
