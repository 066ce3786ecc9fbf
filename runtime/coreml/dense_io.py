"""What a built dense function's inputs, output and weights are called, and the digest that ties a function to the
weights it was built from: shared by the builder (runtime/coreml/dense_programs.py), ane-sim and the `ane` backend
that runs the package's functions."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from runtime.backends import DenseSpec
from runtime.cpu.quantized import QuantizedLinear, linear_weight

MASKED = -1e4  # the additive mask of a key that may not be attended to (ml-ane-transformers' value)
OUTPUT = "y"
ROW_INPUT = "x"
ATTENTION_INPUTS = ("q", "k", "v", "mask")


def fp16(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float16).contiguous().numpy()


def dense_weights(spec: DenseSpec) -> dict[str, np.ndarray]:
    """The function's weights as fp16 arrays, by const name (unique per layer and role)."""
    out = {}
    for role, module in spec.modules.items():
        linear = isinstance(module, (torch.nn.Linear, QuantizedLinear))
        tensors = {"w": linear_weight(module) if linear else getattr(module, "weight", None),
                   "b": getattr(module, "bias", None)}
        if role == "mlp":
            tensors = {f"{n}_w": linear_weight(getattr(module, n)) for n in ("gate_proj", "up_proj", "down_proj")}
        for kind, t in tensors.items():
            if t is not None:
                out[f"layer{spec.layer}_{role}_{kind}"] = fp16(t)
    return out


def dense_digest(weights: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(weights):
        h.update(name.encode() + b"\0" + weights[name].tobytes())
    return h.hexdigest()
