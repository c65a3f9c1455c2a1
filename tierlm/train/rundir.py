"""The run directory and the NVMe directory: one run at a time, room for the state, and what a
resumed run must agree with."""
from __future__ import annotations

import base64
import errno
import fcntl
import io
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..units import fmt_bytes

# Options whose change alters the result of the remaining steps (the others: where files go,
# budgets and performance knobs, which are exact by construction, and the sample at the end).
RESULT_OPTIONS = ("model", "data", "precision", "seq_len", "batch_size", "grad_accum", "steps", "epochs",
                  "lr", "schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
                  "max_grad_norm", "optim_impl", "optim_states", "seed")


class RunLock:
    """An exclusive lock on the run directory: a second run pointed at it refuses to start."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                holder = self.path.read_text().strip() or "another process"
                raise ValueError(f"{directory} is in use by a running fine-tune ({holder}); wait for it "
                                 f"to finish or give this run another --output") from None
            raise
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def check_nvme(directory: str, needed: int) -> None:
    """The NVMe directory must be writable and have room for the state (both slots)."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".write-probe-"):
            pass
    except OSError as e:
        raise ValueError(f"--nvme {d}: cannot write there ({e.strerror}); give a writable directory "
                         f"on a file system with at least {fmt_bytes(needed)} free") from None
    have = shutil.disk_usage(d).free + _bytes_under(d)
    if have < needed:
        raise ValueError(f"--nvme {d}: the state needs {fmt_bytes(needed)} but the file system has "
                         f"{fmt_bytes(have)} free; free space there or choose another --nvme")


def _bytes_under(d: Path) -> int:
    """What a restart would reuse: the state files already there."""
    total = 0
    for p in d.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_blocks * 512
        except OSError:
            pass
    return total


def config_diff(saved: dict, now: dict) -> list[str]:
    """Options that change results and differ. An option the saved run predates had its default
    then (options are added with the old behaviour as their default)."""
    from dataclasses import fields

    from .finetune import FinetuneConfig
    defaults = {f.name: f.default for f in fields(FinetuneConfig)}
    return [f"{k}: {saved.get(k, defaults.get(k))!r} in the run, {now.get(k)!r} now" for k in RESULT_OPTIONS
            if saved.get(k, defaults.get(k)) != now.get(k)]


def rng_state() -> str:
    buf = io.BytesIO()
    torch.save(torch.get_rng_state(), buf)
    return base64.b64encode(buf.getvalue()).decode()


def set_rng_state(encoded: str) -> None:
    torch.set_rng_state(torch.load(io.BytesIO(base64.b64decode(encoded))))


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop rows of steps that were not committed (a crash between the row and the commit)."""
    if not path.exists():
        return
    import json
    keep = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= last_step]
    path.write_text("".join(line + "\n" for line in keep))
