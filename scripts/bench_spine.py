"""The MLX spine's overhead against mlx-lm, beside today's torch spine with mlx-exact, measured side by side.

Three sides on one model folder (default tiny-moe, through mlx-lm's loader) in float32, with a plan that puts every
expert on mlx-exact and no static group:
- `mlx-lm`: mlx-lm's own `generate_step` on the same model object with the plan uninstalled (its prefill in chunks
  of the plan's size, then its decode steps);
- `mlx-spine`: `runtime.generate` on the MLX spine (`--engine mlx`);
- `torch-spine`: `runtime.generate` on the torch spine, the experts crossing to mlx-exact call by call.
Prefill is the time to the first token (wall, and the process's CPU time: a shared host's other load inflates the
wall clock only); decode is tokens/s after the first (wall, and on the process's CPU time: `decode_cpu_tok_s`),
`generate`'s loop with its text against mlx-lm's `generate_step` (token ids). The sides run interleaved, their
order rotated round by round, `--repeats` rounds, each figure the median of its rounds; each ratio the median of the
rounds' pairs (a pair ran close in time: a shared host's load drifts between rounds): `prefill_vs_mlx_lm` =
mlx-lm's prefill time / ours (`prefill_cpu_vs_mlx_lm` on CPU time), `decode_vs_mlx_lm` = our decode tok/s / mlx-lm's
(`decode_cpu_vs_mlx_lm` on CPU time; >= 1: ours is as fast), and the same for the torch spine; `best_round` the MLX
spine's CPU-time ratios from each side's least disturbed round; `loadavg` the host's load before and after the
rounds. On Linux MLX runs on its CPU device: the figures are the spine's overhead, not a GPU's speed.

    python scripts/bench_spine.py --json [--quick] [--model DIR] [--threads 1]

With `--overlap` (default prompt 4,096 tokens in chunks of 1,024): two chunks in flight against one at a time
(`runtime.mlx.overlap`), on a plan whose experts are in static groups on cpu-static (torch: the static lane) and
whose dense half (and any spill) runs on mlx-exact (MLX: the host lane). The two sides run interleaved in one
process, `--repeats` rounds, each the prefill of the same prompt from an empty cache: `overlap_speedup` (measured:
the one-at-a-time prefill's median wall over the two-in-flight one's), `overlap_predicted_speedup` (predicted: the
schedule, `autotune.costing.schedule`, of the one-at-a-time run's recorded lane times per op, one in flight over
two), `overlap_max_rel_diff` (the two runs' last logits), `greedy_text_equal` (`generate`'s greedy text under
each, on the prompt's first `greedy_prompt_tokens`: what fits the model's context before the new tokens), each
lane's busy and wait ms, the process's CPU time per side and `cores_used` (it over the wall: two in flight overlap
only where this process gets a second core), and the host's load (`/proc/loadavg`) before and after.
`--static-dense F,..` puts those dense functions (of qkv, o_proj, attention) on cpu-static by hand; `--profile P`
lets the schedule choose them on host profile P (`autotune.searching.host_lanes`: the placement whose two-in-flight
schedule ends first), and `chosen` says what it chose and predicted (each lane's busy and idle ms, the makespan with
one and two in flight). `--placement` names the placements measured side by side on P (interleaved in each round):
`schedule` (that choice, every expert grouped) and `balanced` (`host_lanes_balanced`: each layer's first k experts
grouped, the others and the dense functions the static lane does not take on mlx-exact, the plan two in flight
speed up most among those within 1.25 of the fastest); the first's figures are the top level's, `placements` holds
each one's and `two_in_flight_ms_over` each one's in-flight wall over the first's. Each side's `rounds` gives every
round's walls, `cores_used` and load; `sched_autogroup` whether the kernel shares the CPU by session (then the
process's share is its session's, one thread or two: two in flight gain only from CPU no other session wants).

    python scripts/bench_spine.py --overlap --json [--threads 1] [--profile P [--placement balanced,schedule] |
                                                    --static-dense F,..]
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.calibration.workload import encode_text
from autotune.costing.schedule import schedule, steps_from_events
from autotune.costing.whole_prefill import DensePlacement, decoder_shape
from autotune.measuring.bench_run import paired_ratio
from autotune.searching.dense_choice import dense_plan
from autotune.searching.host_lanes import WHOLE_FUNCTIONS, grouped_first, whole_placement
from autotune.searching.templates import template_plan
from runtime import generation
from runtime.errors import NpumoeError
from runtime.loading.model_record import read_model_spec, resolve_model
from runtime.plan import DensePlan, Plan


def _mlx_lm_prefill(loaded, ids: list[int], chunk: int) -> None:
    """mlx-lm's own prefill (`generate_step` to its first token) on the spine's model, the plan uninstalled."""
    import mlx.core as mx

    step = importlib.import_module("mlx_lm.generate").generate_step
    with loaded.unmodified():
        for _ in step(mx.array(ids), loaded.model.mlx, max_tokens=1, prefill_step_size=chunk):
            pass


def _after_first(tokens: Iterator, count: Callable[[], int]) -> tuple[float, float]:
    """Tokens/s after the first of a generation's `tokens` (one item a token; `count()`: the tokens made), on the
    wall clock and on the process's CPU clock (every thread's, which a shared host's other load does not inflate)."""
    for n, _ in enumerate(tokens):
        if n == 0:
            wall, cpu = time.perf_counter(), time.process_time()
    made = count() - 1
    return made / (time.perf_counter() - wall), made / (time.process_time() - cpu)


