"""`runtime.allocator`: under `reuse_temporaries` a prefill-sized temporary allocated again and again is reused from
the heap (no page faults after the first), under `return_temporaries_to_the_os` it is mapped and faulted in anew
each time. Each policy in a process of its own (it is process-wide)."""
import subprocess
import sys

import pytest

PROBE = """
import resource, sys, torch
from runtime import allocator
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
