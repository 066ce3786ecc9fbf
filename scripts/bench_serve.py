"""`autotune serve` against `runtime.generate`, side by side in one run, and the server's behaviour under load.

Starts `autotune serve` on a free loopback port (a subprocess, 1 torch thread by default) and loads the same model
and plan here for `runtime.generate`; prompts are token ids from builtin:pydoc-heldout, so both sides see the same
tokens. Checks, each with a bounded number of requests:

1. overhead: the same greedy request through the server (streamed over HTTP, timed by this client: its first
   token's chunk, then tokens per second between first and last; the server sends a chunk per token, text or not)
   and through `runtime.generate` here, interleaved within each repeat, each repeat on a prompt of its own (none
   finds an earlier one's KV in the server's prefix cache); `overhead_ttft` = median over repeats of
   server TTFT / runtime TTFT, `overhead_tok_s` = median of runtime tok/s / server tok/s (1.0: no overhead; goal
   <= 1.05 each). The floor under the first: the same client's first token from a bare uvicorn app (no model, no
   engine; in the same rotation): `http_floor_ms`, and `overhead_ttft_floor` = median of (runtime TTFT + floor) /
   runtime TTFT, the overhead_ttft of a server that spent nothing but its model's time beside HTTP;
2. prefix cache: prompts sharing a 1,024-token prefix: the first request's TTFT over a later one's, median over
   prefixes (goal >= 5);
3. concurrency: several clients at once (the queue holds them all), every answer's token ids checked against
   `runtime.generate`'s (`mismatched`; a shape twin's random weights mostly pick ids its small tokenizer
   cannot spell, so text alone would not tell), `lost` (no complete answer), TTFT percentiles (queue wait included);
4. a client that leaves mid-stream: its generation stops (the server's cancelled count) and the next request
   is answered as usual (`disconnect_ok`);
5. SIGTERM with a request in flight: it finishes, then the server exits 0 and takes no new connection
   (`sigterm_drain_ok`).

Ends with one JSON line. The machine's load average is in it: a shared machine moves every time figure.
`--engine mlx` serves and generates on the MLX spine (an MLX folder and its plan; the disk prefix cache, torch's
only, is left out and said so).

    python scripts/bench_serve.py [--quick] [--model M --plan P] [--dtype D] [--threads N] [--engine E]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from script_deps import require  # scripts/

require("bench_serve.py", "httpx")
import httpx  # noqa: E402
import torch  # noqa: E402
import uvicorn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import runtime  # noqa: E402
from autotune.calibration.workload import encode_text  # noqa: E402
from runtime.engines import ENGINES  # noqa: E402
from runtime.serving.engine import disk_cache_off  # noqa: E402
from runtime.serving.server import listen  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PLAN = "plans/tiny-moe@apple-m2-ultra-published.json"
PREFIX_TOKENS = 1024
BATCH = 8  # the clients of the batching figure, and the server's --max-batch


class Endpoint:
    """A server this client streams completions from, over one kept connection."""

    def __init__(self, url: str, key: str, model_id: str) -> None:
        self.url, self.model_id = url, model_id
        self.headers = {"Authorization": f"Bearer {key}"}
        self.errors_5xx = 0
        self.requests = 0
        self.client = httpx.Client(timeout=600)  # made once: a new client builds an SSL context, tens of ms

    def stream(self, ids: list[int], max_tokens: int, on_first: Callable[[], bool] | None = None) -> dict:
        """One streamed greedy completion, timed here: first text, last text, the text, finish and usage.
        `on_first` runs at the first text; when it says True the client leaves there."""
        body = {"model": self.model_id, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        out = {"text": "", "finish_reason": None, "usage": None, "done": False, "status": None, "npumoe": None}
        self.requests += 1
        t0 = time.perf_counter()
        with self.client.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers) as r:
            out["status"] = r.status_code
            if r.status_code >= 500:
                self.errors_5xx += 1
            if r.status_code != 200:
                return out
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors_5xx += chunk["error"]["type"] == "server_error"
                    break
                for choice in chunk["choices"]:
                    if choice["finish_reason"] is None:  # one chunk per token (its text may be empty)
                        now = time.perf_counter()
                        out.setdefault("times", []).append(now)
                        if "first_s" not in out:
                            out["first_s"] = now - t0
                            if on_first is not None and on_first():
                                return out  # closing the stream closes the connection
                        out["last_s"] = now - t0
                        out["text"] += choice["text"]
                    out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                out["npumoe"] = chunk.get("npumoe", out.get("npumoe"))
        return out


class Server(Endpoint):
    """`autotune serve` in a subprocess, stopped by its pid."""

    def __init__(self, args: argparse.Namespace, model_id: str, max_queue: int, extra: list[str] = ()) -> None:
        key = secrets.token_hex(16)
        cmd = [sys.executable, "-m", "autotune", "serve", "--model", args.model, "--plan", args.plan, "--dtype",
               args.dtype, "--port", "0", "--threads", str(args.threads), "--max-queue", str(max_queue),
               "--max-batch", str(BATCH), "--engine", args.engine, *extra]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NPUMOE_API_KEY": key}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        if " at " not in line:
            self.proc.wait()
            sys.exit(f"bench_serve: the server did not start (exit {self.proc.returncode})")
        super().__init__(line.split(" at ")[1].split()[0].removesuffix("/v1"), key, model_id)

    def metric(self, name: str) -> float:
        text = self.client.get(self.url + "/metrics", headers=self.headers).text
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.split("{")[0].split(" ")[0] == name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=120)


async def _bare_app(scope: dict, receive: Callable, send: Callable) -> None:
    """An answer with no model behind it: the body read, then a streamed completion of one empty token."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    for finish in (None, "length"):
        chunk = {"choices": [{"text": "", "finish_reason": finish}]}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(chunk)}\n\n".encode(),
                    "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def _serve_bare(port: Connection) -> None:
    sock = listen("127.0.0.1", 0)
    port.send(sock.getsockname()[1])
    uvicorn.Server(uvicorn.Config(_bare_app, log_level="warning", access_log=False)).run(sockets=[sock])


