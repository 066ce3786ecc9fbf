"""A model across Macs on MLX's ring, as `autotune run`, `generate` and `serve` run it under `mlx.launch`: each rank
loads only its stage's layers (mlx-lm's `pipeline(group, split)`) and installs its stage's plan on the MLX spine;
every rank runs the same forwards, and rank 0 answers. Imports mlx.

    mlx.launch --backend ring -n 2 autotune generate --model DIR --plan P --prompt "..."
    mlx.launch --hostfile hosts.json autotune serve --model DIR --plan P

The split is the pipeline file `autotune search --macs N` (or `--hosts`) wrote beside the plan (`<plan>.pipeline.json`,
or `--pipeline F`), each rank running the plan of its stage; without one, mlx-lm's even split, every rank under the
plan given. mlx-lm's pipeline gives rank 0 the last layers and rank N-1 the first: the stage of layers first..last-1
that the search calls stage s of N runs on rank N-1-s.

Every forward of the model's decoder is evaluated where it is called, under the ring's watchdog
(`runtime.mlx.ring`): mlx-lm's pipelined decoder receives the hidden states from the rank after, sends its own to the
rank before and gathers the last stage's on every rank (`all_gather`), so every rank computes the same logits and
the same tokens; a neighbour that dies or hangs ends the rank with one line naming it. A server's followers
(`cluster_follow`) are told each forward rank 0 makes. Everything here is checked before the ring is joined, but what
needs the ring (the ranks agreeing on their plans' chunk).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from runtime.errors import NpumoeError
from runtime.mlx.cluster_follow import Link
from runtime.mlx.ring import Ring, quiet_ring_lines
from runtime.mlx.tensor_parallel import check_shardable, load_shard, read_layout

DEFAULT_TIMEOUT_S = 60.0


def rank_split(stages: list[tuple[int, int]]) -> list[int]:
    """mlx-lm's `split` (layers per rank, rank 0 first) of stages in layer order (stage s on rank N-1-s)."""
    return [b - a for a, b in stages][::-1]


