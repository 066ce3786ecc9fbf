"""A model across two ranks of MLX's ring on 127.0.0.1 (free ports), as users run it: `autotune run`, `generate` and
`serve` under `mlx.launch` (or each rank started with the launcher's environment), tiny-moe at 4 bits in float32,
each rank holding only its stage's layers under its stage's plan, against one process; a neighbour that dies, hangs
or never comes ends a rank with one line naming it, within the timeout; bad input ends every rank with one line of
ours, before the ring is joined where the input says it."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import ENV, convert_to_mlx, launch, one_line_exit_2, ring_file

pytest.importorskip("mlx_lm")
PROMPT = "Static capacity tiers and grouped experts"
AUTOTUNE = [sys.executable, "-m", "autotune"]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


def test_rank_split_is_mlx_lms_order():
    from runtime.mlx.cluster import rank_split

    assert rank_split([(0, 3), (3, 4)]) == [1, 3]  # rank 0 holds the last stage


@pytest.fixture(scope="module")
def pipeline(tiny4, tmp_path_factory):
    """A pipeline file as `autotune search --macs 2` writes it, beside its plan: stage 0 (layer 0, on rank 1) under
    a plan of cpu-static groups (float32) at a tight capacity spilling to mlx-exact, stage 1 (layers 1-3, on rank 0)
    every expert on mlx-exact; an uneven split, so that mlx-lm's even one would not pass for it. The plan beside it
    is the two stages' layers in one, what one process runs."""
    from autotune.cli import main

    d = tmp_path_factory.mktemp("plan")
    common = ["--model", str(tiny4), "--exact", "mlx-exact", "--chunk", "16"]
    assert main(["plan-template", *common, "--capacity", "tight", "--overflow", "spill", "--backend", "cpu-static",
                 "--out", str(d / "plan.stage0.json")]) == 0
    assert main(["plan-template", *common, "--no-groups", "--overflow", "spill", "--out",
                 str(d / "plan.stage1.json")]) == 0
    whole = json.loads((d / "plan.stage1.json").read_text())
    whole["layers"][0] = json.loads((d / "plan.stage0.json").read_text())["layers"][0]
    (d / "plan.json").write_text(json.dumps(whole))
    stages = [{"stage": 0, "rank": 1, "layers": [0, 1], "plan": str(d / "plan.stage0.json")},
              {"stage": 1, "rank": 0, "layers": [1, 4], "plan": "plan.stage1.json"}]  # beside the file
    (d / "plan.pipeline.json").write_text(json.dumps({"schema": "npumoe.pipeline/1", "split": [[0, 1], [1, 4]],
                                                      "stages": stages}))
    return d


@pytest.mark.slow
def test_run_under_the_launcher_runs_each_stage_under_its_plan(tiny4, pipeline, tmp_path):
    ranks = launch(["run", "--model", str(tiny4), "--plan", str(pipeline / "plan.json"), "--engine", "mlx",
                    "--dtype", "float32", "--max-tokens", "64", "--reference", "--json"], tmp_path)
    assert [(r["rank"], r["ranks"], r["layers"]) for r in ranks] == [(0, 2, [1, 4]), (1, 2, [0, 1])]
    for r in ranks:  # every position's logits against mlx-lm's own forward across the same two ranks
        assert r["max_rel_diff_vs_reference"] <= 1e-5 and r["tokens"] == 64
    assert ranks[0]["assignments"] == 64 * 3 * 2 and ranks[1]["assignments"] == 64 * 2  # top-2, each its layers
    assert ranks[1]["spilled"] > 0 and ranks[0]["spilled"] == 0  # rank 1 runs stage 0's tight groups


@pytest.mark.slow
def test_generate_under_the_launcher_gives_one_processs_greedy_tokens(tiny4, pipeline, tmp_path):
    import runtime

    ranks = launch(["generate", "--model", str(tiny4), "--plan", str(pipeline / "plan.json"), "--dtype", "float32",
                    "--prompt", PROMPT, "--max-tokens", "12", "--json"], tmp_path)
    loaded = runtime.load(str(tiny4), plan=str(pipeline / "plan.json"), engine="mlx", dtype="float32")
    one = runtime.generate(loaded, PROMPT, max_tokens=12).to_json()
    assert [r["layers"] for r in ranks] == [[1, 4], [0, 1]]
    assert [r["token_ids"] for r in ranks] == [one["token_ids"]] * 2 and ranks[0]["text"] == one["text"]