class BareServer(Endpoint):
    """uvicorn, as `autotune serve` runs it, over `_bare_app` in a process of its own: what this client and HTTP
    alone take to a first token (the floor under the server's overhead)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        mine, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_bare, args=(theirs,), daemon=True)
        self.proc.start()
        super().__init__(f"http://127.0.0.1:{mine.recv()}", secrets.token_hex(16), "bare")  # a key as the server's

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.join()


def tok_s(r: dict) -> float | None:
    n = r["usage"]["completion_tokens"] if r.get("usage") else 0
    span = r.get("last_s", 0) - r.get("first_s", 0)
    return (n - 1) / span if n > 1 and span > 0 else None


def overhead(server: Server, bare: BareServer, loaded: runtime.Loaded, prompts: list[list[int]], new: int) -> dict:
    """Each repeat its own prompt (the same on both sides): no repeat finds an earlier one's KV in the server's
    prefix cache (the tail rule keeps a whole short prompt), so both sides do the same work. The bare server's
    first token, in the same rotation, is the floor: what this client and uvicorn take with nothing behind them."""
    ours, theirs, floor = [], [], []
    run = {"server": lambda p: server.stream(p, new), "bare": lambda p: bare.stream(p, new),
           "runtime": lambda p: runtime.generate(loaded, p, max_tokens=new).to_json()}
    for side in run:  # warm-up, each side (the last prompt: no repeat's)
        run[side](prompts[-1])
    repeats = len(prompts) - 1
    for r, prompt in enumerate(prompts[:-1]):
        order = list(run)[r % 3:] + list(run)[:r % 3]  # each side in each place, in turn
        got = {side: run[side](prompt) for side in order}
        ours.append(got["server"])
        theirs.append(got["runtime"])
        floor.append(got["bare"]["first_s"] * 1e3)
        print(f"overhead repeat {r + 1}/{repeats}: server ttft {got['server']['first_s'] * 1e3:.1f} ms (on its "
              f"model {got['server']['npumoe']['ttft_ms']:.1f} ms, cached "
              f"{got['server']['npumoe']['cached_tokens']}), runtime {got['runtime']['ttft_ms']:.1f} ms, bare "
              f"server {floor[-1]:.2f} ms", file=sys.stderr)
    ttft = [s["first_s"] * 1e3 / t["ttft_ms"] for s, t in zip(ours, theirs)]
    speed = [t["generation_tok_s"] / tok_s(s) for s, t in zip(ours, theirs)
             if tok_s(s) and t["generation_tok_s"]]
    return {"overhead_ttft": statistics.median(ttft), "overhead_tok_s": statistics.median(speed) if speed else None,
            "server_ttft_ms": statistics.median(s["first_s"] * 1e3 for s in ours),
            # the server's TTFT outside its model (HTTP, queue hand-off, thread wake-ups): client's less the server's
            "server_outside_model_ms": statistics.median(s["first_s"] * 1e3 - s["npumoe"]["ttft_ms"] for s in ours),
            # the floor: a bare uvicorn app's first token to this client; the best overhead_ttft any server could show
            "http_floor_ms": statistics.median(floor),
            "overhead_ttft_floor": statistics.median((t["ttft_ms"] + f) / t["ttft_ms"] for t, f in zip(theirs, floor)),
            "server_outside_floor_ms": statistics.median(s["first_s"] * 1e3 - s["npumoe"]["ttft_ms"] - f
                                                         for s, f in zip(ours, floor)),
            "runtime_ttft_ms": statistics.median(t["ttft_ms"] for t in theirs),
            "server_tok_s": statistics.median(x for x in map(tok_s, ours) if x) if speed else None,
            "runtime_tok_s": statistics.median(t["generation_tok_s"] for t in theirs if t["generation_tok_s"]),
            "overhead_cached_tokens": sum(s["npumoe"]["cached_tokens"] for s in ours),
            "overhead_mismatched": sum(s["npumoe"]["token_ids"] != t["token_ids"] for s, t in zip(ours, theirs))}


def prefix_cache(server: Server, text_ids: list[int], pairs: int, suffix: int) -> dict:
    """Per prefix: a first request (nothing cached), then one with another suffix (the prefix cached)."""
    ratios, firsts, laters, cached = [], [], [], []
    for p in range(pairs):
        base = p * (PREFIX_TOKENS + 2 * suffix)
        prefix = text_ids[base:base + PREFIX_TOKENS]
        tail = text_ids[base + PREFIX_TOKENS:base + PREFIX_TOKENS + 2 * suffix]
        first = server.stream(prefix + tail[:suffix], 2)
        later = server.stream(prefix + tail[suffix:], 2)
        cached.append(later["usage"]["prompt_tokens_details"]["cached_tokens"])
        firsts.append(first["first_s"] * 1e3)
        laters.append(later["first_s"] * 1e3)
        ratios.append(firsts[-1] / laters[-1])
        print(f"prefix {p + 1}/{pairs}: first {firsts[-1]:.1f} ms, later {laters[-1]:.1f} ms (cached {cached[-1]}; "
              f"on its model {first['npumoe']['ttft_ms']:.1f} and {later['npumoe']['ttft_ms']:.1f} ms, queued "
              f"{first['npumoe']['queue_ms']:.1f} and {later['npumoe']['queue_ms']:.1f} ms)", file=sys.stderr)
    return {"prefix_cache_ttft_speedup": statistics.median(ratios), "prefix_tokens": PREFIX_TOKENS,
            "prefix_cached_tokens": min(cached), "prefix_first_ttft_ms": statistics.median(firsts),
            "prefix_later_ttft_ms": statistics.median(laters)}


def concurrency(server: Server, loaded: runtime.Loaded, prompts: list[list[int]], clients: int, new: int) -> dict:
    expected = [runtime.generate(loaded, p, max_tokens=new).token_ids for p in prompts]
    results: list[dict | None] = [None] * len(prompts)

    def client(c: int) -> None:
        for i in range(c, len(prompts), clients):
            try:
                results[i] = server.stream(prompts[i], new)
            except httpx.HTTPError as e:
                print(f"request {i}: {e}", file=sys.stderr)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    complete = [r for r in results if r and r["done"] and r["finish_reason"]]
    ttfts = sorted(r["first_s"] * 1e3 for r in complete if "first_s" in r)
    return {"concurrent_clients": clients, "concurrent_requests": len(prompts),
            "lost": len(prompts) - len(complete),
            "mismatched": sum(r is None or r["npumoe"] is None or r["npumoe"]["token_ids"] != e
                              for r, e in zip(results, expected)),
            "p50_ttft_ms": statistics.median(ttfts) if ttfts else None,
            "p99_ttft_ms": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))] if ttfts else None}


def batching(server: Server, loaded: runtime.Loaded, prompts: list[list[int]], new: int) -> dict:
    """`batch_tok_s_ratio`: BATCH clients at once, their total generation tokens/s (from the first one's first
    token to the last one's last), over one client's alone; their greedy tokens against runtime.generate's."""
    alone = server.stream(prompts[0], new)
    results: list[dict | None] = [None] * len(prompts)

    def client(i: int) -> None:
        results[i] = server.stream(prompts[i], new)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in results if r and r.get("times")]
    span = max(r["times"][-1] for r in done) - min(r["times"][0] for r in done)
    total = sum(len(r["times"]) for r in done) - 1
    expected = [runtime.generate(loaded, p, max_tokens=new).token_ids for p in prompts]
    return {"batch_clients": len(prompts), "batch_tok_s": total / span, "single_tok_s": tok_s(alone),
            "batch_tok_s_ratio": total / span / tok_s(alone),
            "batch_mismatched": sum(r is None or r["npumoe"]["token_ids"] != e for r, e in zip(results, expected))}


