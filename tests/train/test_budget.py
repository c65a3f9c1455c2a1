"""`--cpu-mem` is a promise: a model whose training state is >= 4x the budget fine-tunes under it."""
import json
import subprocess
import sys

import pytest

from tierlm.hf.presets import make_config, param_count
from tierlm.units import parse_bytes

from ..memory import library_peak

BUDGET = "96MiB"
SHAPE = {"layers": 8, "hidden": 512, "heads": 8, "kv_heads": 4, "intermediate": 1408, "vocab": 4096}


@pytest.mark.slow
def test_training_state_4x_budget_stays_under_budget(tmp_path):
    config = make_config("llama", None, SHAPE)
    state = 16 * param_count(config)
    budget = parse_bytes(BUDGET)
    assert state >= 4 * budget
    model = tmp_path / "model"
    subprocess.run([sys.executable, "-m", "tierlm", "init", str(model), "--arch", "llama"]
                   + [f"--{k.replace('_', '-')}={v}" for k, v in SHAPE.items()], check=True)
    data = tmp_path / "data.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))

    libraries = library_peak()
    run = subprocess.run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data),
                          "--output", str(tmp_path / "run"), "--cpu-mem", BUDGET, "--seq-len", "64",
                          "--steps", "3", "--lr", "1e-3"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 3
    peak = summary["peak_rss_bytes"]  # the fine-tune's own VmHWM at the end of the run
    print(f"state {state / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB, libraries {libraries / 2**20:.0f} MiB, "
          f"peak {peak / 2**20:.0f} MiB = libraries + {(peak - libraries) / 2**20:.0f} MiB")
    assert peak <= libraries + budget, (
        f"peak RSS {peak / 2**20:.0f} MiB > libraries {libraries / 2**20:.0f} MiB + budget {budget / 2**20:.0f} MiB")
