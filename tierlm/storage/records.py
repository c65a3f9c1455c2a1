"""What the store knows of each tensor it holds: dtype, shape, length, checksum, and the file that
holds it (its own, or a pack of small ones), plus the errors that name a damaged file."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import fastcrc
import torch

from .aligned import as_bytes


class StorageError(RuntimeError):
    """Reading or writing a state file failed; the message names the file."""


class CorruptionError(StorageError):
    """A state file's bytes do not match its recorded checksum or length."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise StorageError(f"unknown dtype {name!r} in store manifest")
    return dt


@dataclass(frozen=True)
class Record:
    dtype: str
    shape: tuple
    nbytes: int
    crc: int
    # None: the tensor has a file of its own, named by its key. Else the pack file (relative to the
    # store's root) and the offset of its bytes there; "" while it is only in RAM (storage/packed.py).
    pack: str | None = None
    offset: int = 0

    def to_json(self) -> list:
        head = [self.dtype, list(self.shape), self.nbytes, self.crc]
        return head if self.pack is None else head + [self.pack, self.offset]

    @staticmethod
    def from_json(v) -> "Record":
        return Record(v[0], tuple(v[1]), int(v[2]), int(v[3]), *((v[4], int(v[5])) if len(v) > 4 else ()))

    def file(self, key: str) -> str:
        """The file that holds the bytes, relative to the store's root."""
        return key if self.pack is None else self.pack


def record_file(key: str, rec_json: list) -> str:
    """`Record.file` of a manifest's entry, without building the record."""
    return key if len(rec_json) <= 4 else rec_json[4]


def record_bytes(root: Path, key: str, rec_json: list) -> bytes:
    """A committed record's bytes as they lie on disk (tests compare whole states with it)."""
    rec = Record.from_json(rec_json)
    with open(Path(root) / rec.file(key), "rb") as f:
        f.seek(rec.offset)
        return f.read(rec.nbytes)


# CRC32C (Castagnoli), the same values as every state written before: fastcrc folds with carry-less
# multiplies (VPCLMULQDQ / PCLMULQDQ, PMULL on ARM), 27 against 12.8 GB/s for the crc32c package's
# crc32 instructions over a 64 MiB buffer on a 2-vCPU Zen 4 VM, and releases the GIL from 16 KiB
# (docs/benchmarks.md at a2b1c1e, "A faster CRC32C").
checksum = fastcrc.crc32.iscsi


def crc_of(raw: torch.Tensor) -> int:
    return checksum(as_bytes(raw)) if raw.numel() else 0


def verify(raw: torch.Tensor, where: str, rec: Record, out: torch.Tensor) -> torch.Tensor:
    if crc_of(raw) != rec.crc:
        raise CorruptionError(f"{where}: checksum mismatch: the file was changed or damaged on disk")
    return out
