"""`autotune serve`: the official `openai` client against the server on a free loopback port (in-process uvicorn on
a thread; a subprocess for SIGTERM): completions and chat, streaming and not, the greedy tokens of
`runtime.generate`, the prefix cache, auth, 429, malformed requests, disconnects, the drain."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import anthropic
import httpx
import openai
import pytest
import torch
from helpers import served_on_a_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import runtime
from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import model_spec
from runtime.plan import save_plan
from runtime.prefill import prefill_logits
from runtime.serving.engine import Engine, fallback_chat_text
from runtime.serving.scheduler import Job
from runtime.serving.server import listen

KEY = "test-key"
CHUNK = 16
PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2
ROOT = Path(__file__).resolve().parents[1]


def _spill_plan(path: Path) -> Path:
    save_plan(template_plan(model_spec(runtime.load("tiny-moe", dtype="float32").model), "tight", "spill",
                            chunk_tokens=CHUNK), path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """tiny-moe under a spill plan with 16-token chunks, served on a free loopback port from a thread."""
    plan = _spill_plan(tmp_path_factory.mktemp("serve") / "spill.json")
    loaded = runtime.load("tiny-moe", plan=plan, dtype="float32")
    engine = Engine(loaded, "tiny-moe", max_queue=2, prefix_cache_mb=64)
    engine.warm_up()
    with served_on_a_thread(engine, KEY) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        yield SimpleNamespace(url=url, client=client, engine=engine, loaded=loaded, plan=plan)


def _reference(served, prompt, max_tokens: int) -> dict:
    """runtime.generate on the same loaded model and plan (the worker is idle between tests)."""
    return runtime.generate(served.loaded, prompt, max_tokens=max_tokens)


def _finish(reference: dict) -> str:
    return "stop" if reference.finish_reason == "eos" else "length"


def _metric(served, name: str) -> float:
    text = httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def test_completion_greedy_equals_runtime_generate(served):
    ref = _reference(served, PROMPT, 8)
    r = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == _finish(ref)
    assert r.usage.prompt_tokens == ref.prompt_tokens and r.usage.completion_tokens == ref.generated_tokens
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    extra = r.model_extra["npumoe"]
    assert extra["token_ids"] == ref.token_ids
    assert extra["prefill_static_calls"] > 0 and extra["decode_static_calls"] == 0 and extra["spilled"] > 0
    assert extra["ttft_ms"] > 0 and extra["drift"]["alert"] is False
    assert served.client.models.list().data[0].id == "tiny-moe"


def test_streamed_completion_is_the_same_text_with_usage_last(served):
    ref = _reference(served, PROMPT, 8)
    chunks = list(served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == ref.text and len([t for t in texts if t]) > 1
    assert chunks[-2].choices[0].finish_reason == _finish(ref)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == ref.generated_tokens


def test_chat_uses_the_fallback_format_streamed_or_not(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be"}]
    text = fallback_chat_text(messages)
    assert text == "System: Be brief.\nUser: To be, or not to be\nAssistant:"
    ref = _reference(served, text, 6)
    r = served.client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=6, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == ref.prompt_tokens
    chunks = list(served.client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=6,
                                                        temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == _finish(ref) and chunks[-1].usage is None


def test_prefix_cache_reuses_whole_chunks_and_keeps_the_output(served):
    """A prompt that shares 40 tokens with an earlier one reuses 32 (two chunks of 16): same tokens as without."""
    ids = served.loaded.tokenizer.encode(PROMPT * 2, add_special_tokens=False)
    first, second = ids[:45], ids[:40] + ids[50:58]
    r1 = served.client.completions.create(model="tiny-moe", prompt=first, max_tokens=4, temperature=0)
    r2 = served.client.completions.create(model="tiny-moe", prompt=second, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == 32
    assert r2.model_extra["npumoe"]["cached_tokens"] == 32
    ref1, ref2 = _reference(served, first, 4), _reference(served, second, 4)
    assert (r1.choices[0].text, r2.choices[0].text) == (ref1.text, ref2.text)
    again = served.client.completions.create(model="tiny-moe", prompt=first, max_tokens=4, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 32 and again.choices[0].text == ref1.text


def test_concurrent_requests_batch_their_decode_and_keep_their_greedy_tokens(served):
    """Six clients at once, prompts of different lengths (left padding, interleaved prefill chunks), their own
    max_tokens and stop sequences: each gets what runtime.generate gives it alone; decode stays exact."""
    ids = served.loaded.tokenizer.encode(PROMPT * 3, add_special_tokens=False)
    prompts = [ids[:n] for n in (5, 17, 40, 23, 64, 9)]
    news = [12, 7, 10, 3, 9, 12]
    refs = [_reference(served, p, n) for p, n in zip(prompts, news)]
    stop = refs[0].text[4:7]  # the first client stops early on its own stop sequence
    decode_calls = _metric(served, 'npumoe_static_calls_total{phase="decode"}')
    results = [None] * len(prompts)

    def ask(i):
        results[i] = served.client.completions.create(model="tiny-moe", prompt=prompts[i], max_tokens=news[i],
                                                      temperature=0, stop=[stop] if i == 0 else None)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    scheduler = served.engine.scheduler
    scheduler.max_queue = 16  # they all arrive before the worker's next round (the fixture's queue holds 2)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        scheduler.max_queue = 2
    assert results[0].choices[0].text == refs[0].text[:refs[0].text.index(stop)]
    assert results[0].choices[0].finish_reason == "stop"
    for r, ref in list(zip(results, refs))[1:]:
        assert r.model_extra["npumoe"]["token_ids"] == ref.token_ids and r.choices[0].text == ref.text
        assert r.model_extra["npumoe"]["decode_static_calls"] == 0
    assert served.engine.batch.widest >= 2  # decode steps really ran together
    assert _metric(served, 'npumoe_static_calls_total{phase="decode"}') == decode_calls


def test_a_long_prefill_runs_beside_the_decoding_stream_and_both_keep_their_tokens(served):
    """A 13-chunk prompt arrives while a stream decodes: its prefill runs on the prefill thread while decode steps
    go on (counted), the stream's greedy tokens and the long request's tokens and prefill figures (static calls,
    spills, drops: the prefill phase's own, not mixed with the decode thread's) equal runtime.generate's alone."""
    ids = served.loaded.tokenizer.encode(PROMPT * 12, add_special_tokens=False)
    short, long = ids[:9], ids[200:1:-1]  # no earlier prompt starts like it: nothing of it is cached
    ref_short, ref_long = _reference(served, short, 40), _reference(served, long, 4)
    beside = served.engine.beside_prefill
    body = {"model": "tiny-moe", "prompt": short, "max_tokens": 40, "temperature": 0, "stream": True}
    first, streamed = threading.Event(), {}

    def stream():
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    first.set()
                    streamed["npumoe"] = json.loads(line[6:]).get("npumoe", streamed.get("npumoe"))
    thread = threading.Thread(target=stream)
    thread.start()
    assert first.wait(60)
    r = served.client.completions.create(model="tiny-moe", prompt=long, max_tokens=4, temperature=0)
    thread.join()
    figures = r.model_extra["npumoe"]
    assert figures["cached_tokens"] == 0 and figures["token_ids"] == ref_long.token_ids
    assert (figures["prefill_static_calls"], figures["spilled"], figures["dropped"]) == \
        (ref_long.prefill_static_calls, ref_long.spilled, ref_long.dropped)
    assert ref_long.prefill_static_calls > 0 and ref_long.spilled > 0  # the plan's groups really ran
    assert streamed["npumoe"]["token_ids"] == ref_short.token_ids and streamed["npumoe"]["decode_static_calls"] == 0
    assert served.engine.beside_prefill > beside  # decode steps ran while the long prompt prefilled


