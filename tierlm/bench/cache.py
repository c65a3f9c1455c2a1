"""Where measured rates are kept: ~/.cache/tierlm/bench.json (or $TIERLM_CACHE_DIR), and a copy next
to the NVMe directory measured, so the planner's `--hardware this` finds them without re-measuring."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

NAME = "bench.json"
PROBES = "drive_probes"  # section: mount point -> a run's first-step drive probe (bench.rates)


def cache_path() -> Path:
    root = os.environ.get("TIERLM_CACHE_DIR") or Path.home() / ".cache" / "tierlm"
    return Path(root) / NAME


def load() -> dict:
    path = cache_path()
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read the cached measurements ({e}); delete it and run `tierlm bench io` "
                         f"and `tierlm bench compute` again") from None


def update(section: str, values: dict, also_next_to: str | os.PathLike | None = None) -> Path:
    """Merge one section ("io" or "compute") into the cache; returns the cache file."""
    data = load()
    data[section] = values
    path = _write(data)
    if also_next_to is not None:
        (Path(also_next_to) / f"tierlm-{NAME}").write_text(json.dumps({section: values}, indent=2) + "\n")
    return path


def _write(data: dict) -> Path:
    """The cache replaced whole by `data`, through a file of this process's own: runs that start
    together (a data-parallel job, a test's concurrent runs) each write a complete cache."""
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{NAME}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


def probe_for(path: str | os.PathLike) -> dict | None:
    """The drive probe an earlier run made of the file system `path` is on (keep_probe), else None."""
    try:
        return load().get(PROBES, {}).get(mount_point(path))
    except (OSError, ValueError, AttributeError):
        return None


def keep_probe(path: str | os.PathLike, values: dict) -> None:
    """Keep a run's drive probe of the file system `path` is on, by mount point, for the runs after
    it. A cache that cannot be read or written leaves the run as it was: it measured its rates."""
    try:
        data = load()
        data.setdefault(PROBES, {})[mount_point(path)] = values
        _write(data)
    except (OSError, ValueError, TypeError):
        pass


def mount_point(path: str | os.PathLike) -> str:
    """The mount point of the file system `path` is on."""
    p = Path(path).resolve()
    while not os.path.ismount(p) and p != p.parent:
        p = p.parent
    return str(p)


def io_for(path: str | os.PathLike) -> dict | None:
    """The cached `bench io` section if it measured the file system `path` is on, else None: the
    folder measured, or (once it is gone: a scratch folder) the same mount point."""
    try:
        io = load().get("io")
        if not io:
            return None
        if os.path.exists(io["dir"]):
            return io if os.stat(io["dir"]).st_dev == os.stat(path).st_dev else None
        return io if io.get("mount") and io["mount"] == mount_point(path) else None
    except (OSError, KeyError, ValueError):
        return None
