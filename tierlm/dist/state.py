"""Which committed state a data-parallel run resumes, and resharding it to another number of ranks.

Layout: `<nvme>/rank<r>/` per rank (a plain one-process run uses `<nvme>/` itself). A step is
committed when every rank of its world has `manifest-<step>.json` recording that world; the newest
such step is the run's state. Every manifest also records the ownership map, so a run with another
number of ranks finds each file it now needs in the folder of the rank that wrote it, and hard-links
it into its own folder (no bytes copied; every write renames a new file into place, so a linked file
never changes). That needs all rank folders on one file system, as torchrun's --standalone gives.
A small tensor the other rank kept in its pack (storage/packed.py) is copied into a file of its own.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ..storage import commit as C
from ..storage.layout import key
from ..storage.file_io import save_json
from ..storage.records import record_bytes

PENDING_RE = re.compile(r"^reshard-(\d{8})\.json$")


def rank_dir(nvme: str | os.PathLike, rank: int) -> Path:
    return Path(nvme) / f"rank{rank}"


def _manifests(folder: Path) -> list[tuple[int, Path]]:
    """Committed manifests and resharded ones not yet renamed into place."""
    out = [(int(C.MANIFEST_RE.match(p.name).group(1)), p) for p in C.list_manifests(folder)]
    if folder.is_dir():
        out += [(int(m.group(1)), p) for p in folder.iterdir() if (m := PENDING_RE.match(p.name))]
    return out


def scan(nvme: Path) -> dict:
    """(world, step) -> {rank: (path, content)} for every manifest under nvme; world 0 is the
    one-process layout in nvme itself."""
    states: dict = {}
    for step, p in _manifests(nvme):
        states.setdefault((0, step), {})[0] = p
    for folder in sorted(nvme.glob("rank*")):
        if not re.fullmatch(r"rank\d+", folder.name):
            continue
        for step, p in _manifests(folder):
            try:
                d = json.loads(p.read_text()).get("dist") or {}
            except (OSError, json.JSONDecodeError):
                continue  # unreadable: that rank has no usable state at this step
            if d.get("rank") == int(folder.name[4:]):
                states.setdefault((d["world"], step), {}).setdefault(d["rank"], p)
    return states


def complete(states: dict) -> list[tuple[int, int]]:
    """(world, step) of the states every rank of their world committed, newest first."""
    done = [(w, s) for (w, s), ranks in states.items() if len(ranks) == max(w, 1)
            and set(ranks) == set(range(max(w, 1)))]
    return sorted(done, key=lambda ws: ws[1], reverse=True)


def attach(engine, resume: bool, overwrite: bool) -> None:
    """Called by Engine before it loads its state: ownership, and on resume this rank's manifest of
    the newest step every rank committed (resharded when the world or the ownership changed)."""
    dist = engine.dist
    dist.set_params({n: i.numel for n, i in engine.infos.items()})
    root = engine.root
    nvme = root.parent
    states = scan(nvme)
    found = complete(states)
    if found and resume:
        world, step = max(found, key=lambda ws: (ws[1], ws[0] == dist.world))
        engine.dist_candidates = [_take(engine, states, world, step)]
    elif found and not overwrite:
        w, s = found[0]
        raise ValueError(f"{nvme} holds the committed state of a {max(w, 1)}-rank run at step {s}; continue it "
                         f"with --resume auto, or start over with --overwrite (which deletes it), or "
                         f"choose another --nvme directory")
    else:
        dist.barrier()  # every rank has looked before any deletes
        for _, p in _manifests(root):
            p.unlink()
        if dist.rank == 0 and overwrite:  # the states of other layouts must not outrank the new run
            for (w, _), ranks in states.items():
                for r, p in ranks.items():
                    if w != dist.world or r >= dist.world:
                        p.unlink(missing_ok=True)
        engine.dist_candidates = []
    dist.barrier()


def _take(engine, states: dict, world: int, step: int) -> Path:
    dist, root = engine.dist, engine.root
    ranks = states[(world, step)]
    contents = {r: json.loads(p.read_text()) for r, p in ranks.items()}
    same = world == dist.world and (contents[dist.rank].get("dist") or {}).get("owners") == dist.owners
    plan = None if same else _plan(engine, ranks, contents, world)
    dist.barrier()  # every rank has read the old manifests before any folder changes
    if same:
        mine = ranks[dist.rank]
    else:
        records = {}
        for (folder, src), dst in plan:
            rec = contents_of(contents, ranks, folder)[src]
            if len(rec) > 4:  # in the writer's pack: the bytes get a file of their own here
                _materialize(folder, src, rec, root / dst)
                rec = rec[:4]
            else:
                _link(folder / src, root / dst)
            records[dst] = rec
        C.sync_fs(root)
        state = {k: v for k, v in contents[0].items() if k != "records"}
        state["dist"] = dist.describe()
        mine = _write_pending(root, dict(state, records=records))
        dist.barrier()  # every rank's resharded manifest is durable: make them the state
    final = root / C.manifest_name(step)
    if mine != final:
        os.replace(mine, final)
        C.fsync_dir(root)
    dist.barrier()
    for _, p in _manifests(root):
        if p != final:
            p.unlink(missing_ok=True)  # newer: not committed on every rank; older: another layout
    return final


def _plan(engine, ranks: dict, contents: dict, world: int) -> list[tuple[tuple[Path, str], str]]:
    """((source folder, key there), key here) for every tensor this rank's share of the state needs."""
    import torch
    slots, steps = contents[0]["optim"]["slots"], contents[0]["optim"]["steps"]
    folders = sorted(ranks, key=lambda r: r != engine.dist.rank)  # our own folder first
    fp32 = engine.dtype == torch.float32
    plan = []
    for n, info in engine.infos.items():
        kinds = (["master"] + (["m", "v"] if steps[n] > 0 else [])) if engine._owned(n) else []
        kinds += ["w"] if engine._wkind(n) == "w" else []
        for kind in kinds:
            for k in range(len(info.shards)):
                dst = key(kind, n, k, slots[n])
                alts = [dst] + ([key("master", n, k, slots[n])] if kind == "w" and fp32 else [])
                src = next(((ranks[r].parent, a) for a in alts for r in folders
                            if a in contents[r]["records"]), None)
                if src is None:
                    raise ValueError(f"resharding the state of step {contents[0]['step']} ({world or 1} "
                                     f"rank(s)): no rank folder holds {dst}; the state under "
                                     f"{engine.root.parent} is incomplete")
                plan.append((src, dst))
    return plan


def contents_of(contents: dict, ranks: dict, folder: Path) -> dict:
    """The records of the manifest in `folder`."""
    return next(contents[r]["records"] for r, p in ranks.items() if p.parent == folder)


def _materialize(folder: Path, src: str, rec: list, dst: Path) -> None:
    """A packed tensor's bytes (storage/packed.py) as a file of its own at `dst`, renamed into place."""
    data = record_bytes(folder, src, rec)
    if len(data) < rec[2]:
        raise ValueError(f"resharding: {folder / rec[4]} is truncated where it holds {src}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".link")
    tmp.write_bytes(data)
    os.replace(tmp, dst)


def _link(src: Path, dst: Path) -> None:
    if src.resolve() == dst.resolve():
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".link")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        import shutil
        shutil.copy2(src, tmp)  # another file system: a copy (the docs ask for one file system)
    os.replace(tmp, dst)


def _write_pending(root: Path, content: dict) -> Path:
    return save_json(root / f"reshard-{content['step']:08d}.json", content)
