"""`runtime.serving.engine_process`: the engine in a spawned process of its own behind the app, as `autotune serve`
runs it: greedy tokens as `runtime.generate`'s, refusals (a full queue's included) reaching the client with their
fields, one /metrics text from both processes, a client that leaves cancelling its job in the child, a load failure
in one line, and the child gone once closed."""
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from helpers import served_on_a_thread

import runtime
from runtime.errors import NpumoeError
from runtime.serving.engine_process import EngineProcess

KEY = "test-key"
PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2
ENGINE = {"max_queue": 2, "prefix_cache_mb": 64}


@pytest.fixture(scope="module")
def served():
    engine = EngineProcess({"model": "tiny-moe", "dtype": "float32"}, ENGINE, "tiny-moe", threads=1)
    with served_on_a_thread(engine, KEY) as url:
        yield SimpleNamespace(url=url, engine=engine, client=openai.OpenAI(base_url=url + "/v1", api_key=KEY,
                                                                           max_retries=0))
    engine.close(10)


def _metrics(served) -> str:
    return httpx.get(served.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def test_greedy_tokens_are_runtime_generates_streamed_or_not(served):
    ref = runtime.generate(runtime.load("tiny-moe", dtype="float32"), PROMPT, max_tokens=8)
    whole = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=8, temperature=0)
    assert whole.choices[0].text == ref.text and whole.model_extra["npumoe"]["token_ids"] == ref.token_ids
    chunks = list(served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=8, temperature=0,
                                                   stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert served.engine.tokenizer.decode(ref.token_ids) == ref.text  # the child's tokenizer, pickled back


def test_a_refusal_in_the_child_reaches_the_client_with_its_fields(served):
    with pytest.raises(openai.BadRequestError) as e:
        served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=10**12)
    assert e.value.body["param"] == "max_tokens"


def test_a_full_queue_in_the_child_is_429_with_retry_after():
    """The child refuses as the job's first event (the app does not wait on the child to submit)."""
    engine = EngineProcess({"model": "tiny-moe", "dtype": "float32"}, {**ENGINE, "max_queue": 0}, "tiny-moe",
                           threads=1)  # a queue that holds none: every request is refused
    try:
        with served_on_a_thread(engine, KEY) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            for stream in (False, True):
                with pytest.raises(openai.RateLimitError) as e:
                    client.completions.create(model="tiny-moe", prompt="x", max_tokens=1, stream=stream)
                assert e.value.body["code"] == "queue_full" and int(e.value.response.headers["Retry-After"]) >= 1
            assert not engine._jobs  # each refused job forgotten here
    finally:
        engine.close(10)


def test_metrics_hold_both_processes_and_health_the_childs(served):
    served.client.completions.create(model="tiny-moe", prompt="Hello", max_tokens=2, temperature=0)
    text = _metrics(served)
    assert 'npumoe_requests_total{endpoint="/v1/completions",status="200"}' in text  # counted here
    assert "npumoe_generated_tokens_total" in text  # counted in the child
    health = httpx.get(served.url + "/health").json()
    assert health["status"] == "ok" and health["max_queue"] == 2 and health["model"] == "tiny-moe"


def test_a_client_that_leaves_cancels_its_job_in_the_child(served):
    def cancelled() -> float:
        return sum(float(line.split()[-1]) for line in _metrics(served).splitlines()
                   if line.startswith("npumoe_requests_cancelled_total"))
    before = cancelled()
    stream = served.client.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=400, temperature=0,
                                              stream=True)
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while cancelled() < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert cancelled() == before + 1
    r = served.client.completions.create(model="tiny-moe", prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2  # the engine serves on


def test_a_load_failure_is_one_line_and_the_child_is_gone():
    with pytest.raises(NpumoeError) as e:
        EngineProcess({"model": "no-such-model"}, ENGINE, "no-such-model")
    assert len(str(e.value).splitlines()) == 1 and "no-such-model" in str(e.value)


def test_close_ends_the_child():
    engine = EngineProcess({"model": "tiny-moe", "dtype": "float32"}, ENGINE, "tiny-moe", threads=1)
    assert engine.process.is_alive()
    engine.close(10)
    assert not engine.process.is_alive() and engine.process.exitcode == 0
