"""The MoE blocks of an mlx-lm model, found by attribute (no mlx import): shared by the MLX spine and the MLX
calibration engine."""
from __future__ import annotations

MOE_BLOCKS = ("mlp", "block_sparse_moe")  # mlx-lm's names for a decoder layer's MoE block, by family


def moe_blocks(model) -> dict[int, object]:
    """{decoder layer: its MoE block} of an mlx-lm model: the blocks with a router `gate` and experts `switch_mlp`
    (by attribute, so a block whose experts a spine or a recorder wraps is still found)."""
    blocks = {}
    for index, layer in enumerate(getattr(model, "model", model).layers):
        block = next((b for n in MOE_BLOCKS if (b := getattr(layer, n, None)) is not None), None)
        if hasattr(block, "gate") and hasattr(block, "switch_mlp"):
            blocks[index] = block
    return blocks
