"""`autotune serve --engine mlx`: the server's one scheduler on the MLX spine (tiny-moe converted by mlx-lm to 4 bits,
MLX's CPU device, float32, a plan of 16-token chunks with every expert on mlx-exact), on a free loopback port: a
request's greedy tokens are `autotune generate --engine mlx`'s and mlx-lm's own; requests decoding together (one
batched forward on mlx-lm's BatchKVCache) give each one's tokens alone; a repeated prompt reuses its whole chunks
from the prefix cache (mlx-lm's KVCache) with the same tokens; an echo scores the prompt as mlx-lm's forward does."""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest

mx = pytest.importorskip("mlx.core")
mlx_lm = pytest.importorskip("mlx_lm")

from helpers import convert_to_mlx, mlx_fp32, served_on_a_thread  # noqa: E402

import runtime  # noqa: E402
from autotune.cli import main  # noqa: E402
from runtime.serving.engine import Engine  # noqa: E402

PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2
OTHER = "To be, or not to be"
CHUNK = 16
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = convert_to_mlx(tmp_path_factory.mktemp("serve-mlx") / "q4", 4, 64)
    plan = folder.parent / "exact.json"
    assert main(["plan-template", "--model", str(folder), "--exact", "mlx-exact", "--no-groups", "--chunk",
                 str(CHUNK), "--out", str(plan)]) == 0
    loaded = runtime.load(str(folder), plan=plan, engine="mlx", dtype="float32")
    engine = Engine(loaded, "q4", max_queue=4, prefix_cache_mb=64, max_batch=4)
    engine.warm_up()
    with served_on_a_thread(engine, "k") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        yield SimpleNamespace(url=url, client=client, engine=engine, loaded=loaded, folder=folder, plan=plan)


def _complete(served, prompt, max_tokens: int = 8, **kw) -> openai.types.Completion:
    return served.client.completions.create(model="q4", prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)


