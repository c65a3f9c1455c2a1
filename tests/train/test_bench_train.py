"""`bench train`'s I/O figures: the drive measured beside the run, not the cached `bench io`."""
import json
from pathlib import Path

from tierlm.train import bench_train as bt

GB = 1e9


def _fake_finetune(cmd, check=False, env=None, **kw):
    run = Path(cmd[cmd.index("--output") + 1])
    run.mkdir(parents=True)
    rows = [{"s_per_step": s, "loss": 1.0, "ssd_read_bytes": 6 * GB, "ssd_write_bytes": 4 * GB,
             "ssd_read_gbps": 6 / s, "ssd_write_gbps": 4 / s} for s in (9.0, 5.0, 5.0)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"peak_rss_bytes": 1 << 30, "library_rss_bytes": 1 << 28}))
    (run / "timeline.json").write_text(json.dumps({"traceEvents": [{"cat": "wait", "dur": 1e6}]}))


def test_bound_uses_the_drive_measured_before_and_after_the_run(monkeypatch, tmp_path):
    probes = iter([{"read_gbps": 1.0, "write_gbps": 2.0, "dir": "d"}, {"read_gbps": 3.0, "write_gbps": 2.0, "dir": "d"}])
    calls = []

    def probe(nvme_dir):
        calls.append(nvme_dir)
        return next(probes)
    monkeypatch.setattr(bt, "_probe_io", probe)
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (False, 1 << 40))
    monkeypatch.setattr(bt.subprocess, "run", _fake_finetune)
    r = bt.bench_train("model", "data.txt", "1GiB", 3, str(tmp_path), ["--precision", "fp32", "--device", "cpu"])

    assert len(calls) == 2 and calls[0] == calls[1]
    o, io = r["outofcore"], r["measured_io"]
    assert (io["read_gbps"], io["write_gbps"]) == (2.0, 2.0)  # the mean of the two probes
    assert abs(o["io_bound_s"] - (6 / 2 + 4 / 2)) < 1e-9
    # each direction's share of the step at its own rate; together they are bound / step
    assert abs(o["ssd_read_share"] - 0.6) < 1e-9 and abs(o["ssd_write_share"] - 0.4) < 1e-9
    text = bt.report(r)
    assert "before and after the run 1.00 / 2.00; 3.00 / 2.00" in text
    assert "read 60% + write 40% = 100% of the step" in text
    assert "step / bound = 1.00x" in text
