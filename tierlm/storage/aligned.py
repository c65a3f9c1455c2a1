"""Page-aligned host memory and the direct-I/O capability check.

Direct I/O (O_DIRECT) bypasses the page cache, so reads and writes run at the SSD's own speed and
do not fill RAM with cached copies that the memory budget cannot see. It needs the buffer address,
the file offset and the length to be multiples of the logical block size; 4 KiB covers every
NVMe and file system we target.
"""
from __future__ import annotations

import os
import tempfile

import torch

ALIGN = 4096


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of round_up(nbytes) bytes whose data pointer is ALIGN-aligned.

    Pinned (page-locked) memory from CUDA's allocator is page-aligned already; plain CPU memory is
    over-allocated by one page and sliced, the slice keeping the allocation alive.
    """
    size = round_up(max(nbytes, 1))
    if pin:
        t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % ALIGN == 0:
            return t
        del t
    raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % ALIGN
    return raw[off:off + size]


def is_aligned(t: torch.Tensor, padded_nbytes: int) -> bool:
    """Can `t`'s memory be handed to O_DIRECT for `padded_nbytes` bytes (room for the padding)?"""
    if t.device.type != "cpu" or not t.is_contiguous() or t.data_ptr() % ALIGN:
        return False
    room = t.untyped_storage().nbytes() - t.storage_offset() * t.element_size()
    return room >= padded_nbytes


def supports_direct_io(directory: str | os.PathLike) -> bool:
    """Probe by writing one aligned block with O_DIRECT (tmpfs and some overlay file systems refuse)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    fd = -1
    path = None
    try:
        fd, path = tempfile.mkstemp(dir=directory, prefix=".odirect-probe-")
        os.close(fd)
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        buf = aligned_empty(ALIGN)
        os.pwrite(fd, memoryview(buf.numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        if path:
            try:
                os.unlink(path)
            except OSError:
                pass


def as_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.view(torch.uint8).numpy()) if t.dim() else memoryview(t.reshape(1).view(torch.uint8).numpy())
