"""An asynchronous tensor store over files in the NVMe directory.

One file per key. Reads and writes run on a thread pool (os.pread/os.pwrite release the GIL, so they
overlap compute); with direct I/O when the file system allows it, buffered otherwise. Every tensor
carries a CRC32C checksum that is verified on every read: a flipped or truncated file raises
CorruptionError naming it, it never turns into wrong weights.
"""
from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from .aligned import as_bytes, is_aligned, round_up, supports_direct_io
from .file_io import pread, save_json, write_file
from .io_queue import after, settle, submit
from .packed import Packed
from .pool import Buffer, HostBufferPool
from .records import CorruptionError, Record, StorageError, _dtype, _dtype_name, crc_of, verify


CRC_AWAY = 1 << 20  # bytes from which a checksum runs beside the I/O (TensorStore._beside)


class Loaded:
    """A tensor read into a pool buffer; `release()` returns the buffer."""

    __slots__ = ("tensor", "buffer")

    def __init__(self, tensor: torch.Tensor, buffer: Buffer | None):
        self.tensor = tensor
        self.buffer = buffer

    def release(self) -> None:
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
        self.tensor = None


class IOStats:
    """Byte and busy-time counters, read by the progress line and the benchmarks."""

    def __init__(self):
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.bytes_written = 0
        self.reads = 0
        self.writes = 0

    def add(self, read: int = 0, written: int = 0) -> None:
        with self._lock:
            self.bytes_read += read
            self.bytes_written += written
            self.reads += bool(read)
            self.writes += bool(written)

    def snapshot(self) -> dict:
        with self._lock:
            return {"bytes_read": self.bytes_read, "bytes_written": self.bytes_written,
                    "reads": self.reads, "writes": self.writes}


