"""The store's requests in flight, the shard size and the window's read-ahead: bench io's and bench
compute's picks (read by the recipe: tierlm.bench.rates) for this model where they were measured,
the defaults where not, an explicit setting always; the engine executes them."""
import os
from pathlib import Path

import pytest

from tierlm.bench import cache, rates
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.plan.io import (DEFAULT_IO_THREADS, DEFAULT_READ_AHEAD, MAX_READ_AHEAD, LayerWork, compute_rate,
                            io_depth, pick_read_ahead, read_ahead as plan_read_ahead, shard_size)


def _measured(root):
    """What the recipe hands the picks: bench io of root's file system and bench compute."""
    m = rates.measured(root, probe=False)
    return m.io, m.compute


def test_the_engine_takes_bench_ios_depth_for_its_file_system(monkeypatch, tmp_path):
    """The measured directory's file system: its pick; an explicit setting wins; nothing cached or
    another file system: the default."""
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    assert io_depth(None, cache.io_for(tmp_path)) == (DEFAULT_IO_THREADS, "default; `tierlm bench io` measures it")
    (tmp_path / "nvme").mkdir()
    cache.update("io", {"dir": str(tmp_path / "nvme"), "queue_depth": 8})
    assert io_depth(None, cache.io_for(tmp_path)) == (8, "bench io's pick")
    assert io_depth(3, cache.io_for(tmp_path)) == (3, "set")
    other = Path("/dev/shm")
    if other.is_dir() and os.stat(other).st_dev != os.stat(tmp_path).st_dev:
        cache.update("io", {"dir": str(other), "queue_depth": 8})
        assert io_depth(None, cache.io_for(tmp_path))[0] == DEFAULT_IO_THREADS  # measured on another file system
    cache.update("io", {"dir": str(tmp_path / "gone"), "queue_depth": 8})
    assert io_depth(None, cache.io_for(tmp_path))[0] == DEFAULT_IO_THREADS  # the measured directory is gone


def test_read_ahead_covers_a_read_and_the_drives_slow_requests_when_compute_bound():
    fast_drive = dict(step_io_s=0.05, step_compute_s=0.06)
    assert pick_read_ahead(read_s=0.010, compute_s=0.020, spread_s=0.0, **fast_drive) == 2
    assert pick_read_ahead(read_s=0.010, compute_s=0.020, spread_s=0.025, **fast_drive) == 3  # 35 ms over 20
    assert pick_read_ahead(read_s=0.010, compute_s=0.020, spread_s=1.0, **fast_drive) == MAX_READ_AHEAD
    # I/O-bound, by the layer's weights or by the step's whole traffic: the drive is the wait
    # whatever the depth, and deeper only takes the state cache's RAM
    assert pick_read_ahead(read_s=0.040, compute_s=0.020, spread_s=1.0, **fast_drive) == DEFAULT_READ_AHEAD
    assert pick_read_ahead(read_s=0.010, compute_s=0.020, spread_s=1.0, step_io_s=0.07,
                           step_compute_s=0.06) == DEFAULT_READ_AHEAD


def test_compute_rate_prefers_the_layer_probe_nearest_the_models_shape():
    comp = {"layer_dtype": "bf16", "matmul_tflops": {"bfloat16": 0.4, "float32": 0.2},
            "layer_tflops_by_tokens": {"256": {"512": 0.1, "2048": 0.2}, "2048": {"512": 0.3, "2048": 0.35}}}
    assert compute_rate(comp, "bf16", hidden=896, tokens=128) == pytest.approx(0.1e12)
    assert compute_rate(comp, "bf16", hidden=2048, tokens=4096) == pytest.approx(0.35e12)
    assert compute_rate(comp, "fp32", hidden=896, tokens=128) == pytest.approx(0.2e12)  # the layers ran in bf16
    assert compute_rate({}, "bf16", 896, 128) is None and compute_rate(None, "bf16", 896, 128) is None


