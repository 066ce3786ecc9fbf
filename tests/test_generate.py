"""`autotune generate` and the runtime API: same greedy tokens as the unmodified model under a spill plan, no
static call while decoding, the streamed text is the text, bad input fails in one line."""
import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from helpers import random_model

import runtime
from autotune.cli import main
from autotune.searching.templates import template_plan
from runtime.loading.model_loader import BUILTIN_MODELS, model_spec
from runtime.plan import save_plan

JSON_KEYS = {"prompt_tokens", "generated_tokens", "ttft_ms", "prefill_tok_s", "generation_tok_s", "peak_rss_mb",
             "dropped", "spilled", "decode_static_calls", "text"}
PROMPT = "Static groups for the prompt, the exact path for every new token. " * 2


def _spill_plan(tmp_path, name: str) -> str:
    model = random_model(name)[0] if name.startswith("random:") else runtime.load(name, dtype="float32").model
    path = tmp_path / "spill.json"
    save_plan(template_plan(model_spec(model), "tight", "spill", chunk_tokens=16), path)
    return str(path)


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_spill_plan_gives_the_same_tokens_and_no_decode_static_calls(name, tmp_path, capsys):
    plan = _spill_plan(tmp_path, name)
    rc = main(["generate", "--model", name, "--plan", plan, "--prompt", PROMPT, "--max-tokens", "6",
               "--dtype", "float32", "--compare", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert JSON_KEYS | {"reference_ttft_ms", "prefill_speedup", "same_tokens"} <= set(r)
    assert r["same_tokens"] is True
    assert r["decode_static_calls"] == 0
    assert r["prefill_static_calls"] > 0 and r["spilled"] > 0 and r["dropped"] == 0  # the plan really ran
    assert r["prompt_tokens"] > 16 and 1 <= r["generated_tokens"] <= 6
    assert r["ttft_ms"] > 0 and r["reference_ttft_ms"] > 0 and r["peak_rss_mb"] > 0


def test_stream_pieces_are_the_text_and_model_generate_runs_under_the_plan(tmp_path):
    loaded = runtime.load("tiny-moe", plan=_spill_plan(tmp_path, "tiny-moe"), dtype="float32")
    pieces = list(runtime.stream_generate(loaded, PROMPT, max_tokens=8))
    result = runtime.generate(loaded, PROMPT, max_tokens=8)
    assert "".join(pieces) == result.text and len(pieces) > 1
    assert result.generated_tokens == 8 and loaded.stats.static_calls("decode") == 0
    # .model.generate() also runs under the plan, and counts its decode steps apart
    ids = loaded.tokenizer(PROMPT, return_tensors="pt").input_ids
    loaded.stats.reset()
    out = loaded.model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out[0, ids.shape[1]:].tolist() == result.token_ids[:4]
    assert loaded.stats.static_calls("prefill") > 0 and loaded.stats.static_calls("decode") == 0
    assert loaded.stats.total("decode").tokens == 3 * len(loaded.plan.layers)


def test_without_a_plan_runs_the_unmodified_model(capsys):
    rc = main(["generate", "--model", "random:olmoe", "--prompt", "hello", "--max-tokens", "3", "--json"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["plan"] is None and r["dropped"] == r["spilled"] == r["decode_static_calls"] == 0
    assert r["prompt_tokens"] == 5


def test_streams_text_to_stdout_and_figures_to_stderr(capsys):
    rc = main(["generate", "--model", "random:qwen3_moe", "--prompt", "hello", "--max-tokens", "4", "--seed", "3",
               "--temp", "0.7"])
    assert rc == 0
    cap = capsys.readouterr()
    assert "time to first token" in cap.err and "tokens/s" in cap.err and "peak memory" in cap.err
    assert "time to first token" not in cap.out


def test_chat_without_template_says_so_once(caplog, capsys):
    with caplog.at_level("WARNING", logger="npumoe"):
        rc = main(["generate", "--model", "random:mixtral", "--prompt", "hi", "--max-tokens", "2", "--chat",
                   "--compare", "--json"])
    assert rc == 0 and json.loads(capsys.readouterr().out)["same_tokens"] is True
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "no chat template" in said[0]


def test_chat_template_is_applied():
    from runtime.generation import chat_prompt

    loaded = runtime.load("tiny-moe", dtype="float32")
    tok = loaded.tokenizer
    assert chat_prompt(tok, "hi") is None
    tok.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    try:
        assert chat_prompt(tok, "hi") == "<user>hi<assistant>"
    finally:
        tok.chat_template = None


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse refuses bad values itself
        return e.code


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "x", "--temp", "-1"], "--temp"),
    (["--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["--prompt", "x", "--package", "nowhere.mlpackage"], "no such package"),
    (["--prompt", "x", "--package", "{tmp}/x.mlpackage"], "give --plan"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read"),
    (["--prompt", ""], "empty"),
    (["--chat", "--prompt", ""], "empty"),
])
def test_bad_input_is_one_line_exit_2(argv, message, tmp_path, capsys):
    (tmp_path / "x.mlpackage").mkdir()
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert _exit_code(["generate", "--model", "random:olmoe", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_an_empty_chat_prompt_is_refused_before_the_model_loads(monkeypatch, capsys):
    import autotune.commands.generate as command

    monkeypatch.setattr(command, "load", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["generate", "--model", "tiny-moe", "--chat", "--prompt", ""]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the prompt is empty" in err


def test_readme_example_runs(tmp_path, monkeypatch, capsys):
    """The README's Python example, run exactly as printed, after the plan-template command it names."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Generate text from Python"):]
    command = re.search(r"`autotune (plan-template [^`]*)`", section).group(1)
    example = re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)
    assert len(example.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(command)) == 0
    exec(compile(example, "README.md", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out
    assert "first token after" in out and "static calls while decoding: 0" in out


def test_incremental_detokenisation_holds_back_incomplete_characters():
    """A multi-byte character arrives byte by byte from the byte tokenizer: no piece carries a half character."""
    from runtime.generation import Generation

    text = "héllo ✓ naïve"
    loaded = runtime.load("random:qwen3_moe")

    class Scripted(Generation):
        def token_ids(self):
            for b in text.encode("utf-8"):
                self.tokens.append(b)
                yield b

    pieces = list(Scripted(loaded, torch.tensor([1]), 50, 0.0, 0, None).pieces())
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)
    assert len(pieces) == len(text)  # one piece per character: ✓'s three bytes came out as one piece


def test_new_tokens_are_bounded_by_the_context():
    """One rule (generate, stream_generate, the server): prompt + new <= positions, past it stopped with
    finish_reason "length"; a max_tokens past the context itself, or a prompt filling it, refused up front."""
    from runtime.errors import NpumoeError
    from runtime.generation import context_positions, max_new_tokens

    model = random_model("random:qwen3_moe")[0]
    assert context_positions(model) == 4096
    assert max_new_tokens(model, 10, 100) == 100
    assert max_new_tokens(model, 10, 4096) == 4086
    with pytest.raises(NpumoeError, match="max_tokens 4097 is past the model's context of 4096 positions: ask for at "
                                          "most 4086 new tokens"):
        max_new_tokens(model, 10, 4097)
    with pytest.raises(NpumoeError, match="no token fits"):
        max_new_tokens(model, 4096, 1)
