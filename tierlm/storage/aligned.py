"""Page-aligned host memory and the direct-I/O capability check.

Direct I/O (O_DIRECT) bypasses the page cache, so reads and writes run at the SSD's own speed and
do not fill RAM with cached copies that the memory budget cannot see. It needs the buffer address,
the file offset and the length to be multiples of the logical block size; 4 KiB covers every
NVMe and file system we target.
"""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import weakref

import torch

ALIGN = 4096
HUGE = 2 << 20  # an x86-64 transparent huge page


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _huge_pages_on() -> bool:
    if os.environ.get("TIERLM_HUGE_BUFFERS", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


_libc = None


def _madvise(addr: int, length: int, advice: int) -> None:
    global _libc
    if length <= 0:
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise(addr, length, advice)  # advice only: a refusal leaves 4 KiB pages, still correct


HUGE_BUFFERS = _huge_pages_on()
MADV_HUGEPAGE, MADV_NOHUGEPAGE = 14, 15


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """A uint8 tensor of round_up(nbytes) bytes whose data pointer is ALIGN-aligned.

    Plain CPU memory is over-allocated by one page and sliced, the slice keeping the allocation
    alive; from 2 MiB, by one huge page, and the slice starts on a huge-page boundary
    (_huge_aligned; TIERLM_HUGE_BUFFERS=0 turns that off). Pinned (page-locked, for asynchronous
    copies to a GPU): the same memory, registered with CUDA for as long as the returned tensor lives. Not `pin_memory=True`: CUDA's caching host
    allocator rounds every block up to a power of two (a 8.7 MB weight takes 16 MB), which broke
    the `cpu` budget by 0.7 GiB on Qwen2.5-0.5B's window.
    """
    size = round_up(max(nbytes, 1))
    if HUGE_BUFFERS and size >= HUGE:
        return _huge_aligned(size, pin)
    raw = torch.empty(size + ALIGN, dtype=torch.uint8)
    off = (-raw.data_ptr()) % ALIGN
    t = raw[off:off + size]
    if pin:
        _register(t)
    return t


def _huge_aligned(size: int, pin: bool) -> torch.Tensor:
    """`size` bytes starting on a huge-page boundary, its whole huge pages advised huge and its
    slack around it not.

    Direct I/O moves a buffer's pages to the device a segment per physically contiguous run, so on
    4 KiB pages a 16 MiB request becomes thousands of segments. From 2 MiB pages this virtio disk
    read 2.4-2.8 GB/s and wrote 4.0-4.5, from 4 KiB pages 1.75-1.84 and 2.8-3.1 (16 MiB requests, 4
    in flight, same files, alternating; docs/benchmarks.md at a2b1c1e). PyTorch's own huge-page switch
    advises its allocations but does not align them: an 8 MiB buffer got 3 huge pages of 4. The
    slack before the buffer and past its last whole huge page is advised against, so that no huge
    page there faults in memory that the budget does not count."""
    raw = torch.empty(size + HUGE, dtype=torch.uint8)
    start = raw.data_ptr()
    off = (-start) % HUGE
    t = raw[off:off + size]
    first, end = start // ALIGN * ALIGN, (start + raw.numel()) // ALIGN * ALIGN
    _madvise(first, end - first, MADV_NOHUGEPAGE)  # the slack before and after: never a huge page
    _madvise(start + off, size // HUGE * HUGE, MADV_HUGEPAGE)
    if pin:
        _register(t)
    return t


def _register(t: torch.Tensor) -> None:
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    torch.cuda.check_error(cudart.cudaHostRegister(ptr, t.numel(), 0))
    # Views outliving `t` keep the memory, unpinned: a later copy from them is merely synchronous.
    weakref.finalize(t, cudart.cudaHostUnregister, ptr)


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