def _mlx_lm_decode(loaded, ids: list[int], tokens: int, chunk: int) -> tuple[float, float]:
    """mlx-lm's `generate_step` greedy after `ids`: tokens/s after its first token (wall, CPU). It leaves one step
    past the last token computing: waited for after the clocks stop, so that it falls on no other side's time."""
    import mlx.core as mx

    gen = importlib.import_module("mlx_lm.generate")
    with loaded.unmodified():
        out = _after_first(gen.generate_step(mx.array(ids), loaded.model.mlx, max_tokens=tokens,
                                             prefill_step_size=chunk), lambda: tokens)
    mx.synchronize(gen.generation_stream)
    return out


def _decode(loaded, ids: list[int], tokens: int) -> tuple[float, float]:
    """`generate`'s greedy decode after `ids` (its loop, the text included: `Generation.pieces`): tokens/s after the
    first token (wall, CPU)."""
    run = generation.Generation(loaded, torch.tensor(ids), tokens, 0.0, 0, loaded.plan.chunk_tokens)
    loaded.reset()
    out = _after_first(run.pieces(every_token=True), lambda: len(run.tokens))
    assert len(run.tokens) == tokens, run.finish_reason
    return out


def _clocked(fn) -> tuple[float, float]:
    """(wall s, process CPU s: every thread's, which a shared host's other load does not inflate) of `fn()`."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def _rounds(prefills: dict, decodes: dict, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Each side's prefill (wall s, CPU s) and decode (tok/s wall, CPU) per round, interleaved: every round runs
    every side, the order rotated round by round, so a shared host's load falls on each alike."""
    sides = list(prefills)
    runs = {f: {s: [] for s in sides} for f in ("wall", "cpu", "tok_s", "cpu_tok_s")}
    for r in range(repeats):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            wall, cpu = _clocked(prefills[side])
            tok_s, cpu_tok_s = decodes[side]()
            for f, v in zip(runs, (wall, cpu, tok_s, cpu_tok_s)):
                runs[f][side].append(v)
    return runs


