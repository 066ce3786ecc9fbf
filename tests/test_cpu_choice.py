"""The CPU's expert storage as a search decision (autotune/searching/cpu_choice.py, autotune/costing/cpu_storage.py):
priced per storage (measured kernel records, or derived from the fit), counted by costing/memory.py, chosen under
--memory-gb (bf16 when it fits), pinned by --cpu-weights, recorded in the plan and measured by the gate."""
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from autotune.calibration.traces import synthetic_traces
from autotune.cli import main
from autotune.costing.cpu_storage import dequant_ms, packed_checkpoint_price, parse_storage, storage_price
from autotune.costing.memory import GB, ModelSize, fixed_memory, model_size
from autotune.profiling.profile import load_profile
from autotune.searching.cpu_choice import choose_cpu_storage
from autotune.searching.layer_data import LayerData
from runtime.backends import EXACT
from runtime.errors import NpumoeError
from runtime.loading.model_record import resolve_model

PUBLISHED = "apple-m2-ultra-published"


@pytest.fixture(scope="module")
def published():
    return load_profile(PUBLISHED).cost_model


def _qwen3():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_shape_twin import TWINS, twin_config

    config = twin_config("qwen3-30b-a3b", TWINS["qwen3-30b-a3b"]["num_hidden_layers"])
    spec = dict(num_experts=128, top_k=8, moe_layers=list(range(48)))
    return ModelSize.of_config(config, 2), LayerData.from_traces(synthetic_traces(spec, 10, 4096, skew=1.1))


def test_storages_parse_and_bad_ones_are_refused():
    assert parse_storage("bf16") == ("bf16", None) and parse_storage("int8") == ("int8", None)
    assert parse_storage("int4") == ("int4", 64) and parse_storage("int4:32") == ("int4", 32)
    for bad in ("int4:48", "int8:64", "fp8", "int4:x"):
        with pytest.raises(NpumoeError, match="not a CPU storage"):
            parse_storage(bad)


def test_a_measured_price_is_the_fastest_kernel_over_bf16s():
    records = [{"kind": "expert_kernel", "hidden": 2048, "ffn": 768, "storage": s, "group_size": g, "kernel": k,
                "rows": r, "median_ms": ms}
               for s, g, k, per_row in (("bf16", None, "dense", 0.10), ("int8", None, "packed", 0.08),
                                        ("int8", None, "dequant", 0.30), ("int4", 64, "packed", 0.40))
               for r in (1, 2, 4, 16, 64, 256) for ms in [per_row * r + (1.0 if k == "dequant" else 0.5)]]
    price = storage_price(None, records, "int8", 2048, 768)
    assert price.source.startswith("measured")
    # 1 row: packed 0.58 against dense 0.60; 256 rows: dequant 77.8 against packed 20.98, dense 26.1
    assert price.factors[0] == pytest.approx(0.58 / 0.60) and price.kernels[0] == "packed"
    assert price.factors[-1] == pytest.approx((0.08 * 256 + 0.5) / (0.10 * 256 + 0.5))
    assert price.factor(np.array([0, 1, 256, 10**4])).tolist() == pytest.approx(
        [price.factors[0], price.factors[0], price.factors[-1], price.factors[-1]])
    assert storage_price(None, records, "bf16", 2048, 768) is None


def test_a_derived_price_streams_fewer_bytes_and_moves_the_exact_path(published):
    """The published profile times no int kernel: the price is the cpu-exact fit's, weights at the storage's bytes."""
    fit = published.backend_model(EXACT)
    price = storage_price(published, [], "int4:64", 2048, 768)
    assert price.source.startswith("derived") and set(price.kernels) == {"packed"}
    bf16 = published.ffn_ms(EXACT, 16, 2048, 768)
    saved = fit.ms_per_mb * 3 * 2048 * 768 / 1e6 * (fit.dtype_bytes - (0.5 + 8 / 64))
    assert price.factors[3] == pytest.approx((bf16 - saved) / bf16)
    priced = published.with_cpu_storage(price)
    assert priced.ffn_ms(EXACT, 16, 2048, 768) == pytest.approx(bf16 * price.factors[3])
    assert published.ffn_ms(EXACT, 16, 2048, 768) == bf16  # the profile's own model is left as it was
    assert priced.ffn_ms("ane", 16, 2048, 768) == published.ffn_ms("ane", 16, 2048, 768)


