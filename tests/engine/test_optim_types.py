"""A shard's buffers go back to the pool as soon as nothing needs them."""
from concurrent.futures import Future

from tierlm.engine.optim_types import ShardItem


class Buf:
    def __init__(self):
        self.released = 0

    def release(self):
        self.released += 1


def test_buffers_no_write_reads_from_are_released_before_the_writes_land():
    it = ShardItem("w", 0, 0, 8)
    it.bufs = {t: Buf() for t in ("master", "m", "v", "w", "g")}
    bufs = dict(it.bufs)
    writes = [Future() for _ in range(4)]
    it.release_after(writes, {"master", "m", "v", "w"})
    assert bufs["g"].released == 1  # the gradient's fp32 copy is not written: back at once
    assert all(bufs[t].released == 0 for t in ("master", "m", "v", "w"))
    for f in writes[:3]:
        f.set_result(None)
    assert all(bufs[t].released == 0 for t in ("master", "m", "v", "w"))
    writes[3].set_result(None)
    assert all(b.released == 1 for b in bufs.values())


def test_without_writes_everything_is_released():
    it = ShardItem("w", 0, 0, 8)
    it.bufs = {"g": Buf(), "master": Buf()}
    bufs = dict(it.bufs)
    it.release_after([], {"master"})
    assert all(b.released == 1 for b in bufs.values())