def test_sampling_is_seeded(served):
    def sample(seed):
        return served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=6, temperature=1.0,
                                                top_p=0.9, seed=seed).choices[0].text
    assert sample(7) == sample(7)


def test_stop_sequence_ends_the_text_before_it(served):
    full = _reference(served, PROMPT, 12).text
    at = next(i for i in range(2, len(full) - 3) if full.index(full[i:i + 3]) == i)  # its first occurrence
    r = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=12, temperature=0,
                                         stop=["never there", full[at:at + 3]])
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"


def test_new_tokens_stop_at_the_model_context(served):
    positions = served.loaded.model.config.max_position_embeddings
    prompt = [5] * (positions - 3)
    r = served.client.completions.create(model="tiny-moe", prompt=prompt, max_tokens=50, temperature=0)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")


def _plan_logprobs(served, ids: list[int]) -> torch.Tensor:
    """log-softmax of the logits the plan computes for `ids` in its chunks, float32: [T, vocab]."""
    return torch.log_softmax(prefill_logits(served.loaded.model, torch.tensor(ids), CHUNK).float(), dim=-1)


def test_echo_scores_the_prompt_with_the_plans_logits(served):
    ids = served.loaded.tokenizer.encode(PROMPT, add_special_tokens=False)
    r = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2,
                                         temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT and r.usage.completion_tokens == 0 and len(lp.tokens) == len(ids)
    assert "".join(lp.tokens) == PROMPT and lp.text_offset[0] == 0 and lp.text_offset[-1] == len(PROMPT) - len(
        lp.tokens[-1])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _plan_logprobs(served, ids)
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), want, atol=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:]):
        best = ref[i].topk(2).values.tolist()
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0], abs=1e-4)
        assert top[lp.tokens[i + 1]] == lp.token_logprobs[i + 1]  # the chosen token is always there


