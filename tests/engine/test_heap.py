"""Freed heap memory kept for reuse while training (engine/heap.py): kept under the budget, handed
back past the limit, and off where it is not safe."""
import subprocess
import sys

import pytest

from ..train.test_budget import finetune_under

# A child process: glibc's settings are process-wide, and pytest's own heap would blur the RSS.
PROBE = """
import resource, torch, tierlm
from tierlm.engine.heap import HeapGuard
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


LONG = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 688, "vocab": 4096,
        "max_positions": 4096}


@pytest.mark.slow
def test_kept_heap_stays_under_the_budget(tmp_path):
    """2 x 4096 tokens make a 276 MiB compute share, so freed blocks are kept between checks; the
    fine-tune still peaks under --cpu-mem 360MiB (measured: 275 MiB beyond the libraries)."""
    libraries, summary = finetune_under(tmp_path, LONG, 6000, "360MiB", "--seq-len", "4096", "--batch-size", "2",
                                        "--steps", "3", "--precision", "bf16")
    assert summary["heap_kept"], "the guard was off: this test no longer covers it"
    peak = summary["peak_rss_bytes"]
    print(f"peak libraries + {(peak - libraries) / 2**20:.0f} MiB of 360 MiB, {summary['heap_trims']} trims")
    assert peak <= libraries + (360 << 20)


def test_the_guard_is_sized_by_transient_compute_not_a_held_gradient(make_model_dir, tmp_path, monkeypatch):
    """Qwen2.5-0.5B at 1x32 tokens under --cpu-mem 4GiB: a 352 MiB compute share, 260 MiB of it the
    tied head's held gradient. Counted as compute, the guard kept holes and the run peaked 4.06-4.14
    GiB beyond the libraries; sized by the 92 MiB that one block frees again, it is off and 3.90-3.92."""
    from tierlm.engine import engine as engine_mod
    from tierlm.engine.engine import Engine, EngineConfig
    from tierlm.engine.optimizer import AdamWConfig
    shares = []

    class Recording(engine_mod.HeapGuard):
        def __init__(self, limit, compute_share):
            shares.append(compute_share)
            super().__init__(limit, compute_share)
    monkeypatch.setattr(engine_mod, "HeapGuard", Recording)
    model_dir, _ = make_model_dir("qwen2", vocab_size=4096, hidden_size=64)
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="1GiB", precision="fp32",
                       tokens_per_micro_batch=16, optim=AdamWConfig(lr=1e-2))
    eng = Engine.from_pretrained(model_dir, cfg)
    try:
        assert eng.split.held_grad == 4096 * 64 * 4  # the tied weight's fp32 gradient
        assert shares == [eng.split.compute - eng.split.held_grad]
    finally:
        eng.close()
