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


def test_bf16_losses_equal_the_out_of_core_runs_with_fp32_routers(tmp_path):
    """In bf16, the reference keeps what transformers keeps in fp32 (DeepSeek-V3's router weights),
    as the engine does: its losses are the out-of-core run's, bit for bit (bf16 routers differed at
    step 1)."""
    import tierlm
    from tests.families import family_config
    from tierlm.hf.init import init_model

    model = init_model(tmp_path / "model", family_config("deepseek_v3", vocab_size=300), seed=1)
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"word{i % 37} and number {i}." for i in range(400)))
    common = dict(seq_len=32, batch_size=2, steps=3, lr=5e-3, precision="bf16")
    tierlm.finetune(model=str(model), data=str(data), output=str(tmp_path / "run"), cpu_mem="512MiB", **common)
    out = tmp_path / "mem.json"
    inmemory.main([str(model), "--data", str(data), "--json", str(out)]
                  + [a for k, v in common.items() for a in (f"--{k.replace('_', '-')}", str(v))])
    ref = [r["loss"] for r in json.loads(out.read_text())["rows"]]
    got = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert got == ref
