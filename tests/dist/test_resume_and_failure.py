"""Killing one rank fails the job within a bounded time; the run resumes on 1 rank, then on 2 with
torchrun restarting it after another kill, and ends where an uninterrupted 2-rank run ends."""
import json
import time

import pytest
from safetensors.torch import load_file

from tierlm.storage.commit import list_manifests, read_manifest

from ..train.reliability_utils import make_inputs
from .util import tierlm_cli

ARGS = ["--seq-len", "24", "--batch-size", "4", "--steps", "6", "--lr", "1e-3", "--max-grad-norm", "0.5",
        "--precision", "fp32", "--weight-decay", "0.01", "--cpu-mem", "256MiB", "--timeline-step", "0",
        "--dist-timeout", "60"]


def finetune(model, data, out, *extra, **env):
    t0 = time.monotonic()
    r = tierlm_cli("finetune", model, "--data", data, "--output", out, *ARGS, *extra, **env)
    return r, time.monotonic() - t0


def committed(out, rank):
    return read_manifest(list_manifests(out / "nvme" / f"rank{rank}")[0])


def losses(out):
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    model, data = make_inputs(root)
    r, _ = finetune(model, data, root / "ref", "--nproc", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    return root, model, data, root / "ref"


@pytest.mark.slow
def test_rank_killed_mid_step_then_resumed_on_1_then_2_ranks(reference):
    root, model, data, ref = reference
    out = root / "chain"
    # Rank 1 dies inside the optimizer of step 2: torchrun stops rank 0, the job fails.
    r, took = finetune(model, data, out, "--nproc", "2", TIERLM_FAULT="optimizer.write:30:kill",
                       TIERLM_FAULT_RANK="1")
    assert r.returncode != 0 and took < 150, (took, r.stderr[-2000:])
    step = committed(out, 0)["step"]
    assert 1 <= step < 6 and committed(out, 1)["step"] in (step, step + 1)

    # 2 -> 1: one rank takes over both shares and runs two steps (killed after its 2nd commit).
    r, _ = finetune(model, data, out, "--nproc", "1", "--resume", "auto", TIERLM_FAULT="commit.after:2:kill")
    assert r.returncode != 0 and f"resumed after step {step} (the last committed" in r.stderr, r.stderr[-2000:]
    one = committed(out, 0)
    assert one["step"] == step + 2 and one["dist"]["world"] == 1

    # 1 -> 2, and torchrun's restart: rank 1 is killed once, torchrun restarts both, they resume.
    r, _ = finetune(model, data, out, "--nproc", "2", "--resume", "auto", "--max-restarts", "1",
                    TIERLM_FAULT="optimizer.write:5:kill", TIERLM_FAULT_RANK="1")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("resumed after step") == 2

    assert [committed(out, i)["step"] for i in range(2)] == [6, 6]
    got, want = load_file(out / "final" / "model.safetensors"), load_file(ref / "final" / "model.safetensors")
    assert got.keys() == want.keys()
    for n, w in want.items():
        diff = float((got[n].double() - w.double()).norm() / w.double().norm())
        assert diff < 1e-6, f"{n}: relative difference {diff:.2e}"
    assert losses(out) == pytest.approx(losses(ref), rel=1e-6)
    assert len(losses(out)) == 6


def test_plain_run_refuses_a_data_parallel_state(reference):
    root, model, data, ref = reference
    r, _ = finetune(model, data, root / "plain", "--nvme", ref / "nvme", "--resume", "auto")
    assert r.returncode == 2 and "--nproc N --resume auto" in r.stderr, r.stderr[-1000:]