@pytest.mark.slow
def test_evaluate_under_the_launcher_gives_one_processs_figures(tiny4, pipeline, tmp_path):
    """Every rank gets the model's logits: one process's perplexities, agreement and difference; each rank counts
    its own layers' experts, which add up to one process's counts."""
    from autotune import pipeline as stages

    args = ["--model", str(tiny4), "--plan", str(pipeline / "plan.json"), "--dtype", "float32", "--max-tokens",
            "256", "--prompt-tokens", "64"]
    ranks = launch(["evaluate", *args, "--json"], tmp_path)
    one = stages.evaluate(str(tiny4), pipeline / "plan.json", max_tokens=256, prompt_tokens=64, dtype="float32",
                          engine="mlx", progress=False).to_json()
    assert [r["layers"] for r in ranks] == [[1, 4], [0, 1]] and one["top1_agreement"] == 1.0
    for r in ranks:
        for key in ("tokens", "prompts", "ppl_reference", "ppl_plan", "top1_agreement", "max_rel_diff_vs_reference"):
            assert r[key] == pytest.approx(one[key], rel=1e-6), key
        assert r["kl_mean"] == pytest.approx(one["kl_mean"], abs=1e-9)
    counts = [[r["assignments"], r["assignments"] * r["spill_rate"], r["assignments"] * r["drop_rate"]]
              for r in [*ranks, one]]
    assert [a + b for a, b in zip(counts[0], counts[1])] == pytest.approx(counts[2])
    assert ranks[1]["spill_rate"] > 0 and ranks[0]["spill_rate"] == 0  # rank 1 runs stage 0's tight groups


def rank_env(hostfile: Path, rank: int) -> dict:
    return {**ENV, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}