def test_a_packed_checkpoints_experts_pay_their_dequant_each_call(published):
    """An mlx checkpoint's experts stay packed and the exact path dequantizes each one it runs, every chunk: its
    price is bf16's plus one elementwise pass over the expert's weights, and MLX's own path (which reads them
    packed) stays in the model."""
    price = packed_checkpoint_price(published, "mlx-4bit-g64", 2048, 768)
    bf16 = published.ffn_ms(EXACT, 16, 2048, 768)
    assert set(price.kernels) == {"dequant"}
    assert price.factors[3] == pytest.approx((bf16 + dequant_ms(published, EXACT, 3 * 2048 * 768, 2048)) / bf16)
    assert all(f > 1.0 for f in price.factors)
    priced = published.with_cpu_storage(price, quantized_at_load=False)
    assert priced.ffn_ms(EXACT, 16, 2048, 768) == pytest.approx(bf16 * price.factors[3])
    assert set(priced.models) == set(published.models)
    size, layers = _qwen3()
    choice = choose_cpu_storage(None, None, replace(size, storage="mlx-4bit-g64"), published, [], layers, 2048, 768,
                                4096, 4096)
    assert choice.storage == "mlx-4bit-g64" and choice.cost.ffn_ms(EXACT, 16, 2048, 768) == pytest.approx(
        bf16 * price.factors[3])


def test_qwen3_under_56_gb_gets_quantized_experts_that_fit(published):
    """bf16 needs 65.98 GB for any plan of Qwen3-30B-A3B (chunk 4096): under 56 GB the search picks a quantized one."""
    size, layers = _qwen3()
    args = (size, published, [], layers, 2048, 768, 4096, 4096)
    with pytest.raises(NpumoeError, match="--cpu-weights bf16 --memory-gb 56: with bf16 experts any plan needs 65.98"):
        choose_cpu_storage("bf16", 56, *args)
    choice = choose_cpu_storage(None, 56, *args)
    by = {o["storage"]: o for o in choice.options}
    assert by["bf16"]["memory_gb"] == pytest.approx(65.98, abs=0.01) and not by["bf16"]["fits"]
    assert by["int8"]["fits"] and by["int4:64"]["fits"] and by["int4:64"]["memory_gb"] < by["int8"]["memory_gb"]
    assert choice.storage == min(("int8", "int4:64"), key=lambda s: by[s]["all_cpu_ms_per_prompt"])
    assert choice.reason.startswith("bf16 needs 65.98 GB > 56") and "derived" in choice.reason
    kind, group = parse_storage(choice.storage)
    assert choice.ane_bytes == pytest.approx(56 * GB - fixed_memory(size, 4096, 4096, kind, group or 64).total)
    assert choice.plan_field().kind == kind
    # with room for bf16 it stays bf16; without a budget nothing is decided (the plan says nothing)
    assert choose_cpu_storage(None, 120, *args).storage == "bf16"
    assert choose_cpu_storage(None, None, *args).plan_field() is None
    # the pin is honoured where it fits
    assert choose_cpu_storage("int8", 56, *args).storage == "int8"
    with pytest.raises(NpumoeError, match="--memory-gb 20 is below what any plan needs with any CPU storage: the "
                                          "smallest, int4:64, needs 26.11 GB"):
        choose_cpu_storage(None, 20, *args)


def _search(tmp_path, traces, *extra) -> tuple[int, dict]:
    out = tmp_path / "plan.json"
    rc = main(["search", "--model", "tiny-moe", "--traces", str(traces), "--profile", PUBLISHED, "--out", str(out),
               "--threads", "1", "--trials", "8", "--json", *extra])
    return rc, json.loads(out.read_text()) if rc == 0 else {}


@pytest.fixture(scope="module")
def tiny_traces(tmp_path_factory):
    traces = tmp_path_factory.mktemp("traces") / "tiny.npz"
    assert main(["calibrate", "--model", "tiny-moe", "--out", str(traces), "--max-tokens", "8192", "--json"]) == 0
    return traces


