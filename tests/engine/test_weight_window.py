"""The weight window keeps the step's new working weights of the blocks it still holds after
backward (the first ones, which the next forward needs first) instead of reading them back."""
import pytest
import torch

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig
from tierlm.engine.weights import WeightWindow

from .test_exactness import batches


def _run(model_dir, nvme, data, precision, clip, clip_path="speculate"):
    # nothing packed: the reads counted are the window's (this tiny model's tensors are all small)
    cfg = EngineConfig(nvme_dir=str(nvme), cpu_mem="1GiB", precision=precision, clip_path=clip_path,
                       optim=AdamWConfig(lr=1e-2, weight_decay=0.1, max_grad_norm=clip),
                       tokens_per_micro_batch=data[0].numel(), pack_below=0)
    eng = Engine.from_pretrained(model_dir, cfg)
    losses, fwd_reads, kept = [], [], []
    try:
        for x in data:
            before = eng.store.stats.snapshot()["bytes_read"]
            loss = eng.forward(x, labels=x).loss
            fwd_reads.append(eng.store.stats.snapshot()["bytes_read"] - before)
            eng.backward(loss)
            losses.append(loss.item())
            eng.step()
            kept.append(eng.window.kept_bytes)
        masters = {n: eng.master(n) for n in eng.names}
        weights = {n: eng.weights(n) for n in eng.names}
    finally:
        eng.close()
    return losses, masters, weights, fwd_reads, kept


@pytest.mark.parametrize("precision,clip,clip_path", [("bf16", None, "speculate"), ("fp32", 0.5, "speculate"),
                                                       ("bf16", 0.5, "speculate"), ("bf16", 0.5, "hold"),
                                                       ("fp32", 0.5, "hold")])
def test_kept_weights_equal_reading_them_back(make_model_dir, tmp_path, monkeypatch, precision, clip, clip_path):
    """hold: the update runs beside the next forward, and the entries the window kept take its new
    weights shard by shard as it makes them (a block waits for its own)."""
    model_dir, _ = make_model_dir("qwen2")  # tied embedding and head: one tensor in two blocks
    data = batches(4)
    losses, masters, weights, fwd_reads, kept = _run(model_dir, tmp_path / "kept", data, precision, clip, clip_path)
    # The embedding's gradient arrives last, when no block holds it: it at least stays.
    assert all(k > 0 for k in kept)
    if clip_path == "speculate":  # (a deferred update's state reads fall in the next forward)
        # Every forward after the first reads what the commit did not keep (prefetch may have
        # started reading some of it already at the commit, so compare with the first forward).
        assert all(r <= fwd_reads[0] - k for r, k in zip(fwd_reads[1:], kept))

    monkeypatch.setattr(WeightWindow, "offer", lambda self, *a: None)  # read everything back
    ref = _run(model_dir, tmp_path / "reread", data, precision, clip, clip_path)
    if clip_path == "speculate":  # (held: the entries await the update, and leave at its end unrenewed)
        assert ref[4] == [0] * len(data)
    assert losses == ref[0]
    for got, want in ((masters, ref[1]), (weights, ref[2])):
        for n, t in want.items():
            assert torch.equal(got[n], t), n


