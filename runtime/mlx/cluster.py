"""A model across Macs on MLX's ring: each rank loads only its stage's layers (mlx-lm's `pipeline(group, split)`),
every rank runs the same prefill and decode, and rank 0 answers. Imports mlx.

    mlx.launch --backend ring -n 2 python -m runtime.mlx.cluster --model DIR --prompt "..." [--max-tokens N]
    mlx.launch --hostfile hosts.json python -m runtime.mlx.cluster --model DIR --split plans/M.pipeline.json ...

(`--split`: the split `autotune search --macs N` chose, each rank running its stage's plan.)

mlx-lm's pipeline gives rank 0 the last layers and rank N-1 the first: the stage of layers first..last-1 that the
search calls stage s of N runs on rank N-1-s. A prefill chunk's hidden states go from rank to rank (`send`,
`recv_like`); the chunks of one prompt overlap across ranks, as in mlx-lm, because a chunk evaluates only its KV
cache, which depends on the send; the last chunk's and each decode step's hidden states are gathered on every rank
(`all_gather`), so every rank computes the same logits and the same greedy token. Every step runs under the ring's
watchdog (`runtime.mlx.ring`).

With `--plan` (the stage's plan `autotune search --macs N` wrote, or any plan of the model), the MLX spine
(`runtime.mlx.spine.MlxSpine`) installs it on this rank's layers: each MoE block's experts as the plan's block, the
dense half as mlx-lm computes it. Without one, every rank runs mlx-lm's own experts.
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

# imported once the ring is joined (runtime.mlx.spine pulls in torch and transformers: seconds to tens of seconds),
# so that every rank joins within the connecting side's window (MLX's ring gives up connecting after about 30 s)
DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_STEP = 2048  # mlx-lm's prefill_step_size


def rank_split(stages: list[tuple[int, int]]) -> list[int]:
    """mlx-lm's `split` (layers per rank, rank 0 first) of stages in layer order (stage s on rank N-1-s)."""
    return [b - a for a, b in stages][::-1]


