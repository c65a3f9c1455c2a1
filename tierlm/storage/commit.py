"""The commit protocol: when a step's new state becomes the state.

A step writes its new tensors into the other slot (each file written to a temporary name and
renamed), then the file system is synced (data, renames and directories at once), then a manifest naming every current file with its
checksum is written to a temporary name, fsynced, renamed to `manifest-<step>.json`, and the
directory fsynced. Only then is the manifest before the previous one deleted. So at every instant
the newest manifest on disk describes files that are complete and durable, and the one before it
still exists as a fallback until its files are overwritten by the next step.

Named checkpoints (`checkpoints/step-N/`) hard-link the files of a committed state: every write
renames a new file into place, so a linked file is never changed afterwards.

Small tensors share one file a commit (`packs/<step>.bin`, storage/packed.py): a manifest's entry
for one names that file and the offset; every file a state needs is `files(records)`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..faults import fault
from .store import CorruptionError, StorageError
from .file_io import save_json
from .packed import pack_name, prune_packs
from .records import record_file

MANIFEST_RE = re.compile(r"^manifest-(\d{8})\.json$")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_fs(path: Path) -> None:
    """Make everything written on `path`'s file system durable: one syncfs() for the whole step's
    files (thousands of per-file fsyncs would each wait for the device); os.sync() where the
    call is missing."""
    import ctypes
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.syncfs(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"syncfs failed: {os.strerror(err)}")
        finally:
            os.close(fd)
    except (OSError, AttributeError) as e:
        if isinstance(e, OSError) and e.errno:
            raise StorageError(f"{path}: making the step durable failed: {e.strerror}") from e
        os.sync()


def manifest_name(step: int) -> str:
    return f"manifest-{step:08d}.json"


def write_manifest(root: Path, content: dict) -> Path:
    path = save_json(root / manifest_name(content["step"]), content, before_rename=lambda: fault("commit.manifest"))
    fault("commit.after")
    return path


def files(records: dict) -> list[str]:
    """The files (relative to the state's folder) that hold a manifest's records, each once."""
    return list(dict.fromkeys(record_file(k, r) for k, r in records.items()))


def prune(root: Path, keep: int = 2) -> None:
    """Delete all but the newest `keep` manifests (the current state and its fallback), then the
    packs of the steps deleted: a manifest's small tensors are in its own step's pack (durable.py)."""
    manifests = list_manifests(root)
    for old in manifests[keep:]:
        old.unlink(missing_ok=True)
    prune_packs(root, {pack_name(int(MANIFEST_RE.match(m.name).group(1))) for m in manifests[:keep]})


def list_manifests(root: Path) -> list[Path]:
    """Committed manifests, newest first (temporary files of an interrupted commit are ignored)."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := MANIFEST_RE.match(p.name))]
    return [p for _, p in sorted(found, reverse=True)]


def list_checkpoints(root: Path) -> list[Path]:
    d = root / "checkpoints"
    if not d.is_dir():
        return []
    found = []
    for c in d.iterdir():
        ms = list_manifests(c)
        if ms:
            found.append((json.loads(ms[0].read_text())["step"], ms[0]))
    return [p for _, p in sorted(found, reverse=True)]


def read_manifest(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CorruptionError(f"{path}: unreadable manifest: {e}") from None


def snapshot(root: Path, manifest: Path, name: str) -> Path:
    """Hard-link (or copy, where links are refused) a committed state into checkpoints/<name>/."""
    content = read_manifest(manifest)
    dest = root / "checkpoints" / name
    tmp = dest.with_name(name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    held = files(content["records"])
    for rel in held:
        src = root / rel
        dst = tmp / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        fault("checkpoint")
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
    shutil.copy2(manifest, tmp / manifest.name)
    for d in {(tmp / k).parent for k in held} | {tmp}:
        fsync_dir(d)
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return dest


def restore_files(root: Path, checkpoint_manifest: Path) -> None:
    """Put a checkpoint's files back in the live layout (links; each renamed into place)."""
    src_root = checkpoint_manifest.parent
    for rel in files(read_manifest(checkpoint_manifest)["records"]):
        dst = root / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".restore")
        tmp.unlink(missing_ok=True)
        try:
            os.link(src_root / rel, tmp)
        except OSError:
            shutil.copy2(src_root / rel, tmp)
        os.replace(tmp, dst)


def verify(store, records: dict) -> None:
    """Read every file of a state and check its checksum; raises naming the first bad file."""
    for key in records:
        store.read(key).result().release()


__all__ = ["CorruptionError", "StorageError", "files", "fsync_dir", "list_checkpoints", "list_manifests", "prune",
           "read_manifest", "restore_files", "snapshot", "verify", "write_manifest"]


def committed_shard_elems(root: Path) -> int | None:
    """The optimizer shard size the newest readable committed state (or checkpoint) was cut in: a
    resumed run keeps it, whatever its settings would pick now."""
    for m in list_manifests(root) + list_checkpoints(root):
        try:
            committed = read_manifest(m).get("fingerprint", {}).get("shard_elems")
        except CorruptionError:  # resume passes over it and names it
            continue
        if committed:
            return int(committed)
    return None
