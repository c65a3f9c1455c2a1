"""The in-memory reference's per-step record: the same CPU counters as the out-of-core run's."""
import json

import torch

from tests.cpu_spin import after_spinning
from tierlm.train import inmemory


def test_each_step_records_its_cpu_seconds_by_thread(tiny, tmp_path, monkeypatch):
    # Each step spends a known 60 ms of main-thread CPU (in the clip, which the step runs on the main
    # thread): a tiny model's own step can take under the kernel's 10 ms tick, so it alone cannot show
    # that a row counts the main thread's work.
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", after_spinning(torch.nn.utils.clip_grad_norm_, 0.06))
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "mem.json"
    inmemory.main([str(tiny), "--data", str(data), "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                   "--precision", "fp32", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["cpu_s"]) <= {"main", "torch_threads", "other", "exited"}, r["cpu_s"]
        assert r["cpu_s"].get("main", 0) >= 0.04, rows  # every step's lap holds its own main-thread work
        assert r["grad_norm"] is not None  # the clip ran (default --max-grad-norm)
