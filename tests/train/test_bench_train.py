"""`bench train`'s I/O figures: the drive measured beside the run, not the cached `bench io`."""
import json
from pathlib import Path

import pytest

from tierlm.hf import checks
from tierlm.train import bench_train as bt

GB = 1e9


def _fake_finetune(cmd, check=False, env=None, **kw):
    run = Path(cmd[cmd.index("--output") + 1])
    run.mkdir(parents=True)
    rows = [{"s_per_step": s, "loss": 1.0, "ssd_read_bytes": 6 * GB, "ssd_write_bytes": 4 * GB,
             "ssd_read_gbps": 6 / s, "ssd_write_gbps": 4 / s,
             "cpu_s": {"main": s, "torch_threads": 4.0, "checksums": c}} for s, c in ((9.0, 3.0), (5.0, 0.5), (5.0, 1.5))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"peak_rss_bytes": 1 << 30, "library_rss_bytes": 1 << 28}))
    (run / "timeline.json").write_text(json.dumps({"traceEvents": [{"cat": "wait", "dur": 1e6}]}))


@pytest.fixture(autouse=True)
def _model_dir_checks_pass(monkeypatch):
    """The runs are faked here; so is the model directory they would read."""
    monkeypatch.setattr(checks, "check_model_dir", lambda path: {})
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(bt, "deepspeed_version", lambda: None)  # the peer's row: test_bench_train_peers.py


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
    # each probe alone: 6/1 + 4/2 = 8 s and 6/3 + 4/2 = 4 s; twice apart, so the ratio is not settled
    assert o["io_bound_by_probe_s"] == [8.0, 4.0]
    assert "by the probe before / after alone: 8.00 / 4.00 s, 0.62 / 1.25x" in text
    assert "the drive's rate moved during the run (the bounds by each probe differ by 100%)" in text


def test_cpu_seconds_of_the_steady_steps_by_thread(monkeypatch, tmp_path):
    monkeypatch.setattr(bt, "_probe_io", lambda d: {"read_gbps": 2.0, "write_gbps": 2.0, "dir": "d"})
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (False, 1 << 40))
    monkeypatch.setattr(bt.subprocess, "run", _fake_finetune)
    r = bt.bench_train("model", "data.txt", "1GiB", 3, str(tmp_path), ["--precision", "fp32", "--device", "cpu"])
    # the steady step (the third: the first two create the state files) alone, largest first
    assert r["outofcore"]["cpu_s"] == {"main": 5.0, "torch_threads": 4.0, "checksums": 1.5}
    assert "out-of-core: 10.50 CPU s a step (2.10 cores busy): main 5.00, torch_threads 4.00, checksums 1.50" \
        in bt.report(r)


def test_probes_that_agree_raise_no_warning(monkeypatch, tmp_path):
    probes = iter([{"read_gbps": 2.0, "write_gbps": 2.0, "dir": "d"}, {"read_gbps": 2.2, "write_gbps": 2.0, "dir": "d"}])
    monkeypatch.setattr(bt, "_probe_io", lambda nvme_dir: next(probes))
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (False, 1 << 40))
    monkeypatch.setattr(bt.subprocess, "run", _fake_finetune)
    text = bt.report(bt.bench_train("model", "data.txt", "1GiB", 3, str(tmp_path), ["--precision", "fp32", "--device", "cpu"]))
    assert "by the probe before / after alone" in text
    assert "rate moved" not in text


def test_a_failed_run_is_one_clear_error(monkeypatch, tmp_path, capsys):
    """A run's own error is printed by the run; bench then names which run failed, without a traceback."""
    import subprocess

    from tierlm.cli import main

    def fail(cmd, check=False, **kw):
        raise subprocess.CalledProcessError(2, cmd)
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (True, 1 << 20))
    monkeypatch.setattr(bt.subprocess, "run", fail)
    assert main(["bench", "train", "model", "--data", "data.txt", "--work", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "tierlm bench: error: the in-memory run failed (exit status 2); its own error is above" in err
    assert "Traceback" not in err


def test_a_model_without_a_tokenizer_fails_before_any_run(make_model_dir, tmp_path, capsys, monkeypatch):
    from tierlm.cli import main

    monkeypatch.undo()  # the real model directory checks
    model_dir, _ = make_model_dir("llama")  # weights and config, no tokenizer files
    assert main(["bench", "train", str(model_dir), "--data", "data.txt", "--work", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer files" in err and "tierlm init" in err
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("mode,fits,ran", [("auto", True, True), ("auto", False, False), ("always", False, True),
                                           ("never", True, False)])
def test_the_in_memory_reference_runs_where_it_fits_or_where_asked(monkeypatch, tmp_path, mode, fits, ran):
    """The estimate keeps a fifth of the RAM spare; `--inmemory always` runs the reference anyway
    (TinyLlama-1.1B fitted where the estimate said no) and `never` compares with the I/O bound only."""
    import subprocess as sp

    cmds = []

    def run(cmd, check=False, env=None, **kw):
        cmds.append(cmd)
        if "tierlm.train.inmemory" in cmd:
            out = Path(cmd[cmd.index("--json") + 1])
            out.write_text(json.dumps({"rows": [{"s_per_step": 5.0, "loss": 1.0}] * 3, "peak_rss_bytes": 1 << 30}))
            return sp.CompletedProcess(cmd, 0)
        return _fake_finetune(cmd, check, env, **kw)
    monkeypatch.setattr(bt, "_probe_io", lambda nvme_dir: {"read_gbps": 2.0, "write_gbps": 2.0, "dir": "d"})
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (fits, 20 << 30))
    monkeypatch.setattr(bt.subprocess, "run", run)
    r = bt.bench_train("model", "data.txt", "1GiB", 3, str(tmp_path), ["--device", "cpu", "--precision", "fp32"],
                       inmemory=mode)
    assert any("tierlm.train.inmemory" in c for c in cmds) == ran
    assert (r["inmemory"] is not None) == ran
    if not ran:
        assert ("--inmemory always" in r["inmemory_skipped"]) == (mode == "auto")
    with pytest.raises(ValueError, match="--inmemory must be auto, always or never"):
        bt.bench_train("model", "data.txt", "1GiB", 3, str(tmp_path), ["--device", "cpu"], inmemory="yes")