def test_the_search_picks_quantized_storage_under_a_budget_bf16_cannot_meet(tmp_path, tiny_traces, capsys):
    size = model_size(resolve_model("tiny-moe"))
    need = {s: fixed_memory(size, 1024, 1024, *parse_storage(s)[:1], parse_storage(s)[1] or 64).total / GB
            for s in ("bf16", "int8", "int4:64")}
    assert need["int4:64"] < need["int8"] < need["bf16"]
    budget = round((need["int8"] + need["bf16"]) / 2, 4)  # int8 and int4 fit, bf16 does not
    capsys.readouterr()
    rc, plan = _search(tmp_path, tiny_traces, "--memory-gb", str(budget), "--no-gate")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and report["cpu_weights"]["storage"] in ("int8", "int4:64")
    assert plan["cpu_weights"]["kind"] == report["cpu_weights"]["storage"].split(":")[0]
    assert plan["predicted"]["memory"]["total_bytes"] <= budget * GB
    assert plan["predicted"]["memory"]["cpu_storage"] in ("int8", "int4-g64")
    # the pin is honoured, and a pin whose plans cannot fit is one line, exit 2
    rc, plan = _search(tmp_path, tiny_traces, "--memory-gb", str(budget), "--no-gate", "--cpu-weights", "int8")
    # the published profile times no int8 kernel: the runtime's defaults, written out
    assert rc == 0 and plan["cpu_weights"] == {"kind": "int8", "kernel_rows": {"packed": 0, "dequant": 16}}
    capsys.readouterr()
    assert main(["search", "--model", "tiny-moe", "--traces", str(tiny_traces), "--profile", PUBLISHED,
                 "--out", str(tmp_path / "x.json"), "--memory-gb", str(budget), "--cpu-weights", "bf16",
                 "--no-gate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--cpu-weights bf16 --memory-gb {budget:g}: with bf16 experts any plan needs" in err[0]
    with pytest.raises(SystemExit) as parsed:
        main(["search", "--model", "tiny-moe", "--cpu-weights", "int4:48"])
    assert parsed.value.code == 2 and "--cpu-weights: not a CPU storage" in capsys.readouterr().err


@pytest.mark.slow
def test_the_gate_measures_candidates_with_their_cpu_storage(tmp_path, tiny_traces, capsys):
    """int8 CPU experts: even the all-CPU candidate is measured (it is not the model any more), against bf16."""
    capsys.readouterr()
    rc, plan = _search(tmp_path, tiny_traces, "--cpu-weights", "int8", "--gate-candidates", "2")
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    gate = report["gate"]
    assert rc == 0 and gate["cpu_weights"] == "int8" and "CPU experts in int8" in gate["label"]
    assert all(c["ppl_delta"] != 0.0 or c["top1"] < 1.0 for c in gate["candidates"])
    assert plan["cpu_weights"] == {"kind": "int8", "kernel_rows": {"packed": 0, "dequant": 16}}
    assert plan["meta"]["gate"]["top1"] >= 0.99


def _template(tmp_path, cpu_weights=None) -> Path:
    from autotune.searching.templates import template_plan
    from runtime.loading.model_record import read_model_spec
    from runtime.plan import CpuWeights, save_plan

    plan = template_plan(read_model_spec("tiny-moe"), "ample", backend="cpu-static", chunk_tokens=64)
    path = tmp_path / f"plan-{cpu_weights}.json"
    save_plan(plan.model_copy(update={"cpu_weights": cpu_weights and CpuWeights(kind=cpu_weights)}), path)
    return path


def test_the_commands_quantize_at_load_and_refuse_a_flag_the_plan_contradicts(tmp_path, capsys, text_file):
    plan = _template(tmp_path)
    capsys.readouterr()
    assert main(["run", "--model", "tiny-moe", "--plan", str(plan), "--text", text_file, "--max-tokens", "128",
                 "--cpu-weights", "int4:32", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bf16 = 2 * 3 * 4 * 16 * 256 * 256  # tiny-moe's experts at full width
    held = r["memory"]["predicted"]["cpu_expert_bytes"]
    assert held == pytest.approx(bf16 * (0.5 + 8 / 32) / 2, rel=1e-3)  # int4, group 32: codes, scale and zero
    assert main(["generate", "--model", "tiny-moe", "--plan", str(plan), "--prompt", "def f(x):", "--max-tokens",
                 "4", "--cpu-weights", "int8", "--json"]) == 0
    g = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert g["generated_tokens"] == 4 and g["memory"]["predicted"]["cpu_storage"] == "packed"
    assert main(["calibrate", "--model", "tiny-moe", "--text", text_file, "--prompt-tokens", "64", "--chunk", "32",
                 "--cpu-weights", "int8", "--out", str(tmp_path / "t.npz"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"] > 0
    # a plan that holds its CPU experts as int8 applies it, and a flag saying otherwise is one line, exit 2
    planned = _template(tmp_path, "int8")
    assert main(["evaluate", "--model", "tiny-moe", "--plan", str(planned), "--text", text_file, "--max-tokens",
                 "256", "--prompt-tokens", "128", "--json"]) == 0
    e = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert e["ppl_delta_rel"] != 0.0  # int8 experts: not the unmodified model's perplexity
    for command in (["run"], ["evaluate"]):
        assert main([*command, "--model", "tiny-moe", "--plan", str(planned), "--text", text_file, "--cpu-weights",
                     "int4"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--cpu-weights int4:64: the plan" in err[0] and "as int8" in err[0]
