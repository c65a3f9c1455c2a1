"""The same `tierlm finetune` command gives the same bits on the same machine, however busy it is
and whatever `tierlm bench io` timed since: every choice that changes results (precision, the
optimizer's shard size with gradient accumulation, activation policies, kernels) comes from the
hardware's ISA flags or from flags, never from a timing."""
import json
import os
import subprocess
import sys

import pytest

from tierlm.bench import cache
from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config

BURN = "while True:\n    pass\n"


def _finetune(model, data, out, env):
    r = subprocess.run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data),
                        "--output", str(out), "--cpu-mem", "256MiB", "--seq-len", "32", "--steps", "3",
                        "--grad-accum", "2", "--lr", "1e-2", "--max-grad-norm", "0.05", "--timeline-step", "0"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


def _losses(out):
    return [(r["loss"], r["grad_norm"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_the_same_command_beside_a_busy_cpu_writes_the_same_bytes(tmp_path, monkeypatch):
    model = tmp_path / "model"
    # widths past the 2048-element shards bench io is made to pick below: a split tensor's clip norm
    init_model(model, make_config("llama", None, {"layers": 2, "hidden": 64, "intermediate": 192}))
    data = tmp_path / "d.txt"
    data.write_text("the same command gives the same bits on the same machine, busy or idle. " * 300)
    monkeypatch.setenv("TIERLM_CACHE_DIR", str(tmp_path / "cache"))
    runs, burners = {}, []
    try:
        for name, shard_bytes, busy in (("idle", 8 << 10, False), ("busy", 64 << 10, True)):
            # a bench io timing of this file system, another each time (as a re-run of bench io on a
            # busy drive may give): it may tune I/O, never change bits
            cache.update("io", {"dir": str(tmp_path), "shard_bytes": shard_bytes, "queue_depth": 1 if busy else 8})
            if busy:  # a process spinning on every core while the run chooses and computes
                burners = [subprocess.Popen([sys.executable, "-c", BURN]) for _ in range(os.cpu_count() or 1)]
            runs[name] = _finetune(model, data, tmp_path / name, dict(os.environ))
            for p in burners:
                p.kill()
                p.wait()
            burners = []
    finally:
        for p in burners:
            p.kill()
            p.wait()
    idle, busy = tmp_path / "idle", tmp_path / "busy"
    assert runs["idle"]["precision"] == runs["busy"]["precision"]
    assert runs["idle"]["precision_reason"] == runs["busy"]["precision_reason"]
    assert "--precision auto chose" in runs["idle"]["precision_reason"]
    assert _losses(idle) == _losses(busy)
    files = sorted(p.name for p in (idle / "final").iterdir())
    assert any(f.endswith(".safetensors") for f in files)
    assert files == sorted(p.name for p in (busy / "final").iterdir())
    for f in files:
        assert (idle / "final" / f).read_bytes() == (busy / "final" / f).read_bytes(), f