class TensorStore:
    def __init__(self, root: str | os.PathLike, pool: HostBufferPool, io_threads: int = 4,
                 direct_io: bool | None = None, on_event=None, in_place: bool = True,
                 pack_below: int = 0, pack_keys=None):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.pool = pool
        self.direct = supports_direct_io(self.root) if direct_io is None else bool(direct_io)
        self.records: dict[str, Record] = {}
        self._rec_lock = threading.RLock()  # a done callback may run at once, in the caller holding it
        self.stats = IOStats()
        self.on_event = on_event  # callable(kind, key, t0, t1, nbytes) for the timeline
        self.in_place = in_place  # overwrite a key's file in place where that is safe (see _write)
        # Reads and writes each keep `io_threads` requests in flight, in queues of their own: in one
        # shared queue a step's reads (which the compute waits on) queued behind its writes (which
        # only have to land), and the two together kept no more in flight than either alone.
        self._exec = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="tierlm-read")
        self._wexec = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="tierlm-write")
        # Checksums run beside the I/O, not inside its slot: a request's CRC (2-4 ms per 32 MiB,
        # longer while the compute holds both cores) left the drive that much short of requests.
        # A read is verified here after its bytes land; a write's CRC runs while its bytes go out.
        self._crc = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tierlm-crc")
        self._inflight: dict[str, Future] = {}  # key -> its latest write not yet landed
        self._reserved: dict[str, tuple] = {}   # key -> (promise, what its write waits for): reserve()
        self._reading: dict[str, set[Future]] = {}  # key -> its reads not yet done
        # Tensors under pack_below bytes (of the keys pack_keys accepts) live in RAM and reach the
        # disk together, in one file a commit (`pack`; storage/packed.py).
        self.packed = Packed(self.root, pack_below, pack_keys)

    # ---- paths and records -------------------------------------------------------------
    def path(self, key: str) -> Path:
        return self.root / key

    def record(self, key: str) -> Record:
        with self._rec_lock:
            rec = self.records.get(key)
        if rec is None:
            raise StorageError(f"{self.path(key)}: no such tensor in the store (it was never written)")
        return rec

    def landed_record(self, key: str) -> Record:
        """The record of `key` once its write in flight, if any, has landed (a write's record is
        known only then)."""
        with self._rec_lock:
            fut = self._inflight.get(key)
        if fut is not None:
            fut.exception()  # a failed write leaves the record it replaced, or none
        return self.record(key)

    def __contains__(self, key: str) -> bool:
        with self._rec_lock:
            return key in self.records

    # ---- writes ------------------------------------------------------------------------
    def write(self, key: str, tensor: torch.Tensor, durable: bool = False) -> "Future[Record]":
        """Write a contiguous CPU tensor under `key`; the caller keeps `tensor` unchanged until done."""
        if tensor.device.type != "cpu":
            raise StorageError(f"{key}: the store writes host tensors; copy to CPU first")
        tensor = tensor.contiguous()
        small = self.packed.takes(key, tensor.numel() * tensor.element_size())
        with self._rec_lock:
            # after the key's write in flight and every read of it not yet done: a write in place
            # must not change the bytes under a read (nor interleave with another write)
            promised = self._reserved.pop(key, None)
            if promised is not None:  # reads asked for since the reservation wait for this write
                deps = [f for f in promised[1] if not f.done()]
            else:
                deps = [f for f in [self._inflight.get(key), *self._reading.get(key, ())] if f is not None]
            if small and not deps:  # a copy into RAM: done before this returns
                fut = Future()
                fut.set_result(self._put(key, tensor))
                if promised is not None:
                    if self._inflight.get(key) is promised[0]:
                        del self._inflight[key]
                    promised[0].set_result(fut.result())
                return fut
            fut = self._after(key, deps, self._put if small else self._write, key, tensor,
                              *(() if small else (durable,)), executor=self._wexec)
            self._inflight[key] = fut
        fut.add_done_callback(lambda f, k=key: self._landed(k, f))
        if promised is not None:
            fut.add_done_callback(lambda f, out=promised[0]: settle(out, f))
        return fut

    def reserve(self, keys) -> None:
        """Writes of `keys` are on their way: a read asked for before one is issued waits for it
        to land (without a thread held), as it would for a write in flight. The write, when it
        comes, is ordered after what was in flight or reading before the reservation only."""
        with self._rec_lock:
            for key in keys:
                before = [f for f in [self._inflight.get(key), *self._reading.get(key, ())] if f is not None]
                promise: Future = Future()
                self._reserved[key] = (promise, before)
                self._inflight[key] = promise
                promise.add_done_callback(lambda f, k=key: self._landed(k, f))

    def cancel_reserved(self, error: BaseException) -> None:
        """The promised writes will not come (the work that would write them failed): the reads
        waiting for them fail with `error`."""
        with self._rec_lock:
            promised, self._reserved = self._reserved, {}
        for promise, _ in promised.values():
            promise.set_exception(error)

    def _landed(self, key: str, fut: Future) -> None:
        with self._rec_lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]

    def _track_read(self, key: str, fut: Future) -> Future:
        """Caller holds _rec_lock."""
        self._reading.setdefault(key, set()).add(fut)

        def done(f, k=key):
            with self._rec_lock:
                live = self._reading.get(k)
                if live is not None:
                    live.discard(f)
                    if not live:
                        del self._reading[k]
        fut.add_done_callback(done)
        return fut

    def _after_write(self, key: str, fn, *args) -> Future:
        """fn(*args) on the I/O threads, after the write of `key` in flight (if any) has landed
        (failed or not). Reads and writes of a key are ordered as they were asked for: a step's
        last writes may still be landing while the next step reads (the engine defers them), and
        two writes of one file in place must not interleave. Caller holds _rec_lock."""
        prev = self._inflight.get(key)
        return self._after(key, [prev] if prev is not None else [], fn, *args)

    def _after(self, key: str, deps: list[Future], fn, *args, executor=None) -> Future:
        """fn(*args) on the I/O threads (the read queue unless told) once every future in `deps`
        is done (failed or not)."""
        return after(executor or self._exec, deps, self.path(key), fn, *args)

    def _put(self, key: str, tensor: torch.Tensor) -> Record:
        rec = self.packed.put(key, tensor)
        with self._rec_lock:
            self.records[key] = rec
        return rec

    def _write(self, key: str, tensor: torch.Tensor, durable: bool) -> Record:
        """Overwrite the key's file in place when it already holds a tensor of this size and no
        snapshot shares it; otherwise write a temporary name and rename it over the file.

        In place is what a step's writes almost always are: the engine writes only to the slot that
        the newest committed state does not use, the file is already allocated, and the data is
        the only thing that moves (no create, truncate, block allocation or rename for the
        journal: 2.1-2.9x the write rate for 1-16 MiB tensors on the 2-vCPU dev machine,
        `benchmarks/store_writes.py`). A crash mid-write leaves a torn file there, which its
        checksum names if an older state is ever resumed from it. A snapshot's hard link (a checkpoint) is never written through: such a
        file, a new key, or a size change takes the rename path, and a reader (or the snapshot)
        never sees a half-written tensor."""
        t0 = time.perf_counter()
        path = self.path(key)
        nbytes = tensor.numel() * tensor.element_size()
        padded = round_up(nbytes)
        direct = self.direct and nbytes > 0 and is_aligned(tensor, padded)
        raw = tensor.reshape(-1).view(torch.uint8)
        if direct:
            # The pool's buffers are padded to ALIGN, so the bytes past the tensor are ours to write.
            mv = memoryview(torch.as_strided(raw, (padded,), (1,)).numpy())
        else:
            mv = as_bytes(raw)
        crc = self._beside(nbytes, crc_of, raw)  # while the bytes go out
        try:
            write_file(path, mv, nbytes, direct, durable, self.in_place)
        except BaseException:
            if isinstance(crc, Future):
                crc.exception()  # the caller may reuse the tensor once this returns
            raise
        rec = Record(_dtype_name(tensor.dtype), tuple(tensor.shape), nbytes,
                     crc.result() if isinstance(crc, Future) else crc)
        with self._rec_lock:
            self.records[key] = rec
        self.stats.add(written=nbytes)
        if self.on_event:
            self.on_event("ssd_write", key, t0, time.perf_counter(), nbytes)
        return rec

    # ---- reads -------------------------------------------------------------------------
    def read(self, key: str) -> "Future[Loaded]":
        """Read `key` into a new pool buffer (blocks the caller while the pool is full)."""
        with self._rec_lock:
            if key in self._inflight:
                raise StorageError(f"{self.path(key)}: read() while its write is in flight (use read_into)")
        rec = self.record(key)
        buf = self.pool.acquire(rec.nbytes)
        try:
            out = buf.view(_dtype(rec.dtype), rec.shape)
        except Exception:
            buf.release()
            raise
        fut: Future = Future()
        with self._rec_lock:
            if key in self._inflight:
                buf.release()
                raise StorageError(f"{self.path(key)}: read() while its write is in flight (use read_into)")
            if self.packed.get_into(key, out):
                fut.set_result(Loaded(out, buf))
                return fut
            inner = self._track_read(key, submit(self._exec, self._read, key, rec, out, True))

        def done(f):
            exc = f.exception()
            if exc is not None:
                buf.release()
                fut.set_exception(exc)
            else:
                fut.set_result(Loaded(out, buf))
        inner.add_done_callback(done)
        return fut

    def read_into(self, key: str, out: torch.Tensor, owns_padding: bool = False,
                  writer: bool = False) -> "Future[torch.Tensor]":
        """Read `key` into `out` (same dtype and element count), e.g. a slice of a larger buffer.

        owns_padding: the memory after `out` up to the next 4 KiB is the caller's to overwrite
        (true for a pool buffer's start), which lets an unaligned length use direct I/O.
        writer: the caller is the work whose write of `key` was reserved (a held step's update,
        which reads a master it rewrites in place between commits): it reads the bytes there now,
        after what was in flight before the reservation, and the promised write waits for this read.
        Waiting for the promise instead would wait for itself.
        """
        with self._rec_lock:
            promised = self._reserved.get(key) if writer else None
            if promised is not None:
                fut = self._after(key, [f for f in promised[1] if not f.done()], self._read_latest, key, out,
                                  owns_padding)
                promised[1].append(fut)
                return self._track_read(key, fut)
            if key in self._inflight:  # the record is the write's, known once it lands
                return self._track_read(key, self._after_write(key, self._read_latest, key, out, owns_padding))
        rec = self._check_into(key, out)
        with self._rec_lock:
            if key in self._inflight:  # a write was asked for meanwhile: read what it lands
                return self._track_read(key, self._after_write(key, self._read_latest, key, out, owns_padding))
            if rec.pack is not None and self.packed.get_into(key, out):  # RAM holds its latest bytes
                fut: Future = Future()
                fut.set_result(out)
                return fut
            # tracked, so that a write asked for later waits until this read is done
            return self._track_read(key, submit(self._exec, self._read, key, rec, out, owns_padding))

    def _check_into(self, key: str, out: torch.Tensor) -> Record:
        rec = self.record(key)
        if _dtype_name(out.dtype) != rec.dtype or out.numel() * out.element_size() != rec.nbytes:
            raise StorageError(f"{self.path(key)}: holds {rec.dtype}{list(rec.shape)}, "
                               f"cannot read into {_dtype_name(out.dtype)}{list(out.shape)}")
        return rec

    def _read_latest(self, key: str, out: torch.Tensor, owns_padding: bool) -> torch.Tensor:
        return self._read(key, self._check_into(key, out), out, owns_padding)

    def _read(self, key: str, rec: Record, out: torch.Tensor, owns_padding: bool = True) -> torch.Tensor:
        t0 = time.perf_counter()
        if rec.pack is not None:  # small: in RAM, else (after a resume) in its pack
            if self.packed.get_into(key, out):
                return out
            if not rec.pack:
                raise StorageError(f"{self.path(key)}: held in RAM only, and not there")
            return self._read_packed(key, rec, out, t0)
        path = self.path(key)
        padded = round_up(rec.nbytes)
        raw = out.reshape(-1).view(torch.uint8) if rec.nbytes else out.view(-1)
        # A direct read fills whole blocks: past the tensor's end only if that memory is ours
        # (a slice of a larger buffer would have its neighbour overwritten).
        direct = (self.direct and rec.nbytes > 0 and is_aligned(out, padded)
                  and (owns_padding or rec.nbytes == padded))
        mv = memoryview(torch.as_strided(raw, (padded,), (1,)).numpy()) if direct else as_bytes(raw)
        got = pread(path, str(path), mv, 0, os.O_DIRECT if direct else 0)
        if got < rec.nbytes:
            raise CorruptionError(f"{path}: truncated: {got} of {rec.nbytes} bytes present")
        self.stats.add(read=rec.nbytes)
        if self.on_event:
            self.on_event("ssd_read", key, t0, time.perf_counter(), rec.nbytes)
        # verified beside the I/O: the read slot takes its next request meanwhile
        return self._beside(rec.nbytes, verify, raw, path, rec, out)

    def _read_packed(self, key: str, rec: Record, out: torch.Tensor, t0: float) -> torch.Tensor:
        """A small tensor from its pack (read once after a resume; RAM serves it from then on)."""
        where = f"{self.root / rec.pack} (holding {key})"
        raw = out.reshape(-1).view(torch.uint8)
        got = pread(self.root / rec.pack, where, as_bytes(raw), rec.offset)
        if got < rec.nbytes:
            raise CorruptionError(f"{where}: truncated: {got} of {rec.nbytes} bytes present")
        verify(raw, where, rec, out)
        self.packed.remember(key, raw.clone())
        self.stats.add(read=rec.nbytes)
        if self.on_event:
            self.on_event("ssd_read", key, t0, time.perf_counter(), rec.nbytes)
        return out

    def pack(self, rel: str, keys) -> dict[str, Record]:
        """The records of `keys`, for a manifest: the small ones (packed) are first written
        together into the new file `rel` (relative to the root), and their records point there.
        Durable with the next syncfs, like every other write."""
        with self._rec_lock:
            recs = {k: self.record(k) for k in keys}
        small = [(k, r) for k, r in recs.items() if r.pack is not None]
        if not small:
            return recs
        t0 = time.perf_counter()
        new, nbytes = self.packed.write(rel, small, self._load_small)
        with self._rec_lock:
            for k, r in new.items():
                if self.records.get(k) is recs[k]:  # not written again meanwhile
                    self.records[k] = r
        recs.update(new)
        self.stats.add(written=nbytes)
        if self.on_event:
            self.on_event("ssd_write", rel, t0, time.perf_counter(), nbytes)
        return recs

    def _load_small(self, key: str) -> torch.Tensor:
        rec = self.record(key)
        raw = torch.empty(rec.nbytes, dtype=torch.uint8)
        self._read(key, rec, raw)
        return raw

    # ---- checksums and chaining --------------------------------------------------------
    def _beside(self, nbytes: int, fn, *args):
        """fn(*args) on the checksum threads from CRC_AWAY bytes, its Future returned (the caller
        goes on with its I/O); below that, here (a thread hop costs more than the sum)."""
        if nbytes >= CRC_AWAY:
            try:
                return self._crc.submit(fn, *args)
            except RuntimeError:  # the store is closing: the I/O threads finish their own sums
                pass
        return fn(*args)

    # ---- manifest ----------------------------------------------------------------------
    def manifest(self) -> dict:
        with self._rec_lock:
            return {k: r.to_json() for k, r in self.records.items()}

    def load_manifest(self, entries: dict) -> None:
        with self._rec_lock:
            self.records = {k: Record.from_json(v) for k, v in entries.items()}
            self.packed.forget()  # what RAM held belongs to the records replaced

    def save_manifest(self, path: str | os.PathLike) -> None:
        """Atomically: temp file, fsync, rename, fsync the directory."""
        save_json(path, self.manifest())

    def close(self) -> None:
        self._wexec.shutdown(wait=True)
        self._exec.shutdown(wait=True)
        self._crc.shutdown(wait=True)
        self.packed.forget()
