"""Where measured rates are kept: ~/.cache/tierlm/bench.json (or $TIERLM_CACHE_DIR), and a copy next
to the NVMe directory measured, so the planner's `--hardware this` finds them without re-measuring."""
from __future__ import annotations

import json
import os
from pathlib import Path

NAME = "bench.json"


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
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    if also_next_to is not None:
        (Path(also_next_to) / f"tierlm-{NAME}").write_text(json.dumps({section: values}, indent=2) + "\n")
    return path


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