def _cached_metric(served) -> float:
    text = httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer k"}).text
    name = "npumoe_prompt_cached_tokens_total "
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def test_greedy_tokens_are_autotune_generates_and_mlx_lms(served, capsys):
    r = _complete(served, PROMPT)
    extra = r.model_extra["npumoe"]
    assert extra["engine"] == "mlx" and len(extra["token_ids"]) == 8
    capsys.readouterr()
    assert main(["generate", "--model", str(served.folder), "--plan", str(served.plan), "--engine", "mlx",
                 "--dtype", "float32", "--prompt", PROMPT, "--max-tokens", "8", "--json"]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert generated["engine"] == "mlx" and generated["token_ids"] == extra["token_ids"]
    assert r.choices[0].text == generated["text"]
    step = importlib.import_module("mlx_lm.generate").generate_step  # the module, not mlx_lm's `generate`
    ids = served.loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
    theirs = [int(t) for t, _ in step(mx.array(ids), mlx_fp32(served.folder), max_tokens=8)]
    assert extra["token_ids"] == theirs
    assert httpx.get(served.url + "/health").json()["engine"] == "mlx"


def test_streamed_text_is_the_whole_responses(served):
    whole = _complete(served, OTHER)
    chunks = list(_complete(served, OTHER, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == whole.choices[0].text and len([t for t in texts if t]) > 1
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].model_extra["npumoe"]["engine"] == "mlx"


def test_requests_decoding_together_give_each_its_own_tokens(served):
    """Prompts of different lengths (their caches left-padded into one BatchKVCache) decode in one forward a step:
    each one's tokens are those it gets alone."""
    prompts = [PROMPT, OTHER, PROMPT[:30]]
    alone = [_complete(served, p, 12).model_extra["npumoe"]["token_ids"] for p in prompts]
    served.engine.batch.widest = 0
    together = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i: int) -> None:
        start.wait()
        together[i] = _complete(served, prompts[i], 12).model_extra["npumoe"]["token_ids"]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert served.engine.batch.widest >= 2  # decoded together
    assert together == alone and all(len(t) == 12 for t in alone)


def test_a_long_prompt_prefills_on_its_thread_while_another_decodes(served):
    """A prompt over 64 tokens that arrives while a request decodes prefills on the prefill thread, beside the
    decode steps (MLX: each thread on its own stream, each counting its own forwards' experts): both requests give
    the tokens they give alone."""
    text = "A long prompt, prefilled on its own thread while the other request keeps decoding. " * 8
    long_ids = served.loaded.tokenizer.encode(text, add_special_tokens=False)[:100]
    alone = [runtime.generate(served.loaded, p, max_tokens=n).token_ids for p, n in ((OTHER, 48), (long_ids, 8))]
    before, got = served.engine.beside_prefill, {}

    def long_request() -> None:
        got["long"] = _complete(served, long_ids).model_extra["npumoe"]["token_ids"]

    second = threading.Thread(target=long_request)
    chunks = _complete(served, OTHER, 48, stream=True, stream_options={"include_usage": True})
    for i, chunk in enumerate(chunks):
        if i == 1:  # the first request decodes: the second arrives
            second.start()
    second.join()
    got["other"] = chunk.model_extra["npumoe"]["token_ids"]  # the usage chunk, last
    assert served.engine.beside_prefill > before
    assert [got["other"], got["long"]] == alone


def test_a_repeated_prompt_reuses_its_whole_chunks(served):
    text = "A prompt no other test sends, long enough for two whole chunks of sixteen tokens. " * 3
    ids = served.loaded.tokenizer.encode(text, add_special_tokens=False)[:40]  # two chunks of 16, then 8
    before = _cached_metric(served)
    first = _complete(served, ids)
    again = _complete(served, ids)
    assert first.model_extra["npumoe"]["cached_tokens"] == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.model_extra["npumoe"]["cached_tokens"] == 32
    assert _cached_metric(served) - before == 32
    assert again.model_extra["npumoe"]["token_ids"] == first.model_extra["npumoe"]["token_ids"]
    reference = runtime.generate(served.loaded, ids, max_tokens=8)
    assert first.model_extra["npumoe"]["token_ids"] == reference.token_ids
    assert httpx.get(served.url + "/health").json()["prefix_cache"]["entries"] >= 1


def test_an_echo_scores_the_prompt_as_mlx_lms_forward(served):
    """`echo` with `max_tokens` 0 (what lm-eval's log-likelihood asks): each prompt token's log-probability from the
    position before it, as the log-softmax of mlx-lm's own forward of the unmodified folder."""
    ids = served.loaded.tokenizer.encode(PROMPT, add_special_tokens=False)[:24]  # a chunk, then 8
    r = served.client.completions.create(model="q4", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    ours = r.choices[0].logprobs.token_logprobs
    logits = mlx_fp32(served.folder)(mx.array(ids)[None])[0]
    theirs = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert ours[0] is None and len(ours) == len(ids)
    np.testing.assert_allclose(ours[1:], [theirs[i - 1, t] for i, t in enumerate(ids) if i], rtol=1e-5, atol=1e-5)



def test_a_plan_with_static_groups_serves_batched_as_alone(served):
    """A tight plan spilling to mlx-exact beside static groups (ane, run as ane-sim here): each layer's block goes
    through the plan's executor. Two requests decoding together give their tokens alone, and each response's spills
    and static calls are its own run's (the groups run in prefill; every decode row stays on the exact path)."""
    plan = served.folder.parent / "tight.json"
    assert main(["plan-template", "--model", str(served.folder), "--exact", "mlx-exact", "--capacity", "tight",
                 "--overflow", "spill", "--backend", "ane", "--chunk", str(CHUNK), "--out", str(plan)]) == 0
    loaded = runtime.load(str(served.folder), plan=plan, engine="mlx", dtype="float32")
    prompts = [PROMPT, OTHER]
    alone = [runtime.generate(loaded, p, max_tokens=10) for p in prompts]
    engine = Engine(loaded, "q4", max_queue=4, prefix_cache_mb=0, max_batch=4)
    got = [None, None]
    with served_on_a_thread(engine, "k") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        start = threading.Barrier(2)

        def run(i: int) -> None:
            start.wait()
            got[i] = client.completions.create(model="q4", prompt=prompts[i], max_tokens=10,
                                               temperature=0).model_extra["npumoe"]

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert engine.batch.widest == 2
    for ours, ref in zip(got, alone):
        assert ours["token_ids"] == ref.token_ids
        assert (ours["spilled"], ours["prefill_static_calls"]) == (ref.spilled, ref.prefill_static_calls)
        assert ours["decode_static_calls"] == 0
    assert got[0]["spilled"] > 0 and got[0]["prefill_static_calls"] > 0


@pytest.mark.slow
def test_autotune_serve_engine_mlx_serves_from_its_engine_process(served):
    """The command as a user runs it (the engine in its spawned process): the request's tokens are the in-process
    engine's, its figures and /health say mlx; SIGTERM drains and exits 0."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPUMOE_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--model", str(served.folder), "--plan",
                             str(served.plan), "--engine", "mlx", "--dtype", "float32", "--port", "0", "--threads",
                             "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = proc.stdout.readline().split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0)
        r = client.completions.create(model="q4", prompt=OTHER, max_tokens=8, temperature=0)
        assert r.model_extra["npumoe"]["engine"] == "mlx"
        assert r.model_extra["npumoe"]["token_ids"] == _complete(served, OTHER).model_extra["npumoe"]["token_ids"]
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["engine"] == "mlx"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
