"""Run a command under a hard memory limit that counts the page cache: a memory cgroup of its own.

    python benchmarks/peers/memlimit.py --limit 2.5GiB [--evict FILE ...] -- COMMAND ...

A memory-mapped model (llama.cpp maps its GGUF) lives in the page cache, which RLIMIT_AS and RSS
limits do not see; a memory cgroup charges both the process's own memory and the file pages it
brings in, and reclaims (or, for memory it cannot drop, kills) at the limit. cgroup v1
(memory.limit_in_bytes) and v2 (memory.max) are both handled: a child group is made under this
process's own memory cgroup, the command joins it, and the group's peak is read after it exits.

A page is charged to the group that first brought it in: a file already in the page cache (just
written, or read by an earlier run) would be read free of the limit. `evict` drops a file's clean
pages first (posix_fadvise DONTNEED), so the limited command pays for every page it reads.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1000, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'2GiB', '2.5G', '512MiB', 1024 -> bytes (binary prefixes for K/M/G without 'B', as cgroups do)."""
    if isinstance(text, int):
        return text
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"not a size: {text!r} (e.g. 2GiB, 512MiB)")
    return int(float(num) * _UNITS[unit])


class Unavailable(RuntimeError):
    """This machine lets this process set no memory limit (the message says why)."""


@dataclass(frozen=True)
class Controller:
    version: int    # 1 or 2
    root: Path      # this process's own memory cgroup directory

    @property
    def limit_file(self) -> str:
        return "memory.limit_in_bytes" if self.version == 1 else "memory.max"

    @property
    def peak_file(self) -> str:
        return "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"

    @property
    def current_file(self) -> str:
        return "memory.usage_in_bytes" if self.version == 1 else "memory.current"


def _mounts() -> list[tuple[str, str, str]]:
    """(mount point, fs type, super options) of the cgroup mounts, from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if tail and tail[0] in ("cgroup", "cgroup2"):
            out.append((fields[4], tail[0], tail[2] if len(tail) > 2 else ""))
    return out


def _own_dir(mount: str, rel: str) -> Path:
    """The group's directory: the mount plus the path /proc/self/cgroup names; in a cgroup namespace
    the mount is already the group (the path then reads '/')."""
    d = Path(mount) / rel.lstrip("/")
    return d if d.is_dir() else Path(mount)


def controller() -> Controller:
    """This process's memory cgroup (v1 memory controller first, then v2 with memory enabled), or
    Unavailable saying what is missing."""
    lines = [ln.split(":", 2) for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.count(":") >= 2]
    mounts = _mounts()
    for _, ctrls, rel in lines:
        if "memory" in ctrls.split(","):
            for mnt, fs, opts in mounts:
                if fs == "cgroup" and "memory" in opts.split(","):
                    return Controller(1, _own_dir(mnt, rel))
    for _, ctrls, rel in lines:
        if ctrls == "":
            for mnt, fs, _ in mounts:
                if fs == "cgroup2":
                    d = _own_dir(mnt, rel)
                    if "memory" in (d / "cgroup.controllers").read_text().split():
                        return Controller(2, d)
    raise Unavailable("no memory cgroup: neither a cgroup v1 memory controller nor cgroup v2 with the memory "
                      "controller is mounted for this process (see /proc/self/cgroup, /proc/self/mountinfo)")


def _has_swap() -> bool:
    return len(Path("/proc/swaps").read_text().splitlines()) > 1


def evict(*paths: str | os.PathLike) -> None:
    """Drop the files' clean pages from the page cache, so a limited run is charged for reading them."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)  # dirty pages (a file just written) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class MemoryLimit:
    """A child memory cgroup limited to `limit` bytes (page cache included, no swap); `run` starts
    commands inside it; `stats` reads its peak. Removed on exit (its charges go to the parent)."""

    def __init__(self, limit: int | str, ctl: Controller | None = None):
        self.limit = parse_bytes(limit)
        self.ctl = ctl or controller()
        self.path = self.ctl.root / f"tierlm-limit-{uuid.uuid4().hex[:8]}"

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(str(value))

    def _read(self, name: str) -> str:
        return (self.path / name).read_text()

    def __enter__(self) -> "MemoryLimit":
        try:
            self.path.mkdir()
        except OSError as e:
            raise Unavailable(f"cannot create a memory cgroup under {self.ctl.root}: {e}") from e
        try:
            if self.ctl.version == 2 and not (self.path / "memory.max").exists():
                raise Unavailable(f"{self.ctl.root}/cgroup.subtree_control does not enable memory for child groups")
            self._write(self.ctl.limit_file, self.limit)
            swap = "memory.memsw.limit_in_bytes" if self.ctl.version == 1 else "memory.swap.max"
            if (self.path / swap).exists() and _has_swap():  # no swapping past the limit
                self._write(swap, self.limit if self.ctl.version == 1 else 0)
        except OSError as e:
            self._remove()
            raise Unavailable(f"cannot set a memory limit in {self.path}: {e}") from e
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for _ in range(50):  # the last member may still be exiting
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)

    def command(self, cmd: list[str]) -> list[str]:
        """`cmd` wrapped to join this group before it starts (a shell writes its pid, then execs)."""
        return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path), *map(str, cmd)]

    def run(self, cmd: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(cmd), **kw)

    def stats(self) -> dict:
        """The limit, the group's peak and current charge (bytes), and how often it hit the limit / OOM-killed."""
        out = {"limit": self.limit, "peak": int(self._read(self.ctl.peak_file)),
               "current": int(self._read(self.ctl.current_file)), "cgroup": f"v{self.ctl.version}"}
        if self.ctl.version == 1:
            out["limit_hits"] = int(self._read("memory.failcnt"))
            oom = dict(ln.split() for ln in self._read("memory.oom_control").splitlines())
            out["oom_kills"] = int(oom.get("oom_kill", 0))
        else:
            ev = dict(ln.split() for ln in self._read("memory.events").splitlines())
            out["limit_hits"], out["oom_kills"] = int(ev.get("max", 0)), int(ev.get("oom_kill", 0))
        return out


def run_limited(cmd: list[str], limit: int | str, evict_files=(), **kw) -> tuple[subprocess.CompletedProcess, dict]:
    """Run `cmd` under `limit` (after evicting `evict_files` from the page cache); returns the
    finished process and the group's stats (peak, hits, OOM kills)."""
    evict(*evict_files)
    with MemoryLimit(limit) as g:
        p = g.run(cmd, **kw)
        return p, g.stats()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", required=True, help="memory limit, page cache included (e.g. 2.5GiB)")
    p.add_argument("--evict", nargs="*", default=[], help="files to drop from the page cache first")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        p.error("no command")
    try:
        proc, st = run_limited(cmd, a.limit, a.evict)
    except Unavailable as e:
        print(f"memlimit: {e}", file=sys.stderr)
        return 2
    mib = 1 << 20
    print(f"memlimit: {st['cgroup']} limit {st['limit'] / mib:.0f} MiB, peak {st['peak'] / mib:.0f} MiB, "
          f"limit hits {st['limit_hits']}, OOM kills {st['oom_kills']}, exit {proc.returncode}", file=sys.stderr)
    return proc.returncode if proc.returncode >= 0 else 128 - proc.returncode


if __name__ == "__main__":
    sys.exit(main())
