"""The pools' arena: buffers of any size placed in one region whose freed pages serve the next
buffer, within the pool's capacity, with nothing overlapping."""
import random
import subprocess
import sys

from tierlm.storage import HostBufferPool
from tierlm.storage import pool as pool_mod
from tierlm.storage.arena import Arena


def _check(a: Arena, live: dict) -> None:
    segs = a._segs
    assert all(s[1] > s[0] for s in segs)
    assert all(x[1] <= y[0] for x, y in zip(segs, segs[1:]))
    assert not any(x[1] == y[0] and x[2] == y[2] for x, y in zip(segs, segs[1:])), "alike neighbours unmerged"
    assert a.dirty == sum(s[1] - s[0] for s in segs if s[2])
    spans = sorted([(s[0], s[1]) for s in segs] + [(k, k + v) for k, v in live.items()])
    assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), "a buffer overlaps another or free space"
    assert sum(b - a_ for a_, b in spans) == a.size


def test_placements_never_overlap_and_every_byte_is_accounted_for():
    rng = random.Random(0)
    a = Arena(16 << 20)
    live, fill = {}, {}
    for it in range(3000):
        if live and rng.random() < 0.5:
            k = rng.choice(sorted(live))
            assert bool((fill[k][1] == fill[k][0]).all()), "a buffer's bytes were overwritten"
            a.free(k, live.pop(k))
        else:
            size = rng.choice([4096, 8192, 65536, 1 << 20, 3 << 20])
            got = a.place(size, (0, 1 << 20) if rng.random() < 0.1 else None)
            if got is not None:
                k, t = got
                assert t.numel() == size and t.data_ptr() == a.region.data_ptr() + k
                t.fill_(it % 251)
                live[k], fill[k] = size, (it % 251, t)
        if rng.random() < 0.05:
            a.discard(rng.choice([4096, 1 << 20]))
        _check(a, live)


def test_a_placement_prefers_resident_pages_and_avoids_a_range():
    a = Arena(8 << 20)
    k1, _ = a.place(1 << 20)
    k2, _ = a.place(1 << 20)
    a.free(k1, 1 << 20)
    assert a.place(1 << 20)[0] == k1  # the freed (resident) pages, not untouched ones past k2
    a.free(k1, 1 << 20)
    k3, _ = a.place(1 << 20, avoid=(0, 2 << 20))
    assert k3 >= 2 << 20


def test_each_buffer_is_its_own_storage():
    """The saved-tensor hooks tell parameters apart by their storage."""
    a = Arena(1 << 20)
    (_, t1), (_, t2) = a.place(8192), a.place(8192)
    assert t1.untyped_storage().data_ptr() != t2.untyped_storage().data_ptr()
    assert t1.untyped_storage().nbytes() == 8192


def test_a_pool_with_an_arena_reuses_freed_pages_for_other_sizes(monkeypatch):
    pool = HostBufferPool(8 << 20, name="t", arena=True)
    held = [pool.acquire(n) for n in (3 << 20, 1 << 20, 2 << 20)]
    for b in held:
        b.release()

    def fresh(*a, **k):
        raise AssertionError("fresh pages taken while the arena had room")
    monkeypatch.setattr(pool_mod, "aligned_empty", fresh)
    for sizes in ([4 << 20, 2 << 20], [1 << 20] * 6, [6 << 20]):
        bufs = [pool.acquire(n) for n in sizes]
        assert all(b.offset is not None for b in bufs)
        assert pool.resident_bytes <= pool.capacity
        for b in bufs:
            b.release()
    pool.trim()
    assert pool.arena.dirty == 0 and pool.resident_bytes == 0


def test_beside_a_fragmented_arena_the_pool_stays_within_its_capacity():
    """No place for a buffer in the arena: it is allocated beside it, and the arena hands pages back
    so that what the pool holds stays within its capacity."""
    pool = HostBufferPool(8 << 20, name="t", arena=True)
    bufs = [pool.acquire(1 << 20) for _ in range(8)]
    for b in bufs[::2]:
        b.release()
    assert pool.try_acquire(2 << 20, arena_only=True) is None  # 4 MiB free, none of it contiguous
    big = pool.acquire(2 << 20)
    assert big.offset is None
    assert pool.resident_bytes <= pool.capacity


def test_peak_rss_of_an_arena_pool_streaming_many_sizes_stays_within_its_capacity():
    code = r"""
import random, resource, torch
from tierlm.storage import HostBufferPool
cap = 64 << 20
pool = HostBufferPool(cap, name="t", arena=True)
rng = random.Random(1)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
live = []
for i in range(4000):  # ~33 GiB through a 64 MiB pool
    while True:
        b = pool.try_acquire(rng.choice([4096, 229376, 1605632, 8716288, 16 << 20, 24 << 20]))
        if b is not None:
            break
        live.pop(rng.randrange(len(live))).release()
    b.tensor.fill_(1)  # touch every page
    live.append(b)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - base)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grew = int(out.stdout.split()[-1])
    assert grew <= (64 << 20) + (16 << 20), f"peak RSS grew {grew >> 20} MiB for a 64 MiB pool"