def read_pipeline(path: str | Path) -> tuple[list[tuple[int, int]], dict[int, str]]:
    """The stages (first, last) of a pipeline file that `autotune search --macs N` writes, and each rank's plan."""
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
        split = [(int(a), int(b)) for a, b in obj["split"]]
        plans = {int(s["rank"]): str(s["plan"]) for s in obj.get("stages", []) if s.get("plan")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise NpumoeError(f"cannot read the split in {path}: {e}") from None
    return split, plans


def pipeline_beside(plan: str | None) -> str | None:
    """The pipeline file `search --macs N` writes next to the plan, where there is one."""
    if plan is None:
        return None
    beside = Path(plan).with_suffix(".pipeline.json")
    return str(beside) if beside.is_file() else None


@dataclass(frozen=True)
class ClusterSpec:
    """What a rank runs, known before it joins the ring (picklable: it crosses to the server's engine process):
    the ring, the layers each rank holds (mlx-lm's `split`, rank 0 first; None: its even split), this rank's plan
    and whether it leads followers (rank 0 of a server)."""
    ring: Ring
    split: tuple[int, ...] | None
    plan: str | None
    pipeline: str | None = None
    lead: bool = False
    layout: str = "pipeline"  # or "tensor": every rank every layer, sliced (`tensor_parallel`)

    @property
    def rank(self) -> int:
        return self.ring.rank

    def stages(self, layers: int) -> list[list[int]]:
        """[first, last) of the layers of each rank, rank 0 first."""
        if self.layout == "tensor":
            return [[0, layers]] * self.ring.size
        split = self.split or _even_split(layers, self.ring.size)
        return [[sum(split[r + 1:]), sum(split[r:])] for r in range(len(split))]

    def leading(self) -> ClusterSpec:
        return replace(self, lead=True)


def _even_split(layers: int, ranks: int) -> list[int]:
    """mlx-lm's own split where none is given: the low ranks take the extra layers."""
    base, extra = divmod(layers, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def cluster_spec(model: str, plan: str | None, pipeline: str | None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> ClusterSpec:
    """This rank's part, checked before the ring is joined: the launcher's ring, the model's folder, the pipeline
    file (`pipeline`, else the one beside `plan`) covering the model's layers over the ring's ranks, this rank's
    plan readable."""
    from runtime.loading.model_config import read_config
    from runtime.loading.model_loader import model_dir
    from runtime.loading.model_record import read_model_spec

    ring = Ring.from_env(timeout_s)
    layers = read_model_spec(str(model_dir(model))).num_layers
    pipeline = pipeline or pipeline_beside(plan)
    if pipeline is None:
        if layers < ring.size:
            raise NpumoeError(f"{model} has {layers} layers: too few for {ring.size} ranks")
        return ClusterSpec(ring, None, plan)
    stages, plans = read_pipeline(pipeline)
    layout = read_layout(pipeline)
    ends = [a for a, _ in stages[1:]] + [layers]
    if layout == "pipeline" and (len(stages) != ring.size or stages[0][0] != 0
            or any(b != end or b <= a for (a, b), end in zip(stages, ends))):
        raise NpumoeError(f"the split {[list(s) for s in stages]} in {pipeline} does not cover the {layers} layers "
                          f"of {model} in {ring.size} consecutive stages, one per rank")
    mine = _plan_file(plans.get(ring.rank), Path(pipeline)) or plan
    if mine is not None and not Path(mine).is_file():
        raise NpumoeError(f"rank {ring.rank}'s plan {mine} (from {pipeline}) is not a file")
    if layout == "tensor":
        check_shardable(read_config(model_dir(model)), ring.size, mine)
    split = None if layout == "tensor" else tuple(rank_split(stages))
    return ClusterSpec(ring, split, mine, pipeline, layout=layout)


def _plan_file(name: str | None, pipeline: Path) -> str | None:
    """A stage's plan as the pipeline file names it: as written, else beside the pipeline file (a folder moved)."""
    if name is None or Path(name).is_absolute() or Path(name).is_file():
        return name
    return str(pipeline.parent / Path(name).name)


@dataclass
class Cluster:
    """A rank once joined: its spec, the group, the layers it holds and the link its forwards go through."""
    spec: ClusterSpec
    group: mx.distributed.Group
    layers: list[int]
    stages: list[list[int]]
    link: Link
    exact_below: int = 0  # the ranks' plans' smallest exact_below_tokens: a tail every rank runs exactly is below it

    def to_json(self) -> dict:
        """What a rank's report carries: its rank, the ranks, [first, last) of its layers."""
        return {"rank": self.spec.rank, "ranks": self.group.size(), "layers": self.layers}

    def health(self) -> dict:
        """The ranks and their stages (`/health` on rank 0)."""
        return {"ranks": self.group.size(), "pipeline": self.spec.pipeline, "layout": self.spec.layout,
                "stages": [{"rank": r, "layers": s} for r, s in enumerate(self.stages)],
                "exact_below": self.exact_below}

    def agree(self, what: str, value: int) -> None:
        """Every rank holds the same `value` (a plan's chunk, ...), or every rank refuses in one line."""
        got = self.link.gather(value)
        if len(set(got)) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(got))
            raise NpumoeError(f"the ranks' plans differ in {what} ({each}): search them together "
                              "(`autotune search --macs N`)")


def load_rank(spec: ClusterSpec, name: str, dtype: str, package: str | None = None) -> dict:
    """`runtime.generation.Loaded`'s fields on a rank (its model, tokenizer, plan, spine and cluster): its plan and its
    folder checked, then the ring joined, its stage loaded and its plan installed; the ranks agree on the plans'
    chunk, and on whether a prompt's last token goes alone (`SpineModel.all_fast`), so that every rank makes the
    same forwards; and a server's prefix cache keeps a prompt's exact tail only below every rank's `exact_below`."""
    import transformers

    from runtime.loading.checkpoints import check_tokenizer_files
    from runtime.loading.model_config import read_config
    from runtime.loading.model_loader import model_dir, open_checkpoint
    from runtime.loading.model_record import read_model_spec
    from runtime.mlx.spine import MlxSpine
    from runtime.mlx.spine_generation import SpineModel
    from runtime.plan import check_plan_matches, load_plan

    path = model_dir(name)
    open_checkpoint(path, read_config(path))
    check_tokenizer_files(path)
    plan = load_plan(spec.plan) if spec.plan else None
    if plan is not None:
        check_plan_matches(plan, read_model_spec(str(path)), spec.plan)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model, cluster = join(spec, path, dtype)
    spine = MlxSpine(model, plan, path, plan_path=spec.plan, package=package).install() if plan else None
    if spine is not None:
        cluster.link.phase = lambda: spine.phase
    cluster.agree("chunk_tokens", plan.chunk_tokens if plan else 0)
    cluster.exact_below = min(cluster.link.gather(plan.exact_below if plan else 0))
    stage = SpineModel(model, path, spine)
    stage.all_fast = min(cluster.link.gather(int(stage.all_fast))) == 1
    return {"model": stage, "tokenizer": tokenizer, "plan": plan, "executor": spine, "engine": "mlx",
            "cluster": cluster}


def load_stage(path: Path, group: mx.distributed.Group, split: list[int] | None, dtype: str) -> nn.Module:
    """mlx-lm's model of the folder with only this rank's layers made (the others never leave the disk), floats in
    `dtype` (`spine_loading.compute_dtype`)."""
    from mlx_lm.utils import load_model

    from runtime.mlx.spine_loading import cast_floats, folder_config

    model, _ = load_model(path, lazy=True, model_config=folder_config(path))
    if not hasattr(model, "model") or not hasattr(model.model, "pipeline"):
        raise NpumoeError(f"mlx-lm has no pipeline for {type(model).__module__.rsplit('.', 1)[-1]!r} models ({path})")
    model.model.pipeline(group, split)
    cast_floats(model, dtype)
    return model


def join(spec: ClusterSpec, path: Path, dtype: str) -> tuple[nn.Module, Cluster]:
    """Join the ring (the ring's own retry lines kept off stderr), load this rank's stage and route its decoder's
    forwards through the link."""
    quiet_ring_lines(spec.ring)
    group = spec.ring.join()
    model = (load_shard(path, group, dtype) if spec.layout == "tensor"
             else load_stage(path, group, list(spec.split) if spec.split else None, dtype))
    link = Link(spec.ring, spec.lead)
    route_forwards(model, link.forward)
    inner = model.model
    layers = len(inner.layers)  # mlx-lm keeps the whole list, None before the stage
    return model, Cluster(spec, group, [inner.start_idx, inner.end_idx or layers], spec.stages(layers), link)


def route_forwards(model: nn.Module, through: Callable) -> None:
    """Every call of the model's decoder (`model.model`) as `through(run, inputs, cache)`: the instance's class
    becomes a subclass whose call does so, so the spine's wrappers and mlx-lm's attributes stay as they are."""
    inner = model.model
    base = type(inner)

    def call(self, inputs: mx.array, cache: list | None = None, *args, **kwargs) -> mx.array:
        return through(lambda: base.__call__(self, inputs, cache, *args, **kwargs), inputs, cache)

    inner.__class__ = type(f"Ringed{base.__name__}", (base,), {"__call__": call})


if __name__ == "__main__":  # the entry before the commands ran across Macs: say which command to run instead
    print("python -m runtime.mlx.cluster: error: across Macs, run the commands under the launcher: `mlx.launch "
          "--hostfile hosts.json autotune run|generate|serve --model M --plan P`", file=sys.stderr)
    sys.exit(2)
