"""The report of a plan per Mac: the split, each stage's plan and memory against its Mac's budget, the link, the
pipelined prefill, the other layouts (`pipeline_layouts`), and the same Macs running mlx-lm's pipeline on the GPU
alone and its `shard()`. Every figure is predicted.

- `layouts`: each layout's prefill (`pipeline`; `tensor` and `expert` where priced: their work, their sums and each
  rank's plan and memory); `layout`: the fastest, whose prefill is `predicted_prefill_ms`.
- `pipeline_prefill_ms`: the prompt's chunks overlapping across stages (`pipeline_link.pipeline_ms`);
  `sequential_ms`: the same stages with no overlap.
- `one_stage_ms`: one stage's worth of work, the stages' work over the number of Macs (what each Mac would do were the
  work split evenly and the chunks overlapping with no fill or drain); `efficiency` is it over the prefill.
  `busiest_stage_ms`: the slowest stage's own work, the floor no overlap can pass.
- `mlx_gpu_pipeline`: mlx-lm's pipeline (its even split, every op on each Mac's GPU), its chunks overlapping the same
  way (each rank sends a chunk's hidden states on and starts the next), at the pipeline's chunk size, at mlx-lm's
  2048-token prefill step and at the chosen layout's chunk size (`-chunk<c>`, where it is another); `vs`: its
  prefill over the chosen layout's.
- `mlx_gpu_sharded`: the other mode mlx-lm runs across Macs, priced against the pipeline before anything is built
  for it: `shard()` (tensor parallel), every rank a 1/N slice of every attention head group and every expert on its
  GPU, and two `all_sum`s of `chunk x hidden` per layer per chunk over the link (a ring all-reduce moves 2(N-1)/N of
  the bytes each way), on the critical path; the embedding, router and `lm_head` whole on every rank; at the same
  chunk sizes as `mlx_gpu_pipeline`. The `tensor` layout is the same slices and sums with our plan on each slice.
"""
from __future__ import annotations

from autotune.costing.pipeline_link import LinkFigure, pipeline_ms, sequential_ms
from autotune.costing.stage_prefill import stage_chunk_ms, stage_memory, stage_shape
from autotune.costing.whole_prefill import DecoderShape, DensePlacement
from autotune.searching.layer_data import LayerData
from autotune.searching.objective import prompts_in
from autotune.searching.optimizer import Solution
from autotune.searching.pipeline_layouts import LayoutOutcome, choose_layout, sharded_shape, sums_ms
from autotune.searching.pipeline_plan import (
    MLX_LM_PREFILL_STEP,
    Mac,
    PipelineOutcome,
    Stage,
    StageSearch,
    chunk_links,
    stage_ms,
    static_backend,
)
from autotune.searching.pipeline_split import even_split
from autotune.searching.prefill_report import placement_json
from autotune.searching.scoring import Scorer
from autotune.searching.space import LayerConfig
from runtime.coreml import ane_limits


def ane_bytes(stage: Stage, sol: Solution, place: DensePlacement) -> float:
    """What the stage's plan keeps on the ANE: its resident experts as each layer stores them and its dense
    functions' matrices in fp16."""
    h, ffn = stage.shape.hidden, stage.shape.expert_ffn
    experts = sum(c.resident * ane_limits.expert_weight_bytes(h, ffn, c.compress) for c in sol.configs)
    q, kv = stage.shape.heads * stage.shape.head_dim, stage.shape.kv_heads * stage.shape.head_dim
    fp16 = ane_limits.BYTES_PER_WEIGHT["none"]
    per_layer = sum(w for on, w in ((place.qkv, h * (q + 2 * kv)), (place.o_proj, q * h)) if on)
    mlp = sum(3 * h * stage.shape.mlp_ffn(i) for i in range(stage.shape.num_layers)) if place.mlp else 0
    return experts + fp16 * (per_layer * stage.shape.num_layers + mlp)


