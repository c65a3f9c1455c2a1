"""Measurements never stop a run and never surprise: the activation planner's drive probe fits the
free space or is skipped with a printed default, a failed probe leaves the run on defaults, and
the first `--hardware this` plan says what it measures before it does."""
import json
import shutil
import subprocess
from collections import namedtuple

import pytest

from tierlm.bench import measure
from tierlm.bench import rates as act_rates

Usage = namedtuple("Usage", "total used free")


def _free(monkeypatch, free):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(free * 4, free * 3, free))


def test_probe_takes_an_eighth_of_the_free_space_at_most(monkeypatch, tmp_path):
    _free(monkeypatch, 1 << 30)
    size, why = measure.probe_size(tmp_path, 256 << 20)
    assert size == 128 << 20 and "1/8" in why
    _free(monkeypatch, 100 << 30)
    assert measure.probe_size(tmp_path, 256 << 20)[0] == 256 << 20
    _free(monkeypatch, 100 << 20)
    size, why = measure.probe_size(tmp_path / "not" / "yet", 256 << 20)  # a folder the run will create
    assert size == 0 and "needs 32 MiB" in why


def test_drive_probe_on_a_nearly_full_drive_is_skipped_with_a_message(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    _free(monkeypatch, 50 << 20)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the probe ran on a nearly full drive"))
    said = []
    r = act_rates.activation_rates(tmp_path, say=said.append)
    assert (r.ssd_read, r.ssd_write) == act_rates.P.DEFAULT_RATES[:2]
    assert len(said) == 1 and "skipped" in said[0] and "default rates" in said[0]


@pytest.mark.parametrize("failure", ["exit", "raise", "garbage"])
def test_drive_probe_failure_gives_defaults(monkeypatch, tmp_path, failure):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))

    def run(cmd, **kw):
        if failure == "raise":
            raise subprocess.CalledProcessError(1, cmd)
        return subprocess.CompletedProcess(cmd, 1 if failure == "exit" else 0, "not json\n",
                                           "OSError: [Errno 28] No space left on device\n")
    monkeypatch.setattr(subprocess, "run", run)
    said = []
    r = act_rates.activation_rates(tmp_path, say=said.append)
    assert (r.ssd_read, r.ssd_write) == act_rates.P.DEFAULT_RATES[:2]
    assert "measuring the drive" in said[0] and "probe failed" in said[-1]
    if failure == "exit":
        assert "No space left" in said[-1]


def test_drive_probe_measures_within_its_size(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    _free(monkeypatch, 400 << 20)  # 1/8: 50 MiB, whole 16 MiB blocks: 48 MiB
    seen = []
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: seen.append(cmd) or real(cmd, **kw))
    said = []
    r = act_rates.activation_rates(tmp_path / "nv", say=said.append)
    assert seen and seen[0][-1] == str(48 << 20)
    assert r.ssd_read > 0 and "measured" in r.source and "48 MiB" in said[0]

    # kept for the runs after it, on the same file system: they plan with it and measure nothing
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("the probe ran again"))
    again = act_rates.activation_rates(tmp_path / "other", say=said.append)
    assert (again.ssd_read, again.ssd_write, again.host_copy) == (r.ssd_read, r.ssd_write, r.host_copy)
    assert "earlier run's drive probe" in again.source and len(said) == 2
    m = act_rates.measured(tmp_path / "a-run")
    assert m.probe is None and m.activation_rates == again
    # not for another file system: there the run measures its own
    from tierlm.bench import cache
    monkeypatch.setattr(cache, "mount_point", lambda p: "/elsewhere")
    assert act_rates.measured(tmp_path / "a-run").probe is not None


def test_an_unreadable_kept_probe_leaves_the_run_measuring(monkeypatch, tmp_path):
    from tierlm.bench import cache
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    cache.keep_probe(tmp_path, {"read_gbps": "fast"})
    assert cache.probe_for(tmp_path) == {"read_gbps": "fast"}
    assert act_rates.measured(tmp_path).probe is not None
    cache.cache_path().write_text("{ not json")
    assert act_rates.measured(tmp_path).probe is not None
    cache.keep_probe(tmp_path, {"read_gbps": 1.0})  # an unreadable cache is left as it is
    assert cache.cache_path().read_text() == "{ not json"


def test_a_failing_drive_probe_does_not_stop_a_training_run(make_model_dir, tmp_path, monkeypatch, capsys):
    from tests.engine.test_exactness import batches, run_engine

    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))  # nothing cached: the probe runs
    real = subprocess.run

    def run(cmd, **kw):  # only the probe's child fails (a compiler call, say, runs)
        if "bench_io" in " ".join(map(str, cmd)):
            raise subprocess.CalledProcessError(1, cmd)
        return real(cmd, **kw)
    monkeypatch.setattr(subprocess, "run", run)
    model_dir, _ = make_model_dir("llama")
    measured = act_rates.measured(tmp_path / "nvme-fp32-auto")  # the recipe's: the probe runs after step 1
    _, _, losses, results = run_engine(model_dir, tmp_path, batches(4, seq=16), lr=1e-3, wd=0.0, clip=1.0,
                                       accum=1, warmup=1, precision="fp32", activations="auto", measured=measured)
    assert len(results) == 4 and all(l == l for l in losses)
    assert "drive probe failed" in capsys.readouterr().err
    plan = json.loads((tmp_path / "nvme-fp32-auto" / "plan.json").read_text())
    assert plan["rates"]["source"].startswith("defaults")


def test_read_probe_reads_as_decode_does(monkeypatch):
    """Through our one-row kernels where they build (as decode), on torch's threads, on huge pages;
    the rate is the best way's."""
    import torch

    from tierlm.infer import native

    calls = []
    real = native.products
    monkeypatch.setattr(native, "products", lambda x, ws, *a, **k: calls.append((ws[0].dtype, torch.get_num_threads()))
                        or real(x, ws, *a, **k))
    r = measure.bench_read(size_bytes=8 << 20, repeats=2)
    assert r["read_gbps"] == max(r["read_gbps_by_way"].values()) > 0 and r["read_bytes"] == 8 << 20
    assert r["read_huge_pages"]
    if native.available():
        assert {d for d, _ in calls} == {torch.int8, torch.bfloat16}
        assert {t for _, t in calls} == {torch.get_num_threads()}
        assert any(k.startswith("native") for k in r["read_gbps_by_way"])
    else:
        assert not calls


def test_a_killed_probes_store_is_cleared_at_the_next_start_and_a_running_ones_is_kept(tmp_path):
    """A probe killed by SIGKILL or timeout's SIGTERM leaves its store (GBs for a large model's
    state); the next probe in that directory deletes every store whose process is gone, and keeps
    a live process's and an unmarked one (made by an older tierlm, or being made)."""
    import os
    import sys
    from tierlm.bench.model_step import PROBE_PREFIX, clear_stale_probes
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead, live, unmarked = (tmp_path / (PROBE_PREFIX + x) for x in ("dead", "live", "unmarked"))
    for d, pid in ((dead, gone), (live, str(os.getpid())), (unmarked, None)):
        (d / "nvme").mkdir(parents=True)
        (d / "nvme" / "state").write_bytes(b"x" * 4096)
        if pid is not None:
            (d / "pid").write_text(pid)
    clear_stale_probes(tmp_path)
    assert not dead.exists() and live.exists() and unmarked.exists()
