"""Options and output helpers shared by the subcommands, so every command spells them the same way."""
from __future__ import annotations

import argparse
import json
import sys

import torch

from autotune.commands.argtypes import cpu_storage, input_file, input_package, positive_float, positive_int
from runtime.engines import ENGINES, mlx_importable
from runtime.errors import NpumoeError
from runtime.loading.model_loader import BUILTIN_MODELS, DTYPE_CHOICES
from runtime.mlx.launcher import launched


def add_model_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="M",
                   help=f"a local transformers model directory or a built-in name ({', '.join(BUILTIN_MODELS)})")


def add_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="dtype to load the model in and compute with (default auto: the checkpoint's own dtype, "
                        "bfloat16 for tiny-moe, float32 for the random models; float32 instead of a bf16/fp16 "
                        "checkpoint's where this host's torch emulates that dtype's matmuls and the float32 "
                        "weights fit half the memory: `autotune doctor` says which)")


def add_cpu_weights_argument(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--cpu-weights", type=cpu_storage, default=None, metavar="bf16|int8|int4[:G]",
                   help=help or "how the CPU holds the experts: quantized at load from a full-width checkpoint "
                                "(int8 per output channel, int4 per group of G inputs, default 64); default: as "
                                "the plan says, else as loaded. A flag that differs from the plan's is refused")


def add_package_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--package", type=input_package, metavar="X.mlpackage|X.aimodel",
                   help="what `autotune build` wrote for the plan's device functions: a Core ML package (`ane`) "
                        "or a Core AI asset (`coreai`)")


def require_plan_for_package(args: argparse.Namespace) -> None:
    """Where --plan is optional (generate, serve): a package runs a plan's device functions."""
    if args.package and not args.plan:
        raise NpumoeError("--package runs a plan's device functions: give --plan too")


def add_engine_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", choices=ENGINES, default="auto",
                   help="the spine that runs the model: torch (transformers on the CPU), mlx (mlx-lm's own model: the "
                        "GPU on a Mac, MLX's CPU device elsewhere; float32 there), or auto (default: mlx on a Mac "
                        "where mlx imports and the plan places anything on MLX, torch otherwise)")


def add_in_flight_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--in-flight", type=int, choices=(1, 2), default=None,
                   help="prefill chunks in flight on the MLX spine (default: the plan's `in_flight`, 1 where it says "
                        "none): 2 runs one chunk's static calls while the other chunk's MLX work runs (same logits; "
                        "executed gains each lane's busy and wait ms)")


def add_text_argument(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--text", default=default, metavar="F",
                   help=f"a UTF-8 text file or a built-in text name (default: {default})")


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's)")


def apply_threads(n: int | None) -> None:
    if n is not None:
        torch.set_num_threads(n)


def print_json(obj: dict) -> None:
    """One JSON object on one line of stdout: what scripts read."""
    print(json.dumps(obj, sort_keys=False))
    sys.stdout.flush()


def add_planned_arguments(p: argparse.ArgumentParser, text_default: str, max_tokens_default: int) -> None:
    """The options of every command that runs a plan on a text (`run`, `evaluate`)."""
    add_model_argument(p)
    add_dtype_argument(p)
    add_engine_argument(p)
    p.add_argument("--plan", required=True, type=input_file, metavar="P", help="plan file (npumoe.plan/1 JSON)")
    add_text_argument(p, text_default)
    p.add_argument("--max-tokens", type=positive_int, default=max_tokens_default, metavar="N",
                   help=f"use at most N tokens of the text (default {max_tokens_default})")
    add_package_argument(p)
    add_cpu_weights_argument(p)
    add_threads_argument(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


PEER_TIMEOUT_S = 60.0


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a command that runs across Macs under `mlx.launch` (`runtime.mlx.cluster`)."""
    p.add_argument("--pipeline", type=input_file, metavar="F",
                   help="under mlx.launch: the pipeline file `autotune search --macs N` (or --hosts) wrote, each rank "
                        "loading only its stage's layers and running them under its stage's plan (default: "
                        "<plan>.pipeline.json beside the plan, else mlx-lm's even split under the plan given)")
    p.add_argument("--peer-timeout-s", type=positive_float, default=PEER_TIMEOUT_S, metavar="S",
                   help="under mlx.launch: how long a rank waits on a neighbour before it ends, naming it (default "
                        f"{PEER_TIMEOUT_S:g})")


def cluster_of(args: argparse.Namespace, plan: str | None) -> object | None:
    """Under `mlx.launch`, this rank's part (`runtime.mlx.cluster.ClusterSpec`), checked before any ring is joined;
    None in a process of its own."""
    if not launched():
        if args.pipeline:
            raise NpumoeError("--pipeline runs a model across Macs: start every rank with `mlx.launch --backend ring "
                              "-n N ...` or `mlx.launch --hostfile hosts.json ...`")
        return None
    if args.engine == "torch":
        raise NpumoeError("--engine torch: across Macs (under mlx.launch) the model runs on the MLX spine; leave "
                          "--engine out or give --engine mlx")
    if not mlx_importable():
        raise NpumoeError("under mlx.launch the model runs across Macs on mlx and mlx-lm (pip install mlx-lm)")
    from runtime.mlx.cluster import cluster_spec

    return cluster_spec(args.model, plan, args.pipeline, args.peer_timeout_s)