def stage_json(stage: Stage, shape: DecoderShape, prompt: int, chunk: int, last: bool) -> dict:
    sol, place = stage.at(chunk)
    ms = stage_ms(stage, prompt, chunk, last)
    memory = stage_memory(shape, stage.first, stage.last, prompt, chunk, ane_bytes(stage, sol, place))
    resident = sum(c.resident for c in sol.configs)
    compress = {k: sum(1 for c in sol.configs if c.resident and c.compress == k) for k in {c.compress for c in
                                                                                          sol.configs}}
    return {"mac": stage.mac.name, "layers": [stage.first, stage.last], "num_layers": stage.last - stage.first,
            "predicted_stage_ms": sum(ms), "chunk_ms": ms,
            "plan": {"chunk_tokens": chunk, "static_backend": stage.scorer.backend,
                     "resident_experts": resident, "experts": len(sol.configs) * shape.num_experts,
                     "layers_with_residents": sum(1 for c in sol.configs if c.resident),
                     "compress_layers": {k: v for k, v in compress.items() if v},
                     "experts_ms": sol.latency_ms / prompts_in(stage.outcome.chunks[chunk].layers, prompt),
                     "heldout_drops": sol.heldout_drops,
                     "dense_placement": placement_json(place, prompt, chunk)},
            "ane_budget_gb": round(stage.ane_budget / 1e9, 3),
            "memory": memory.to_json(), "budget_gb": stage.mac.budget_bytes / 1e9,
            "within_budget": memory.total <= stage.mac.budget_bytes}


def gpu_stage_ms(mac: Mac, shape: DecoderShape, layers: list[LayerData], prompt: int, first: int, last: int,
                 final: bool) -> list[float]:
    """One stage as mlx-lm runs it: every expert and every dense op on the Mac's GPU (the exact path)."""
    scorer = Scorer(mac.cost, shape.hidden, shape.expert_ffn, static_backend(mac, shape, layers, StageSearch()), 0.0)
    experts = sum(scorer.score(d, LayerConfig(0)).latency_ms for d in layers if first <= d.layer < last)
    return stage_chunk_ms(mac.cost, stage_shape(shape, first, last), prompt, layers[0].chunk_tokens,
                          experts / prompts_in(layers, prompt), DensePlacement(host=scorer.exact), logits=final)


def mlx_gpu_pipeline(macs: list[Mac], shape: DecoderShape, layers: list[LayerData], prompt: int,
                     link: LinkFigure) -> dict:
    """mlx-lm's pipeline on the same Macs at the layers' chunk size: its split, each stage on the GPU alone."""
    split = even_split(shape.num_layers, len(macs))
    ms = [gpu_stage_ms(m, shape, layers, prompt, a, b, k == len(macs) - 1) for k, (m, (a, b)) in
          enumerate(zip(macs, split))]
    links = chunk_links(link, prompt, layers[0].chunk_tokens, shape.hidden)
    return {"split": [list(s) for s in split], "chunk_tokens": layers[0].chunk_tokens,
            "stage_ms": [sum(s) for s in ms], "predicted_prefill_ms": pipeline_ms(ms, links)}


def mlx_gpu_sharded(mac: Mac, n: int, shape: DecoderShape, layers: list[LayerData], prompt: int,
                    link: LinkFigure) -> dict:
    """mlx-lm's tensor parallelism on n Macs alike at the layers' chunk size (see the module docstring)."""
    part = sharded_shape(shape, n)
    chunk = layers[0].chunk_tokens
    ms = gpu_stage_ms(mac, part, layers, prompt, 0, shape.num_layers, True)
    reduce = sums_ms(link, n, shape, prompt, chunk)
    return {"chunk_tokens": chunk, "compute_ms": sum(ms), "all_sum_ms": sum(reduce),
            "predicted_prefill_ms": sum(ms) + sum(reduce)}