def test_read_ahead_from_the_cache_for_this_file_system(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # 15M parameters a layer in bf16, 128 tokens a micro-batch, a step moving 3 bytes a parameter
    # (an optimizer state kept in RAM would move none: a step that only reads its weights is 2)
    args = dict(layer_params=15_000_000, weight_bytes=2, step_bytes=(2.0, 1.0), tokens=128, micros=1,
                precision="bf16", hidden=896, on_gpu=False)

    def read_ahead(asked, io, compute, **kw):
        return plan_read_ahead(asked, io, compute, LayerWork(**kw))
    assert read_ahead(None, *_measured(nvme), **args) == (
        DEFAULT_READ_AHEAD, "default; `tierlm bench io` and `tierlm bench compute` measure it")
    cache.update("io", {"dir": str(nvme), "read_gbps": 3.0, "write_gbps": 3.0, "read_ms_p50": 20.0,
                        "read_ms_p99": 45.0})
    assert read_ahead(None, *_measured(nvme), **args)[0] == DEFAULT_READ_AHEAD  # no compute rate yet
    cache.update("compute", {"layer_dtype": "bf16", "matmul_tflops": {"bfloat16": 0.4},
                             "layer_tflops_by_tokens": {"256": {"1024": 0.2}}})
    # a layer reads in 10 ms and computes forward in 19.2 ms; slow reads come 25 ms later
    depth, why = read_ahead(None, *_measured(nvme), **args)
    assert depth == 3 and why == ("a layer reads in 10 ms at 3.00 GB/s and computes forward in 19 ms at "
                                  "0.20 TFLOP/s, slow reads 25 ms later")
    # the optimizer's states through the drive each step: 15 ms of traffic against 58 ms of compute
    # at 1 micro-batch is still compute-bound; at 28 bytes a parameter (fp32 states) it is not
    depth, why = read_ahead(None, *_measured(nvme), **{**args, "step_bytes": (2.0 + 12, 14.0)})
    assert depth == DEFAULT_READ_AHEAD and why == (
        "I/O-bound: a layer's SSD traffic takes 140 ms a step at 3.00 / 3.00 GB/s, its compute 58 ms at "
        "0.20 TFLOP/s; further only takes RAM")
    # ... unless the step computes 4 micro-batches for one optimizer pass
    assert read_ahead(None, *_measured(nvme), **{**args, "step_bytes": (8.0 + 12, 14.0), "micros": 4})[0] == 3
    assert read_ahead(5, *_measured(nvme), **args) == (5, "set")
    assert read_ahead(None, *_measured(nvme), **{**args, "on_gpu": True})[0] == DEFAULT_READ_AHEAD


def test_the_engine_reads_ahead_what_it_picked_and_sizes_its_window_for_it(make_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    model_dir, _ = make_model_dir()
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    # compute so slow against the drive, and the drive's slow requests so late, that the pick is the deepest
    cache.update("io", {"dir": str(nvme), "read_gbps": 1000.0, "write_gbps": 1000.0, "read_ms_p50": 1.0,
                        "read_ms_p99": 1e7})
    cache.update("compute", {"matmul_tflops": {"float32": 1e-6}})
    sizes = {}
    for asked in (None, 1):
        eng = Engine.from_pretrained(model_dir, EngineConfig(nvme_dir=str(nvme), cpu_mem="1GiB", precision="fp32",
                                                             tokens_per_micro_batch=16, prefetch=asked),
                                     overwrite=True, measured=rates.measured(nvme, probe=False))
        try:
            sizes[asked] = (eng.prefetch, eng.split.window)
            if asked is None:
                assert eng.prefetch_why.startswith("a layer reads in")
            ahead = []
            monkeypatch.setattr(eng.window, "prefetch", lambda names: ahead.append(list(names)))
            eng._prefetch_from(-1, +1)
            assert len(ahead) == eng.prefetch  # blocks 0.. read ahead of the forward's start
        finally:
            eng.close()
    assert sizes[None][0] == MAX_READ_AHEAD and sizes[1][0] == 1
    assert sizes[None][1] > sizes[1][1]  # the window holds the blocks it reads ahead


def test_shard_size_from_bench_io_within_the_budget_and_kept_on_resume(make_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    gib = 1 << 30
    assert shard_size(None, cache.io_for(nvme), 4 * gib, None) == (1 << 22, "default; `tierlm bench io` measures it")
    cache.update("io", {"dir": str(nvme), "shard_bytes": 8 << 20})
    assert shard_size(None, cache.io_for(nvme), 4 * gib, None) == (1 << 21, "bench io's pick")
    # a shard's buffers stay within a twentieth of the budget: 256 MiB / 20 / 18 bytes
    assert shard_size(None, cache.io_for(nvme), 256 << 20, None) == (745472, "bench io's pick, cut to fit --cpu-mem")
    assert shard_size(6144, cache.io_for(nvme), 4 * gib, None) == (6144, "set")
    # with gradient accumulation the shard size can move the clip norm's rounding: never a timing's
    for picked in (4 << 20, 8 << 20, 32 << 20):
        cache.update("io", {"dir": str(nvme), "shard_bytes": picked})
        n, why = shard_size(None, cache.io_for(nvme), 4 * gib, None, grad_accum=2)
        assert n == 1 << 22 and "grad-accum" in why
        assert shard_size(None, cache.io_for(nvme), 256 << 20, None, grad_accum=4)[0] == 745472  # the budget's cut
    assert shard_size(6144, cache.io_for(nvme), 4 * gib, None, grad_accum=2) == (6144, "set")
    cache.update("io", {"dir": str(nvme), "shard_bytes": 8 << 20})

    # a run's state keeps its shards when bench io picks another size before the resume
    model_dir, _ = make_model_dir()
    cfg = lambda: EngineConfig(nvme_dir=str(nvme), cpu_mem="1GiB", precision="fp32", tokens_per_micro_batch=16)
    cache.update("io", {"dir": str(nvme), "shard_bytes": 16 << 10})
    eng = Engine.from_pretrained(model_dir, cfg(), overwrite=True, measured=rates.measured(nvme, probe=False))
    first = eng.shard_elems
    eng.close()
    assert first == 4096 and eng.shard_why == "bench io's pick"
    cache.update("io", {"dir": str(nvme), "shard_bytes": 32 << 10})
    assert shard_size(None, cache.io_for(nvme), gib, None)[0] == 8192
    eng = Engine.from_pretrained(model_dir, cfg(), resume=True, measured=rates.measured(nvme, probe=False))
    try:
        assert (eng.shard_elems, eng.shard_why) == (first, "the committed state's")
    finally:
        eng.close()


def test_the_engine_reads_no_cache_of_its_own(make_model_dir, monkeypatch, tmp_path):
    """Measurements reach the engine only as data from the recipe: with bench io's pick in the cache
    but none handed in, the engine runs on the defaults and says so."""
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cache.update("io", {"dir": str(nvme), "queue_depth": 8, "shard_bytes": 16 << 10})
    model_dir, _ = make_model_dir()
    cfg = EngineConfig(nvme_dir=str(nvme), cpu_mem="1GiB", precision="fp32", tokens_per_micro_batch=16)
    eng = Engine.from_pretrained(model_dir, cfg, overwrite=True)
    try:
        assert (eng.io_threads, eng.io_threads_why) == (DEFAULT_IO_THREADS, "default; `tierlm bench io` measures it")
        assert eng.shard_why.startswith("default")
        record = eng.settings_record()
        assert record["io_threads"] == {"value": DEFAULT_IO_THREADS, "why": "default; `tierlm bench io` measures it"}
        assert record["budget_split"]["value"]["budget"] == 1 << 30
    finally:
        eng.close()
    eng = Engine.from_pretrained(model_dir, cfg, overwrite=True, measured=rates.measured(nvme, probe=False))
    try:
        assert (eng.io_threads, eng.io_threads_why) == (8, "bench io's pick")
    finally:
        eng.close()
