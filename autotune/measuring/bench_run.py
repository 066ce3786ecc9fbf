"""`autotune bench`: a plan measured on this machine against what a user would run instead, side by side in
one run (`side_by_side.time_sides`): mlx-lm's own forward of the same folder (where MLX runs), transformers' forward
in torch, and the all-exact plan of the plan's engine, each on the same torch threads. Per side: the whole prefill of
each prompt (measured, and predicted by the plan's profile where its cost model prices the side: `predicted`), each part
from `executed` (the plans' timed pass), decode tokens/s and the prefill's peak memory; `vs` each baseline over the
plan. Lanes this host only simulates (`ane-sim`) are named, never reported as a device's speed."""
from __future__ import annotations

import os
import statistics
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from autotune.calibration.texts import DEFAULT_EVAL_TEXT
from autotune.calibration.workload import encode_text
from autotune.costing.memory import model_size
from autotune.costing.whole_prefill import decoder_shape
from autotune.evaluation.run_parts import Routing, measure_parts, plan_profile, recorded_routing
from autotune.measuring.predicted import all_exact, predict_side
from autotune.measuring.side_by_side import (
    Side,
    Timed,
    clock_for,
    mlx_lm_side,
    plan_side,
    prefill_prompt,
    time_decode,
    time_sides,
    unmodified_side,
)
from autotune.run_stage import torch_executed
from autotune.searching.templates import template_plan
from runtime.engines import mlx_importable, places_on_mlx, resolve_engine, torch_only
from runtime.errors import NpumoeError
from runtime.generation import Loaded, load
from runtime.loading.compute_dtype import dtype_name
from runtime.loading.model_record import check_context, resolve_model
from runtime.mlx.formats import NAME as MLX_EXACT
from runtime.plan import Plan, load_plan
from runtime.resources import peak_rss_bytes
from runtime.stats import TORCH_CPU

GB = 1 << 30
PLAN, ALL_EXACT, MLX_LM, TRANSFORMERS = "plan", "all-exact", "mlx-lm", "transformers"
LABELS = {PLAN: "the plan", ALL_EXACT: "every expert on the plan's exact path, no static function (same engine)",
          MLX_LM: "mlx-lm's own forward of the same folder (generate_step, the plan's chunk as its prefill step)",
          TRANSFORMERS: "transformers' forward in torch (the model as loaded, no plan)"}
DEFAULT_PROMPT_TOKENS = 1024  # where the plan does not say what prompt it was searched for


@dataclass
class BenchConfig:
    """What `autotune bench` measures (its options)."""
    model: str
    plan: str
    dtype: str = "auto"
    engine: str = "auto"
    threads: int = 1
    prompt_tokens: int | None = None
    prompts: int = 1
    repeats: int = 3
    decode_tokens: int = 32
    text: str = DEFAULT_EVAL_TEXT


@dataclass
class Sides:
    """The sides loaded for one bench: each side, the plans among them, what each side runs on (`loaded`: a
    baseline may share the all-exact side's model, with the plan uninstalled) and the baselines left out, with why."""
    engine: str
    sides: list[Side] = field(default_factory=list)
    plans: dict[str, Plan] = field(default_factory=dict)
    loaded: dict[str, Loaded] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)


def bench_engine(engine: str, plan: Plan) -> str:
    """The spine the plan runs on: `auto` is the MLX spine wherever mlx imports and the plan places anything on MLX
    (on any OS: MLX's CPU device off a Mac), else torch; an explicit engine as `runtime.engines` resolves it."""
    if engine == "auto":
        mlx = mlx_importable() and places_on_mlx(plan) and torch_only(plan) is None
        return "mlx" if mlx else "torch"
    return resolve_engine(engine, plan, torch_only(plan))


def load_sides(c: BenchConfig, plan: Plan, engine: str) -> Sides:
    """The plan, the all-exact plan of its engine, transformers' forward and (where MLX loads the folder) mlx-lm's,
    each loaded once; a baseline this host cannot run is left out, saying why."""
    out = Sides(engine)
    chunk = plan.chunk_tokens
    exact = template_plan(plan.model, chunk_tokens=chunk, exact=plan.exact, grouped=False)
    out.loaded[PLAN] = load(c.model, plan, dtype=c.dtype, engine=engine)
    out.loaded[ALL_EXACT] = load(c.model, exact, dtype=c.dtype, engine=engine)
    out.sides += [plan_side(PLAN, out.loaded[PLAN]), plan_side(ALL_EXACT, out.loaded[ALL_EXACT])]
    out.plans.update({PLAN: plan, ALL_EXACT: exact})
    if engine == "mlx":
        out.loaded[MLX_LM] = out.loaded[ALL_EXACT]  # mlx-lm's model as it loads: the plan uninstalled
    elif not mlx_importable():
        out.left_out[MLX_LM] = "mlx-lm is not installed (pip install mlx-lm)"
    else:
        try:
            out.loaded[MLX_LM] = load(c.model, None, dtype=c.dtype, engine="mlx")
        except NpumoeError as e:
            out.left_out[MLX_LM] = str(e)
    if MLX_LM in out.loaded:
        out.sides.append(mlx_lm_side(MLX_LM, out.loaded[MLX_LM], chunk))
    out.loaded[TRANSFORMERS] = out.loaded[ALL_EXACT] if engine == "torch" else load(c.model, None, dtype=c.dtype,
                                                                                    engine="torch")
    out.sides.append(unmodified_side(TRANSFORMERS, out.loaded[TRANSFORMERS], chunk))
    return out