def test_completion_logprobs_of_the_new_tokens_streamed_or_not(served):
    ref = _reference(served, PROMPT, 6)
    r = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=6, logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == ref.text and len(lp.tokens) == ref.generated_tokens
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and max(top.values()) == value == top[token]  # greedy: the chosen one is the likeliest
    chunks = list(served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=6, logprobs=1,
                                                   temperature=0, stream=True))
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    echoed = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=6, logprobs=1,
                                              temperature=0, echo=True).choices[0]
    # all prompt positions' logits against the last one's alone: the same to float32 rounding
    assert echoed.text == PROMPT + ref.text
    assert echoed.logprobs.token_logprobs[-6:] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_content_streamed_or_not(served):
    messages = [{"role": "user", "content": "To be, or not to be"}]
    r = served.client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and "".join(c.token for c in content) == \
        r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob == c.logprob  # greedy
        assert c.bytes == list(c.token.encode())
    chunks = list(served.client.chat.completions.create(model="tiny-moe", messages=messages, max_tokens=5,
                                                        temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [c for ch in chunks if ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == [c.logprob for c in content]
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model="tiny-moe", messages=messages, top_logprobs=3)
    with pytest.raises(openai.BadRequestError):
        served.client.chat.completions.create(model="tiny-moe", messages=messages, logprobs=True, top_logprobs=21)


ANTHROPIC_MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "To be, or not to be"}]}]
GREEDY = {"temperature": 0}  # the SDK (2.x) no longer names temperature; the API and this server take it


def _anthropic(served, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=key, max_retries=0)


def _chat_text(served, max_tokens: int, **kwargs) -> object:
    return served.client.chat.completions.create(
        model="tiny-moe", max_tokens=max_tokens, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be, or not to be"}],
        **kwargs)


def test_anthropic_messages_equal_the_chat_endpoint_streamed_or_not(served):
    chat = _chat_text(served, 6)
    client = _anthropic(served)
    m = client.messages.create(model="tiny-moe", max_tokens=6, extra_body=GREEDY, system="Be brief.",
                               messages=ANTHROPIC_MESSAGES)
    assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text"
    assert m.content[0].text == chat.choices[0].message.content
    assert m.usage.input_tokens == chat.usage.prompt_tokens and m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    with client.messages.stream(model="tiny-moe", max_tokens=6, extra_body=GREEDY, system="Be brief.",
                                messages=ANTHROPIC_MESSAGES) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == m.content[0].text == final.content[0].text and final.stop_reason == m.stop_reason
    assert final.usage.output_tokens == m.usage.output_tokens


