"""The optimizer's parts on their own: the shard update against torch.optim.AdamW, the read-ahead's
order and depth, and the state cache's all-or-nothing sets and hit accounting."""
import pytest
import torch

from tierlm.engine.cache_policy import StateCache
from tierlm.engine.optim_readahead import ArrivalOrder, ReadAhead, update_sequence
from tierlm.engine.optim_types import EARLY, AdamWConfig, ShardItem, StateFormat
from tierlm.engine.optim_update import adamw_shard, clipped_grad
from tierlm.storage import HostBufferPool
from tierlm.storage.layout import ParamInfo


@pytest.mark.parametrize("impl", ["fused", "foreach", "single"])
def test_the_shard_update_is_torch_adamw_shard_by_shard(impl):
    """Three steps on a tensor in two shards, clipped gradients included, give torch's bits."""
    torch.manual_seed(0)
    cfg = AdamWConfig(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1, impl=impl)
    p = torch.nn.Parameter(torch.randn(1000))
    opt = torch.optim.AdamW([p], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, **cfg.kernel_flags())
    master, m, v = p.detach().clone(), torch.zeros(1000), torch.zeros(1000)
    for step in range(3):
        g = torch.randn(1000)
        p.grad = g.clone()
        torch.nn.utils.clip_grad_norm_([p], 1.0)
        opt.step()
        coef = torch.clamp(1.0 / (torch.linalg.vector_norm(g, 2) + 1e-6), max=1.0)
        for a, b in ((0, 600), (600, 1000)):
            gs = clipped_grad(g[a:b].clone(), None, coef)
            adamw_shard(master[a:b], gs, m[a:b], v[a:b], step, cfg.lr, cfg)
    assert torch.equal(master, p.detach())
    assert torch.equal(m, opt.state[p]["exp_avg"]) and torch.equal(v, opt.state[p]["exp_avg_sq"])


def test_a_low_precision_saved_gradient_is_upcast_before_the_clip():
    g = torch.empty(3)
    saved = torch.tensor([1.0, -2.0, 3.0], dtype=torch.bfloat16)
    assert torch.equal(clipped_grad(g, saved, torch.tensor(0.5)), torch.tensor([0.5, -1.0, 1.5]))


class Prep:
    """prepare/abandon for a ReadAhead over a pool of `room` shards."""

    def __init__(self, room):
        self.room, self.log = room, []

    def prepare(self, name, k, blocking):
        if self.room == 0:
            assert not blocking, "a blocking prepare waits for room; here it would hang"
            return None
        self.room -= 1
        self.log.append(("read", name, k))
        return ShardItem(name, k, 0, 1)

    def abandon(self, it):
        self.room += 1
        self.log.append(("drop", it.name, it.shard))


def test_the_read_ahead_keeps_depth_shards_and_drops_the_furthest_for_one_needed_now():
    seq = [("a", 0), ("a", 1), ("b", 0), ("c", 0)]
    p = Prep(room=2)
    ahead = ReadAhead(seq, 3, p.prepare, p.abandon)
    ahead.fill()
    assert p.log == [("read", "a", 0), ("read", "a", 1)]  # the pool's room, below the depth
    it = ahead.take(("c", 0))  # arrived out of the predicted order: room made from the furthest
    assert (it.name, it.shard) == ("c", 0) and p.log[2:] == [("drop", "a", 1), ("read", "c", 0)]
    ahead.close()
    assert p.log[-1] == ("drop", "a", 0) and p.room == 1  # read ahead for no gradient: given back
    p = Prep(room=5)
    ahead = ReadAhead(seq, 2, p.prepare, p.abandon)
    ahead.fill()
    ahead.take(("a", 0))
    ahead.fill()
    assert [e[1:] for e in p.log] == [("a", 0), ("a", 1), ("b", 0)]  # two beside the one taken


def test_the_arrival_order_learns_and_an_early_arrival_updates_its_shards_once():
    order = ArrivalOrder(["x", "y", "z"])
    order.learn(["y", "x"])
    assert order.predicted == ["y", "x", "z"] and order.last == ["y", "x"]
    infos = {"e": ParamInfo("e", (4, 2), 8, ((0, 2), (2, 4), (4, 8))), "x": ParamInfo("x", (2,), 2, ((0, 2),))}
    assert update_sequence(["e" + EARLY, "x", "e"], infos, {"e": [1, 2]}) == [("e", 1), ("e", 2), ("x", 0), ("e", 0)]


def test_the_state_cache_takes_whole_states_and_counts_hits():
    fmt = StateFormat(None)
    page = 4096  # a buffer's bytes, rounded up
    cache = StateCache(HostBufferPool(5 * page), fmt)  # one state (master, m, v) and two buffers
    got = cache.reserve(100)
    assert set(got) == {"master", "m", "v"}
    assert cache.reserve(100) is None and cache.pool.used_bytes == 3 * page  # no partial set kept
    cache.stage(("a", 0), got)
    assert cache.take(("a", 0)) is None  # staged, not resident until the step commits
    cache.commit()
    bufs = cache.take(("a", 0))
    assert bufs is got and cache.hits == 1
    cache.put_back(("a", 0), bufs)
    assert cache.hits == 0 and cache.resident == {("a", 0): got}
    cache.drop()
    assert cache.pool.used_bytes == 0 and not cache.resident
    infos = {n: ParamInfo(n, (100,), 100, ((0, 50), (50, 100))) for n in "ab"}
    cache.prefer_last([("a", 0), ("a", 1), ("b", 0), ("b", 1)], infos)
    assert cache.preferred == {("b", 1)}  # the last shard's state is all that fits
    assert StateCache(None, fmt).reserve(100) is None
