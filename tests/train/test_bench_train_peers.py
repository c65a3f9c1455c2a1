"""`bench train`'s peer row (DeepSpeed ZeRO-3 offloaded) and the machine line above the figures.

DeepSpeed is optional: these tests fake its runs, and the one that runs it is skipped where it is
not installed (CI)."""
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tierlm.bench.machine import ISA_FLAGS, machine_kind, machine_line
from tierlm.hf import checks
from tierlm.train import bench_train as bt
from tierlm.train import peer_deepspeed as peer

from .test_bench_train import _fake_finetune

MACHINE = {"cpu": "Some CPU", "isa": ["avx2", "avx512f"], "cores": 2, "ram_bytes": 24 << 30}


@pytest.fixture(autouse=True)
def _no_real_runs(monkeypatch):
    monkeypatch.setattr(checks, "check_model_dir", lambda path: {})
    monkeypatch.setattr(checks, "load_tokenizer", lambda path: None)
    monkeypatch.setattr(bt, "_probe_io", lambda nvme_dir: {"read_gbps": 2.0, "write_gbps": 2.0, "dir": "d"})
    monkeypatch.setattr(bt, "_inmemory_fits", lambda model: (True, 1 << 30))


def _runs(cmds, peer_fails=False, offload="nvme"):
    """subprocess.run for the three runs: in-memory 4 s/step, out-of-core 5, DeepSpeed 8 (steady)."""
    def run(cmd, check=False, env=None, **kw):
        cmds.append(cmd)
        if "tierlm.train.inmemory" in cmd or "tierlm.train.peer_deepspeed" in cmd:
            if "tierlm.train.peer_deepspeed" in cmd and peer_fails:
                raise subprocess.CalledProcessError(1, cmd)
            ds = "tierlm.train.peer_deepspeed" in cmd
            rows = [{"s_per_step": s, "loss": 1.0} for s in ((20.0, 12.0, 8.0, 8.0) if ds else (9.0, 4.0, 4.0, 4.0))]
            out = {"rows": rows, "peak_rss_bytes": 3 << 30}
            if ds:
                out.update(offload=offload, offload_why="--offload auto", deepspeed_version="0.19.8",
                           swap_bytes=1 << 30, tuning=peer.tuning_defaults())
            Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(out))
            return subprocess.CompletedProcess(cmd, 0)
        return _fake_finetune(cmd, check, env, **kw)
    return run


def _bench(monkeypatch, tmp_path, version, peers="auto", **kw):
    cmds = []
    monkeypatch.setattr(bt, "deepspeed_version", lambda: version)
    monkeypatch.setattr(bt.subprocess, "run", _runs(cmds, **kw))
    r = bt.bench_train("model", "data.txt", "1GiB", 4, str(tmp_path), ["--precision", "bf16", "--device", "cpu"],
                       peers=peers)
    return r, bt.report(r), cmds


def test_the_peer_runs_as_a_third_process_on_the_same_model_data_and_batch(monkeypatch, tmp_path):
    r, text, cmds = _bench(monkeypatch, tmp_path, "0.19.8")
    ds = [c for c in cmds if "tierlm.train.peer_deepspeed" in c]
    mem = [c for c in cmds if "tierlm.train.inmemory" in c]
    assert len(ds) == 1 and len(mem) == 1
    # the in-memory run's arguments, the same ones, and its own swap folder under the work directory
    assert ds[0][3:ds[0].index("--nvme")] == mem[0][3:mem[0].index("--json")]
    assert ds[0][ds[0].index("--nvme") + 1] == str(tmp_path / "deepspeed" / "nvme")
    assert r["deepspeed"]["s_per_step"] == 8.0 and r["deepspeed"]["offload"] == "nvme"
    assert ("DeepSpeed:    8.00 s/step, peak RSS 3.00 GiB (DeepSpeed 0.19.8 ZeRO-3, parameters and optimizer "
            "offloaded to NVMe; steps 20.00, 12.00, 8.00, 8.00)") in text
    assert ("ratio DeepSpeed / in-memory: 2.00x; out-of-core / DeepSpeed: 0.62x; losses against in-memory identical"
            in text)


def test_a_cpu_offload_is_never_called_nvme(monkeypatch, tmp_path):
    _, text, _ = _bench(monkeypatch, tmp_path, "0.19.8", offload="cpu")
    assert "offloaded to CPU RAM (not NVMe" in text and "offloaded to NVMe" not in text


def test_without_deepspeed_there_is_no_peer_row_and_a_line_says_so(monkeypatch, tmp_path):
    r, text, cmds = _bench(monkeypatch, tmp_path, None)
    assert not any("tierlm.train.peer_deepspeed" in c for c in cmds)
    assert r["deepspeed"] is None
    assert "DeepSpeed:    not run (DeepSpeed is not installed (pip install deepspeed to compare with it))" in text
    assert "ratio DeepSpeed" not in text