def test_anthropic_stream_is_anthropics_event_sequence(served):
    body = {"model": "tiny-moe", "max_tokens": 4, "temperature": 0, "stream": True, "messages": ANTHROPIC_MESSAGES}
    with httpx.stream("POST", served.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as r:
        events = [line.removeprefix("event: ") for line in r.iter_lines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert set(events[3:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_stop_sequences_and_errors(served):
    client = _anthropic(served)
    full = client.messages.create(model="tiny-moe", max_tokens=12, extra_body=GREEDY,
                                  messages=ANTHROPIC_MESSAGES).content[0].text
    at = next(i for i in range(2, len(full) - 3) if full.index(full[i:i + 3]) == i)
    m = client.messages.create(model="tiny-moe", max_tokens=12, extra_body=GREEDY, messages=ANTHROPIC_MESSAGES,
                               stop_sequences=[full[at:at + 3]])
    assert m.content[0].text == full[:at] and m.stop_reason == "stop_sequence"
    assert m.stop_sequence == full[at:at + 3]
    with pytest.raises(anthropic.AuthenticationError) as e:
        _anthropic(served, "wrong").messages.create(model="tiny-moe", max_tokens=4, messages=ANTHROPIC_MESSAGES)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(model="claude-x", max_tokens=4, messages=ANTHROPIC_MESSAGES)
    assert e.value.body["error"]["type"] == "not_found_error"
    for bad in ({"messages": ANTHROPIC_MESSAGES}, {"max_tokens": 4, "messages": []},
                {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
                {"max_tokens": 4, "messages": ANTHROPIC_MESSAGES, "temperature": 1.5},
                {"max_tokens": 4, "messages": ANTHROPIC_MESSAGES, "tools": [{"name": "x"}]}):
        r = httpx.post(served.url + "/v1/messages", json={"model": "tiny-moe", **bad}, headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", bad


@pytest.mark.parametrize("where,block", [
    ("messages.0.content", {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}),
    ("messages.0.content", {"type": "tool_result", "tool_use_id": "t1", "content": "42"}),
    ("system", {"type": "document", "source": {}}),
])
def test_an_unsupported_anthropic_block_is_named(served, where, block):
    """Before, pydantic tried the content as a string: "messages.0.content.str: Input should be a valid string"."""
    body = {"model": "tiny-moe", "max_tokens": 4, "messages": ANTHROPIC_MESSAGES}
    if where == "system":
        body["system"] = [{"type": "text", "text": "be brief"}, block]
    else:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "look:"}, block]}]
    r = httpx.post(served.url + "/v1/messages", json=body, headers={"x-api-key": KEY})
    error = r.json()["error"]
    assert r.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{where}: content block 1 is of type {block['type']!r}, which this "
                                       "server does not support"), error


@pytest.mark.parametrize("case", ["file", "unwritable", "no plan"])
def test_serve_refuses_a_bad_prefix_cache_dir_before_loading(case, tmp_path, capsys, monkeypatch):
    """Refused at once in one line: before, the model was loaded first (9 s on a large one) and a file said only
    "File exists"."""
    import autotune.commands.serve as serve_command

    def must_not_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr(serve_command, "EngineProcess", must_not_load)
    folder = tmp_path / "cache"
    if case == "file":
        folder.write_text("not a folder")
    elif case == "unwritable":
        folder.mkdir()
        folder.chmod(0o500)
        try:  # root writes anywhere permission bits say no: take a folder no one can create files in
            (folder / "probe").touch()
            folder = Path("/proc/self")
        except PermissionError:
            pass
    plan = [] if case == "no plan" else ["--plan", str(_spill_plan(tmp_path / "spill.json"))]
    try:
        code = main(["serve", "--model", "tiny-moe", *plan, "--port", "0", "--prefix-cache-dir", str(folder)])
    except SystemExit as e:  # the flag's own check: argparse's exit
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    expect = {"file": "is a file, not a directory", "unwritable": "cannot write in", "no plan": "needs --plan"}[case]
    assert code == 2 and len(err) == 1 and expect in err[0] and "--prefix-cache-dir" in err[0], err


FUZZ_EXAMPLES = 40  # per endpoint, valid and invalid each: bounded for CI
FUZZED: dict[str, int] = {}


def _from_schema(schema: dict, root: dict):
    """Values valid under a JSON schema, for the parts pydantic writes (hypothesis-jsonschema does not run on
    this Hypothesis): $ref, anyOf, const/enum, objects, arrays, strings, numbers, booleans, null."""
    if "$ref" in schema:
        return st.deferred(lambda: _from_schema(root["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]],
                                                root))
    if "anyOf" in schema:
        return st.one_of([_from_schema(s, root) for s in schema["anyOf"]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")]))
    kind = schema.get("type")
    if kind == "object":
        props = {k: _from_schema(v, root) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if kind == "array":
        return st.lists(_from_schema(schema.get("items", {}), root), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 5), 5))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40))
    if kind in ("integer", "number"):
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        high = schema.get("maximum", schema.get("exclusiveMaximum"))
        if kind == "integer":
            return st.integers(low, high)
        return st.floats(low, high, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return _json_values()


def _json_values():
    scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=12), inner, max_size=4), max_leaves=12)


