"""`runtime.cpu.allocator`: under `reuse_temporaries` a prefill-sized temporary allocated again and again is reused from
the heap (no page faults after the first), under `return_temporaries_to_the_os` it is mapped and faulted in anew
each time. Each policy in a process of its own (it is process-wide)."""
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from runtime.cpu import allocator
getattr(allocator, sys.argv[1])()
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def temporary():
    x = torch.empty(4 << 20)  # 16 MiB, written then freed
    x.fill_(1.0)
for _ in range(10):  # the first ones grow the heap to its steady state
    temporary()
before = faults()
for _ in range(10):
    temporary()
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("policy,low", [("reuse_temporaries", True), ("return_temporaries_to_the_os", False)])
def test_a_temporary_is_reused_or_returned_as_the_policy_says(policy, low):
    out = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    faults = int(out.stdout.split()[-1])
    pages = 10 * (16 << 20) // 4096  # every page of every temporary faulted in anew
    assert faults < pages // 20 if low else faults > pages // 2


PRIMITIVES = """
import os, sys
if sys.argv[1] == "default":  # the libraries' own capacities, set before `import runtime` bounds them
    os.environ.update(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024", LRU_CACHE_CAPACITY="1024")
import torch
from runtime.cpu import allocator
torch.set_num_threads(1)
allocator.return_temporaries_to_the_os()
def anonymous():
    fields = open("/proc/self/statm").read().split()
    return (int(fields[1]) - int(fields[2])) * 4096
w = torch.randn(768, 2048, dtype=torch.bfloat16)  # a Qwen3-30B-A3B expert's gate projection
torch.nn.functional.linear(torch.randn(1, 2048, dtype=torch.bfloat16), w)
before = anonymous()
for rows in range(2, 402):  # an expert's rows differ from call to call in a prefill
    torch.nn.functional.linear(torch.randn(rows, 2048, dtype=torch.bfloat16), w)
allocator.release_freed_heap()
print(anonymous() - before, allocator.primitive_cache_bytes())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/statm")
def test_the_compute_librarys_primitive_caches_are_bounded_as_priced():
    """bf16 matmuls of 400 row counts: what torch's two caches of compiled primitives (oneDNN's and ideep's) keep of
    them, bounded from `import runtime` on, is at most what `primitive_cache_bytes` prices (both full), and far less
    than at the libraries' defaults (1,024 entries each: 400 x 2 entries, 0.28 MiB each). Where torch's bf16 matmul
    keeps nothing per shape, there is nothing to bound."""
    runs = {how: [int(v) for v in subprocess.run([sys.executable, "-c", PRIMITIVES, how], capture_output=True,
                                                 text=True, check=True).stdout.split()[-2:]]
            for how in ("bound", "default")}
    grown = {how: r[0] for how, r in runs.items()}
    if grown["default"] < 64 << 20:
        pytest.skip(f"this host's bf16 matmul keeps {grown['default'] >> 20} MiB for 400 shapes: no cache to bound")
    priced = runs["bound"][1]
    assert grown["bound"] <= priced + (4 << 20) and grown["bound"] < 0.5 * grown["default"], \
        ({k: v >> 20 for k, v in grown.items()}, priced >> 20)
