"""One pipeline stage (a run of consecutive decoder layers on one Mac), predicted: its time on each chunk of a prompt
and the memory it holds.

A stage's time on a chunk is what `whole_prefill.predict_prefill` composes for its layers (the same `layer_links`,
the same chain), with the experts' figure over one prompt spread over the chunks by their rows, and the final norm
and `lm_head` on the last chunk of the last stage only. Summed over the chunks, a stage holding every layer gives
`predict_prefill`'s latency.

A stage's memory, every figure predicted: its layers' weights as mlx-lm stores them quantized (`bits`, affine groups
of `group_size`, a bf16 scale and bias per group; the router as mlx-lm's qwen3_moe keeps it, at 8 bits), the input
embedding and `lm_head` (every rank of mlx-lm's pipeline loads both), the ANE's packages (the plan's resident
experts and dense functions, in the form they are stored), the KV cache of its layers at the prompt's length
(bf16), one chunk's activations and the process around them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from autotune.costing import evaluator
from autotune.costing.costmodel import CostModel
from autotune.costing.memory import HIDDEN_BUFFERS, RUNTIME_BYTES, storage_bytes_per_weight
from autotune.costing.whole_prefill import DecoderShape, DensePlacement, dense_link, layer_links, prompt_chunks

KV_BYTES = 2  # MLX's KV cache in bf16
ROUTER_BITS = 8  # mlx-lm's qwen3_moe quant_predicate keeps the router (mlp.gate) at 8 bits


def stage_shape(shape: DecoderShape, first: int, last: int) -> DecoderShape:
    """The decoder of layers first..last-1, renumbered from 0 (its MoE layers the ones among them)."""
    moe = tuple(i - first for i in shape.moe_layers if first <= i < last)
    return dataclasses.replace(shape, num_layers=last - first, moe_layers=moe)


def stage_chunk_ms(cost: CostModel, shape: DecoderShape, prompt_tokens: int, chunk_tokens: int, experts_ms: float,
                   place: DensePlacement = DensePlacement(), logits: bool = False) -> list[float]:
    """The stage's latency on each chunk of the prompt: its layers' dense steps (`layer_links`), its experts'
    figure over one prompt (`experts_ms`) spread by rows, and with `logits` the final norm and `lm_head` (one row)
    on the last chunk."""
    kinds: dict[tuple, list[int]] = {}
    for layer in range(shape.num_layers):
        kinds.setdefault((layer in shape.moe_layers, shape.mlp_ffn(layer)), []).append(layer)
    out = []
    for rows, context in prompt_chunks(prompt_tokens, chunk_tokens):
        full = rows == chunk_tokens
        steps = [s.times(len(same)) for same in kinds.values()
                 for part in layer_links(cost, shape, same[0], rows, context, full, place).values() for s in part]
        out.append(evaluator.chain(steps).latency_ms + experts_ms * rows / prompt_tokens)
    if logits:
        host = place.host
        out[-1] += dense_link(cost, host, cost.matmul_ms(host, 1, shape.vocab, shape.hidden)
                              + cost.norm_ms(host, 1, shape.hidden, shape.hidden)).latency_ms
    return out


def layer_weights(shape: DecoderShape, layer: int) -> tuple[int, int]:
    """(matrix weights but the router's, router weights) of one decoder layer."""
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    attention = shape.hidden * (q + 2 * kv) + q * shape.hidden
    mlp = 3 * shape.hidden * shape.mlp_ffn(layer)
    if layer not in shape.moe_layers:
        return attention + mlp, 0
    return attention + mlp + 3 * shape.num_experts * shape.hidden * shape.expert_ffn, shape.num_experts * shape.hidden


def layer_bytes(shape: DecoderShape, layer: int, bits: int = 4, group_size: int = 64) -> float:
    """One decoder layer's weights as mlx-lm stores them quantized (norms left out: a few KB)."""
    matrices, router = layer_weights(shape, layer)
    return (matrices * storage_bytes_per_weight(f"mlx{bits}", group_size)
            + router * storage_bytes_per_weight(f"mlx{ROUTER_BITS}", group_size))


def kv_bytes_per_layer(shape: DecoderShape, prompt_tokens: int) -> float:
    """One attention layer's keys and values at the prompt's length."""
    return 2.0 * shape.kv_heads * shape.head_dim * prompt_tokens * KV_BYTES


def ends_bytes(shape: DecoderShape, bits: int = 4, group_size: int = 64) -> float:
    """The input embedding and `lm_head`, quantized as the layers."""
    return 2.0 * shape.vocab * shape.hidden * storage_bytes_per_weight(f"mlx{bits}", group_size)


@dataclass
class StageMemory:
    """A stage's predicted memory, in bytes, by part."""
    weights: float
    ends: float
    ane_packages: float
    kv_cache: float
    activations: float
    runtime: float = float(RUNTIME_BYTES)

    @property
    def total(self) -> float:
        return self.weights + self.ends + self.ane_packages + self.kv_cache + self.activations + self.runtime

    def to_json(self) -> dict:
        return {**{k: round(v / 1e9, 3) for k, v in dataclasses.asdict(self).items()},
                "total": round(self.total / 1e9, 3), "unit": "GB", "label": "predicted"}


def stage_memory(shape: DecoderShape, first: int, last: int, prompt_tokens: int, chunk_tokens: int,
                 ane_bytes: float = 0.0, bits: int = 4) -> StageMemory:
    """The memory of the stage holding layers first..last-1 of `shape`, with `ane_bytes` of ANE packages."""
    layers = range(first, last)
    return StageMemory(weights=sum(layer_bytes(shape, i, bits) for i in layers), ends=ends_bytes(shape, bits),
                       ane_packages=ane_bytes, kv_cache=len(layers) * kv_bytes_per_layer(shape, prompt_tokens),
                       activations=HIDDEN_BUFFERS * chunk_tokens * shape.hidden * 4.0)