def bench_prompts(loaded: Loaded, c: BenchConfig, prompt_tokens: int) -> list[list[int]]:
    """`c.prompts` prompts of `prompt_tokens` tokens each, from the text; a text too short is refused."""
    ids = encode_text(loaded.tokenizer, c.text, prompt_tokens * c.prompts).tolist()
    if len(ids) < prompt_tokens * c.prompts:
        raise NpumoeError(f"--text {c.text!r} holds {len(ids)} tokens, fewer than --prompts {c.prompts} x "
                          f"--prompt-tokens {prompt_tokens}; give a longer text or fewer tokens")
    return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(c.prompts)]


def run_bench(c: BenchConfig, progress: bool = True) -> dict:
    """The bench's report (see the module docstring; `autotune bench --json` prints it)."""
    from tqdm import tqdm

    plan = load_plan(c.plan)
    engine = bench_engine(c.engine, plan)
    record = resolve_model(c.model, c.dtype)
    prompt_tokens = c.prompt_tokens or int((plan.meta or {}).get("prompt_tokens") or DEFAULT_PROMPT_TOKENS)
    check_context(c.model, record.context, prompt_tokens)
    torch.set_num_threads(c.threads)
    loaded = load_sides(c, plan, engine)
    prompts = bench_prompts(loaded.loaded[PLAN], c, prompt_tokens)
    memory: dict[str, dict] = {}
    with tqdm(total=c.repeats * len(prompts) * len(loaded.sides), desc="bench: prefills", unit="prefill",
              disable=not progress) as bar:
        timed = time_sides(loaded.sides, prompts, c.repeats, progress=bar.update,
                           warm=lambda side, ids: memory.setdefault(side.name, prefill_memory(side, ids)))
    decode_ids = decode_prompt(prompts[0], record.context, c.decode_tokens)
    decode = time_decode(loaded.sides, decode_ids, c.decode_tokens, c.repeats) if c.decode_tokens > 1 else {}
    parts = {name: executed_parts(loaded.loaded[name], prompts[0]) for name in (PLAN, ALL_EXACT)}
    routing = transformers_routing(loaded, prompts, plan.chunk_tokens)
    predicted = predictions(c, record, loaded, routing, prompt_tokens, len(prompts))
    out = report(c, plan, loaded, timed, decode, memory, parts, predicted, prompt_tokens)
    return out | {"decode_prompt_tokens": len(decode_ids)}


def decode_prompt(ids: list[int], context: int | None, tokens: int) -> list[int]:
    """The prompt decode is timed after: the first prompt, cut where the new tokens would pass the context."""
    return ids if context is None else ids[:max(1, min(len(ids), context - tokens))]


def executed_parts(loaded: Loaded, ids: list[int]) -> dict:
    """One more prefill of `ids` under the side's plan, each part timed where it ran (`executed`: per part, per
    lane, calls and ms; the MLX spine's timed pass, the torch spine's part hooks), wall clock."""

    chunk = loaded.plan.chunk_tokens
    loaded.reset()
    if loaded.engine == "mlx":
        with loaded.executor.timed():
            prefill_prompt(loaded, ids, chunk)
        return loaded.executor.executed().to_json()
    calls: dict = {}
    measured, _ = measure_parts(loaded.model, lambda: prefill_prompt(loaded, ids, chunk), False, chunk, 1, calls)
    dense = loaded.executor.dense.to_json() if loaded.executor.dense is not None else None
    return torch_executed(loaded.executor.stats.total(), measured, calls, dense)


def transformers_routing(loaded: Sides, prompts: list[list[int]], chunk: int) -> Routing:
    """Each MoE layer's assignments per expert in each chunk of the prompts, as transformers' forward routes them:
    what every side's experts are priced from (their routing is the same model's)."""
    side = next(s for s in loaded.sides if s.name == TRANSFORMERS)
    with recorded_routing(loaded.loaded[TRANSFORMERS].model, chunk) as routing:
        for ids in prompts:
            side.prefill(ids)
    return routing


