"""A model across two ranks of MLX's ring on 127.0.0.1 (free ports): tiny-moe at 4 bits, each rank holding half its
layers, against mlx-lm's single process in float32; and a neighbour that dies, hangs or never comes ends the rank
with one line naming it, within the timeout."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import convert_to_mlx, mlx_fp32

pytest.importorskip("mlx_lm")
ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Static capacity tiers and grouped experts"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    return convert_to_mlx(tmp_path_factory.mktemp("mlx") / "q4g64", 4, 64)


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """`n` ports nothing listens on (consecutive ones for mlx.launch's --starting-port)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        ports = [first + i for i in range(n)] if consecutive else [first] + free_ports(n - 1) if n > 1 else [first]
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return ports
        except OSError:
            continue
    raise RuntimeError("no free ports")


def test_rank_split_is_mlx_lms_order():
    from runtime.mlx.cluster import rank_split

    assert rank_split([(0, 3), (3, 4)]) == [1, 3]  # rank 0 holds the last stage


@pytest.fixture(scope="module")
def tight_plan(tiny4, tmp_path_factory):
    """ane-sim groups at a tight capacity, spills to mlx-exact: a plan whose every layer runs the plan's block."""
    from autotune.cli import main

    out = tmp_path_factory.mktemp("plan") / "tight.json"
    assert main(["plan-template", "--model", str(tiny4), "--capacity", "tight", "--overflow", "spill", "--backend",
                 "ane", "--exact", "mlx-exact", "--out", str(out)]) == 0
    return out


def spine_logits(tiny4, plan, ids: list[int], step: int) -> np.ndarray:
    """The single-process MLX spine's logits of every position, in chunks of `step`, float32."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from runtime.mlx.spine import MlxSpine
    from runtime.plan import load_plan

    model = mlx_fp32(tiny4)
    spine, cache = MlxSpine(model, load_plan(plan), tiny4).install(), make_prompt_cache(model)
    return np.concatenate([np.array(spine.forward(mx.array([ids[s:s + step]], dtype=mx.uint32), cache, "all")[0])
                           for s in range(0, len(ids), step)])


@pytest.mark.slow
def test_a_two_stage_plan_under_the_launcher_matches_the_single_process_spine(tiny4, tight_plan, tmp_path):
    import transformers

    import runtime

    port = free_ports(2, consecutive=True)[0]
    logits_out = tmp_path / "logits.npy"
    cmd = [str(Path(sys.executable).parent / "mlx.launch"), "--backend", "ring", "-n", "2", "--starting-port",
           str(port), "--env", f"PYTHONPATH={ROOT}", "--env", "OMP_NUM_THREADS=1", sys.executable, "-m",
           "runtime.mlx.cluster", "--model", str(tiny4), "--plan", str(tight_plan), "--prompt", PROMPT,
           "--max-tokens", "12", "--dtype", "float32", "--logits-out", str(logits_out), "--timeout", "60"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert (out["ranks"], out["layers"]) == (2, [2, 4])  # rank 0: the last two of tiny-moe's four layers
    ids = transformers.AutoTokenizer.from_pretrained(tiny4).encode(PROMPT)
    ref = spine_logits(tiny4, tight_plan, ids, 256)  # the plan's chunk
    got = np.load(logits_out)
    assert got.shape == ref.shape == (out["prompt_tokens"], 4096)
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-5
    loaded = runtime.load(str(tiny4), plan=str(tight_plan), engine="mlx", dtype="float32")
    assert out["tokens"] == runtime.generate(loaded, PROMPT, max_tokens=12).to_json()["token_ids"]


def rank0(tiny4, hostfile: Path, timeout: float, cwd: Path) -> subprocess.Popen:
    env = {**ENV, "MLX_RANK": "0", "MLX_HOSTFILE": str(hostfile)}
    return subprocess.Popen([sys.executable, "-m", "runtime.mlx.cluster", "--model", str(tiny4), "--prompt", PROMPT,
                             "--max-tokens", "4", "--timeout", str(timeout)], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def peer(hostfile: Path, then: str, cwd: Path) -> subprocess.Popen:
    """Rank 1: joins the ring, then `then` (a Python statement)."""
    code = f"import os, time, mlx.core as mx; mx.distributed.init(backend='ring', strict=True); {then}"
    env = {**ENV, "MLX_RANK": "1", "MLX_HOSTFILE": str(hostfile)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def ring_file(tmp_path: Path) -> tuple[Path, str]:
    ports = free_ports(2)
    hostfile = tmp_path / "ring.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in ports]))
    return hostfile, f"rank 1 (127.0.0.1:{ports[1]})"


def one_line(proc: subprocess.Popen, limit: float, status: int = 3) -> tuple[str, float]:
    start = time.monotonic()
    _, err = proc.communicate(timeout=limit)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == status, err[-2000:]
    assert len([line for line in lines if line.startswith("npumoe:")]) == 1 and not any(
        line.startswith("[ring]") or "Traceback" in line for line in lines), err
    return next(line for line in lines if line.startswith("npumoe:")), time.monotonic() - start


@pytest.mark.parametrize("then, says", [("os._exit(1)", "lost {peer}"),
                                        ("time.sleep(120)", "{peer} did not answer within 4 s")])
def test_a_neighbour_that_dies_or_hangs_ends_the_rank_naming_it(tiny4, tmp_path, then, says):
    hostfile, name = ring_file(tmp_path)
    first = rank0(tiny4, hostfile, 4.0, tmp_path)  # rank 0 accepts; rank 1 connects (and gives up after ~30 s)
    other = peer(hostfile, then, tmp_path)
    try:
        line, _ = one_line(first, 60)
    finally:
        other.kill()
        other.wait()
    assert line.startswith("npumoe: rank 0: " + says.format(peer=name))
    assert line.endswith("it died or cannot be reached")


def test_a_neighbour_that_never_comes_ends_the_rank_within_the_timeout(tiny4, tmp_path):
    hostfile, name = ring_file(tmp_path)
    start = time.monotonic()
    proc = rank0(tiny4, hostfile, 3.0, tmp_path)
    line, _ = one_line(proc, 60, status=-9)  # killed by its watchdog: the ring's init holds the interpreter
    assert line == f"npumoe: rank 0: {name} did not answer within 3 s (joining the ring): it died or cannot be reached"
    assert time.monotonic() - start < 40  # the imports, then 3 s