def _valid_shape(path: str, r: httpx.Response, body: object) -> None:
    """The response is within its schema: an answer of its endpoint, or its API's error object."""
    assert r.status_code < 500, (path, body, r.text[:300])
    if r.status_code >= 400:
        error = r.json()
        if path == "/v1/messages":
            assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        lines = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
        assert lines and all(line == "[DONE]" or isinstance(json.loads(line), dict) for line in lines)
        return
    out = r.json()
    if path == "/v1/messages":
        assert out["type"] == "message" and out["content"][0]["type"] == "text"
        assert out["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence")
    else:
        choice = out["choices"][0]
        assert out["object"] == ("chat.completion" if "chat" in path else "text_completion")
        assert choice["finish_reason"] in ("stop", "length") and isinstance(out["usage"]["total_tokens"], int)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/messages"])
def test_the_api_fuzzed_from_its_own_openapi_schema_has_no_5xx(served, path):
    """Requests drawn from /openapi.json's request schema (the model name mostly ours, few new tokens) and
    arbitrary JSON: never a 5xx, every response within its schema. The count of requests sent is printed."""
    auth = {"Authorization": f"Bearer {KEY}"}
    doc = httpx.get(served.url + "/openapi.json", headers=auth).json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid = _from_schema(ref, doc)
    sent = FUZZED.setdefault(path, 0)

    def post(body: object) -> None:
        FUZZED[path] += 1
        r = httpx.post(served.url + path, json=body, headers=auth, timeout=60)
        _valid_shape(path, r, body)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=valid, ours=st.booleans(), stream=st.booleans())
    def valid_requests(body, ours, stream):
        if ours:
            body["model"] = "tiny-moe"
        for key in ("max_tokens", "max_completion_tokens"):  # a few new tokens: the fuzz stays quick
            if key in body or (key == "max_tokens" and ours):
                body[key] = min(body.get(key) or 2, 2)
        body["stream"] = stream and body.get("stream", True)
        post(body)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=_json_values())
    def invalid_requests(body):
        post(body)
    valid_requests()
    invalid_requests()
    print(f"fuzz {path}: {FUZZED[path] - sent} requests")
    assert FUZZED[path] - sent >= FUZZ_EXAMPLES


def test_a_key_is_required_but_not_for_health(served):
    for key in ("wrong", ""):
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=served.url + "/v1", api_key=key or "x", max_retries=0).models.list()
        assert e.value.body["code"] == "invalid_api_key"
    assert httpx.get(served.url + "/v1/models").status_code == 401
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_an_idle_connection_outlives_the_clients_pools(served):
    """A connection the openai/anthropic clients' pools hold (httpx: dropped after 5 s idle) is still open past
    that on the server: else a request sent on it as the server's own timer fired got a reset (the flaky
    APIConnectionError). One connection, idle past the clients' expiry, then used again."""
    import http.client
    from urllib.parse import urlsplit

    from openai._constants import DEFAULT_CONNECTION_LIMITS

    url = urlsplit(served.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        for pause in (0.0, DEFAULT_CONNECTION_LIMITS.keepalive_expiry + 0.5):
            time.sleep(pause)
            conn.request("GET", "/health")
            r = conn.getresponse()
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        conn.close()


BAD = [
    (b"{bad json", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "max_tokens": "3"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "max_tokens": -1}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "temperature": 9}).encode(), 400, "temperature"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "seed": -4}).encode(), 400, "seed"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "n": 3}).encode(), 400, "n"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "stop": [""]}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "stop": [3]}).encode(), 400, "stop"),
    (json.dumps({"model": "tiny-moe", "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny-moe", "prompt": [10**7]}).encode(), 400, "prompt"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "logprobs": 6}).encode(), 400, "logprobs"),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "max_tokens": 0}).encode(), 400, None),
    (json.dumps({"model": "tiny-moe", "prompt": "x", "best_of": 3}).encode(), 400, None),
    (json.dumps({"model": "gpt-4", "prompt": "x"}).encode(), 404, "model"),
    (json.dumps({"model": "tiny-moe"}).encode(), 400, "prompt"),
]


