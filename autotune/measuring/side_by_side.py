"""The timing primitive: plans of one model (and the baselines a user would run instead) prefilled on this host,
side by side, interleaved, repeated, on the given torch threads; measured whole-prefill ms per side per prompt (each
run's, and their median).

Which lanes are real here: on Linux, `cpu-exact` and `cpu-static` are torch's CPU kernels and `mlx-exact` (with the
MLX spine's dense half) is MLX's CPU device, one compute thread; all three are timed as they run. A plan whose groups
sit on `ane` or `coreai` runs there through a simulator off a Mac (`ane-sim`: numerics, never speed): its time is
what the simulator took, never the device's, and `simulated_lanes` names such a side so that no caller reports it
as a device's time. On a Mac the same code times the GPU (MLX) and the ANE (Core ML) for real.

A side prefills one prompt from an empty cache, computing the last position's logits (what generation needs), as
`autotune run` and `generate` do: the torch spine through `runtime.prefill`, the MLX spine through
`runtime.mlx.spine_generation`, mlx-lm's own forward through its `generate_step`, transformers' forward with the
plan uninstalled (`Loaded.unmodified`). Every side is warmed once, untimed; then each round runs every prompt on
every side, the sides' order rotated round by round, so a shared host's load falls on each alike. `clock`: the
process's CPU time where the run is one-thread CPU work (a shared host's other load does not inflate it, as
`profile-device` times its records), else the wall clock."""
from __future__ import annotations

import importlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.generation import Loaded, generate
from runtime.plan import Plan
from runtime.prefill import prefill_prompts_last_logits
from runtime.resources import Clock

Prompt = Sequence[int]


@dataclass
class Side:
    """One thing timed: `prefill(ids)` runs one prompt's prefill from an empty cache; `decode(ids, n)` generates
    `n` tokens greedily after it and returns tokens/s after the first (None: not measured for this side)."""
    name: str
    prefill: Callable[[Prompt], object]
    decode: Callable[[Prompt, int], float] | None = None
    simulated: tuple[str, ...] = ()  # lanes this side runs through a simulator here (its time is no device's)


@dataclass
class Timed:
    """A side's measured prefills: per prompt, each round's wall and CPU ms; `simulated`: its lanes this host runs
    through a simulator (`simulated_lanes`: then no device's time)."""
    wall_ms: list[list[float]] = field(default_factory=list)
    cpu_ms: list[list[float]] = field(default_factory=list)
    simulated: tuple[str, ...] = ()

    def runs_ms(self, clock: str) -> list[list[float]]:
        return self.cpu_ms if clock == "cpu" else self.wall_ms

    def median_ms(self, clock: str) -> list[float]:
        """Per prompt, the median of its rounds on `clock`."""
        return [statistics.median(r) for r in self.runs_ms(clock)]

    def whole_ms(self, clock: str) -> float:
        """The median prefill over every prompt (each prompt's median, their mean: prompts of one length)."""
        return statistics.fmean(self.median_ms(clock))

    def to_json(self, clock: str) -> dict:
        return {"median_ms": [round(v, 3) for v in self.median_ms(clock)], "whole_ms": round(self.whole_ms(clock), 3),
                "runs_ms": [[round(v, 3) for v in r] for r in self.runs_ms(clock)], "clock": clock,
                "simulated": list(self.simulated)}


def clock_for(threads: int) -> str:
    """The clock a run on `threads` torch threads is read on (see the module docstring)."""
    return "cpu" if threads == 1 else "wall"


def simulated_lanes(loaded: Loaded) -> tuple[str, ...]:
    """The plan's backends this host does not have, each as "name -> what ran it instead" (off a Mac `ane` runs as
    `ane-sim`): their calls' time here is not the device's."""
    fallbacks = loaded.executor.fallbacks if loaded.executor is not None else {}
    return tuple(f"{name} -> {used}" for name, used in sorted(fallbacks.items()))


def plan_side(name: str, loaded: Loaded) -> Side:
    """The plan installed on `loaded` (either spine), in its own chunks: the prefill `autotune run` times and the
    decode `autotune generate` measures."""
    chunk = loaded.plan.chunk_tokens

    def prefill(ids: Prompt) -> object:
        loaded.reset()
        return prefill_prompt(loaded, ids, chunk)

    return Side(name, prefill, lambda ids, n: _generated(loaded, ids, n), simulated_lanes(loaded))


def unmodified_side(name: str, loaded: Loaded, chunk: int) -> Side:
    """The model with the plan uninstalled (on the torch spine: transformers' own forward), in chunks of `chunk`."""

    def prefill(ids: Prompt) -> object:
        with loaded.unmodified():
            return prefill_prompt(loaded, ids, chunk)

    def decode(ids: Prompt, n: int) -> float:
        with loaded.unmodified():
            return _generated(loaded, ids, n)

    return Side(name, prefill, decode)