def test_a_forward_before_step_is_refused(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama")
    x = batches(1)[0]
    cfg = EngineConfig(nvme_dir=str(tmp_path / "nv"), cpu_mem="1GiB", tokens_per_micro_batch=x.numel())
    eng = Engine.from_pretrained(model_dir, cfg)
    try:
        eng.backward(eng.forward(x, labels=x).loss)
        with pytest.raises(RuntimeError, match="call step"):
            eng.forward(x, labels=x)
    finally:
        eng.close()


def test_a_tied_heads_gradient_is_in_the_budget(make_model_dir, tmp_path):
    """Autograd holds the head's gradient of a tied embedding until the embedding's arrives: the
    split sets that much aside (qwen2 ties them, llama does not)."""
    from tierlm.plan.budget import TRAINING_RESERVE

    splits = {}
    for arch in ("qwen2", "llama"):
        model_dir, model = make_model_dir(arch, hidden_size=64, vocab_size=4096)
        cfg = EngineConfig(nvme_dir=str(tmp_path / arch), cpu_mem="1GiB", precision="fp32", tokens_per_micro_batch=8)
        eng = Engine.from_pretrained(model_dir, cfg)
        splits[arch] = eng.split.compute - TRAINING_RESERVE
        eng.close()
    embed = 4096 * 64 * 4
    assert splits["qwen2"] - splits["llama"] == embed


def test_prefetch_does_not_evict_weights_kept_for_the_next_forward(tmp_path):
    """After backward the first blocks' new weights stay; the next forward's read-ahead of later
    blocks must evict what that forward has used, not what it is about to use."""
    from tierlm.storage.layout import make_param_info
    from tierlm.storage import HostBufferPool, TensorStore

    names = [f"p{i}" for i in range(5)]  # one parameter a block, 4 KiB each
    infos = {n: make_param_info(n, (1024,)) for n in names}
    store = TensorStore(tmp_path / "st", HostBufferPool(1 << 20, name="io"), direct_io=False)
    for n in names:
        store.write(f"w/{n}.0", torch.full((1024,), float(n[1:]))).result()
    win = WeightWindow(store, HostBufferPool(3 * 4096, name="window"), infos, lambda n: torch.float32,
                       lambda n, k: f"w/{n}.{k}")
    try:
        for n in ("p2", "p1", "p0"):  # backward: the first blocks last
            win.acquire([n])
            win.release([n])
            win.offer(n, 0, torch.full((1024,), -float(n[1:])))
        win.invalidate_all(keep_renewed=True)
        assert win.kept_bytes == 3 * 4096

        misses = win.misses
        win.acquire(["p0"])  # the next forward: block 0, then read ahead of block 1
        win.release(["p0"])
        win.prefetch(["p3"])
        got = win.acquire(["p1"])["p1"]
        win.release(["p1"])
        got2 = win.acquire(["p2"])["p2"]
        assert win.misses == misses, "a weight kept for this forward was evicted and read again"
        assert float(got[0]) == -1.0 and float(got2[0]) == -2.0  # the step's new values, not the store's
        win.release(["p2"])
    finally:
        store.close()


def test_a_large_weight_lands_in_resident_pages_and_moves_what_was_read_ahead(tmp_path, monkeypatch):
    """A tied embedding takes most of a small window. It gets one contiguous range of the pool's
    arena: the least recently used entries there are dropped, entries read ahead and not yet used
    are moved out of it (not dropped, which would read them again), and no fresh pages are taken."""
    from tierlm.storage.layout import make_param_info
    from tierlm.storage import HostBufferPool, TensorStore
    from tierlm.storage import pool as pool_mod

    small = [f"p{i}" for i in range(6)]  # one page each
    infos = {n: make_param_info(n, (1024,)) for n in small}
    infos["E"] = make_param_info("E", (6 * 1024,))
    store = TensorStore(tmp_path / "st", HostBufferPool(1 << 20, name="io"), direct_io=False)
    for i, n in enumerate(small):
        store.write(f"w/{n}.0", torch.full((1024,), float(i))).result()
    store.write("w/E.0", torch.arange(6 * 1024, dtype=torch.float32)).result()
    win = WeightWindow(store, HostBufferPool(10 * 4096, name="window", arena=True), infos, lambda n: torch.float32,
                       lambda n, k: f"w/{n}.{k}")
    try:
        for n in ("p0", "p1", "p2"):
            win.acquire([n])
            win.release([n])
        win.prefetch(["p3", "p4"])  # read ahead, in the arena's middle
        win.acquire(["p5"])
        win.release(["p5"])
        for n in ("p3", "p4"):  # landed (an entry still reading is not moved: it would be read again)
            for f in win._entries[n].reads:
                f.result()
        monkeypatch.setattr(pool_mod, "aligned_empty", lambda *a, **k: pytest.fail("fresh pages taken"))
        misses = win.misses
        e = win.acquire(["E"])["E"]
        assert win._entries["E"].buffer.offset is not None
        assert torch.equal(e, torch.arange(6 * 1024, dtype=torch.float32))
        win.release(["E"])
        got = win.acquire(["p3", "p4"])
        assert win.misses == misses + 1, "an entry read ahead was dropped and read again"
        assert float(got["p3"][0]) == 3.0 and float(got["p4"][-1]) == 4.0
        assert {n for n in win._entries} >= {"p3", "p4", "E"}
        win.release(["p3", "p4"])
    finally:
        store.close()


def test_new_weights_of_a_block_still_computing_are_stashed_until_it_lets_go(tmp_path):
    """A layer's weight gradients come before its backward ends, so the optimizer offers new values
    while the block still holds the old ones: with `stash` they go to a second buffer (the block
    keeps computing with the old values) that replaces the entry when the block releases it (so
    stashes never pile up over a backward); without room for one, or without `stash`, the entry
    is read back as before."""
    from tierlm.storage.layout import make_param_info
    from tierlm.storage import HostBufferPool, TensorStore

    infos = {n: make_param_info(n, (1024,)) for n in ("a", "b")}
    store = TensorStore(tmp_path / "st", HostBufferPool(1 << 20, name="io"), direct_io=False)
    for n in infos:
        store.write(f"w/{n}.0", torch.full((1024,), 1.0)).result()
    try:
        for stash, room, kept in ((True, 4, {"a", "b"}), (True, 2, set()), (False, 4, set())):
            win = WeightWindow(store, HostBufferPool(room * 4096, name="window"), infos, lambda n: torch.float32,
                               lambda n, k: f"w/{n}.{k}", stash=stash)
            held = win.acquire(["a", "b"])
            win.offer("a", 0, torch.full((1024,), 2.0))
            win.offer("b", 0, torch.full((1024,), 3.0))
            assert torch.equal(held["a"], torch.full((1024,), 1.0))  # what the block computes with
            win.release(["a", "b"])
            assert win.pool.used_bytes == 2 * 4096  # the stashes replaced the entries
            win.invalidate_all(keep_renewed=True)
            assert set(win._entries) == kept and win.pool.used_bytes == len(kept) * 4096
            misses = win.misses
            got = win.acquire(["a", "b"])
            assert float(got["a"][0]) == (2.0 if kept else 1.0) and float(got["b"][0]) == (3.0 if kept else 1.0)
            assert win.misses == misses + 2 - len(kept)
            win.release(["a", "b"])
            win.invalidate_all(keep_renewed=False)
    finally:
        store.close()


def test_a_budget_with_room_reads_no_weights_after_the_first_step(make_model_dir, tmp_path):
    """Where --cpu-mem holds all the optimizer state, the window takes the rest up to every weight:
    after the first step nothing is read (state from the cache, weights kept), and the weights
    equal a run that reads them back (with the state cache off the window keeps its size)."""
    model_dir, _ = make_model_dir("qwen2")
    data = batches(3)
    runs = {}
    for cache in (True, False):
        cfg = EngineConfig(nvme_dir=str(tmp_path / str(cache)), cpu_mem="1GiB", precision="bf16", state_cache=cache,
                           optim=AdamWConfig(lr=1e-2), tokens_per_micro_batch=data[0].numel(), pack_below=0)
        eng = Engine.from_pretrained(model_dir, cfg)
        reads = []
        try:
            for x in data:
                before = eng.store.stats.snapshot()["bytes_read"]
                eng.backward(eng.forward(x, labels=x).loss)
                eng.step()
                reads.append(eng.store.stats.snapshot()["bytes_read"] - before)
            runs[cache] = (eng.split.weights_kept, reads, {n: eng.weights(n) for n in eng.names})
        finally:
            eng.close()
    kept, reads, weights = runs[True]
    assert kept > 0 and reads[0] > 0 and reads[1:] == [0, 0]
    kept, reads, ref = runs[False]
    assert kept == 0 and all(r > 0 for r in reads)
    for n, t in ref.items():
        assert torch.equal(weights[n], t), n