@pytest.mark.parametrize("body,status,param", BAD)
def test_a_malformed_completion_gets_an_openai_error(served, body, status, param):
    r = httpx.post(served.url + "/v1/completions", content=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param:
        assert error["param"] == param


@pytest.mark.parametrize("messages,status", [([], 400), ([{"role": "wizard", "content": "x"}], 400),
                                             ([{"role": "user"}], 400), ("hello", 400)])
def test_a_malformed_chat_gets_an_openai_error(served, messages, status):
    r = httpx.post(served.url + "/v1/chat/completions", json={"model": "tiny-moe", "messages": messages},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == status and r.json()["error"]["param"] == "messages"


def test_a_long_prompt_or_body_is_refused_and_the_server_stays_up(served):
    auth = {"Authorization": f"Bearer {KEY}"}
    positions = served.loaded.model.config.max_position_embeddings
    r = httpx.post(served.url + "/v1/completions", json={"model": "tiny-moe", "prompt": [5] * positions},
                   headers=auth)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    vocab = served.loaded.model.get_input_embeddings().num_embeddings
    r = httpx.post(served.url + "/v1/completions", json={"model": "tiny-moe", "prompt": [5, vocab]},
                   headers=auth)
    error = r.json()["error"]  # the request's fault, not the model's tokenizer files
    assert r.status_code == 400 and error["param"] == "prompt" and f"token id {vocab} " in error["message"]
    r = httpx.post(served.url + "/v1/completions", content=b"x" * (5 << 20), headers=auth)
    assert r.status_code == 413
    assert served.client.completions.create(model="tiny-moe", prompt="x", max_tokens=1).choices


def _posted_by_three_clients(url: str, body: bytes, auth: dict, tmp_path: Path) -> list[tuple[str, int, dict]]:
    """(client, status, JSON answer) of `body` POSTed by urllib (Content-Length, the whole body sent before the
    answer is read), httpx (chunked: no length, the server counts the bytes) and curl (Expect: 100-continue)."""
    headers = {**auth, "Content-Type": "application/json"}
    out = []
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=120) as r:
            out.append(("urllib", r.status, json.loads(r.read())))
    except urllib.error.HTTPError as e:
        out.append(("urllib", e.code, json.loads(e.read())))
    r = httpx.post(url, content=iter([body[i:i + (1 << 16)] for i in range(0, len(body), 1 << 16)]),
                   headers=headers, timeout=120)
    out.append(("httpx", r.status_code, r.json()))
    (tmp_path / "body.json").write_bytes(body)
    curl = subprocess.run(["curl", "-sS", "-o", str(tmp_path / "answer.json"), "-w", "%{http_code}",
                           "--data-binary", f"@{tmp_path / 'body.json'}", url]
                          + [a for k, v in headers.items() for a in ("-H", f"{k}: {v}")],
                          capture_output=True, text=True, timeout=120)
    out.append(("curl", int(curl.stdout or 0), json.loads((tmp_path / "answer.json").read_text())))
    return out


def test_an_oversized_body_gets_its_413_in_the_apis_shape_through_every_client(served, tmp_path):
    """Before the body was drained, urllib met a broken pipe (or a reset) instead of the 413."""
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"model": "tiny-moe", "max_tokens": 1, "prompt": "x" * (5 << 20)}
    openai_answers = _posted_by_three_clients(served.url + "/v1/completions", json.dumps(big).encode(), auth,
                                              tmp_path)
    assert [(c, s, a["error"]["code"]) for c, s, a in openai_answers] == \
        [(c, 413, "request_too_large") for c in ("urllib", "httpx", "curl")]
    big = {"model": "tiny-moe", "max_tokens": 1, "messages": [{"role": "user", "content": "x" * (5 << 20)}]}
    anthropic_answers = _posted_by_three_clients(served.url + "/v1/messages", json.dumps(big).encode(), auth,
                                                 tmp_path)
    assert [(c, s, a["type"], a["error"]["type"]) for c, s, a in anthropic_answers] == \
        [(c, 413, "error", "request_too_large") for c in ("urllib", "httpx", "curl")]
    assert served.client.completions.create(model="tiny-moe", prompt="x", max_tokens=1).choices  # still up