def test_peers_none_skips_it_where_it_is_installed(monkeypatch, tmp_path):
    r, text, cmds = _bench(monkeypatch, tmp_path, "0.19.8", peers="none")
    assert not any("tierlm.train.peer_deepspeed" in c for c in cmds)
    assert "DeepSpeed:    not run (--peers none)" in text
    with pytest.raises(ValueError, match="--peers must be auto or none"):
        _bench(monkeypatch, tmp_path, "0.19.8", peers="yes")


def test_a_failed_peer_is_a_line_not_the_benchmarks_failure(monkeypatch, tmp_path):
    r, text, _ = _bench(monkeypatch, tmp_path, "0.19.8", peer_fails=True)
    assert r["outofcore"]["s_per_step"] == 5.0 and r["deepspeed"] is None
    assert "DeepSpeed:    not run (DeepSpeed 0.19.8: the DeepSpeed run failed (exit status 1)" in text


def test_the_flag_reaches_bench_train(monkeypatch):
    from tierlm.cli import main

    seen = []

    def fake(*a, **kw):
        seen.append(kw["peers"])
        raise SystemExit(0)
    monkeypatch.setattr(bt, "bench_train", fake)
    for flags in ([], ["--peers", "none"]):
        with pytest.raises(SystemExit):
            main(["bench", "train", "m", "--data", "d", *flags])
    assert seen == ["auto", "none"]


def test_the_machine_is_printed_above_the_figures(monkeypatch, tmp_path):
    monkeypatch.setattr(bt, "machine_kind", lambda: MACHINE)
    _, text, _ = _bench(monkeypatch, tmp_path, None)
    assert text.splitlines()[1] == "  machine: Some CPU, 2 cores, 24.00 GiB RAM; ISA: avx2 avx512f"
    k = machine_kind()
    assert k["cores"] >= 1 and k["ram_bytes"] > 0 and set(k["isa"]) <= set(ISA_FLAGS)
    assert machine_line({**MACHINE, "isa": []}).endswith("ISA: none of " + " ".join(ISA_FLAGS))


def test_the_deepspeed_config_offloads_both_to_the_drive_or_says_cpu():
    from tierlm.train.options import FinetuneConfig

    cfg = FinetuneConfig(model="m", data="d", batch_size=4, grad_accum=2, precision="bf16", lr=3e-4)
    tune = peer.tuning_defaults()
    c = peer.ds_config(cfg, "nvme", "/swap", 32000 * 1024 + 1, tune)
    z = c["zero_optimization"]
    assert z["stage"] == 3 and c["bf16"]["enabled"] and c["optimizer"]["params"]["lr"] == 3e-4
    assert (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"]) == (4, 2)
    for key in ("offload_param", "offload_optimizer"):
        assert z[key]["device"] == "nvme" and z[key]["nvme_path"] == "/swap"
    # a buffer holds the largest tensor whole
    assert z["offload_param"]["buffer_size"] >= 32000 * 1024 + 1 and z["offload_param"]["buffer_size"] % (1 << 20) == 0
    assert c["aio"]["block_size"] == tune["aio_block_size"] and c["aio"]["queue_depth"] == tune["aio_queue_depth"]
    c = peer.ds_config(cfg, "cpu", "/swap", 1000, tune)
    assert all(c["zero_optimization"][k] == {"device": "cpu", "pin_memory": False}
               for k in ("offload_param", "offload_optimizer"))
    assert "aio" not in c
    with pytest.raises(ValueError, match="--offload must be one of auto, nvme, cpu"):
        peer.resolve_offload("disk")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed is not installed")
def test_the_peer_trains_a_tiny_model_offloaded_to_nvme(tmp_path, monkeypatch):
    from tierlm.cli import main

    monkeypatch.undo()  # the real model directory and tokenizer
    # DeepSpeed keeps a tensor under 1 MiB in RAM: at hidden 256 the MLP's (256 x 2048) and the
    # embedding and head go to the drive. (With only the embedding and the head over 1 MiB, its NVMe
    # prefetch asks to read the head twice at the second step: "already assigned swap buffer".)
    model = tmp_path / "model"
    assert main(["init", str(model), "--arch", "llama", "--layers", "2", "--hidden", "256", "--heads", "4",
                 "--intermediate", "2048", "--vocab", "4096"]) == 0
    data = tmp_path / "data.txt"
    data.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "ds.json"
    subprocess.run([sys.executable, "-m", "tierlm.train.peer_deepspeed", str(model), "--data", str(data),
                    "--steps", "3", "--batch-size", "2", "--seq-len", "64", "--precision", "bf16", "--device", "cpu",
                    "--lr", "1e-3", "--nvme", str(tmp_path / "nvme"), "--offload", "nvme", "--json", str(out)],
                   check=True, timeout=600)
    r = json.loads(out.read_text())
    assert r["offload"] == "nvme" and r["swap_bytes"] > 0 and r["peak_rss_bytes"] > 0
    losses = [row["loss"] for row in r["rows"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert not (tmp_path / "nvme" / "deepspeed-swap").exists()  # its swap files are removed after the run
