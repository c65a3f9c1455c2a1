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
from .options import FinetuneConfig

# Options whose change alters the result of the remaining steps (the others: where files go,
# budgets and performance knobs, which are exact by construction, and the sample at the end).
RESULT_OPTIONS = ("model", "data", "precision", "seq_len", "batch_size", "grad_accum", "steps", "epochs",
                  "lr", "schedule", "warmup_steps", "weight_decay", "beta1", "beta2", "eps",
                  "max_grad_norm", "optim_impl", "optim_states", "seed")


class RunLock:
    """An exclusive lock on the run directory: a second run pointed at it refuses to start.

    The `.lock` file goes when the lock is released, so that no run, finished or refused, leaves it
    behind. Removing a flock'ed file races with a process that opened it just before: that process
    would hold a lock on a file no longer there while a third locks a new one. So whoever takes the
    lock checks that the path still names the file it locked, and opens again where it does not."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / ".lock"
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(self.fd)
                if e.errno in (errno.EAGAIN, errno.EACCES):
                    try:
                        holder = self.path.read_text().strip()
                    except OSError:
                        holder = ""
                    raise ValueError(f"{directory} is in use by a running fine-tune ({holder or 'another process'});"
                                     f" wait for it to finish or give this run another --output") from None
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(self.fd)  # the holder released and removed it as we opened it: lock the new one
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.path)  # while still holding it (see the class's docstring)
            except FileNotFoundError:
                pass
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def _first_missing(path) -> Path | None:
    """The top-most directory of `path` that does not exist yet: what mkdir(parents=True) creates."""
    p = Path(path).absolute()
    if p.exists():
        return None
    while not p.parent.exists():
        p = p.parent
    return p


def created_by_us(out: Path, nvme: str | None) -> list[Path]:
    """The directories a new run is about to create (the run directory, the NVMe directory and any
    missing parents), taken before it creates them. A directory that exists already, the user's,
    with whatever it holds, is never among them."""
    return [p for p in (_first_missing(out), _first_missing(nvme) if nvme else None) if p is not None]


def undo_refused(out: Path, created: list[Path]) -> None:
    """After a run was refused: remove the directories it created, unless a step got as far as the
    metrics (a row is written before each step's commit: then the run is resumable and stays; the
    file itself is opened, empty, before step 1). The lock is released by its holder."""
    if any(m.stat().st_size > 0 for m in Path(out).glob("metrics*.jsonl")):
        return
    for d in created:
        shutil.rmtree(d, ignore_errors=True)


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
