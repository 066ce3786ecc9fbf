"""`autotune search --macs N` / `--hosts hosts.json`: a model's plan split across Macs, in steps that
`pipeline.search_across_macs` runs.

The plan is searched as today (`pipeline.search_plan`), once per distinct profile among the hosts; then each layer
is priced under it on each host's profile (its experts under the plan's decision for it, its dense functions where
the plan places them), and the layers are split by those times under each host's memory (`pipeline_split`). Next to
the plan it writes `<plan>.pipeline.json` (the split, the hosts, each stage's predicted time and memory, the link and
the pipelined prefill, all predicted) and `<plan>.stage<k>.json` per stage: the plan its host's profile gave, with
`meta.pipeline` naming the stage's layers and the rank that runs it (mlx-lm's pipeline: rank N-1-k).

hosts.json is MLX's hostfile (`mlx.launch --hostfile`), each host with two optional keys of ours: `profile` (a
file or shipped name; default `--profile`) and `memory_gb` (default `--mac-memory-gb`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from autotune.calibration.traces import load_traces
from autotune.costing.memory import HIDDEN_BUFFERS, RUNTIME_BYTES, ModelSize, model_size
from autotune.costing.pipeline_link import LinkFigure, pipeline_ms
from autotune.costing.stage_prefill import kv_bytes_per_layer, stage_chunk_ms, stage_shape
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, placement_of
from autotune.profiling.profile import load_profile
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import prompts_in
from autotune.searching.pipeline_layouts import choose_layout, sharded_shape, sums_ms
from autotune.searching.pipeline_plan import chunk_links, layer_times
from autotune.searching.pipeline_split import balanced_split
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig
from runtime.coreml import ane_limits
from runtime.errors import NpumoeError
from runtime.loading.compute_dtype import dtype_name
from runtime.mlx.formats import placed_dense
from runtime.plan import Plan, save_plan

GB = 1e9


@dataclass(frozen=True)
class HostSpec:
    """One Mac: its name (the hostfile's `ssh`), its profile and its memory."""
    name: str
    profile: str | None
    memory_gb: float


def read_hosts(path: str | Path, profile: str | None, memory_gb: float) -> list[HostSpec]:
    """The hosts of an MLX hostfile (a list, or {"hosts": [...]}), with our optional `profile` and `memory_gb`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        hosts = data["hosts"] if isinstance(data, dict) else data
        out = [HostSpec(str(h["ssh"]), h.get("profile", profile), float(h.get("memory_gb", memory_gb)))
               for h in hosts]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NpumoeError(f"cannot read the hosts in {path}: {e} (an MLX hostfile: a list of "
                          '{"ssh": ..., "ips": [...]}, each with optional "profile" and "memory_gb")') from None
    if len(out) < 2:
        raise NpumoeError(f"{path} names {len(out)} host; a pipeline needs at least 2")
    return out


def stage_paths(out: Path, stages: int) -> tuple[Path, list[Path]]:
    """The pipeline file and each stage's plan next to the plan `out`."""
    return out.with_suffix(".pipeline.json"), [out.with_suffix(f".stage{k}.json") for k in range(stages)]


@dataclass
class HostPricing:
    """What prices the layers on one host: its cost model, the plan its profile gave and that plan's traces."""
    host: HostSpec
    plan: Plan
    scorer: Scorer
    layers: list[LayerData]
    prompt: int

    def configs(self) -> dict[int, LayerConfig]:
        """The plan's decision for each MoE layer (as the search wrote them in `meta.decisions`)."""
        decisions = (self.plan.meta or {}).get("decisions") or []
        return {layer: LayerConfig(**{**d, "quantiles": tuple(d["quantiles"])})
                for layer, d in zip(self.plan.model.moe_layers, decisions)}

    def layer_ms(self, shape: DecoderShape) -> list[float]:
        return layer_times(self.scorer.cost, self.scorer, shape, self.layers, self.prompt, self.configs(),
                           placement_of(self.plan.dense))

    def slice_ms(self, shape: DecoderShape, n: int) -> list[float]:
        """This host's rank of the tensor layout (`pipeline_layouts`): every layer sliced 1/n, the plan's decisions
        on its slice of each expert, the dense half on the exact path (the spine splices no sliced projection)."""
        part = sharded_shape(shape, n)
        scorer = Scorer(self.scorer.cost, shape.hidden, part.expert_ffn, self.scorer.backend, float("inf"))
        configs = self.configs()
        experts = sum(scorer.score(d, configs.get(d.layer, LayerConfig(0))).latency_ms
                      for d in self.layers) / prompts_in(self.layers, self.prompt)
        return stage_chunk_ms(self.scorer.cost, part, self.prompt, self.plan.chunk_tokens, experts,
                              DensePlacement(host=scorer.exact), logits=True)

    def stage_ms(self, shape: DecoderShape, first: int, last: int, final: bool) -> list[float]:
        configs = self.configs()
        experts = sum(self.scorer.score(d, configs.get(d.layer, LayerConfig(0))).latency_ms for d in self.layers
                      if first <= d.layer < last) / prompts_in(self.layers, self.prompt)
        return stage_chunk_ms(self.scorer.cost, stage_shape(shape, first, last), self.prompt, self.plan.chunk_tokens,
                              experts, placement_of(self.plan.dense), logits=final)


def pricing(host: HostSpec, plan: Plan, record, traces_path: str | Path, backend: str) -> HostPricing:
    prof = load_profile(host.profile) if host.profile else load_profile("host")
    cost, _ = prof.cost_model_for(model_size(record).layer_bytes, dtype_name(record.compute_dtype))
    prompt = int((plan.meta or {}).get("prompt_tokens") or plan.chunk_tokens)
    layers = LayerData.from_traces(load_traces(traces_path), plan.chunk_tokens, prompt)
    scorer = Scorer(cost, record.spec.hidden_size, record.spec.expert_ffn_size, backend, float("inf"))
    return HostPricing(host, plan, scorer, layers, prompt)


def split_hosts(layer_ms: list[list[float]], hosts: list[HostSpec], shape: DecoderShape, size: ModelSize,
                prompt: int, chunk: int) -> list[tuple[int, int]]:
    """The split by each layer's time on each host, its weights and KV cache within each host's memory."""
    per_layer = [size.layer_bytes + kv_bytes_per_layer(shape, prompt) for _ in range(shape.num_layers)]
    fixed = (2 * shape.vocab * shape.hidden * size.dtype_bytes + RUNTIME_BYTES
             + HIDDEN_BUFFERS * chunk * shape.hidden * 4 + ane_limits.WINDOW_BYTES)
    return balanced_split(layer_ms, per_layer, [fixed] * len(hosts), [h.memory_gb * GB for h in hosts])


def pipeline_json(prices: list[HostPricing], shape: DecoderShape, split: list[tuple[int, int]], link: LinkFigure,
                  stage_files: list[Path]) -> dict:
    n, prompt, chunk = len(prices), prices[0].prompt, prices[0].plan.chunk_tokens
    ms = [p.stage_ms(shape, a, b, k == n - 1) for k, (p, (a, b)) in enumerate(zip(prices, split))]
    links = chunk_links(link, prompt, chunk, shape.hidden)
    whole = pipeline_ms(ms, links)
    layouts = {"pipeline": {"prefill_ms": whole}, **tensor_json(prices, shape, link)}
    return {"schema": "npumoe.pipeline/1", "layout": choose_layout({k: v["prefill_ms"] for k, v in layouts.items()}),
            "layouts": layouts, "split": [list(s) for s in split],
            "stages": [{"stage": k, "rank": n - 1 - k, "host": p.host.name, "profile": p.host.profile,
                        "layers": [a, b], "plan": str(f), "predicted_stage_ms": sum(m), "memory_gb": p.host.memory_gb}
                       for k, (p, (a, b), f, m) in enumerate(zip(prices, split, stage_files, ms))],
            "link": {**link.to_json(), "ms_per_boundary_per_chunk": links},
            "predicted": {"label": "predicted by each host's profile and the link's figure", "prompt_tokens": prompt,
                          "chunk_tokens": chunk, "prefill_ms": whole,
                          "efficiency": sum(map(sum, ms)) / n / whole}}


def tensor_json(prices: list[HostPricing], shape: DecoderShape, link: LinkFigure) -> dict:
    """The tensor layout's price, where the runtime can run it: widths that divide over the hosts (mlx-lm's
    `shard()`) and plans that place no dense function (the spine splices whole projections); each rank the plan
    of its host (stage k's file: the host of rank N-1-k), a chunk at the slowest rank's pace, then its sums."""
    n, prompt, chunk = len(prices), prices[0].prompt, prices[0].plan.chunk_tokens
    widths = (shape.heads, shape.kv_heads, shape.expert_ffn, shape.shared_ffn, shape.dense_ffn)
    if any(w % n for w in widths) or any(placed_dense(p.plan) for p in prices):
        return {}
    compute = sum(map(max, zip(*(p.slice_ms(shape, n) for p in prices))))
    sums = sum(sums_ms(link, n, shape, prompt, chunk))
    return {"tensor": {"prefill_ms": compute + sums, "compute_ms": compute, "all_sum_ms": sums}}


def write_stages(plans: list[Plan], hosts: list[HostSpec], split: list[tuple[int, int]], files: list[Path]) -> None:
    n = len(split)
    for k, (plan, host, (a, b), path) in enumerate(zip(plans, hosts, split, files)):
        meta = {**(plan.meta or {}), "pipeline": {"stage": k, "of": n, "layers": [a, b], "rank": n - 1 - k,
                                                  "host": host.name}}
        save_plan(plan.model_copy(update={"meta": meta}), path)
