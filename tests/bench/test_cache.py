"""Which file system a cached `bench io` measured (tierlm.bench.cache)."""
import os

import pytest

from tierlm.bench import cache


def test_a_measurement_outlives_its_scratch_folder_on_the_same_file_system(tmp_path, monkeypatch):
    """`bench io` of a folder that was removed afterwards still serves other folders of that file
    system (before, every run there fell back to the defaults), and never another one."""
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cache.update("io", {"dir": str(scratch), "mount": cache.mount_point(scratch), "queue_depth": 8})
    run = tmp_path / "run"
    run.mkdir()
    assert cache.io_for(run)["queue_depth"] == 8
    scratch.rmdir()
    assert cache.io_for(run)["queue_depth"] == 8
    other = "/dev/shm" if os.path.ismount("/dev/shm") else None
    if other is None or cache.mount_point(other) == cache.mount_point(run):
        pytest.skip("no second file system to compare")
    assert cache.io_for(other) is None


def test_bench_compute_measures_overheads_beside_a_removed_scratch_folder(tmp_path, monkeypatch):
    """`bench compute` measures the engine's fixed costs on the cached `bench io` folder; where that
    scratch folder was removed it used to fail after minutes of measuring (No such file or
    directory): it measures in its nearest surviving parent instead."""
    from tierlm.bench import measure, overhead, overlap
    from tierlm.advise import command

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    cache.update("io", {"dir": str(tmp_path / "gone" / "probe"), "queue_depth": 8})
    for fn in ("bench_compute", "bench_layer", "bench_decode", "bench_checksum"):
        monkeypatch.setattr(measure, fn, lambda *a, **k: {})
    where = []
    monkeypatch.setattr(overhead, "bench_overhead", lambda d: where.append(d) or {})
    monkeypatch.setattr(overlap, "bench_overlap", lambda d: where.append(d) or {})
    command.run_bench("compute", None, quiet=True)
    assert where == [str(tmp_path)] * 2