def ratios(runs: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """Each spine against mlx-lm, >= 1 where the spine is as fast: mlx-lm's prefill time over the spine's, the
    spine's decode tokens/s over mlx-lm's; each the median of the rounds' pairs (`paired_ratio`: a pair ran close in
    time, where a shared host's load drifts between rounds)."""
    out = {}
    for prefix, side in (("", "mlx-spine"), ("torch_spine_", "torch-spine")):
        for key, fig in (("prefill", "wall"), ("prefill_cpu", "cpu"), ("decode", "tok_s"), ("decode_cpu", "cpu_tok_s")):
            ours, lm = runs[fig][side], runs[fig]["mlx-lm"]
            out[f"{prefix}{key}_vs_mlx_lm"] = paired_ratio([lm], [ours]) if key.startswith("prefill") \
                else paired_ratio([ours], [lm])
    return out


def best_round(runs: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """The MLX spine against mlx-lm on each side's least disturbed round (the least CPU time, the most CPU-clock
    tokens/s): a shared host's other load only adds time, so the best round is the closest to the work's own cost."""
    cpu, tok_s = runs["cpu"], runs["cpu_tok_s"]
    return {"prefill_cpu_vs_mlx_lm": round(min(cpu["mlx-lm"]) / min(cpu["mlx-spine"]), 4),
            "decode_cpu_vs_mlx_lm": round(max(tok_s["mlx-spine"]) / max(tok_s["mlx-lm"]), 4)}


def measure(model: str, prompt_tokens: int, decode_tokens: int, repeats: int, chunk: int) -> dict:
    plan = template_plan(read_model_spec(model), chunk_tokens=chunk, exact="mlx-exact", grouped=False)
    spine = generation.load(model, plan, engine="mlx", dtype="float32")
    torch_spine = generation.load(model, plan, engine="torch", dtype="float32")
    ids = encode_text(spine.tokenizer, DEFAULT_EVAL_TEXT, prompt_tokens).tolist()
    prefills = {"mlx-lm": lambda: _mlx_lm_prefill(spine, ids, chunk),
                "mlx-spine": lambda: generation.generate(spine, ids, max_tokens=1),
                "torch-spine": lambda: generation.generate(torch_spine, ids, max_tokens=1)}
    decodes = {"mlx-lm": lambda: _mlx_lm_decode(spine, ids, decode_tokens, chunk),
               "mlx-spine": lambda: _decode(spine, ids, decode_tokens),
               "torch-spine": lambda: _decode(torch_spine, ids, decode_tokens)}
    for run in [*prefills.values(), *decodes.values()]:  # untimed: first-call costs out of the rounds
        run()
    load_before = _loadavg()
    runs = _rounds(prefills, decodes, repeats)
    med = {f: {s: statistics.median(v) for s, v in fig.items()} for f, fig in runs.items()}
    return {"model": model, "prompt_tokens": len(ids), "decode_tokens": decode_tokens, "chunk_tokens": chunk,
            "repeats": repeats, "dtype": "float32", "mlx_device": spine.executor.lane,
            "prefill_ms": {s: round(v * 1e3, 2) for s, v in med["wall"].items()},
            "prefill_cpu_ms": {s: round(v * 1e3, 2) for s, v in med["cpu"].items()},
            "decode_tok_s": {s: round(v, 2) for s, v in med["tok_s"].items()},
            "decode_cpu_tok_s": {s: round(v, 2) for s, v in med["cpu_tok_s"].items()},
            **ratios(runs),
            "best_round": best_round(runs),
            "loadavg": {"before": load_before, "after": _loadavg()},
            "measured": "sides interleaved, their order rotated round by round: prefill wall and process CPU time "
                        "to the first token, decode tokens/s after it (wall and process CPU); each figure the median "
                        "of the rounds, each ratio the median of the rounds' pairs"}


def static_placement(static_dense: tuple[str, ...], chunk: int, prompt_tokens: int) -> DensePlacement:
    """The dense functions `static_dense` (of qkv, o_proj, attention: a bucket per full chunk's context) wholly on
    cpu-static, the rest on mlx-exact."""
    return whole_placement(static_dense, prompt_tokens, chunk, "cpu-static", "mlx-exact")


def overlap_plan(model: str, chunk: int, place: DensePlacement = DensePlacement(host="mlx-exact"),
                 grouped: int | None = None) -> Plan:
    """Every expert (or each layer's first `grouped`) in static groups on cpu-static (ample capacity), the others
    on the plan's exact path, mlx-exact; the dense functions as `place` puts them (spliced into mlx-lm's forward
    where on cpu-static)."""
    spec = read_model_spec(model)
    plan = template_plan(spec, chunk_tokens=chunk, exact="mlx-exact", backend="cpu-static")
    plan = plan if grouped is None else grouped_first(plan, grouped)
    dense = dense_plan(place, decoder_shape(resolve_model(model, torch.float32)))
    return plan.model_copy(update={"dense": None if dense is None else DensePlan.model_validate(dense)})


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "unknown"


def _autogroup() -> bool | None:
    """Whether the kernel shares the CPU by session (`sched_autogroup`): then a process's share is its session's,
    one thread or two, and two in flight gain only from cores no other session wants."""
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return None


def _prefill(loaded, ids: list[int], chunk: int, in_flight: int, lanes) -> tuple[float, float, torch.Tensor]:
    """(wall s, process CPU s, the last row's logits) of one prefill of `ids` from an empty cache with `in_flight`
    chunks."""
    from runtime.mlx.spine_generation import last_logits, prefill_forwards

    model = loaded.model
    pieces = [(ids[s:d], rows) for s, d, rows in prefill_forwards(model, len(ids), chunk)]
    start, cpu = time.perf_counter(), time.process_time()
    out = model.forward_in_flight(pieces, model.make_cache(), in_flight, lanes)
    return time.perf_counter() - start, time.process_time() - cpu, last_logits(out).clone()


def chosen_placement(profile: str, model: str, chunk: int, prompt_tokens: int,
                     placement: str = "schedule") -> tuple[Plan, dict]:
    """The plan `placement` chooses on `profile` (a host profile pricing cpu-static and mlx-exact;
    `autotune.searching.host_lanes`), and what it predicts: each lane's busy and idle ms with two chunks in flight,
    the makespan with one and two (predicted). `schedule`: every expert in static groups, the dense functions whose
    two-in-flight schedule ends first; `balanced`: each layer's first k experts in static groups, the others and
    the dense functions the static lane does not take on mlx-exact, the k and functions two in flight speed up
    most."""
    from autotune.costing.schedule import predict_scheduled
    from autotune.profiling.profile import load_profile
    from autotune.searching.host_lanes import host_lanes_balanced, host_lanes_choice, lanes_apart

    shape = decoder_shape(resolve_model(model, torch.float32))
    cost = load_profile(profile, check_host=False).cost_model.with_exact("mlx-exact")
    if placement == "balanced":
        got = host_lanes_balanced(cost, shape, overlap_plan(model, chunk), prompt_tokens, "cpu-static")
        place, grouped, one, two = got.placement, got.grouped, got.one, got.two
    else:
        over = host_lanes_choice(cost, shape, overlap_plan(model, chunk), prompt_tokens, "cpu-static")
        place, grouped, two = over.placement, shape.num_experts, over.schedule
        one = predict_scheduled(lanes_apart(cost, "cpu-static"), shape, prompt_tokens, chunk,
                                over.candidate.experts, place, 1)[1]
    return overlap_plan(model, chunk, place, grouped), {
        "placement": placement, "profile": profile, "static_dense": [f for f in WHOLE_FUNCTIONS if getattr(place, f)],
        "grouped_experts": grouped, "one_in_flight_ms": round(one.makespan_ms, 1), **two.to_json(),
        "speedup": round(one.makespan_ms / two.makespan_ms, 4),
        "label": "predicted by the profile's cost model, its lanes apart (host_lanes)"}


def _overlap_rounds(sides: dict, ids: list[int], chunk: int, repeats: int) -> dict[str, dict]:
    """Each side's prefill with one and with two chunks in flight, `repeats` rounds, every side and both counts
    interleaved in each round, the order alternating (a shared host's load falls on all alike): per side its walls,
    CPU times, last logits, lanes' figures and the first one-at-a-time run's lane events (measured)."""
    from runtime.mlx.overlap import Lanes

    for loaded in sides.values():  # untimed, two chunks of the timed size: first-call costs out of the rounds
        for n in (1, 2):
            _prefill(loaded, ids[:2 * chunk], chunk, n, Lanes())
    got = {name: {"walls": {1: [], 2: []}, "cpus": {1: [], 2: []}, "logits": {}, "lanes": {}, "events": [],
                  "loadavg": []} for name in sides}
    for r in range(repeats):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            into = got[name]
            into["loadavg"].append(_loadavg())
            for n in ((1, 2) if r % 2 == 0 else (2, 1)):
                lanes = Lanes(record=n == 1)
                wall, cpu, into["logits"][n] = _prefill(sides[name], ids, chunk, n, lanes)
                into["walls"][n].append(wall)
                into["cpus"][n].append(cpu)
                into["lanes"][n] = lanes.figures()
                into["events"] = lanes.events if n == 1 and not into["events"] else into["events"]
    return got


def _side_figures(loaded, got: dict, ids: list[int], decode_tokens: int) -> dict:
    """One side's figures from its rounds (`_overlap_rounds`): the prefill's medians, the measured and the predicted
    overlap speedup, the two runs' logits apart, and `generate`'s greedy text under each."""
    steps = steps_from_events(got["events"])
    one, two = (schedule(steps, n).makespan_ms for n in (1, 2))
    texts = {}
    fits = ids[:int(loaded.model.config.max_position_embeddings) - decode_tokens]  # generate refuses past the context
    for n in (1, 2):
        loaded.model.in_flight = n
        texts[n] = generation.generate(loaded, fits, max_tokens=decode_tokens).text
    loaded.model.in_flight = 1
    wall = {n: statistics.median(v) for n, v in got["walls"].items()}
    cpu = {n: statistics.median(v) for n, v in got["cpus"].items()}
    logits = got["logits"]
    return {"prefill_ms": {"one_in_flight": round(wall[1] * 1e3, 1), "two_in_flight": round(wall[2] * 1e3, 1)},
            "prefill_cpu_ms": {"one_in_flight": round(cpu[1] * 1e3, 1), "two_in_flight": round(cpu[2] * 1e3, 1)},
            "cores_used": {"one_in_flight": round(cpu[1] / wall[1], 3), "two_in_flight": round(cpu[2] / wall[2], 3)},
            "overlap_speedup": round(wall[1] / wall[2], 4),
            "overlap_predicted_speedup": round(one / two, 4),
            "overlap_predicted_over_measured": round(one / two / (wall[1] / wall[2]), 4),
            "overlap_max_rel_diff": float((logits[2] - logits[1]).abs().max() / logits[1].abs().max()),
            "greedy_text_equal": texts[1] == texts[2], "greedy_prompt_tokens": len(fits),
            "lanes_ms": {"one_in_flight": got["lanes"][1], "two_in_flight": got["lanes"][2]},
            "rounds": [{"one_in_flight_ms": round(w1 * 1e3, 1), "two_in_flight_ms": round(w2 * 1e3, 1),
                        "cores_used": [round(c1 / w1, 3), round(c2 / w2, 3)], "loadavg": load}
                       for w1, w2, c1, c2, load in zip(*got["walls"].values(), *got["cpus"].values(), got["loadavg"])]}


def measure_overlap(model: str, prompt_tokens: int, repeats: int, chunk: int, decode_tokens: int,
                    static_dense: tuple[str, ...] = (), profile: str | None = None,
                    placements: tuple[str, ...] = ("schedule",)) -> dict:
    """Two chunks in flight against one at a time on each placement (the first's figures at the top level; with
    more than one, `placements` holds each one's and `two_in_flight_ms_over` each one's in-flight wall over the
    first's)."""
    if profile:
        chosen = {p: chosen_placement(profile, model, chunk, prompt_tokens, p) for p in placements}
    else:
        chosen = {"by-hand": (overlap_plan(model, chunk, static_placement(static_dense, chunk, prompt_tokens)), None)}
    sides = {name: generation.load(model, plan, engine="mlx", dtype="float32") for name, (plan, _) in chosen.items()}
    first = next(iter(sides.values()))
    ids = encode_text(first.tokenizer, DEFAULT_EVAL_TEXT, prompt_tokens).tolist()
    load_before = _loadavg()
    rounds = _overlap_rounds(sides, ids, chunk, repeats)
    figures = {}
    for name, loaded in sides.items():
        pred = chosen[name][1]
        figures[name] = {"static_dense": pred["static_dense"] if pred else list(static_dense), "chosen": pred,
                         **_side_figures(loaded, rounds[name], ids, decode_tokens)}
    head = next(iter(figures.values()))
    out = {"model": model, "prompt_tokens": len(ids), "chunk_tokens": chunk, "repeats": repeats,
           "placement": next(iter(figures)), **head, "dtype": "float32", "mlx_device": first.executor.lane,
           "torch_threads": torch.get_num_threads(), "decode_tokens": decode_tokens,
           "loadavg": {"before": load_before, "after": _loadavg()}, "sched_autogroup": _autogroup(),
           "measured": "sides interleaved, median of the rounds: the prefill's wall time to the last chunk's logits; "
                       "overlap_predicted_speedup is predicted (the schedule of the one-at-a-time run's measured "
                       "lane times), chosen's figures predicted by the profile"}
    if len(figures) > 1:
        out["placements"] = figures
        out["two_in_flight_ms_over"] = {name: round(f["prefill_ms"]["two_in_flight"] /
                                                    head["prefill_ms"]["two_in_flight"], 4)
                                        for name, f in figures.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe", help="a model folder mlx-lm loads (default tiny-moe)")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=256, help="the plan's prefill chunk (default 256)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quick", action="store_true", help="a 128-token prompt, 16 new tokens, one round")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--static-dense", default="", metavar="F,..", help="with --overlap: these dense functions (qkv, "
                    "o_proj, attention) on cpu-static too, beside the experts (default: none, the dense half on "
                    "mlx-exact)")
    ap.add_argument("--profile", help="with --overlap: the dense functions on cpu-static are the ones the schedule "
                    "chooses on this host profile (autotune.searching.host_lanes), not --static-dense")
    ap.add_argument("--placement", default="schedule", metavar="P,..", help="with --profile: the placements measured "
                    "side by side, the first's figures at the top level: schedule (every expert grouped, the dense "
                    "functions whose two in flight end first), balanced (the experts grouped and the dense functions "
                    "two in flight speed up most); default schedule")
    ap.add_argument("--overlap", action="store_true", help="two chunks in flight against one at a time (4,096 tokens "
                    "in chunks of 1,024 unless --prompt-tokens / --chunk say otherwise)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.overlap:
        tokens = args.prompt_tokens if "--prompt-tokens" in (argv or sys.argv) else 4096
        chunk = args.chunk if "--chunk" in (argv or sys.argv) else 1024
        repeats = args.repeats if "--repeats" in (argv or sys.argv) else 1
        dense = tuple(f for f in args.static_dense.split(",") if f)
        placements = tuple(dict.fromkeys(p for p in args.placement.split(",") if p))
        if not set(dense) <= set(WHOLE_FUNCTIONS) or (dense and args.profile):
            print("bench_spine: --static-dense takes qkv, o_proj, attention, and not with --profile", file=sys.stderr)
            return 2
        if not placements or not set(placements) <= {"schedule", "balanced"} or \
                (placements != ("schedule",) and not args.profile):
            print("bench_spine: --placement takes schedule, balanced, and needs --profile", file=sys.stderr)
            return 2
        try:
            out = measure_overlap(args.model, tokens, repeats, chunk, args.decode_tokens, dense, args.profile,
                                  placements)
        except NpumoeError as e:  # a profile that cannot be read or prices no mlx-exact
            print(f"bench_spine: {e}", file=sys.stderr)
            return 2
        print(json.dumps(out) if args.json else "\n".join(f"{k}: {v}" for k, v in out.items()))
        return 0
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.repeats, args.chunk = 128, 16, 1, 64
    out = measure(args.model, args.prompt_tokens, args.decode_tokens, args.repeats, args.chunk)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
