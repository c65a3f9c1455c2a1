"""A run killed with SIGKILL anywhere, then resumed, ends with the bits of a run never killed."""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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


def _kill_and_resume(root, model, data, point, n, every):
    """A run killed at the n-th pass through `point`, then resumed: (the killed run, the resumed
    run, the run directory)."""
    out = root / f"kill-{point}-{n}-{every}"
    killed = finetune(model, data, out, "--commit-every", every, env={"TIERLM_FAULT": f"{point}:{n}:kill"})
    if killed.returncode != -signal.SIGKILL:
        return killed, None, out
    return killed, finetune(model, data, out, "--resume", "auto", "--commit-every", every), out


@pytest.fixture(scope="module")
def kill_runs(reference, request):
    """The selected kill points' runs, started together on as many processes as the machine has
    cores: each is a single-threaded tiny run that spends most of its time importing, so the pairs
    finish in about half the time on the 2-core CI machine. Runs do not share files, and each
    test still checks its own."""
    root, model, data, _ = reference
    wanted = [(it.callspec.params["point"], it.callspec.params["n"], it.callspec.params["every"])
              for it in request.session.items
              if it.originalname == "test_killed_then_resumed_equals_never_killed" and hasattr(it, "callspec")]
    pool = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1))
    futures = {w: pool.submit(_kill_and_resume, root, model, data, *w) for w in wanted}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.slow
@pytest.mark.parametrize("every", ["1", "3"], ids=["commit-every-step", "commit-every-3"])
@pytest.mark.parametrize("point,n", KILLS, ids=[f"{p}-{n}" for p, n in KILLS])
def test_killed_then_resumed_equals_never_killed(reference, kill_runs, point, n, every):
    """Every kill point, with a commit every step and every 3 steps (a kill then loses up to 2
    steps, replayed after the resume): the end is the never-killed run's bits (whose interval was
    auto)."""
    ref = reference[3]
    killed, resumed, out = kill_runs[(point, n, every)].result()
    assert killed.returncode == -signal.SIGKILL, f"the fault did not fire: {killed.stderr[-1000:]}"
    assert resumed.returncode == 0, resumed.stderr[-2000:]
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
