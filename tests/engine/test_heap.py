"""Freed heap memory kept for reuse while training (tierlm/heap.py): under the budget, and sized by
the transient compute."""
import pytest

from ..train.test_budget import finetune_under


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
