"""`autotune serve`: a model under a plan behind the OpenAI API (FastAPI + uvicorn), on loopback by default.

A thin parser over `runtime.serving.engine_process.EngineProcess` (the model loaded and run in a process of its
own) and `runtime.serving.server.serve`."""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

from autotune.commands.argtypes import (
    directory,
    input_file,
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)
from autotune.commands.common import (
    add_cluster_arguments,
    add_cpu_weights_argument,
    add_dtype_argument,
    add_engine_argument,
    add_model_argument,
    add_package_argument,
    add_threads_argument,
    cluster_of,
    require_plan_for_package,
)
from autotune.costing.cpu_storage import load_options
from runtime.engines import resolve_engine, torch_only
from runtime.errors import NpumoeError
from runtime.plan import load_plan
from runtime.serving.engine import DEFAULT_DISK_GB, DEFAULT_MAX_BATCH, disk_cache_off
from runtime.serving.engine_process import EngineEnded, EngineProcess
from runtime.serving.server import DRAIN_S, check_bind, listen, serve, served_model_id

KEY_ENV = "NPUMOE_API_KEY"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model under a plan behind the OpenAI API (/v1/completions, "
                                     "/v1/chat/completions, streaming; /health, /metrics)")
    add_model_argument(p)
    add_engine_argument(p)
    p.add_argument("--plan", type=input_file, metavar="P",
                   help="plan file (npumoe.plan/1 JSON); without it the unmodified model runs (no prefix cache)")
    add_package_argument(p)
    add_dtype_argument(p)
    add_cpu_weights_argument(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1; any other than loopback needs --api-key)")
    p.add_argument("--port", type=port_number, default=8000, help="TCP port (default 8000; 0: any free port)")
    p.add_argument("--api-key", metavar="K",
                   help=f"require `Authorization: Bearer K` (or `x-api-key: K`) on every route but /health "
                        f"(default: ${KEY_ENV}, which keeps the key out of the process list; an empty key is refused)")
    p.add_argument("--max-batch", type=positive_int, default=DEFAULT_MAX_BATCH, metavar="N",
                   help=f"requests generating at once, their decode steps batched (default {DEFAULT_MAX_BATCH})")
    p.add_argument("--max-queue", type=positive_int, default=16, metavar="N",
                   help="requests that may wait behind the active ones (default 16); past it: HTTP 429")
    p.add_argument("--prefix-cache-mb", type=non_negative_float, default=256.0, metavar="MB",
                   help="memory for reusable prompt prefixes (KV cache, whole prefill chunks; default 256; 0: off)")
    p.add_argument("--prefix-cache-dir", type=directory, metavar="DIR",
                   help="also keep reusable prefixes' KV caches in DIR, across restarts (whole prefill chunks, tied to "
                        "the model's and the plan's digests; needs --plan; the torch spine's: on --engine mlx the "
                        "prefix cache is in memory only)")
    p.add_argument("--prefix-cache-disk-gb", type=positive_float, default=DEFAULT_DISK_GB, metavar="GB",
                   help=f"bound of --prefix-cache-dir, least recently used out first (default {DEFAULT_DISK_GB:g})")
    p.add_argument("--drain-s", type=positive_float, default=DRAIN_S, metavar="S",
                   help=f"on SIGTERM, how long requests in flight may take to finish (default {DRAIN_S:g})")
    add_threads_argument(p)
    add_cluster_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    require_plan_for_package(args)
    plan = load_plan(args.plan) if args.plan else None
    cluster = cluster_of(args, args.plan)
    engine = resolve_engine("mlx" if cluster else args.engine, plan, torch_only(plan, args.cpu_weights))
    if args.prefix_cache_dir and not args.plan:
        raise NpumoeError("--prefix-cache-dir keeps whole prefill chunks: it needs --plan")
    if args.prefix_cache_dir and (off := disk_cache_off(engine)) is not None:
        raise NpumoeError(off)
    if args.api_key == "" or (args.api_key is None and os.environ.get(KEY_ENV) == ""):
        raise NpumoeError(f"{'--api-key' if args.api_key == '' else KEY_ENV} is empty: an empty key would let anyone "
                          "in; give a key, or leave it out to serve without one (loopback only)")
    api_key = args.api_key or os.environ.get(KEY_ENV) or None
    check_bind(args.host, api_key)
    load_args = {"model": args.model, "plan": args.plan, "package": args.package, "dtype": args.dtype,
                 **load_options(args.cpu_weights), "engine": engine}
    if cluster is not None and cluster.rank != 0:
        return follow_rank(load_args, cluster)
    sock = listen(args.host, args.port)  # before loading: a taken port fails at once
    try:
        model_id = served_model_id(args.model)
        if cluster is not None:
            load_args["cluster"] = cluster.leading()
        engine_args = {"max_queue": args.max_queue, "prefix_cache_mb": args.prefix_cache_mb,
                       "max_batch": args.max_batch, "prefix_cache_dir": args.prefix_cache_dir,
                       "prefix_cache_disk_gb": args.prefix_cache_disk_gb}
        try:
            engine = EngineProcess(load_args, engine_args, model_id, args.threads,
                                   f"autotune {args.command}: %(message)s")
        except EngineEnded as e:
            if cluster is None or not e.exitcode or e.exitcode == 1:
                raise
            return peer_lost()  # the ring ended it, and its watchdog said which neighbour in one line
        host = f"[{args.host}]" if ":" in args.host else args.host
        url = f"http://{host}:{sock.getsockname()[1]}/v1"

        def ready() -> None:
            print(f"autotune serve: {model_id} at {url} (SIGTERM or Ctrl-C: finish the requests in flight, exit)",
                  flush=True)
        if cluster is not None:
            watch_engine(engine)
        serve(engine, sock, api_key, args.drain_s, ready)
    finally:
        sock.close()
    return peer_lost() if cluster is not None and engine.process.exitcode else 0


def peer_lost() -> int:
    """The exit status of a rank whose neighbour died or could not be reached."""
    from runtime.mlx.ring import PEER_LOST

    return PEER_LOST


def follow_rank(load_args: dict, cluster) -> int:
    """A rank past 0 under mlx.launch: its stage loaded, it runs each forward rank 0 announces until rank 0 ends."""
    from runtime.generation import load
    from runtime.mlx.cluster_follow import follow

    loaded = load(**load_args, cluster=cluster)
    first, last = loaded.cluster.layers
    print(f"autotune serve: rank {cluster.rank} holds layers {first}..{last - 1} and follows rank 0", flush=True)
    follow(loaded)
    return 0


def watch_engine(engine: EngineProcess) -> None:
    """Across Macs, rank 0's engine process ends on its own only when a neighbour is lost (it said which, in one
    line): the server then stops too, once the requests in flight were told (each gets an error), and the command
    exits with the engine's status."""
    def watch() -> None:
        engine.process.join()
        if engine.process.exitcode:
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, name="npumoe-engine-watch", daemon=True).start()
