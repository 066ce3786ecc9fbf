"""Half-precision expert calls on the CPU at few row counts (`call_rows`): oneDNN makes a kernel for each row count
it has not seen (an AMX Xeon, bf16, one thread: 3.8 ms at a Qwen3-30B-A3B-width expert whose call takes 2.9 ms), so
the exact path rounds each expert's rows up to sizes whose kernels stay cached, and the cost model prices the rows
it runs."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from autotune.costing.costmodel import CostModel
from autotune.costing.fitting import fit_backend
from autotune.profiling.callers import make_experts
from autotune.profiling.model_records import ROWS_FULL, ROWS_QUICK
from runtime.backends.protocol import expert_ffn
from runtime.cpu.cpu_backends import call_rows, run_exact


def test_call_rows_are_few_sizes_at_most_an_eighth_more():
    m = np.arange(0, 8193)
    k = call_rows(m)
    assert (k >= m).all() and (k[:65] == m[:65]).all() and ((k - m)[1:] / m[1:]).max() <= 0.125
    assert len(set(k.tolist())) == 121  # 0..64, then 8 sizes per octave to 8,192
    assert call_rows(1955) == 2048 and call_rows(517) == 576 and call_rows(129) == 144
    # the profiler's row grids are such sizes already: its records time the rows the runtime runs
    assert all(call_rows(r) == r for r in (*ROWS_QUICK, *ROWS_FULL))


@pytest.mark.parametrize("dtype,sized", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_exact_path_runs_half_precision_calls_at_call_rows_with_the_same_rows_out(dtype, sized, monkeypatch):
    torch.manual_seed(0)
    module = make_experts(64, 32, 4).to(dtype)
    counts = [3, 70, 130, 1]  # the last expert's padding runs past the end: zeros
    x = torch.randn(sum(counts), 64, dtype=dtype)
    seen = []
    linear = F.linear
    monkeypatch.setattr(F, "linear", lambda a, w, *r: seen.append(a.shape[0]) or linear(a, w, *r))
    with torch.inference_mode():
        y = run_exact(module, x, [0, 1, 2, 3], counts)
    monkeypatch.undo()
    want = [call_rows(m) if sized else m for m in counts]
    assert seen == [r for r in want for _ in range(2)]  # gate_up and down of each expert
    with torch.inference_mode():
        ref = torch.cat([expert_ffn(module, e, r) for e, r in zip(range(4), x.split(counts))])
    assert torch.equal(y, ref)  # each output row depends on its own input row only


def test_the_exact_paths_price_in_bf16_is_the_price_of_the_rows_it_runs_held_out():
    """Records at the profiler's grid (cached kernels: a call's time linear in its rows), then held-out row counts as
    the runtime runs them: priced within 1% (a price at the raw count was up to 11% under)."""
    law = lambda m: 0.5 + 0.02 * m  # noqa: E731 - ms of one cached call of m rows
    recs = [{"kind": "group", "backend": "cpu-exact", "hidden": 256, "ffn": 128, "capacities": [m], "tokens": m,
             "median_ms": law(m)} for m in ROWS_QUICK]
    held_out = np.array([71, 155, 463, 1038, 1955, 2484])
    bf16 = CostModel({"cpu-exact": fit_backend("cpu-exact", recs, dtype_bytes=2, residual=False)})
    runtime = np.array([law(call_rows(m)) for m in held_out])
    assert np.abs(bf16.ffn_ms("cpu-exact", held_out, 256, 128) / runtime - 1).max() < 0.01
    fp32 = CostModel({"cpu-exact": fit_backend("cpu-exact", recs, dtype_bytes=4, residual=False)})
    assert np.abs(fp32.ffn_ms("cpu-exact", held_out, 256, 128) / law(held_out) - 1).max() < 0.01  # MKL: as is
