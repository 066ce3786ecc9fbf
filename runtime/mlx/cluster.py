"""A model across Macs on MLX's ring: each rank loads only its stage's layers (mlx-lm's `pipeline(group, split)`),
every rank runs the same prefill and decode, and rank 0 answers. Imports mlx.

    mlx.launch --backend ring -n 2 python -m runtime.mlx.cluster --model DIR --prompt "..." [--max-tokens N]
    mlx.launch --hostfile hosts.json python -m runtime.mlx.cluster --model DIR --split plans/M.pipeline.json ...

mlx-lm's pipeline gives rank 0 the last layers and rank N-1 the first: the stage of layers first..last-1 that the
search calls stage s of N runs on rank N-1-s. A prefill chunk's hidden states go from rank to rank (`send`,
`recv_like`); the chunks of one prompt overlap across ranks, as in mlx-lm, because a chunk evaluates only its KV
cache, which depends on the send; the last chunk's and each decode step's hidden states are gathered on every rank
(`all_gather`), so every rank computes the same logits and the same greedy token. Every step runs under the ring's
watchdog (`runtime.mlx.ring`).

PLAN HOOK: each rank's experts run as mlx-lm computes them. The stage's plan (`--plan`, one per rank) is meant to
be installed on the rank's layers by the MLX spine (issue 53); until it is merged, a plan is refused in one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from runtime.errors import NpumoeError
from runtime.mlx.ring import Ring, quiet_ring_lines

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size


def rank_split(stages: list[tuple[int, int]]) -> list[int]:
    """mlx-lm's `split` (layers per rank, rank 0 first) of stages in layer order (stage s on rank N-1-s)."""
    return [b - a for a, b in stages][::-1]


def read_split(path: str | Path) -> list[tuple[int, int]]:
    """The stages (first, last) of a pipeline file that `autotune search --macs N` writes."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        return [(int(a), int(b)) for a, b in obj["split"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NpumoeError(f"cannot read the split in {path}: {e}") from None


def load_stage(path: Path, group: mx.distributed.Group, split: list[int] | None, dtype: str | None) -> nn.Module:
    """mlx-lm's model of the folder with only this rank's layers made (the others never leave the disk), floats in
    `dtype` (None: as stored)."""
    from mlx_lm.utils import load_model

    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    extra = {"rope_theta": rope["rope_theta"]} if "rope_theta" not in config and "rope_theta" in rope else {}
    model, _ = load_model(path, lazy=True, model_config=extra)
    if not hasattr(model, "model") or not hasattr(model.model, "pipeline"):
        raise NpumoeError(f"mlx-lm has no pipeline for {config.get('model_type')!r} models ({path})")
    if split is not None and (len(split) != group.size() or sum(split) != len(model.model.layers)):
        raise NpumoeError(f"the split {split} does not cover {len(model.model.layers)} layers over "
                          f"{group.size()} ranks")
    model.model.pipeline(group, split)
    if dtype is not None:
        floats = (mx.float32, mx.bfloat16, mx.float16)
        model.update(tree_map(lambda a: a.astype(DTYPES[dtype]) if a.dtype in floats else a, model.parameters()))
    mx.eval(model.parameters())
    return model


def install_plan(model: nn.Module, plan: str | None) -> None:
    """PLAN HOOK (see the module docstring): the stage's plan on this rank's layers, by the MLX spine."""
    if plan is not None:
        raise NpumoeError("running a stage's plan needs the MLX spine (issue 53), not merged on this branch: run "
                          "without --plan (mlx-lm's own experts on every rank)")


def prefill(ring: Ring, model: nn.Module, cache: list, ids: mx.array, step: int) -> mx.array:
    """Every chunk but the last evaluated through its KV cache (chunks overlap across ranks), the last through the
    logits of every position of the last chunk."""
    while ids.shape[1] > step:
        model(ids[:, :step], cache=cache)
        ring.step("a prefill chunk", lambda: mx.eval([c.state for c in cache]))
        ids = ids[:, step:]
    logits = model(ids, cache=cache)
    return ring.step("the last prefill chunk", lambda: mx.eval(logits) or logits)


def logits_of(ring: Ring, model: nn.Module, ids: list[int], step: int = PREFILL_STEP) -> np.ndarray:
    """Logits [tokens, vocab] of one text in float32, chunk by chunk (every chunk's logits gathered)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, out = make_prompt_cache(model), []
    for start in range(0, len(ids), step):
        logits = model(mx.array([ids[start:start + step]]), cache=cache)
        out.append(np.array(ring.step("a chunk's logits", lambda: mx.eval(logits) or logits)[0].astype(mx.float32)))
    return np.concatenate(out)


def generate(ring: Ring, model: nn.Module, ids: list[int], max_tokens: int, eos: set[int],
             step: int = PREFILL_STEP) -> list[int]:
    """Greedy tokens after the prompt (every rank computes the same ones)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = prefill(ring, model, cache, mx.array([ids]), step)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(mx.argmax(logits[0, -1]).item())
        out.append(token)
        if token in eos:
            break
        logits = model(mx.array([[token]]), cache=cache)
        logits = ring.step("a decode step", lambda: mx.eval(logits) or logits)
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime.mlx.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an MLX (or transformers) folder mlx-lm loads, on every Mac")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--split", help="the pipeline file `autotune search --macs N` wrote (default: mlx-lm's even "
                                    "split)")
    ap.add_argument("--plan", help="this rank's stage plan (needs the MLX spine: see PLAN HOOK)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), help="the floats' dtype (default: as stored)")
    ap.add_argument("--prefill-step", type=int, default=PREFILL_STEP)
    ap.add_argument("--logits-out", help="rank 0 writes the prompt's logits [tokens, vocab] here (.npy, float32)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a rank waits on a neighbour (default 60)")
    return ap.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    """Join the ring, load this rank's stage, run the prompt; the answer (what rank 0 prints)."""
    import transformers

    quiet_ring_lines()
    ring = Ring.from_env(args.timeout)
    group = ring.join()
    path = Path(args.model)
    stages = read_split(args.split) if args.split else None
    model = load_stage(path, group, rank_split(stages) if stages else None, args.dtype)
    install_plan(model, args.plan)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer.encode(args.prompt)
    out = {"ranks": group.size(), "rank": group.rank(), "layers": [model.model.start_idx, model.model.end_idx],
           "prompt_tokens": len(ids)}
    if args.logits_out:
        logits = logits_of(ring, model, ids, args.prefill_step)
        if group.rank() == 0:
            np.save(args.logits_out, logits)
    if args.max_tokens:
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        tokens = generate(ring, model, ids, args.max_tokens, eos, args.prefill_step)
        out |= {"tokens": tokens, "text": tokenizer.decode(tokens)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        out = run(args)
    except NpumoeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out["rank"] == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
