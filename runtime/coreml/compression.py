"""Compressed weights in a Core ML function: each compression's coremltools function (also its graph pass's name),
the configuration every build and ane-sim compress with, and k-means on one thread."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

from runtime.errors import NpumoeError
from runtime.plan import COMPRESSIONS

# Each compression's coremltools function in `coremltools.optimize.coreml`, also its graph pass's name.
COMPRESSION_FUNCTIONS = {"int8": "linear_quantize_weights", "palettize4": "palettize_weights"}


def compression_config(compress: str):
    """The `OptimizationConfig` every build compresses a function's weights with (`compress` other than none)."""
    import coremltools.optimize.coreml as cto

    if compress not in COMPRESSIONS:
        raise NpumoeError(f"unknown compression {compress!r}; choose from {', '.join(COMPRESSIONS)}")
    if compress == "int8":
        cfg = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel",
                                          weight_threshold=2048)
    elif compress == "palettize4":
        # A 16-entry table per group of 16 output channels: far closer than one table per tensor.
        cfg = cto.OpPalettizerConfig(nbits=4, mode="kmeans", granularity="per_grouped_channel", group_size=16,
                                     weight_threshold=2048)
    else:  # "none" compresses nothing: callers ask only for the others
        raise ValueError("compression 'none' has no OptimizationConfig")
    return cto.OptimizationConfig(global_config=cfg)


@contextlib.contextmanager
def one_kmeans_thread() -> Iterator[None]:
    """scikit-learn's k-means (palettization) on one thread: 5x faster than its default on a busy 2-core host,
    and the same tables wherever it runs (no thread-count dependent summation order)."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(1):
        yield


def compressed(mlmodel, compress: str):
    """`mlmodel` with its weights stored as `compress` says (none: as it is)."""
    import coremltools.optimize.coreml as cto

    if compress == "none":
        return mlmodel
    config = compression_config(compress)
    with one_kmeans_thread():
        return getattr(cto, COMPRESSION_FUNCTIONS[compress])(mlmodel, config)
