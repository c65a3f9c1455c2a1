import os
import threading
import time

import pytest
import torch

from tierlm.storage import BudgetError, CorruptionError, HostBufferPool, StorageError, TensorStore
from tierlm.storage.aligned import ALIGN


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def store(request, tmp_path):
    s = TensorStore(tmp_path / "nvme", HostBufferPool(64 << 20), io_threads=2, direct_io=request.param)
    if request.param and not s.direct:
        pytest.skip("file system refuses O_DIRECT")
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(0,), (1,), (3, 5), (1000, 37), (ALIGN,)])
def test_round_trip_is_byte_exact(store, dtype, shape):
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    store.write("a/b/t", t).result()
    got = store.read("a/b/t").result()
    assert got.tensor.dtype == dtype and tuple(got.tensor.shape) == shape
    assert torch.equal(got.tensor.view(torch.uint8) if t.numel() else got.tensor, t.view(torch.uint8) if t.numel() else t)
    got.release()


def test_read_into_slices_of_one_buffer(store):
    # Unaligned sizes next to each other: a direct read must not spill its padding into the neighbour.
    parts = [torch.randn(n) for n in (1000, 1024, 777, 5000)]
    for i, p in enumerate(parts):
        store.write(f"p{i}", p).result()
    out = torch.empty(sum(p.numel() for p in parts))
    futs, off = [], 0
    for i, p in enumerate(parts):
        futs.append(store.read_into(f"p{i}", out[off:off + p.numel()]))
        off += p.numel()
    for f in futs:
        f.result()
    assert torch.equal(out, torch.cat(parts))


@pytest.mark.parametrize("numel", [4096, 1 << 19], ids=["inline", "beside-the-io"])  # CRC_AWAY: 1 MiB
def test_flipped_byte_is_detected_naming_the_file(store, numel):
    t = torch.randn(numel)
    store.write("state/m", t).result()
    path = store.path("state/m")
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptionError, match="state/m.*checksum"):
        store.read("state/m").result()
    assert store.pool.used_bytes == 0  # the failed read gave its buffer back