def _p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def itl_during_prefill(server: Server, prompt: list[int], long_prompt: list[int], new: int) -> dict:
    """A streaming client's p95 inter-token latency while another request prefills a long prompt, over its p95
    alone (`itl_p95_during_prefill_ratio`)."""
    alone = server.stream(prompt, new)
    window: dict = {}

    def long_request() -> None:
        window["start"] = time.perf_counter()
        r = server.stream(long_prompt, 1)
        window["end"] = window["start"] + r["first_s"]
    thread = threading.Thread(target=long_request)
    during = server.stream(prompt, new, on_first=lambda: thread.start() and False)
    thread.join()
    times = during["times"]
    gaps = [b - a for a, b in zip(times, times[1:]) if window["start"] <= b <= window["end"]]
    gaps_alone = [b - a for a, b in zip(alone["times"], alone["times"][1:])]
    return {"long_prompt_tokens": len(long_prompt), "itl_p95_alone_ms": _p95(gaps_alone) * 1e3,
            "itl_p95_during_prefill_ms": _p95(gaps) * 1e3 if gaps else None, "itl_gaps_during_prefill": len(gaps),
            "itl_p95_during_prefill_ratio": _p95(gaps) / _p95(gaps_alone) if gaps else None}


def disk_prefix_tokens(positions: int, chunk: int, exact_below: int, tail: int = 16, room: int = 64) -> int:
    """The longest prefix (at most 2,048 tokens) the prefix caches reuse for it plus `tail` tokens within the
    context less `room`: whole chunks, or past the last boundary by the tail rule (the prompt's partial chunk under
    `exact_below` tokens)."""
    top = min(2048, positions - room - tail)
    best = top // chunk * chunk
    for boundary in range(chunk, top, chunk):
        best = max(best, min(boundary + min(exact_below, chunk) - 1 - tail, top))
    return best


