"""A run killed with SIGKILL anywhere, then resumed, ends with the bits of a run never killed."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .reliability_utils import RUN_ARGS, assert_same_run, make_inputs, state_of

# (fault point, which pass through it): spread over the steps and over every phase of a step.
KILLS = [
    ("forward.layer", 2), ("forward.layer", 11), ("backward.layer", 3), ("backward.layer", 14),
    ("optimizer.write", 5), ("optimizer.write", 77), ("store.write", 40), ("commit.fsync", 3),
    ("commit.manifest", 4), ("commit.after", 2), ("checkpoint", 3),
]


def finetune(model, data, out, *extra, env=None):
    return subprocess.run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data),
                           "--output", str(out), *RUN_ARGS, *extra], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    model, data = make_inputs(root)
    r = finetune(model, data, root / "ref")
    assert r.returncode == 0, r.stderr[-2000:]
    return root, model, data, state_of(root / "ref")


@pytest.mark.slow
@pytest.mark.parametrize("every", ["1", "3"], ids=["commit-every-step", "commit-every-3"])
@pytest.mark.parametrize("point,n", KILLS, ids=[f"{p}-{n}" for p, n in KILLS])
def test_killed_then_resumed_equals_never_killed(reference, point, n, every):
    """Every kill point, with a commit every step and every 3 steps (a kill then loses up to 2
    steps, replayed after the resume): the end is the never-killed run's bits (whose interval was
    auto)."""
    root, model, data, ref = reference
    out = root / f"kill-{point}-{n}-{every}"
    r = finetune(model, data, out, "--commit-every", every, env={"TIERLM_FAULT": f"{point}:{n}:kill"})
    assert r.returncode == -signal.SIGKILL, f"the fault did not fire: {r.stderr[-1000:]}"
    r = finetune(model, data, out, "--resume", "auto", "--commit-every", every)
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(ref, state_of(out))


@pytest.mark.slow
def test_supervisor_recovers_from_two_outside_kills(reference):
    root, model, data, ref = reference
    out = root / "supervised"
    proc = subprocess.Popen([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(data),
                             "--output", str(out), *RUN_ARGS, "--max-restarts", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    deadline = time.time() + 300
    metrics = out / "metrics.jsonl"
    while len(killed) < 2 and time.time() < deadline and proc.poll() is None:
        rows = metrics.read_text().splitlines() if metrics.exists() else []
        pid_file = out / "child.pid"
        if len(rows) >= 2 + 2 * len(killed) and pid_file.exists():
            pid = int(pid_file.read_text())
            if pid not in killed:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=300)
    assert len(killed) == 2 and proc.returncode == 0, err[-2000:]
    causes = [json.loads(x)["cause"] for x in (out / "restarts.jsonl").read_text().splitlines()]
    assert causes == ["killed by SIGKILL", "killed by SIGKILL"], err[-3000:]
    assert_same_run(ref, state_of(out))
