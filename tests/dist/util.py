"""Launching torchrun from the tests: the checkout under test goes on PYTHONPATH, from any directory."""
import os
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


def torchrun(nproc: int, *args, timeout=180, **extra) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "--monitor-interval=0.2", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env(**extra), timeout=timeout, cwd=ROOT)


def tierlm_cli(*args, timeout=180, **extra) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierlm", *map(str, args)], capture_output=True, text=True,
                          env=env(**extra), timeout=timeout, cwd=ROOT)