def disk_prefix(args: argparse.Namespace, server: Server, model_id: str, text_ids: list[int], prefix_len: int,
                folder: Path) -> dict:
    """`disk_prefix_ttft_speedup`: a long prefix stored by one server with --prefix-cache-dir; after a restart,
    the first request that shares it, against the same request as the first to a fresh server without the disk
    cache (both pay a fresh server's first-request costs)."""
    prefix, tails = text_ids[:prefix_len], [text_ids[prefix_len + 16 * i:prefix_len + 16 * i + 16] for i in (0, 1)]
    disk = ["--prefix-cache-dir", str(folder)]
    first = Server(args, model_id, 2, disk)
    first.stream(prefix + tails[0], 2)
    first.stop()
    restarted, plain = Server(args, model_id, 2, disk), Server(args, model_id, 2)  # both fresh after a start
    try:
        hit = restarted.stream(prefix + tails[1], 2)
        cold = plain.stream(prefix + tails[1], 2)
    finally:
        for other in (first, restarted, plain):
            other.stop()
            server.errors_5xx += other.errors_5xx
            server.requests += other.requests
    return {"disk_prefix_tokens": prefix_len,
            "disk_prefix_cached_tokens": hit["usage"]["prompt_tokens_details"]["cached_tokens"],
            "disk_prefix_ttft_ms": hit["first_s"] * 1e3, "no_disk_ttft_ms": cold["first_s"] * 1e3,
            "disk_prefix_ttft_speedup": cold["first_s"] / hit["first_s"],
            "disk_mismatched": int(hit["npumoe"]["token_ids"] != cold["npumoe"]["token_ids"])}


def disconnect(server: Server, loaded: runtime.Loaded, prompt: list[int]) -> bool:
    cancelled = server.metric("npumoe_requests_cancelled_total")
    server.stream(prompt, 1000, on_first=lambda: True)
    after = server.stream(prompt, 4)
    ok = after["done"] and after["npumoe"]["token_ids"] == runtime.generate(loaded, prompt, max_tokens=4).token_ids
    return bool(ok and server.metric("npumoe_requests_cancelled_total") == cancelled + 1)