def gpu_baselines(macs: list[Mac], shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int,
                  link: LinkFigure, steps: dict[str, int]) -> tuple[dict, dict]:
    """mlx-lm's pipeline and its `shard()` on the GPU alone at each chunk size of `steps` (a key's suffix: its
    chunk) that was searched, each size once."""
    gpu: dict[str, dict] = {}
    for k, c in steps.items():
        if c in workloads and c not in {g["chunk_tokens"] for g in gpu.values()}:
            gpu[f"mlx-gpu{k}"] = mlx_gpu_pipeline(macs, shape, workloads[c], prompt, link)
    sharded = {f"mlx-gpu-sharded{k[7:]}": mlx_gpu_sharded(macs[0], len(macs), shape, workloads[g["chunk_tokens"]],
                                                          prompt, link) for k, g in gpu.items()}
    return gpu, sharded


def layout_json(out: LayoutOutcome, prompt: int) -> dict:
    """A layout beside the pipeline (`pipeline_layouts`): its prefill, work and sums, and each rank's plan."""
    return {"chunk_tokens": out.chunk_tokens, "predicted_prefill_ms": out.prefill_ms, "compute_ms": out.compute_ms,
            "all_sum_ms": out.all_sum_ms,
            "ranks": [stage_json(r, r.shape, prompt, out.chunk_tokens, True) for r in out.ranks]}


def pipeline_report(out: PipelineOutcome, shape: DecoderShape, workloads: dict[int, list[LayerData]], prompt: int,
                    link: LinkFigure, others: tuple[LayoutOutcome, ...] = ()) -> dict:
    """The report (see the module docstring)."""
    chunk, n = out.chunk_tokens, len(out.stages)
    ms = [stage_ms(s, prompt, chunk, k == n - 1) for k, s in enumerate(out.stages)]
    links = chunk_links(link, prompt, chunk, shape.hidden)
    whole = pipeline_ms(ms, links)
    work = [sum(m) for m in ms]
    macs = [s.mac for s in out.stages]
    layouts = {"pipeline": {"chunk_tokens": chunk, "predicted_prefill_ms": whole},
               **{o.layout: layout_json(o, prompt) for o in others}}
    chosen = choose_layout({k: v["predicted_prefill_ms"] for k, v in layouts.items()})
    ours = layouts[chosen]["predicted_prefill_ms"]
    steps = {"": chunk, f"-step{MLX_LM_PREFILL_STEP}": MLX_LM_PREFILL_STEP,
             f"-chunk{layouts[chosen]['chunk_tokens']}": layouts[chosen]["chunk_tokens"]}
    gpu, sharded = gpu_baselines(macs, shape, workloads, prompt, link, steps)
    return {"label": "predicted by the cost model (each Mac's profile) and the link's published figure",
            "layout": chosen, "layouts": layouts, "predicted_prefill_ms": ours, "macs": n, "prompt_tokens": prompt,
            "chunk_tokens": chunk,
            "split": [[s.first, s.last] for s in out.stages], "first_split": [list(s) for s in out.first_split],
            "rebalanced": out.rebalanced,
            "stages": [stage_json(s, shape, prompt, chunk, k == n - 1) for k, s in enumerate(out.stages)],
            "link": {**link.to_json(), "bytes_per_chunk": chunk * shape.hidden * 2,
                     "ms_per_boundary_per_chunk": links, "ms_total": (n - 1) * sum(links)},
            "pipeline_prefill_ms": whole, "sequential_ms": sequential_ms(ms, links),
            "one_stage_ms": sum(work) / n, "busiest_stage_ms": max(work), "efficiency": sum(work) / n / whole,
            "balance": max(work) / (sum(work) / n),
            "mlx_gpu_pipeline": gpu, "mlx_gpu_sharded": sharded,
            "vs": {k: g["predicted_prefill_ms"] / ours for k, g in (gpu | sharded).items()},
            "search_seconds": out.seconds}

