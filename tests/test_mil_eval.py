"""Host evaluation of MIL programs against numpy."""
import numpy as np
from helpers import mil_program

from runtime.coreml.converter import quiet_coremltools_import

quiet_coremltools_import()


def test_host_evaluation_of_hand_written_ops_matches_numpy():
    from runtime.coreml.mil_eval import evaluate_function

    w = (np.random.default_rng(1).standard_normal((4, 16, 1, 1)) * 0.2).astype(np.float16)
    prog = mil_program(lambda mb, x: mb.conv(x=mb.silu(x=x), weight=w), shape=(1, 16, 1, 8))
    x = np.random.default_rng(2).standard_normal((1, 16, 1, 8)).astype(np.float16)
    got = next(iter(evaluate_function(prog.functions["main"], {"x": x}).values()))
    xs = x.astype(np.float32)
    ref = np.einsum("oi,nihw->nohw", w[:, :, 0, 0].astype(np.float32), xs / (1 + np.exp(-xs)))
    assert np.max(np.abs(got - ref)) <= 2e-3 * np.max(np.abs(ref))


def test_a_function_without_the_output_the_runtime_reads_is_refused():
    import pytest

    from runtime.coreml.mil_eval import evaluate_output
    from runtime.errors import NpumoeError

    prog = mil_program(lambda mb, x: mb.silu(x=x, name="z"))
    x = np.ones((8, 16), dtype=np.float16)
    assert evaluate_output(prog.functions["main"], {"x": x}, "z", "main").shape == (8, 16)
    with pytest.raises(NpumoeError, match="function main has outputs \\['z'\\], not 'y'"):
        evaluate_output(prog.functions["main"], {"x": x}, "y", "main")


def test_the_host_checks_tolerance_adds_the_references_own_rounding():
    """Against a float32 reference the bound is the compression's; a bf16 reference rounds each of its values to
    2^-8, so q/k/v (norm, projection, q/k norm) may differ by three bf16 half-steps more, an fp16 one by far less."""
    import torch

    from runtime.coreml.mil_eval import TOLERANCE, tolerance

    assert abs(tolerance("none", torch.float32, "qkv") - TOLERANCE["none"]) < 1e-6
    assert tolerance("none", torch.bfloat16, "qkv") == TOLERANCE["none"] + 3 * 2**-8
    assert tolerance("int8", torch.float16, "o_proj") == TOLERANCE["int8"] + 2**-11
    assert tolerance("none", torch.bfloat16, "attention") == TOLERANCE["none"]
