"""A shard's buffers go back to the pool as soon as nothing needs them."""
from concurrent.futures import Future

import pytest
import torch

from tierlm.engine.optim_types import ShardItem, StateFormat, shard_buffer_bytes
from tierlm.plan.budget import MODES
from tierlm.storage import BudgetError, HostBufferPool
from tierlm.storage.aligned import round_up
from tierlm.storage.layout import nbytes


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


# ---- one shard's buffers: what the budget gives the optimizer's pool at the least ------------------

N = 3 * 1024 + 5  # elements: not a whole page of any dtype


def _reader(pool, fmt):
    from tierlm.engine.cache_policy import StateCache
    from tierlm.engine.optim_reads import ShardReader
    return ShardReader(None, pool, fmt, StateCache(None, fmt), lambda n, k: 0, {"p": 1})


@pytest.mark.parametrize("states", MODES)
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_one_shard_item_holds_what_every_mode_takes(dtype, states):
    """The budget's least optimizer pool is one `shard_buffer_bytes`: every mode's buffers must fit
    in it, a clipped step's update from held gradients (apply, redo) with the gradient as saved.
    They did not (the saved bf16 gradient was not counted), and the README's demo waited forever
    at step 2 whenever its pool came out at the least."""
    fmt = StateFormat(dtype, states)
    reader = _reader(None, fmt)
    item = shard_buffer_bytes(N, dtype, states)
    for mode, micro in [("update", 0), ("update", 1), ("accumulate", 1), ("hold", 1), ("redo", 0), ("apply", 0)]:
        saved = (dtype or torch.float32) if mode in ("redo", "apply") else None
        tags = reader._needs(mode, micro, saved)
        took = sum(round_up(nbytes(saved, N) if t == "gl" else fmt.size(t, N, "p")) for t in tags)
        assert took <= item, (mode, micro, tags)


def test_a_pool_too_small_for_one_shard_raises_instead_of_waiting():
    """Taken one at a time, a shard's buffers would wait forever for room they hold themselves."""
    fmt = StateFormat(torch.bfloat16)
    pool = HostBufferPool(3 * round_up(4 * N), name="optimizer buffers")
    it = ShardItem("p", 0, 0, N)
    with pytest.raises(BudgetError, match=r"optimizer buffers: one shard of p .*raise --cpu-mem"):
        _reader(pool, fmt).prepare(it, "update", 0, blocking=True)
    assert pool.used_bytes == 0 and not it.bufs
