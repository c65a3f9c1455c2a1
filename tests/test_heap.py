"""The heap guard (tierlm/heap.py): freed blocks kept for reuse while it is open, handed back past
its limit and on close, and off where it is not safe."""
import subprocess
import sys

# A child process: glibc's settings are process-wide, and pytest's own heap would blur the RSS.
PROBE = """
import resource, torch, tierlm
from tierlm.heap import HeapGuard
def freed_stays():
    # a freed 2 MiB block below a live one (off the top of the heap, which free() still returns),
    # then 1 MiB: kept, the block serves it with its pages resident (no faults); handed back, the
    # new tensor faults its 256 pages in. (A same-size tensor would not fit the freed block:
    # PyTorch's aligned allocation asks for a little more.)
    flt = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = torch.empty(2 << 20, dtype=torch.uint8).fill_(1)
    b = torch.empty(1 << 20, dtype=torch.uint8).fill_(1)
    del a
    f0 = flt()
    a = torch.empty(1 << 20, dtype=torch.uint8).fill_(1)
    faults = flt() - f0
    del a, b
    return faults < 64
g = HeapGuard(limit=1 << 50, compute_share=1 << 30)
kept = freed_stays()
g.limit = 0
g.check()
g.close()
print(g.active, kept, g.trims, freed_stays(), HeapGuard(1 << 50, compute_share=16 << 20).active)
"""


def probe(env_extra=None):
    import os
    env = {k: v for k, v in os.environ.items() if k != "TIERLM_MALLOC"}
    env.update(env_extra or {})
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_freed_blocks_stay_while_open_and_go_back_on_check_and_close():
    active, kept, trims, kept_after_close, small_budget_active = probe()
    assert active == "True" and kept == "True"       # a freed block's pages stay for reuse
    assert trims == "1"                               # past the limit, check() hands them back
    assert kept_after_close == "False"                # closed: tierlm's import settings again
    assert small_budget_active == "False"             # a small compute share keeps those settings


def test_no_guard_under_glibcs_own_settings():
    active, kept, *_ = probe({"TIERLM_MALLOC": "glibc"})
    assert active == "False"