def predictions(c: BenchConfig, record, loaded: Sides, routing: Routing, prompt_tokens: int,
                prompts: int) -> dict[str, dict | None]:
    """Each side's predicted whole prefill of one prompt by the plan's profile (None without that profile, or where
    its cost model prices no lane the side runs on)."""
    profile = plan_profile(loaded.plans[PLAN])
    if profile is None:
        return {s.name: None for s in loaded.sides}
    cost, cache_state = profile.cost_model_for(model_size(record).layer_bytes, dtype_name(record.compute_dtype))
    shape = decoder_shape(record)
    spec = loaded.plans[PLAN].model
    chunk = loaded.plans[PLAN].chunk_tokens
    as_plans = {**{name: (p, loaded.engine) for name, p in loaded.plans.items()},
                MLX_LM: (template_plan(spec, chunk_tokens=chunk, exact=MLX_EXACT, grouped=False), "mlx"),
                TRANSFORMERS: (template_plan(spec, chunk_tokens=chunk, grouped=False), "torch")}
    out: dict[str, dict | None] = {}
    for side in loaded.sides:
        pred = predict_side(cost, *as_plans[side.name], shape, routing, prompt_tokens, prompts)
        out[side.name] = None if pred is None else {
            "predicted_prefill_ms": round(pred.latency_ms, 3),
            "predicted_parts_ms": {k: round(v, 3) for k, v in pred.parts_ms.items()},
            "label": f"predicted by the cost model of profile {loaded.plans[PLAN].meta['profile']} ({cache_state}; "
                     "experts priced from transformers' routing of these prompts)"}
    return out


