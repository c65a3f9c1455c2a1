"""Planning a 405B model builds it on `meta`: the process stays at a few hundred MB."""
import subprocess
import sys

CHILD = r"""
from tierlm.plan.catalog import Catalog
from tierlm.plan.planner import Task, plan
from tierlm.advise.models import model_shape
s = model_shape("llama-3.1-405b")
assert s.params > 400e9
for kind in ("finetune", "serve"):
    plan(s, Catalog().parse("h100-server"), Task(kind=kind, batch=4))
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        print(int(line.split()[1]) * 1024)
"""


def test_405b_plan_peak_rss_is_a_few_hundred_mb():
    # A fresh process: VmHWM is its own peak (ru_maxrss would carry pytest's across exec).
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    peak = int(out.stdout.split()[-1])
    # The bf16 weights alone would be 811 GB; torch + transformers imports are ~250 MB of this.
    assert peak < 600 << 20, f"peak RSS {peak / 2**20:.0f} MiB"
