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