class _Gate:
    """Jobs that hold the worker (or a queue place) until opened: make the queue full without timing."""

    def __init__(self, served):
        self.opened = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.served = served

    def hold(self, running: bool = False) -> None:
        started = threading.Event()

        def work(job):
            started.set()
            self.opened.wait()
        self.served.engine.scheduler.submit(Job(work, self.loop))
        if running:
            started.wait()

    def release(self) -> None:
        """Open the gate and wait until its jobs have left the queue."""
        self.opened.set()
        while self.served.engine.scheduler.depth > 0:
            time.sleep(0.01)


def test_a_full_queue_is_429_with_retry_after(served):
    gate = _Gate(served)
    gate.hold(running=True)  # the worker is taken
    gate.hold()
    gate.hold()  # max_queue 2: the queue is full
    try:
        with pytest.raises(openai.RateLimitError) as e:
            served.client.completions.create(model="tiny-moe", prompt="x", max_tokens=1)
        assert int(e.value.response.headers["Retry-After"]) >= 1
        assert e.value.body["code"] == "queue_full"
    finally:
        gate.release()
    assert served.client.completions.create(model="tiny-moe", prompt="x", max_tokens=1).choices
    assert _metric(served, 'npumoe_requests_total{endpoint="/v1/completions",status="429"}') >= 1


def test_a_client_that_leaves_the_queue_frees_its_place(served):
    gate = _Gate(served)
    gate.hold(running=True)
    generated = _metric(served, "npumoe_generated_tokens_total")
    try:
        with pytest.raises(httpx.ReadTimeout):  # it waits behind the gate; the client gives up
            httpx.post(served.url + "/v1/completions", json={"model": "tiny-moe", "prompt": "x", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=httpx.Timeout(60, read=0.5))
        while served.engine.scheduler.depth > 0:  # the server sees the disconnect and drops the job
            time.sleep(0.05)
    finally:
        gate.release()
    assert served.client.completions.create(model="tiny-moe", prompt="x", max_tokens=1).choices
    assert _metric(served, "npumoe_generated_tokens_total") == generated + 1  # the one above ran; the other never


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_mid_generation_stops_it(served, stream):
    """1,500 tokens take seconds; the client leaves after its first piece (streamed) or after half a second."""
    cancelled = _metric(served, "npumoe_requests_cancelled_total")
    if stream:
        pieces = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=1500, temperature=0,
                                                  stream=True)
        next(iter(pieces))
        pieces.close()
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": "tiny-moe", "prompt": PROMPT, "max_tokens": 1500, "temperature": 0},
                       timeout=httpx.Timeout(60, read=0.5))
    r = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].text == _reference(served, PROMPT, 2).text  # the next request did not notice
    # the server notices a client gone at its next poll (DISCONNECT_POLL_S) and the engine at its next round: on
    # a loaded host that can come after the next request's two tokens
    deadline = time.monotonic() + 10
    while _metric(served, "npumoe_requests_cancelled_total") < cancelled + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(served, "npumoe_requests_cancelled_total") == cancelled + 1


def test_non_loopback_without_a_key_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.delenv("NPUMOE_API_KEY", raising=False)
    assert main(["serve", "--model", "tiny-moe", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--api-key" in err and "0.0.0.0" in err


@pytest.mark.parametrize("args,env", [(["--api-key", ""], None), ([], "")])
def test_an_empty_key_is_refused_in_one_line(capsys, monkeypatch, args, env):
    if env is None:
        monkeypatch.delenv("NPUMOE_API_KEY", raising=False)
    else:
        monkeypatch.setenv("NPUMOE_API_KEY", env)
    assert main(["serve", "--model", "tiny-moe", "--port", "0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "empty" in err


def test_a_taken_port_is_refused_in_one_line(capsys):
    sock = listen("127.0.0.1", 0)
    try:
        assert main(["serve", "--model", "tiny-moe", "--port", str(sock.getsockname()[1])]) == 2
    finally:
        sock.close()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot listen" in err


@pytest.mark.slow
def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(tmp_path):
    plan = _spill_plan(tmp_path / "spill.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NPUMOE_API_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "serve", "--model", "tiny-moe", "--plan", str(plan),
                             "--port", "0", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = line.split(" at ")[1].split()[0]
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0)
        stream = client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=40, temperature=0,
                                           stream=True)
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)  # the request in flight runs to its end
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert proc.wait(timeout=60) == 0
        with pytest.raises(openai.APIConnectionError):
            client.models.list()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