def _rss_now() -> int | None:
    """This process's resident set now (Linux: /proc), None where the OS does not say."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextmanager
def _sampled_peak(every_s: float = 0.002) -> Iterator[Callable[[], int]]:
    """The highest resident set seen while the block runs (a sampling thread; without /proc: the process's peak)."""
    peak, done = [_rss_now() or 0], threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            peak[0] = max(peak[0], _rss_now() or 0)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        yield lambda: peak[0] if _rss_now() is not None else peak_rss_bytes()
    finally:
        done.set()
        t.join()


def prefill_memory(side: Side, ids: list[int]) -> dict:
    """The side's first prefill of one prompt (its warm-up, untimed): the process's resident set at its peak, and
    how far it rose over the resident set before (every side is loaded in this one process, so the whole is
    shared)."""
    before = _rss_now() or peak_rss_bytes()
    with _sampled_peak() as peak:
        side.prefill(ids)
    high = peak()
    return {"peak_rss_gb": round(high / GB, 4), "prefill_rise_gb": round(max(0, high - before) / GB, 4)}


def _summed(executed: dict | None) -> dict | None:
    """`executed`'s ms per part, its lanes summed (None where a part's time was not measured)."""
    if not executed:
        return None
    return {part: round(sum(v.get("ms") or 0.0 for v in lanes.values()), 3) for part, lanes in executed.items()}


def lanes_here(loaded: Sides, parts: dict[str, dict]) -> dict:
    """The lanes the sides ran on and which are real on this machine: the plans' from `executed`, the baselines'
    own (transformers on torch's CPU kernels; mlx-lm on MLX's device); a backend this host lacks ran through its
    fallback (`ane` as `ane-sim`: the ANE's numerics on the CPU, timed as a simulator, never as the device)."""
    real = {lane for ex in parts.values() for lanes in (ex or {}).values() for lane in lanes}
    real.add(TORCH_CPU)
    if MLX_LM in loaded.loaded:
        from runtime.mlx.spine import dense_lane

        real.add(dense_lane())
    simulated = sorted({f for s in loaded.sides for f in s.simulated})
    return {"real": sorted(real - {f.split(" -> ")[1] for f in simulated}), "simulated": simulated,
            "note": "every side ran on this machine and was timed; a simulated lane's time is the simulator's, not "
                    "the device's" if simulated else "every lane timed here is real on this machine"}


def is_plan(name: str, plan: Plan, engine: str) -> bool:
    """Whether the written plan is that baseline itself: every expert on the exact path of the baseline's engine,
    no static function (mlx-lm's: on the MLX spine on mlx-exact; transformers': on torch on cpu-exact)."""
    same = all_exact(plan)
    return {ALL_EXACT: same, MLX_LM: same and engine == "mlx" and plan.exact_path == MLX_EXACT,
            TRANSFORMERS: same and engine == "torch" and plan.exact_path == "cpu-exact"}.get(name, False)


def _ratio(side: float | None, plan: float | None) -> float | None:
    return None if side is None or not plan else round(side / plan, 4)


def paired_ratio(side_runs: list[list[float]], plan_runs: list[list[float]]) -> float | None:
    """The side's prefill over the plan's: the median, over every prompt and round, of the two runs of that round
    (each round runs every side once, close in time). A shared host's load drifts between rounds; the ratio of two
    separate medians takes each side's from other rounds, and read identical plans 0.94-0.97 here."""
    ratios = [s / p for side, mine in zip(side_runs, plan_runs) for s, p in zip(side, mine) if p > 0]
    return round(statistics.median(ratios), 4) if ratios else None


def versus(side: dict, plan: dict, same: bool) -> dict:
    """A baseline over the plan: measured (`paired_ratio` of the rounds), predicted, decode. Where either ran a lane
    through a simulator here, the measured ratio is the simulator's (`latency_through_simulator`), never a device's:
    `latency` is None."""
    measured = paired_ratio(side["prefill"]["runs_ms"], plan["prefill"]["runs_ms"])
    simulated = sorted({*side["prefill"]["simulated"], *plan["prefill"]["simulated"]})
    out = {"latency": None if simulated else measured,
           "predicted_latency": _ratio(side["predicted_prefill_ms"], plan["predicted_prefill_ms"]),
           "decode": _ratio(plan["decode_tok_s"], side["decode_tok_s"]), "is_plan": same}
    return out | ({"simulated": simulated, "latency_through_simulator": measured} if simulated else {})


def report(c: BenchConfig, plan: Plan, loaded: Sides, timed: dict[str, Timed], decode: dict, memory: dict,
           parts: dict, predicted: dict, prompt_tokens: int) -> dict:
    """The bench's JSON: each side measured beside predicted, and `vs` each baseline over the plan."""
    clock = clock_for(c.threads)
    sides = {}
    for s in loaded.sides:
        pred = predicted.get(s.name)
        sides[s.name] = {"label": LABELS[s.name], "measured_prefill_ms": round(timed[s.name].whole_ms(clock), 3),
                         "predicted_prefill_ms": pred["predicted_prefill_ms"] if pred else None,
                         "prefill": timed[s.name].to_json(clock), "predicted": pred,
                         "measured_parts_ms": _summed(parts.get(s.name)), "executed": parts.get(s.name),
                         "decode_tok_s": None if decode.get(s.name) is None else round(decode[s.name], 3),
                         "memory": memory[s.name]}
    mine = sides[PLAN]
    own = plan.predicted or {}
    mine["search_predicted"] = {k: own.get(k) for k in ("predicted_prefill_ms", "label")} | {
        "prompt_tokens": (plan.meta or {}).get("prompt_tokens"),
        "memory_gb": (own.get("memory") or {}).get("total_gb")} if own else None
    vs = {name: versus(s, mine, is_plan(name, plan, loaded.engine)) for name, s in sides.items() if name != PLAN}
    return {"model": c.model, "plan": str(c.plan), "engine": loaded.engine, "dtype": c.dtype, "threads": c.threads,
            "prompt_tokens": prompt_tokens, "prompts": c.prompts, "repeats": c.repeats,
            "decode_tokens": c.decode_tokens, "chunk_tokens": plan.chunk_tokens, "clock": clock,
            "lanes": lanes_here(loaded, parts), "sides": sides, "vs": vs, "left_out": loaded.left_out,
            "measured": f"sides interleaved, {c.repeats} rounds, each prompt's median on the {clock} clock "
                        f"({'process CPU time: one-thread work' if clock == 'cpu' else 'wall'}); `vs[side].latency`: "
                        "the side's measured prefill over the plan's, the median of each round's pair (> 1: the plan "
                        "is faster), `decode`: the plan's decode tokens/s over the side's"}


def plot_bench(out: dict, path: str | os.PathLike) -> None:
    """Each side's whole prefill, measured beside predicted (a PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(out["sides"])
    measured = [out["sides"][n]["measured_prefill_ms"] / 1e3 for n in names]
    predicted = [(out["sides"][n]["predicted_prefill_ms"] or 0.0) / 1e3 for n in names]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], measured, 0.4, label=f"measured ({out['clock']} clock)", color="tab:blue")
    ax.bar([i + 0.2 for i in x], predicted, 0.4, label="predicted (the plan's profile)", color="0.7")
    for i, n in enumerate(names):
        ratio = (out["vs"].get(n) or {}).get("latency")
        if ratio is not None:
            ax.annotate(f"{ratio:.2f}x", (i - 0.2, measured[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), names)
    ax.set_ylabel(f"whole prefill of {out['prompt_tokens']} tokens (s)")
    ax.set_title(f"{os.path.basename(str(out['model']))}: the plan against what a user runs instead "
                 f"({out['engine']} spine, {out['threads']} thread(s))", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
