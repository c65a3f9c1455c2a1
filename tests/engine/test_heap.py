"""Freed heap memory kept for reuse while training (tierlm/heap.py): under the budget, and sized by
the transient compute."""
import pytest

from tierlm.units import parse_bytes

from ..train.test_budget import finetune_under


LONG = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 688, "vocab": 4096,
        "max_positions": 4096}


# The precision `--precision auto` picks here, and a run whose compute share is past the guard's
# MIN_COMPUTE_SHARE in it: bf16 where the CPU has bf16 units (2 x 4096 tokens, a 276 MiB share:
# measured 270-275 MiB beyond the libraries), fp32 elsewhere (2 x 1536 tokens, a 361 MiB share:
# 221 MiB on an AVX2-only EPYC, in 29 s where the bf16 run took 186 s on its fallback kernels).
LONG_RUNS = {"bf16": ("4096", "360MiB"), "fp32": ("1536", "420MiB")}


@pytest.mark.slow
def test_kept_heap_stays_under_the_budget(tmp_path):
    """Long sequences make a compute share big enough that freed blocks are kept between checks;
    the fine-tune still peaks under --cpu-mem."""
    from tierlm.precision import resolve
    precision = resolve("auto")[0]
    seq, budget = LONG_RUNS[precision]
    libraries, summary = finetune_under(tmp_path, LONG, 6000, budget, "--seq-len", seq, "--batch-size", "2",
                                        "--steps", "3", "--precision", precision)
    assert summary["heap_kept"], "the guard was off: this test no longer covers it"
    peak = summary["peak_rss_bytes"]
    print(f"{precision}: peak libraries + {(peak - libraries) / 2**20:.0f} MiB of {budget}, "
          f"{summary['heap_trims']} trims")
    assert peak <= libraries + parse_bytes(budget)


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
