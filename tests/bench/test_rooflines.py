"""The generation report's rooflines (tierlm.bench.rooflines): measured once, kept in the one cache
of measured rates ($TIERLM_CACHE_DIR/bench.json, beside `bench io` and `bench compute`)."""
import json
import subprocess

import torch

from tierlm.bench import cache, rooflines


def test_rates_honour_the_cache_dir_and_the_threads(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    cache.update("io", {"dir": "/somewhere"})  # another section of the one cache, kept
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"mem_gbps": 30.0}) + "\n", "")
    monkeypatch.setattr(subprocess, "run", run)
    assert rooflines.machine_rates()["mem_gbps"] == 30.0
    assert seen[0][-1] == str(torch.get_num_threads())
    assert "measuring this machine's rates" in capsys.readouterr().err
    assert rooflines.machine_rates()["mem_gbps"] == 30.0 and len(seen) == 1  # cached: measured once
    kept = json.loads((tmp_path / "cache" / "bench.json").read_text())
    assert kept["io"] == {"dir": "/somewhere"}
    assert list(kept[rooflines.SECTION].values()) == [{"mem_gbps": 30.0}]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["bench.json"]  # no rates.json


def test_fresh_measures_again_and_store_replaces_the_entry(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path))
    rates = iter([25.0, 33.0])
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, json.dumps({"mem_gbps": next(rates)}), ""))
    assert rooflines.machine_rates()["mem_gbps"] == 25.0
    assert rooflines.machine_rates(fresh=True)["mem_gbps"] == 33.0
    assert rooflines.machine_rates()["mem_gbps"] == 33.0
    rooflines.machine_rates(store={"mem_gbps": 40.0})
    assert rooflines.machine_rates() == {"mem_gbps": 40.0}


def test_without_rates_when_the_probe_fails(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: (_ for _ in ()).throw(subprocess.TimeoutExpired(cmd, 300)))
    assert rooflines.machine_rates(str(tmp_path)) == {}
    assert not (tmp_path / "cache" / "bench.json").exists()  # nothing cached: measured again next time


def test_an_unreadable_cache_costs_a_probe_not_the_report(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path))
    (tmp_path / "bench.json").write_text("{not json")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 0, json.dumps({"mem_gbps": 12.0}), ""))
    assert rooflines.machine_rates() == {"mem_gbps": 12.0}