def read_pipeline(path: str | Path) -> tuple[list[tuple[int, int]], dict[int, str]]:
    """The stages (first, last) of a pipeline file that `autotune search --macs N` writes, and each rank's plan."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        split = [(int(a), int(b)) for a, b in obj["split"]]
        plans = {int(s["rank"]): str(s["plan"]) for s in obj.get("stages", []) if s.get("plan")}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise NpumoeError(f"cannot read the split in {path}: {e}") from None
    return split, plans


def load_stage(path: Path, group: mx.distributed.Group, split: list[int] | None, dtype: str) -> nn.Module:
    """mlx-lm's model of the folder with only this rank's layers made (the others never leave the disk), floats in
    `dtype` (`spine_loading.compute_dtype`)."""
    from mlx_lm.utils import load_model

    from runtime.mlx.spine_loading import compute_dtype, folder_config

    model, _ = load_model(path, lazy=True, model_config=folder_config(path))
    if not hasattr(model, "model") or not hasattr(model.model, "pipeline"):
        raise NpumoeError(f"mlx-lm has no pipeline for {type(model).__module__.rsplit('.', 1)[-1]!r} models ({path})")
    if split is not None and (len(split) != group.size() or sum(split) != len(model.model.layers)):
        raise NpumoeError(f"the split {split} does not cover {len(model.model.layers)} layers over "
                          f"{group.size()} ranks")
    model.model.pipeline(group, split)
    to = compute_dtype(dtype)
    if to is not None:
        floats = (mx.float32, mx.bfloat16, mx.float16)
        model.update(tree_map(lambda a: a.astype(to) if a.dtype in floats else a, model.parameters()))
    mx.eval(model.parameters())
    return model


class Stage:
    """This rank's part of a run: its model, the plan installed on its layers (or none) and the ring's watchdog."""

    def __init__(self, ring: Ring, model: nn.Module, path: Path, plan: str | None) -> None:
        from runtime.mlx.spine import MlxSpine
        from runtime.plan import load_plan

        self.ring, self.model, self.spine = ring, model, None
        if plan is not None:
            # the spine finds the MoE blocks by the model's own layer numbers (a rank's list holds None for the
            # layers before its stage) and walks `model.layers`, which mlx-lm's pipeline narrows to the stage's
            self.spine = MlxSpine(model, load_plan(plan), path, plan_path=plan).install()

    def forward(self, ids: list[int], cache: list, rows: str) -> mx.array | None:
        """`forward_rows` (under the plan where one is installed), watched."""
        from runtime.mlx.spine import forward_rows

        x = mx.array([ids], dtype=mx.uint32)
        run = (lambda: self.spine.forward(x, cache, rows)) if self.spine else lambda: forward_rows(self.model, x,
                                                                                                  cache, rows)
        return self.ring.step(f"a forward of {len(ids)} tokens", run)

    def fill(self, ids: list[int], cache: list) -> None:
        """A prefill chunk that is not the last, evaluated through its KV cache only (as mlx-lm's prefill): the
        chunks overlap across ranks, since each rank's cache depends on its send, not on the gathered output."""
        if self.spine is not None:
            self.spine.set_phase("prefill")
        self.model(mx.array([ids], dtype=mx.uint32), cache=cache)
        self.ring.step("a prefill chunk", lambda: mx.eval([c.state for c in cache]))
        if self.spine is not None:
            self.spine.flush()


def logits_of(stage: Stage, ids: list[int], step: int = PREFILL_STEP) -> np.ndarray:
    """Logits [tokens, vocab] of one text in float32, chunk by chunk (every chunk's logits gathered)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(stage.model)
    out = [stage.forward(ids[s:s + step], cache, "all")[0].astype(mx.float32) for s in range(0, len(ids), step)]
    return np.concatenate([np.array(o) for o in out])


def generate(stage: Stage, ids: list[int], max_tokens: int, eos: set[int], step: int = PREFILL_STEP) -> list[int]:
    """Greedy tokens after the prompt (every rank computes the same ones)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(stage.model)
    starts = range(0, len(ids), step)
    for s in starts[:-1]:
        stage.fill(ids[s:s + step], cache)
    logits = stage.forward(ids[starts[-1]:], cache, "last")
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(int(mx.argmax(logits[0, -1]).item()))
        if out[-1] in eos:
            break
        logits = stage.forward(out[-1:], cache, "last")
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m runtime.mlx.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="an MLX (or transformers) folder mlx-lm loads, on every Mac")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--split", help="the pipeline file `autotune search --macs N` wrote: its split, and each rank "
                                    "its stage's plan (default: mlx-lm's even split, no plan)")
    ap.add_argument("--plan", help="the plan every rank runs its layers under (default: its stage's, from --split)")
    ap.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="the floats' dtype (default auto: float32 on MLX's CPU device, as stored on a GPU)")
    ap.add_argument("--prefill-step", type=int, help="prefill chunk (default: the plan's chunk_tokens, else "
                    f"mlx-lm's {PREFILL_STEP})")
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
    stages, plans = read_pipeline(args.split) if args.split else (None, {})
    model = load_stage(path, group, rank_split(stages) if stages else None, args.dtype)
    stage = Stage(ring, model, path, args.plan or plans.get(group.rank()))
    step = args.prefill_step or (stage.spine.plan.chunk_tokens if stage.spine else PREFILL_STEP)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    ids = tokenizer.encode(args.prompt)
    out = {"ranks": group.size(), "rank": group.rank(), "layers": [model.model.start_idx, model.model.end_idx],
           "prompt_tokens": len(ids)}
    if args.logits_out:
        logits = logits_of(stage, ids, step)
        if group.rank() == 0:
            np.save(args.logits_out, logits)
    if args.max_tokens:
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        tokens = generate(stage, ids, args.max_tokens, eos, step)
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
