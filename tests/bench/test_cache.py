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