def _crc32c_bitwise(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_the_checksum_is_crc32c_so_older_state_stays_readable():
    """Records written before the checksum moved from the crc32c package to fastcrc hold CRC32C
    values; the store must compute the same ones: the standard check value, and a bitwise
    reference over lengths and offsets around the folding kernels' block sizes."""
    import tierlm.storage.records as R
    assert R.checksum(b"123456789") == 0xE3069283
    data = torch.randint(0, 256, (70_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = bytes(data.numpy())
    for off, n in [(0, 0), (0, 1), (3, 7), (1, 63), (5, 64), (7, 255), (11, 257), (13, 4099), (0, 70_000 - 17)]:
        assert R.checksum(memoryview(raw)[off:off + n]) == _crc32c_bitwise(raw[off:off + n]), (off, n)


def test_truncated_and_missing_files_are_detected(store):
    store.write("w", torch.randn(10000)).result()
    os.truncate(store.path("w"), 100)
    with pytest.raises(CorruptionError, match="truncated"):
        store.read("w").result()
    os.unlink(store.path("w"))
    with pytest.raises(CorruptionError, match="missing"):
        store.read("w").result()
    with pytest.raises(StorageError, match="never written"):
        store.read("nope")


def test_manifest_round_trip(store, tmp_path):
    store.write("x", torch.arange(10.0)).result()
    store.save_manifest(tmp_path / "manifest.json")
    other = TensorStore(store.root, HostBufferPool(1 << 20), direct_io=False)
    import json
    other.load_manifest(json.loads((tmp_path / "manifest.json").read_text()))
    assert torch.equal(other.read("x").result().tensor, torch.arange(10.0))
    other.close()


def test_pool_is_bounded_and_reuses_buffers():
    pool = HostBufferPool(3 * ALIGN)
    a = pool.acquire(ALIGN)
    b = pool.acquire(2 * ALIGN)
    with pytest.raises(BudgetError, match="larger than the whole pool"):
        pool.acquire(4 * ALIGN)
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(ALIGN)))
    t.start()
    t.join(0.2)
    assert not got  # blocked: the pool is full
    ptr = a.tensor.data_ptr()
    a.release()
    t.join(5)
    assert got and got[0].tensor.data_ptr() == ptr  # same size: the freed buffer is reused
    assert pool.used_bytes == 3 * ALIGN and pool.peak_used == 3 * ALIGN
    b.release()
    got[0].release()
    assert pool.used_bytes == 0


@pytest.mark.parametrize("n", [1000, 1024, 4096])  # unaligned, and whole 4 KiB blocks
def test_rewrite_goes_in_place_unless_a_snapshot_shares_the_file(store, n):
    first, second, third = torch.randn(n), torch.randn(n), torch.randn(n)
    store.write("slot/t", first).result()
    path = store.path("slot/t")
    inode = os.stat(path).st_ino
    store.write("slot/t", second).result()
    assert os.stat(path).st_ino == inode  # the same file, overwritten
    assert torch.equal(store.read("slot/t").result().tensor, second)
    assert os.path.getsize(path) == n * 4

    # A checkpoint hard-links the file: the next write must not reach through the link.
    snap = path.with_name("snapshot")
    os.link(path, snap)
    store.write("slot/t", third).result()
    assert os.stat(path).st_ino != inode
    assert torch.equal(torch.frombuffer(bytearray(snap.read_bytes()), dtype=torch.float32), second)
    assert torch.equal(store.read("slot/t").result().tensor, third)


def test_a_size_change_writes_a_new_file(store):
    store.write("k", torch.randn(100)).result()
    inode = os.stat(store.path("k")).st_ino
    t = torch.randn(300)
    store.write("k", t).result()
    assert os.stat(store.path("k")).st_ino != inode
    assert torch.equal(store.read("k").result().tensor, t)
    assert not list(store.root.glob("*.partial"))


def held_write(store, key, tensor):
    """A write of `key` that waits on the I/O thread until the returned event is set."""
    gate = threading.Event()
    real = store._write

    def slow(k, t, durable):
        gate.wait(10)
        return real(k, t, durable)
    store._write = slow
    try:
        return store.write(key, tensor), gate
    finally:
        store._write = real


def test_reads_and_writes_of_a_key_wait_for_its_write_in_flight(store):
    """A step's last writes may still be landing when the next step reads the same files (the
    deferred commit): a read gets the new bytes, and a second write lands after the first."""
    a = torch.arange(300_000, dtype=torch.float32)
    store.write("k", a).result()
    w1, gate = held_write(store, "k", a + 1)
    out = torch.empty_like(a)
    r = store.read_into("k", out)
    w2 = store.write("k", a + 2)
    out2 = torch.empty_like(a)
    r2 = store.read_into("k", out2)
    other = torch.empty_like(a)
    store.write("other", a).result()
    store.read_into("other", other).result()  # other keys do not wait
    assert not (w1.done() or r.done() or w2.done() or r2.done())
    gate.set()
    r.result(), r2.result(), w2.result()
    assert torch.equal(out, a + 1) and torch.equal(out2, a + 2)
    final = torch.empty_like(a)
    store.read_into("k", final).result()
    assert torch.equal(final, a + 2)


def test_a_write_waits_for_reads_of_its_key_in_flight(store):
    """A write in place must not change the bytes under a read asked for before it."""
    a = torch.arange(300_000, dtype=torch.float32)
    store.write("k", a).result()
    gate = threading.Event()
    real = store._read

    def slow(*args, **kw):
        gate.wait(10)
        return real(*args, **kw)
    store._read = slow
    out = torch.empty_like(a)
    r = store.read_into("k", out)
    store._read = real
    w = store.write("k", a + 1)
    time.sleep(0.2)
    assert not (r.done() or w.done())
    gate.set()
    r.result(), w.result()
    assert torch.equal(out, a)
    after = torch.empty_like(a)
    store.read_into("k", after).result()
    assert torch.equal(after, a + 1)


def test_a_write_queued_behind_another_is_not_kept_by_it(store):
    """A done future keeps its callbacks: the one that started a write queued behind it must not
    keep that write's tensor alive for as long as anyone holds the first future (the activation
    swapper writes the same keys every step and kept its futures). Keeping the job in the
    callback fails this (checked)."""
    import gc
    import weakref
    first, gate = held_write(store, "k", torch.zeros(1 << 16))
    second = torch.ones(1 << 16)
    alive = weakref.ref(second)
    queued = store.write("k", second)
    del second
    gate.set()
    first.result(), queued.result()
    gc.collect()
    assert alive() is None, "the first write's future keeps the second's tensor"


def test_a_record_asked_for_while_its_write_is_in_flight_waits_for_it(store, monkeypatch):
    """A write's record is known when it lands; the optimizer's redo asks for a saved gradient's
    dtype while that write (deferred past the step) may still be queued."""
    real = TensorStore._write
    gate = threading.Event()
    monkeypatch.setattr(TensorStore, "_write", lambda self, *a: gate.wait(5) and real(self, *a))
    fut = store.write("g/x", torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(StorageError, match="never written"):
        store.record("g/x")
    threading.Timer(0.1, gate.set).start()
    assert store.landed_record("g/x").dtype == "bfloat16" and fut.done()


def test_a_read_is_not_queued_behind_writes(store, monkeypatch):
    """Reads and writes have a queue each: a read runs while every write thread is stuck."""
    store.write("r/a", torch.arange(4.0)).result()
    gate = threading.Event()
    real = TensorStore._write
    monkeypatch.setattr(TensorStore, "_write", lambda self, *a: gate.wait(5) and real(self, *a))
    stuck = [store.write(f"w/{i}", torch.zeros(4)) for i in range(4)]  # twice the write threads
    try:
        got = store.read_into("r/a", torch.empty(4)).result(timeout=2)
        assert torch.equal(got, torch.arange(4.0))
    finally:
        gate.set()
    for f in stuck:
        f.result()


def test_a_checksum_does_not_hold_an_io_slot(store, monkeypatch):
    """A read's checksum runs after its bytes land and a write's while its bytes go out, off the
    I/O threads: with every checksum stuck, more reads than there are read threads still reach
    the drive, none is done unverified, and a write's record waits for its sum."""
    import tierlm.storage.store as S
    n = S.CRC_AWAY // 4  # float32 elements: at the size from which sums leave the I/O thread
    tensors = [torch.full((n,), float(i)) for i in range(4)]  # twice the read threads
    for i, t in enumerate(tensors):
        store.write(f"k/{i}", t).result()
    gate = threading.Event()
    import tierlm.storage.records as R
    real = R.checksum
    monkeypatch.setattr(R, "checksum", lambda b: gate.wait(5) and real(b))
    landed = []
    store.on_event = lambda kind, key, *a: landed.append(key) if kind == "ssd_read" else None
    outs = [torch.empty(n) for _ in tensors]
    reads = [store.read_into(f"k/{i}", o) for i, o in enumerate(outs)]
    w = store.write("k/new", tensors[0] + 1)
    deadline = time.monotonic() + 5
    while len(landed) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(landed) == [f"k/{i}" for i in range(4)]
    assert not any(r.done() for r in reads) and not w.done()
    gate.set()
    for r, o, t in zip(reads, outs, tensors):
        r.result()
        assert torch.equal(o, t)
    assert w.result().crc == real(S.as_bytes((tensors[0] + 1).view(torch.uint8)))


def test_a_direct_rewrite_in_place_never_truncates(store, monkeypatch):
    """A direct write's file keeps its last block whole, so rewriting it in place changes no
    size (a truncate per write cost ~5 ms on ext4); the record still says where the data ends."""
    pool = HostBufferPool(1 << 20)
    buf = pool.acquire(1000 * 2)
    t = buf.view(torch.bfloat16, (1000,))
    t.copy_(torch.arange(1000.0))
    store.write("n", t).result()
    before = os.stat(store.path("n"))
    monkeypatch.setattr(os, "ftruncate", lambda *a: pytest.fail("truncated"))
    t.add_(1)
    store.write("n", t).result()
    after = os.stat(store.path("n"))
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)  # in place
    out = torch.empty(1000, dtype=torch.bfloat16)
    store.read_into("n", out).result()
    assert torch.equal(out, torch.arange(1000.0).to(torch.bfloat16) + 1)
    assert store.record("n").nbytes == 2000
    buf.release()