def sigterm_drain(server: Server, prompt: list[int], new: int) -> bool:
    """SIGTERM once the request has its first text: it must still finish, then the server exit 0."""
    result = server.stream(prompt, new, on_first=lambda: server.proc.send_signal(signal.SIGTERM))
    code = server.proc.wait(timeout=120)
    try:
        httpx.get(server.url + "/health", timeout=5)
        refused = False
    except httpx.ConnectError:
        refused = True
    return bool(result.get("done") and result.get("finish_reason") and code == 0 and refused)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-moe")
    ap.add_argument("--plan", default=DEFAULT_PLAN, help=f"the plan to serve (default {DEFAULT_PLAN})")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="fewer repeats and requests")
    ap.add_argument("--engine", choices=ENGINES, default="auto", help="the spine both sides run on (default auto)")
    args = ap.parse_args()
    if not Path(args.plan).is_file():
        sys.exit(f"bench_serve: no plan at {args.plan}; make it with `autotune search --model {args.model} --profile "
                 "apple-m2-ultra-published --out <plan>` and pass --plan")
    repeats, pairs, clients, per_client = (3, 2, 3, 2) if args.quick else (8, 3, 6, 4)
    prompt_len, new = (128, 16) if args.quick else (256, 32)
    torch.set_num_threads(args.threads)
    loaded = runtime.load(args.model, plan=args.plan, dtype=args.dtype, engine=args.engine)
    positions = loaded.model.config.max_position_embeddings
    need = pairs * (PREFIX_TOKENS + 64) + 2048 + 6400
    text_ids = encode_text(loaded.tokenizer, "builtin:pydoc-heldout", need).tolist()
    if len(text_ids) < need or PREFIX_TOKENS + 32 >= positions:
        sys.exit(f"bench_serve: needs {need} text tokens and a context past {PREFIX_TOKENS + 32}")
    server = Server(args, Path(args.model).resolve().name if Path(args.model).is_dir() else args.model,
                    max(clients, BATCH))
    try:
        prompt = text_ids[:prompt_len]
        result = {"model": args.model, "plan": args.plan, "dtype": args.dtype, "engine": loaded.engine,
                  "threads": args.threads,
                  "quick": args.quick, "chunk_tokens": loaded.plan.chunk_tokens, "prompt_tokens": prompt_len,
                  "new_tokens": new, "repeats": repeats}
        # each repeat (and the warm-up) a prompt of its own, starting one token further into the text
        bare = BareServer()
        try:
            result.update(overhead(server, bare, loaded, [text_ids[r:r + prompt_len] for r in range(repeats + 1)],
                                   new))
        finally:
            bare.stop()
        result.update(prefix_cache(server, text_ids[prompt_len:], pairs, 16))
        start = prompt_len + pairs * (PREFIX_TOKENS + 32)
        prompts = [text_ids[start + 40 * i:start + 40 * i + 24 + i % 16] for i in range(clients * per_client)]
        result.update(concurrency(server, loaded, prompts, clients, 8))
        start += 40 * len(prompts) + 64  # past the concurrency prompts
        batch_prompts = [text_ids[start + 40 * i:start + 40 * i + 24] for i in range(BATCH)]
        result.update(batching(server, loaded, batch_prompts, new))
        # the text's last 6,400 tokens: a long prompt (4,096, or the most the context holds), then a disk prefix;
        # neither starts like an earlier prompt, so no prefix of theirs is cached before
        long_prompt = text_ids[-6400:-6400 + min(4096, positions - 8)]
        result.update(itl_during_prefill(server, batch_prompts[0], long_prompt, 4 * new))
        if (off := disk_cache_off(loaded.engine)) is not None:
            result["disk_prefix"] = f"off: {off.split(';')[0]}"
        else:
            with tempfile.TemporaryDirectory(prefix="npumoe-bench-prefix-") as folder:
                chunk = loaded.plan.chunk_tokens
                result.update(disk_prefix(args, server, server.model_id, text_ids[-2200:],
                                          disk_prefix_tokens(positions, chunk, loaded.plan.exact_below),
                                          Path(folder)))
        result["disconnect_ok"] = disconnect(server, loaded, prompt)
        result["sigterm_drain_ok"] = sigterm_drain(server, prompt, new)
    finally:
        if server.proc.poll() is None:
            server.stop()
    result["mismatched"] += sum(result.get(f"{k}_mismatched", 0) for k in ("overhead", "batch", "disk"))
    result.update(requests=server.requests, errors_5xx=server.errors_5xx, load_average=os.getloadavg())
    print(json.dumps(result))


if __name__ == "__main__":
    main()
