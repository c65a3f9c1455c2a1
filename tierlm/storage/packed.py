"""Small tensors kept in RAM, and written together once a commit in one pack file.

A fine-tuning step of Qwen2.5-0.5B read and wrote 817 tensors under 64 KiB (the norms, the biases
and their optimizer states: 1.6 MB together) each as a request of its own. Replaying the step's
requests with and without them put their cost at 0.28 of the drive's 4.0 s: a request of a few
hundred bytes costs the drive about what 0.5 MB does (docs/benchmarks.md at a2b1c1e, "Small tensors in one
pack"). So a store that packs keeps such a tensor's bytes in RAM when it is written (the write is
a copy), serves its reads from there, and at each commit writes every current small tensor into one
new file, `packs/<step>.bin`, whose name the manifest records with each tensor's offset and CRC32C.
A new name each commit: the previous manifest's pack stays intact until that manifest is pruned,
and a checkpoint's hard link to a pack is never written through.
"""
from __future__ import annotations

import errno
import os
import threading
from dataclasses import replace
from pathlib import Path

import torch

from ..faults import fault
from .aligned import as_bytes
from .records import Record, StorageError, _dtype_name, crc_of

PACK_BELOW = 64 << 10  # bytes: below this a tensor is packed (the engine's choice; 0 packs nothing)
PACKS = "packs"


def pack_name(step: int) -> str:
    return f"{PACKS}/{step:08d}.bin"


class Packed:
    """The small tensors' bytes, by key, for a store that packs (TensorStore(pack_below=...))."""

    def __init__(self, root: Path, below: int, keys=None):
        self.root = Path(root)
        self.below = below
        self.keys = keys  # which keys may be packed (callable); None: all
        self._lock = threading.Lock()
        self._ram: dict[str, torch.Tensor] = {}

    def takes(self, key: str, nbytes: int) -> bool:
        return 0 < nbytes < self.below and (self.keys is None or self.keys(key))

    def put(self, key: str, tensor: torch.Tensor) -> Record:
        """Keep a copy of `tensor` under `key`: its record, in RAM only until the next pack."""
        raw = tensor.reshape(-1).view(torch.uint8).clone()
        rec = Record(_dtype_name(tensor.dtype), tuple(tensor.shape), raw.numel(), crc_of(raw), pack="")
        self.remember(key, raw)
        return rec

    def remember(self, key: str, raw: torch.Tensor) -> None:
        with self._lock:
            self._ram[key] = raw

    def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy `key`'s bytes into `out` if they are in RAM."""
        with self._lock:
            raw = self._ram.get(key)
        if raw is None or raw.numel() != out.numel() * out.element_size():
            return False
        out.reshape(-1).view(torch.uint8).copy_(raw)
        return True

    def forget(self) -> None:
        with self._lock:
            self._ram.clear()

    def write(self, rel: str, items: list[tuple[str, Record]], load) -> tuple[dict[str, Record], int]:
        """Write the bytes of `items` (key, record) into the new file `rel`, one after another;
        durable with the commit's syncfs. `load(key)` gives the bytes of one that is not in RAM
        (committed in an earlier pack and not read since a resume). Returns the records, now
        pointing into `rel`, and the bytes written."""
        parts, out, off = [], {}, 0
        for key, rec in items:
            with self._lock:
                raw = self._ram.get(key)
            if raw is None:
                raw = load(key)  # read, checked and kept in RAM by the store
            parts.append(raw)
            out[key] = replace(rec, pack=rel, offset=off)
            off += rec.nbytes
        data = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
        path = self.root / rel
        tmp = path.with_name(path.name + ".partial")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fault("store.write")
            with open(tmp, "wb") as f:
                f.write(as_bytes(data))
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            what = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e))
            raise StorageError(f"{path}: write failed: {what}") from e
        return out, off


def prune_packs(root: Path, keep: set[str]) -> None:
    """Delete the pack files of `root` other than `keep` (interrupted ones included)."""
    d = Path(root) / PACKS
    if not d.is_dir():
        return
    for p in d.iterdir():
        if f"{PACKS}/{p.name}" not in keep:
            p.unlink(missing_ok=True)
