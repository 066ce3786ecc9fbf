"""The cache state an op meets inside a forward, set before each timed run of a CPU record (dense ops, expert
calls, the executor's host-side work, the expert kernels).

In a forward, an op's input was just written by the op before it, while its weights, the KV cache and the
buffers it writes were last touched a layer ago, pushed out of the caches since by the layer's other work (the
attention scores alone: 64 MiB at tiny-moe's 2,048 tokens). A loop that calls the op again and again finds all of
them in cache: on this project's 2-core VM a tiny-moe projection at 2,048 rows ran 1.2-1.4x and a q/k norm
1.4-2.4x slower inside the forward than in such a loop, and 1.2x and 1.7-1.9x after 128 MiB or more were written
before each run (32 MiB: 1.05x and 1.1x; the host's last-level cache is 300 MiB, shared with other guests). So
before each run `ForwardCaches.before` writes EVICT_BYTES, then rewrites the op's inputs in place (hot again, as
the op before it leaves them). On this VM an exact expert call at 256 rows ran 1.4x and the exact path's host-side
work for a 2,048-token chunk 1.5x slower so than in a loop.

That is the state of a model whose layers do not fit the host's last-level cache. One whose weights do (tiny-moe's
experts, about 50 MB, on a host with 480 MiB of L3) finds them there a forward later: an exact expert call at its
width ran 1.5x (256 rows) and 1.25x (1,024 rows) faster without the eviction. One whose layer does keeps that
layer's buffers hot (tiny-moe in fp32 on an EPYC with 32 MiB: 58 MB of weights, 13 MiB per layer; its run came
within 0.6-1.5% of the in-cache prediction, 30-32% under the evicted one). So each record is also timed back to
back (`warm_median_ms`), and the profile fits a second cost model to those figures for such models
(`Profile.cost_model_for`, by a layer's weights). A forward is not quite that warm (tiny-moe-width expert calls
took 0.53x their evicted time back to back, while its run's experts took about 0.8x), so the in-cache fit priced
such a model a little fast (its experts 9-16% under the run) where the evicted one priced it 17-25% slow."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Past the slowdown's plateau on this VM (128-512 MiB measured the same) and past the last-level caches of the Macs
# we target (an M2 Ultra's system level cache: about 96 MiB). One write of it takes ~25 ms here: a record then stops
# at its min_runs (Settings.min_time_s counts it).
EVICT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Call:
    """One call to time: `run` makes it; `inputs` are what the op before it in a forward writes."""
    run: Callable[[], object]
    inputs: tuple[torch.Tensor, ...]


class ForwardCaches:
    """Puts the caches in a forward's state ahead of a timed run."""

    def __init__(self, nbytes: int = EVICT_BYTES) -> None:
        self.buffer = torch.empty(nbytes // 4, dtype=torch.float32)  # whatever the default dtype

    def before(self, call: Call) -> Callable[[], None]:
        """What to run ahead of each of `call`'s timed runs."""
        def prepare() -> None:
            self.buffer.fill_(1.0)
            for t in call.inputs:
                t.mul_(1.0)  # rewritten, values unchanged
        return prepare
