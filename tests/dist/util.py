"""Launching torchrun from the tests: the checkout under test goes on PYTHONPATH, from any directory."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import tierlm

ROOT = str(Path(tierlm.__file__).resolve().parent.parent)


def env(**extra) -> dict:
    e = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
         "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    e.update(extra)
    return e


def run(cmd, timeout, **extra) -> subprocess.CompletedProcess:
    """Run in a session of its own, so a timeout also ends the ranks torchrun started."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(**extra),
                         cwd=ROOT, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout} s: {cmd}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def torchrun(nproc: int, *args, timeout=180, **extra) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--monitor-interval=0.2", *map(str, args)], timeout, **extra)


def tierlm_cli(*args, timeout=180, **extra) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "tierlm", *map(str, args)], timeout, **extra)