def rank(hostfile: Path, k: int, args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([*AUTOTUNE, *args], env=rank_env(hostfile, k), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def peer(hostfile: Path, then: str, cwd: Path) -> subprocess.Popen:
    """Rank 1: joins the ring (trying again while rank 0 still imports: MLX's connecting side gives up after about
    30 s), then `then` (a Python statement)."""
    code = ("import os, time, mlx.core as mx\nwhile True:\n    try:\n        mx.distributed.init(backend='ring', "
            f"strict=True)\n        break\n    except RuntimeError:\n        pass\n{then}")
    return subprocess.Popen([sys.executable, "-c", code], env=rank_env(hostfile, 1), cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def one_line(proc: subprocess.Popen, limit: float, status: int = 3, prefix: str = "npumoe:") -> str:
    _, err = proc.communicate(timeout=limit)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == status, err[-2000:]
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def generate_args(tiny4, timeout: float, *extra: str) -> list[str]:
    return ["generate", "--model", str(tiny4), "--prompt", PROMPT, "--max-tokens", "4", "--dtype", "float32",
            "--peer-timeout-s", str(timeout), *extra]


@pytest.mark.parametrize("then, says", [("time.sleep(1); os._exit(1)", "lost {peer}"),
                                        ("time.sleep(120)", "{peer} did not answer within 15 s")])
def test_a_neighbour_that_dies_or_hangs_ends_the_rank_naming_it(tiny4, tmp_path, then, says):
    hostfile, name = ring_file(tmp_path)
    # rank 0 accepts; rank 1 connects, and MLX spaces its tries by seconds while rank 0 still imports
    first = rank(hostfile, 0, generate_args(tiny4, 15.0), tmp_path)
    other = peer(hostfile, then, tmp_path)
    try:
        line = one_line(first, 90)
    finally:
        other.kill()
        other.wait()
    assert line.startswith("npumoe: rank 0: " + says.format(peer=name))
    assert line.endswith("it died or cannot be reached")


def test_a_neighbour_that_never_comes_ends_the_rank_within_the_timeout(tiny4, tmp_path):
    hostfile, name = ring_file(tmp_path)
    proc = rank(hostfile, 0, generate_args(tiny4, 3.0), tmp_path)
    line = one_line(proc, 90, status=-9)  # killed by its watchdog: the ring's init holds the interpreter
    assert line == f"npumoe: rank 0: {name} did not answer within 3 s (joining the ring): it died or cannot be reached"


@pytest.mark.slow
def test_a_prompt_past_the_context_ends_every_rank_in_one_line(tiny4, tmp_path):
    hostfile, _ = ring_file(tmp_path)
    long = tmp_path / "long.txt"
    long.write_text("static capacity tiers " * 1200)  # 8,401 tokens: past tiny-moe's 4,096 positions
    args = generate_args(tiny4, 60.0)
    args[args.index("--prompt"):args.index("--prompt") + 2] = ["--prompt-file", str(long)]
    procs = [rank(hostfile, k, args, tmp_path) for k in (0, 1)]
    for proc in procs:
        assert "context" in one_line(proc, 180, status=2, prefix="autotune generate: error:")


@pytest.mark.parametrize("command", ["run", "generate", "serve", "evaluate"])
def test_bad_input_under_the_launcher_is_refused_before_the_ring(tiny4, pipeline, a_rank, capsys, command):
    d = a_rank
    (d / "broken.pipeline.json").write_text("{not json")
    short = json.loads((pipeline / "plan.pipeline.json").read_text()) | {"split": [[0, 1], [1, 3]]}
    (d / "short.pipeline.json").write_text(json.dumps(short))
    (d / "bad.txt").write_text("text")
    base = [command, "--model", str(tiny4)] + (["--prompt", PROMPT] if command == "generate" else [])
    plan = ["--plan", str(pipeline / "plan.json")]
    cases = {
        "missing model": (["--model", str(d / "nowhere")], "neither a built-in model"),
        "pipeline not JSON": (["--pipeline", str(d / "broken.pipeline.json")], "cannot read the split"),
        "split short of the layers": (["--pipeline", str(d / "short.pipeline.json")], "does not cover the 4 layers"),
        "timeout below zero": (["--peer-timeout-s", "-1"], "--peer-timeout-s"),
        "torch across Macs": (["--engine", "torch"], "--engine torch: across Macs"),
    }
    if command == "evaluate":
        cases |= {"tasks across Macs": (["--tasks", "builtin:pydoc-nextsent"], "--tasks scores through the torch")}
    if command == "generate":
        cases |= {"negative max tokens": (["--max-tokens", "-1"], "--max-tokens"),
                  "empty prompt": (["--prompt", ""], "the prompt is empty")}
    for name, (extra, says) in cases.items():
        line = one_line_exit_2(capsys=capsys, argv=base + plan + extra)
        assert line.startswith(f"autotune {command}: error:") and says in line, (name, line)


def test_a_pipeline_needs_the_launcher(tiny4, pipeline, capsys):
    line = one_line_exit_2(capsys=capsys, argv=["generate", "--model", str(tiny4), "--prompt", PROMPT, "--pipeline",
                             str(pipeline / "plan.pipeline.json")])
    assert "start every rank with `mlx.launch" in line


def _serve_url(proc: subprocess.Popen, limit: float) -> str:
    start = time.monotonic()
    while time.monotonic() - start < limit:
        line = proc.stdout.readline()
        if " at http://" in line:
            return line.split(" at ")[1].split()[0]
        assert line or proc.poll() is None, proc.stderr.read()[-3000:]
    raise AssertionError("the server did not start")


def _requests(url: str) -> dict:
    """Three requests started at once, the official clients' (an OpenAI completion and chat, streamed, and an
    Anthropic message, streamed), each read past its first token: the streams, by name."""
    import anthropic
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=180)
    claude = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=180)
    streams = {
        "completion": client.completions.create(model="q4g64", prompt=PROMPT, max_tokens=16, temperature=0,
                                                stream=True),
        "chat": client.chat.completions.create(model="q4g64", messages=CHAT, max_tokens=16, temperature=0,
                                               stream=True),
        "message": claude.messages.create(model="q4g64", messages=CHAT, max_tokens=16, extra_body=GREEDY,
                                          stream=True)}
    return {name: iter(stream) for name, stream in streams.items()}


def _text(name: str, events) -> str:
    """A stream's text, read to its end."""
    if name == "message":
        return "".join(e.delta.text for e in events if e.type == "content_block_delta")
    if name == "chat":
        return "".join(c.choices[0].delta.content or "" for c in events if c.choices)
    return "".join(c.choices[0].text for c in events)


def _first(name: str, events) -> str:
    """A stream read to its first token's text."""
    for e in events:
        if name == "message" and e.type == "content_block_delta":
            return e.delta.text
        if name != "message" and e.choices:
            return e.choices[0].text if name == "completion" else e.choices[0].delta.content or ""
    raise AssertionError(f"the {name} stream ended before its first token")


def _cached(url: str, ids: list[int]) -> tuple[list[int], int]:
    """A completion of token ids: its greedy tokens and the prompt tokens it took from the prefix cache."""
    import openai

    r = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=180).completions.create(
        model="q4g64", prompt=ids, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == r.model_extra["npumoe"]["cached_tokens"]
    return r.model_extra["npumoe"]["token_ids"], r.usage.prompt_tokens_details.cached_tokens


def _cached_metric(url: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("npumoe_prompt_cached_tokens_total "))


def _one_process(tiny4, plan: Path, prefix_ids: list[int]) -> dict:
    """What one process serves (the same server on the whole plan, in this process): each request's text alone,
    and a prompt's tokens and cached prompt tokens, first and again."""
    from helpers import served_on_a_thread

    import runtime
    from runtime.serving.engine import Engine

    loaded = runtime.load(str(tiny4), plan=str(plan), engine="mlx", dtype="float32")
    with served_on_a_thread(Engine(loaded, "q4g64", max_queue=4, prefix_cache_mb=64), "k") as url:
        texts = {name: _text(name, events) for name, events in _requests(url).items()}
        return {"texts": texts, "prefix": [_cached(url, prefix_ids), _cached(url, prefix_ids)]}


CHAT = [{"role": "user", "content": "To be, or not to be"}]
GREEDY = {"temperature": 0}  # the Anthropic SDK no longer names it; the server takes it


@pytest.mark.slow
def test_serve_under_the_launcher_batches_and_caches_prefixes_as_one_process(tiny4, pipeline, tmp_path):
    """rank 0 decides (which requests decode together, which prefix each reuses) and rank 1 follows with its own
    stage's KV caches: three requests at once, by the OpenAI and the Anthropic clients, streamed, give one process's
    greedy text; a prompt again reuses its cached chunks as one process does, in usage, /health and /metrics; rank 1
    killed while two requests decode together gives each client an error within the timeout, and rank 0 ends in one
    line naming rank 1."""
    import httpx
    import openai
    import transformers

    hostfile, name = ring_file(tmp_path)
    args = ["serve", "--model", str(tiny4), "--plan", str(pipeline / "plan.json"), "--dtype", "float32", "--port",
            "0", "--peer-timeout-s", "120"]  # rank 0's engine process joins after its own imports
    leader, follower = rank(hostfile, 0, args, tmp_path), rank(hostfile, 1, args, tmp_path)
    words = "A prompt no other request sends, long enough for two whole chunks of sixteen tokens. " * 3
    ids = transformers.AutoTokenizer.from_pretrained(tiny4).encode(words, add_special_tokens=False)[:40]
    try:
        one = _one_process(tiny4, pipeline / "plan.json", ids)
        url = _serve_url(leader, 240).removesuffix("/v1")
        health = httpx.get(url + "/health").json()
        assert health["cluster"]["stages"] == [{"rank": 0, "layers": [1, 4]}, {"rank": 1, "layers": [0, 1]}]
        assert health["max_batch"] > 1 and "entries" in health["prefix_cache"]
        streams = _requests(url)
        firsts = {name: _first(name, events) for name, events in streams.items()}
        assert httpx.get(url + "/health").json()["active"] == 3  # decoding together: one forward a step
        assert {n: firsts[n] + _text(n, events) for n, events in streams.items()} == one["texts"]

        before = _cached_metric(url)
        first, again = _cached(url, ids), _cached(url, ids)
        assert [first, again] == one["prefix"] and again[1] == 32  # two whole chunks of 16 from the cache
        assert _cached_metric(url) - before == 32 and httpx.get(url + "/health").json()["prefix_cache"]["entries"]

        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=180)
        long = [client.completions.create(model="q4g64", prompt=PROMPT * k, max_tokens=400, temperature=0,
                                          stream=True) for k in (20, 12)]
        for stream in long:
            next(iter(stream))
        assert httpx.get(url + "/health").json()["active"] == 2
        follower.send_signal(signal.SIGKILL)  # mid-batch: rank 1 goes
        start = time.monotonic()
        for stream in long:
            with pytest.raises(openai.APIError):
                for _ in stream:
                    pass
        assert time.monotonic() - start < 120 + 5
        line = one_line(leader, 60)
        assert line.startswith(f"npumoe: rank 0: lost {name}") or line.startswith(f"npumoe: rank 0: {name} did not")
    finally:
        for proc in (leader, follower):
            proc.kill()
            proc.wait()


def test_the_old_entry_names_the_commands_in_one_line():
    done = subprocess.run([sys.executable, "-m", "runtime.mlx.cluster", "--model", "x"], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "autotune run|generate|serve" in done.stderr