def mlx_lm_side(name: str, loaded: Loaded, chunk: int) -> Side:
    """mlx-lm's own `generate_step` on the MLX spine's model with the plan uninstalled: its prefill in steps of
    `chunk` to the first token, and its decode."""
    if loaded.engine != "mlx":
        raise ValueError("mlx-lm's forward runs on the MLX spine's model")

    def prefill(ids: Prompt) -> object:
        for _ in _mlx_lm_steps(loaded, ids, 1, chunk):
            pass

    def decode(ids: Prompt, n: int) -> float:
        first = None
        for i, _ in enumerate(_mlx_lm_steps(loaded, ids, n, chunk)):
            if i == 0:
                first = time.perf_counter()
        return (n - 1) / (time.perf_counter() - first)

    return Side(name, prefill, decode)


def time_sides(sides: Sequence[Side], prompts: Sequence[Prompt], repeats: int = 3,
               threads: int | None = None, progress: Callable[[], None] | None = None,
               warm: Callable[[Side, Prompt], object] | None = None) -> dict[str, Timed]:
    """Every side's prefill of every prompt, `repeats` rounds, interleaved (see the module docstring), on
    `threads` torch threads (None: as set); `progress` is called after each timed prefill. Each side is warmed
    first by one untimed prefill of the first prompt (`warm(side, prompt)` where given: a caller measuring
    something else of it, such as its memory)."""
    if threads is not None:
        torch.set_num_threads(threads)
    for side in sides:  # untimed: first-call costs (allocations, MLX's compiled kernels) out of the rounds
        (warm or (lambda s, ids: s.prefill(ids)))(side, prompts[0])
    out = {s.name: Timed([[] for _ in prompts], [[] for _ in prompts], s.simulated) for s in sides}
    for r in range(repeats):
        order = [sides[(i + r) % len(sides)] for i in range(len(sides))]
        for p, ids in enumerate(prompts):
            for side in order:
                with Clock() as clock:
                    side.prefill(ids)
                out[side.name].wall_ms[p].append(clock.wall_s * 1e3)
                out[side.name].cpu_ms[p].append(clock.cpu_s * 1e3)
                if progress is not None:
                    progress()
    return out


def time_decode(sides: Sequence[Side], prompt: Prompt, tokens: int, repeats: int = 3) -> dict[str, float | None]:
    """Each side's median greedy decode tokens/s after `prompt` (`tokens` new tokens), sides interleaved; None for
    a side that does not decode."""
    runs: dict[str, list[float]] = {s.name: [] for s in sides if s.decode is not None}
    for r in range(repeats):
        for side in [sides[(i + r) % len(sides)] for i in range(len(sides))]:
            if side.decode is not None:
                runs[side.name].append(side.decode(prompt, tokens))
    return {s.name: statistics.median(runs[s.name]) if s.name in runs else None for s in sides}


def time_plans(model: str, plans: dict[str, Plan | str], prompts: Sequence[Prompt], *, repeats: int = 3,
               threads: int = 1, dtype: str = "auto", engine: str = "auto") -> dict[str, Timed]:
    """Plans of one model timed on this host (each loaded once, on the spine `engine` resolves for it), every
    prompt, interleaved: what `search --measure` ranks candidates by. Read `Timed.median_ms(clock_for(threads))`
    for each plan's measured whole prefill per prompt; check `simulated_lanes` before reading one as a device's."""
    from runtime.generation import load

    torch.set_num_threads(threads)
    sides = [plan_side(name, load(model, plan, dtype=dtype, engine=engine)) for name, plan in plans.items()]
    return time_sides(sides, prompts, repeats)


def prefill_prompt(loaded: Loaded, ids: Prompt, chunk: int) -> object:
    """One prompt's prefill from an empty cache, the last position's logits computed (either spine)."""
    tensor = torch.as_tensor(list(ids), dtype=torch.long)
    if loaded.engine == "mlx":
        from runtime.mlx.spine_generation import prefill_logits

        return prefill_logits(loaded.model, tensor, chunk)
    return prefill_prompts_last_logits(loaded.model, tensor, chunk)


def _generated(loaded: Loaded, ids: Prompt, n: int) -> float:
    r = generate(loaded, list(ids), max_tokens=n)
    if r.generated_tokens != n or r.generation_tok_s is None:
        raise RuntimeError(f"decode stopped after {r.generated_tokens} of {n} tokens ({r.finish_reason})")
    return r.generation_tok_s


def _mlx_lm_steps(loaded: Loaded, ids: Prompt, n: int, chunk: int):
    import mlx.core as mx

    step = importlib.import_module("mlx_lm.generate").generate_step
    with loaded.unmodified():
        yield from step(mx.array(list(ids)), loaded.model.mlx, max_tokens=n, prefill_step_size=chunk)
