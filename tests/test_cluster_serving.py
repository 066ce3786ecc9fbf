"""The server across Macs without a ring: rank 0's engine (its link a loopback that queues each announcement) and a
follower in this process (`cluster_follow.follow`, on a second copy of the model, reading that queue). Requests
decoding together and a prompt reusing a cached prefix leave the follower holding exactly rank 0's prefix cache
entries, bitwise, by their handles: every row that joined or left the batch, every entry kept or reused and every
cache rank 0 let go was told, in an order the follower could replay (tiny-moe, 4 bits, MLX's CPU device, float32)."""
from __future__ import annotations

import gc
import queue
import threading
from types import SimpleNamespace

import numpy as np
import openai
import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from helpers import convert_to_mlx, served_on_a_thread  # noqa: E402

import runtime  # noqa: E402
from autotune.cli import main  # noqa: E402
from runtime.mlx.cluster import route_forwards  # noqa: E402
from runtime.mlx.cluster_follow import Kept, Link, follow  # noqa: E402
from runtime.serving.engine import Engine  # noqa: E402

RING = SimpleNamespace(step=lambda what, fn: fn(), timeout_s=600.0)  # no ring: every step runs at once


class Loopback(Link):
    """Rank 0's link: what it shares is queued for the follower."""

    def __init__(self, heard: queue.Queue) -> None:
        super().__init__(RING, lead=True)
        self.heard = heard

    def _share(self, x: mx.array, what: str) -> np.ndarray:
        self.heard.put(np.array(x))
        return np.array(x)


class Heard(Link):
    """The follower's link: what rank 0 shared, in order."""

    def __init__(self, heard: queue.Queue) -> None:
        super().__init__(RING, lead=False)
        self.heard = heard

    def _share(self, x: mx.array, what: str) -> np.ndarray:
        return self.heard.get(timeout=120)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = convert_to_mlx(tmp_path_factory.mktemp("cluster-serving") / "q4", 4, 64)
    plan = folder.parent / "exact.json"
    assert main(["plan-template", "--model", str(folder), "--exact", "mlx-exact", "--no-groups", "--chunk", "16",
                 "--out", str(plan)]) == 0
    heard = queue.Queue()
    lead, other = (runtime.load(str(folder), plan=plan, engine="mlx", dtype="float32") for _ in range(2))
    lead.cluster = SimpleNamespace(link=Loopback(heard), exact_below=lead.plan.exact_below, health=dict)
    route_forwards(lead.model.mlx, lead.cluster.link.forward)
    other.cluster = SimpleNamespace(link=Heard(heard))
    return lead, other


def test_the_follower_holds_rank_0s_prefix_cache_entries_after_batches_and_reuse(pair):
    lead, other = pair
    got: dict = {}
    follower = threading.Thread(target=lambda: got.update(held=follow(other)))
    follower.start()
    engine = Engine(lead, "q4", max_queue=8, prefix_cache_mb=64, max_batch=4)
    words = "Static groups for the prompt, the exact path for every new token. " * 4
    ids = lead.tokenizer.encode(words, add_special_tokens=False)
    together = [ids[:20], ids[3:30], ids[:9]]  # each a row of the batch; the first two keep a chunk each
    with served_on_a_thread(engine, "k") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=120)

        def complete(prompt: list[int], max_tokens: int = 12) -> dict:
            return client.completions.create(model="q4", prompt=prompt, max_tokens=max_tokens,
                                             temperature=0).model_extra["npumoe"]
        out: list = [None] * 3
        threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, complete(together[i]))) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        longer = complete(ids[:40])  # reuses the first's chunk; its two chunks replace that entry
        again = complete(ids[:40])
        complete(ids[50:60], 1)  # done at its prefill: its cache never joins the batch
    assert engine.batch.widest >= 2 and [longer["cached_tokens"], again["cached_tokens"]] == [16, 32]
    assert again["token_ids"] == longer["token_ids"]
    gc.collect()  # what rank 0 let go is told with its last announcement
    engine.close()
    follower.join(timeout=120)
    entries = [e.layers for e in engine.prefix_cache.entries.values()]
    assert entries and all(isinstance(e, Kept) for e in entries)
    assert set(got["held"]) == {e.npumoe_handle for e in entries}  # every cache freed, every entry kept
    for e in entries:
        for (k, v), (k2, v2) in zip(e, got["held"][e.npumoe_handle]):
            assert np.array_equal(np.array(k), np.array(k2)) and np.array_equal(np.array(v), np.array(v2))
