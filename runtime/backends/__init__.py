"""Backends: one small protocol, several implementations (like Optuna's samplers), one registry.

A static backend turns a group of experts into a callable over a packed buffer of fixed shape
`[sum(capacities), H]` (expert i owns rows `offsets[i]:offsets[i+1]`). The exact path runs variable-size
per-expert batches with no padding. `cpu-static` is the reference for what an ANE graph computes. Every fact about
a backend is in its `BackendInfo`, held by `registry` (built-ins, and plugins found through entry points):
docs/backends.md.
"""
from runtime.backends.protocol import (
    DENSE_KINDS,
    DenseFn,
    DenseForm,
    DenseSpec,
    ExactFn,
    ExactLayer,
    ExactPath,
    GroupFn,
    GroupSpec,
    StaticBackend,
    attention_reference,
    dense_reference,
    expert_ffn,
)
from runtime.backends.registry import (
    CPU_ENERGY,
    ENTRY_POINT_GROUP,
    EXACT,
    REFERENCE,
    BackendInfo,
    BackendRegistry,
    registry,
)

__all__ = ["CPU_ENERGY", "DENSE_KINDS", "ENTRY_POINT_GROUP", "EXACT", "REFERENCE", "BackendInfo", "BackendRegistry",
           "DenseFn", "DenseForm", "DenseSpec", "ExactFn", "ExactLayer", "ExactPath", "GroupFn", "GroupSpec",
           "StaticBackend", "attention_reference", "dense_reference", "expert_ffn", "registry"]
