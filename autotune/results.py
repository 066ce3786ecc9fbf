"""What the library functions return, typed: `run_plan` (`RunResult`), `evaluate` (`EvaluateResult`),
`evaluate_tasks` (`TasksResult`) and `search_plan`'s report (`SearchReport`). Each `to_json()` is exactly what its
command's `--json` prints (the keys, in their order, are a contract scripts read)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


def _fields(obj: object, skip_none: tuple[str, ...] = ()) -> dict:
    """The dataclass's fields in order, those in `skip_none` left out when None (keys a run has only sometimes)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)
            if not (f.name in skip_none and getattr(obj, f.name) is None)}


@dataclass
class RunResult:
    """A plan's measured prefill (`autotune run --json`); every figure measured unless its key says predicted."""
    model: str
    plan: str
    text: str
    tokens: int
    chunk_tokens: int
    overflow: str
    latency_ms: float  # median wall time of the planned prefill
    wall_ms_per_token: float
    cpu_ms_per_token: float  # process CPU time (every thread) per token
    stats: dict  # the executor's run statistics (`runtime.stats.RunStats.to_json`), top-level keys in the JSON
    backend_fallbacks: dict[str, str]
    drift: dict
    memory: dict  # measured peak RSS against the predicted memory of this run
    plan_predicted: dict | None  # what the plan's search predicted, to set beside the measurements
    reference_latency_ms: float | None = None  # with `reference`
    max_rel_diff_vs_reference: float | None = None  # with `reference`
    energy_per_backend: dict | None = None  # backends that measure their calls
    traces: dict | None = None  # with `record_traces`
    measured_parts_ms: dict | None = None  # ms per part: the median of `repeat` more planned prefills (run_parts)
    predicted_parts_ms: dict | None = None  # the whole-prefill prediction by part for the plan's profile
    host_speed: dict | None = None  # this host now against its profile's records (evaluation.host_speed)
    dense_calls: dict | None = None  # a plan with dense functions: calls per part and backend (DenseExecutor)
    engine: str = "torch"  # the spine that ran it (runtime.engines)
    executed: dict | None = None  # per part, the lanes that ran it: calls and measured ms (runtime.stats.Executed)
    priced: dict | None = None  # per part, the lanes the plan prices it on (runtime.priced_lanes)
    priced_stand_ins: dict | None = None  # the backends `priced` names by their stand-ins here (ane -> ane-sim)
    off_priced: list | None = None  # the parts executed on a lane the plan does not price them on ([]: as priced)
    cluster: dict | None = None  # under mlx.launch: this rank's `rank`, `ranks` and `layers` ([first, last))

    @property
    def drop_rate(self) -> float:
        return self.stats["drop_rate"]

    def to_json(self) -> dict:
        out = {k: getattr(self, k) for k in ("model", "plan", "text", "tokens", "chunk_tokens", "overflow")}
        if self.reference_latency_ms is not None:
            out["reference_latency_ms"] = self.reference_latency_ms
        out.update(latency_ms=self.latency_ms, wall_ms_per_token=self.wall_ms_per_token,
                   cpu_ms_per_token=self.cpu_ms_per_token, **self.stats, backend_fallbacks=self.backend_fallbacks,
                   drift=self.drift)
        for k in ("energy_per_backend", "traces", "max_rel_diff_vs_reference", "dense_calls"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out.update(self.cluster or {})
        out.update(memory=self.memory, plan_predicted=self.plan_predicted)
        for k in ("measured_parts_ms", "predicted_parts_ms", "host_speed"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        out["engine"] = self.engine  # added after the recorded keys, as scripts read them
        for k in ("executed", "priced", "priced_stand_ins", "off_priced"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


@dataclass
class EvaluateResult:
    """A plan's fidelity against the unmodified model on a text, measured (`autotune evaluate --json`)."""
    model: str
    plan: str
    text: str
    tokens: int
    prompts: int
    ppl_reference: float
    ppl_plan: float
    ppl_delta_rel: float  # ppl_plan / ppl_reference - 1
    top1_agreement: float
    kl_mean: float
    max_rel_diff_vs_reference: float
    drop_rate: float
    spill_rate: float
    padding_fraction: float
    assignments: int
    tokens_per_backend: dict[str, int]
    calls_per_backend: dict[str, int]
    backend_fallbacks: dict[str, str]
    drop_budget: float | None = None  # the plan's, where it has one
    drop_rate_within_1_5x_budget: bool | None = None
    engine: str = "torch"  # the spine that ran it (runtime.engines): added after the recorded keys
    # under mlx.launch: this rank's `rank`, `ranks` and `layers` ([first, last)), whose experts its rates count
    cluster: dict | None = None

    def to_json(self) -> dict:
        out = _fields(self, ("drop_budget", "drop_rate_within_1_5x_budget"))
        return {**out, **(out.pop("cluster") or {})}


@dataclass
class TasksResult:
    """lm-evaluation-harness tasks on the plan and the unmodified model, paired (`evaluate --tasks --json`)."""
    model: str
    plan: str
    limit: int | None
    num_fewshot: int | None
    tasks: dict[str, dict]  # per task: accuracy_reference, accuracy_plan, delta, stderr, n
    metric: str
    drop_rate: float
    spill_rate: float
    calls_per_backend: dict[str, int]
    tokens_per_backend: dict[str, int]
    backend_fallbacks: dict[str, str]

    def to_json(self) -> dict:
        return _fields(self)


@dataclass
class SearchReport:
    """A search's report (`autotune search --json`, the plan's .report.json): latency and energy per calibration
    chunk over all MoE layers and CPU time per token, predicted by the profile's cost model; drop rates on
    held-out traces; `gate` measured."""
    predicted_latency_ms: float
    predicted_energy_mj: float | None
    heldout_drop_rate: float
    figures: str
    baselines: dict[str, float]
    baseline_details: dict[str, dict]
    speedup_vs: dict[str, float | None]  # None where the plan's is 0
    energy_ratio_vs: dict[str, float | None] | None
    gap_vs_exact: float | None
    exact_layers: int
    trials: int
    search_seconds: float
    pareto_front: list[dict]
    plan: str
    profile: str
    static_backend: str
    traces: str
    objective: str
    drop_budget: float
    chunk_tokens: int
    prompt_tokens: int
    chunks_searched: list[int]
    compress_allowed: list[str]
    compress: dict[str, int]
    partial_chunks: str
    memory_gb: float | None
    packing_measured: bool
    predicted_cpu_ms_per_token: float | None
    cpu_ratio_vs: dict[str, float | None]
    robustness: dict
    gate: dict | None
    predicted_memory: dict
    explanation: list[str] = field(default_factory=list)
    # the whole prefill of one prompt (every op, predicted; absent where the model's decoder shape is unknown)
    predicted_prefill_ms: float | None = None
    predicted_parts_ms: dict[str, float] | None = None
    whole_prefill: dict | None = None
    cpu_weights: dict | None = None  # how the CPU holds the experts, and why (searching/cpu_choice.py)
    # per part of the prefill, the axes its prices reach past the profile's records (`costing.fit_range.Reach`)
    priced_outside: dict | None = None
    measure: dict | None = None  # the candidates timed here (`search --measure`: autotune/measuring/measure.py)

    def to_json(self) -> dict:
        # `measure` stays when null: scripts read it, and null says the search measured nothing
        return _fields(self, skip_none=("predicted_prefill_ms", "predicted_parts_ms", "whole_prefill",
                                         "priced_outside"))
