"""--optim-states bf16|int8: the quantiser itself, and the out-of-core AdamW with compressed moments
equal (bit for bit) to an in-memory loop that puts the same encode/decode around torch's kernel."""

import pytest
import torch
from torch.optim.adamw import adamw

from tests.engine.test_exactness import assert_same, batches, reference_loop
from tierlm.engine import state_quant as SQ
from tierlm.engine.engine import Engine, EngineConfig
from tierlm.storage.layout import ParamInfo
from tierlm.engine.optim_types import total_state_bytes
from tierlm.engine.optimizer import AdamWConfig, OptimizerDeps, OptimizerError, OutOfCoreAdamW, OutOfCoreOptions


# ---- the quantiser -----------------------------------------------------------------------

def test_dynamic_maps():
    for signed in (True, False):
        q = SQ.dynamic_map(signed)
        assert q.numel() == 256 and torch.equal(q, q.sort().values) and q.unique().numel() == 256
        assert q.max() == 1.0 and (q == 0).sum() == 1
        pos = q[q > 0]
        assert pos.min() < 1e-6  # seven decades, down to 1e-7..1e-6
        assert (q < 0).any() == signed


@pytest.mark.parametrize("block", [256, 2048])
@pytest.mark.parametrize("signed", [True, False])
def test_round_trip_error_bound(signed, block):
    g = torch.Generator().manual_seed(0)
    n = 5 * block + 77  # a partial last block
    x = torch.randn(n, generator=g) * torch.logspace(-4, 0, n)  # blocks of different scales
    x = x if signed else x * x
    codes, absmax = SQ.quantize_blockwise(x, signed, block)
    y = SQ.dequantize_blockwise(codes, absmax, signed, block)
    assert codes.dtype == torch.uint8 and absmax.numel() == SQ.n_blocks(n, block) == 6
    blocks = torch.arange(n) // block
    rel = (y - x).abs() / absmax[blocks]
    # The top decade has entries 0.9/64 (signed) or 0.9/128 apart: half of that is the worst error.
    assert rel.max() <= (0.9 / 64 if signed else 0.9 / 128) / 2 + 1e-6
    # ...and small values keep a relative precision (not flushed as a linear grid would).
    mid = x.abs() > 1e-3 * absmax[blocks]
    assert ((y - x).abs() / x.abs())[mid].max() < 0.2
    # nearest entry: no other map value is closer
    qmap = SQ.dynamic_map(signed)
    normed = x / absmax[blocks]
    best = (normed[:, None] - qmap[None, :]).abs().min(1).values
    assert torch.allclose((normed - qmap[codes.long()]).abs(), best, rtol=0, atol=1e-7)
    # the table search agrees with a plain binary search on every value
    assert torch.equal(codes.long(), torch.bucketize(normed, (qmap[1:] + qmap[:-1]) / 2))


def test_edge_cases():
    block = 256
    x = torch.zeros(3 * block)
    x[block + 5] = 3e30          # one huge value: its block scales to it, the others are untouched
    x[block + 6] = -1.5e-10      # flushed to 0 beside it (below 1e-7 of the absmax)
    x[2 * block:] = -torch.linspace(1, 2, block)  # all negative
    codes, absmax = SQ.quantize_blockwise(x, True, block)
    y = SQ.dequantize_blockwise(codes, absmax, True, block)
    assert torch.equal(absmax, torch.tensor([0.0, 3e30, 2.0]))
    assert torch.equal(y[:block], torch.zeros(block)) and not torch.isnan(y).any()
    assert y[block + 5] == 3e30 and y[block + 6] == 0
    # the signed map's most negative entry is -0.993 (1.0 has a code, -1.0 does not)
    assert (y[2 * block:] < 0).all() and y[-1] == SQ.dynamic_map(True)[0] * 2.0
    assert ((y[2 * block:] - x[2 * block:]).abs() <= 2.0 * 0.9 / 64 / 2 + 1e-6).all()
    # unsigned: zeros and an exact maximum come back exactly
    v = torch.zeros(block)
    v[0] = 7.0
    c, a = SQ.quantize_blockwise(v, False, block)
    assert torch.equal(SQ.dequantize_blockwise(c, a, False, block), v)
    # empty, and the stored layout of int8 (scales, then codes)
    c, a = SQ.quantize_blockwise(torch.zeros(0), True, block)
    assert c.numel() == 0 and a.numel() == 0
    assert SQ.stored_spec("int8", 4096 + 1) == (torch.uint8, 4 * 3 + 4097)
    with pytest.raises(ValueError, match="flat float32"):
        SQ.quantize_blockwise(torch.zeros(4, 4), True)
    with pytest.raises(ValueError, match="optim_states must be one of fp32, bf16, int8, got 'fp8'"):
        EngineConfig(nvme_dir="x", optim_states="fp8")
    info = ParamInfo("a", (5000,), 5000, ((0, 1024), (1024, 5000)))  # a shard off the block grid
    with pytest.raises(OptimizerError, match="int8 needs shards of a multiple of 2048 elements; a.1"):
        OutOfCoreAdamW(OptimizerDeps(None, None), {"a": info}, ["a"], ["a"], AdamWConfig(), {},
                       OutOfCoreOptions(optim_states="int8"))


def test_finetune_option():
    from tierlm.config import ConfigError, build
    from tierlm.train.finetune import FinetuneConfig
    from tierlm.train.rundir import RESULT_OPTIONS

    assert build(FinetuneConfig, {"model": "m", "data": "d", "optim_states": "int8"}).optim_states == "int8"
    assert build(FinetuneConfig, {"model": "m", "data": "d"}).optim_states == "fp32"
    with pytest.raises(ConfigError, match="optim_states: 'int9' is not one of fp32, bf16, int8"):
        build(FinetuneConfig, {"model": "m", "data": "d", "optim_states": "int9"})
    assert "optim_states" in RESULT_OPTIONS  # a resumed run must keep its format


def test_bf16_mode_rounds_to_nearest():
    x = torch.tensor([1.0 + 2 ** -9, 1.0 + 3 * 2 ** -9, -3e-5, 0.0])
    stored = torch.empty(4, dtype=torch.bfloat16)
    SQ.encode("bf16", x, stored, signed=True)
    out = torch.empty(4)
    SQ.decode("bf16", stored, out, signed=True)
    assert torch.equal(out, x.to(torch.bfloat16).float())
    assert out[0] == 1.0 and out[1] == 1.0 + 2 ** -7  # ties to even


# ---- the engine against an in-memory reference -------------------------------------------

def reference(model, data, *, mode, lr, wd, clip, accum, precision):
    """The reference loop with m, v kept only in their stored form: decode, torch's fused AdamW
    kernel on the whole tensor, encode."""
    def make_step(params):
        stored = [None] * len(params)

        def step(s):
            for i, p in enumerate(params):
                flat, g = p.data.view(-1), p.grad.view(-1)
                m, v = torch.zeros_like(flat), torch.zeros_like(flat)
                if stored[i] is not None:
                    SQ.decode(mode, stored[i][0], m, signed=True)
                    SQ.decode(mode, stored[i][1], v, signed=False)
                adamw([flat], [g], [m], [v], [], [torch.tensor(float(s))], lr=lr, beta1=0.9, beta2=0.999,
                      weight_decay=wd, eps=1e-8, amsgrad=False, maximize=False, fused=True, foreach=False)
                dt, numel = SQ.stored_spec(mode, flat.numel())
                stored[i] = (torch.empty(numel, dtype=dt), torch.empty(numel, dtype=dt))
                SQ.encode(mode, m, stored[i][0], signed=True)
                SQ.encode(mode, v, stored[i][1], signed=False)
                p.grad = None
        return step
    _, masters, losses, _ = reference_loop(model, data, clip=clip, accum=accum, precision=precision,
                                           make_step=make_step)
    return masters, losses


def engine_cfg(tmp_path, name, mode, *, lr, wd, clip, accum, precision, state_cache=True, shard_elems=None,
               pack_below=None, clip_path="auto"):
    return EngineConfig(nvme_dir=str(tmp_path / name), cpu_mem="1GiB", precision=precision, grad_accum=accum,
                        optim=AdamWConfig(lr=lr, weight_decay=wd, max_grad_norm=clip), optim_states=mode,
                        clip_path=clip_path,
                        state_cache=state_cache, shard_elems=shard_elems, tokens_per_micro_batch=24,
                        **({} if pack_below is None else {"pack_below": pack_below}))


def train(eng, data, accum, start=0):
    losses, results = [], []
    for s in range(start, len(data) // accum):
        for x in data[s * accum:(s + 1) * accum]:
            loss = eng.forward(x, labels=x).loss
            eng.backward(loss)
            losses.append(loss.item())
        results.append(eng.step())
    return losses, results


# Shards of 2048 elements (one int8 block each) split every matrix. Not combined with accumulation
# and clipping: an accumulated gradient's norm from shard norms is exact only to rounding (optimizer.py).
CASES = {  # id: (mode, precision, clip, accum, state_cache, shard_elems, clip_path)
    "int8-fp32-clip-cached": ("int8", "fp32", 0.5, 1, True, None, "speculate"),
    "int8-bf16-clip-sharded-disk": ("int8", "bf16", 0.5, 1, False, 2048, "speculate"),
    "int8-bf16-clip-held-cached": ("int8", "bf16", 0.5, 1, True, 2048, "hold"),
    "int8-bf16-accum-disk": ("int8", "bf16", 1.0, 2, False, None, "auto"),
    "bf16-fp32-clip-sharded-disk": ("bf16", "fp32", 0.5, 1, False, 2048, "hold"),
    "bf16-bf16-accum-cached": ("bf16", "bf16", 1.0, 2, True, None, "auto"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_compressed_states_equal_reference(make_model_dir, tmp_path, case):
    mode, precision, clip, accum, cache, shard, clip_path = CASES[case]
    model_dir, model = make_model_dir("llama")
    data = batches(4 * accum)
    kw = dict(lr=1e-2, wd=0.1, clip=clip, accum=accum, precision=precision)
    ref, ref_losses = reference(model, data, mode=mode, **kw)
    eng = Engine.from_pretrained(model_dir, engine_cfg(tmp_path, "nvme", mode, state_cache=cache,
                                                       shard_elems=shard, clip_path=clip_path, **kw))
    try:
        losses, results = train(eng, data, accum)
        masters = {n: eng.master(n) for n in eng.names}
    finally:
        eng.close()
    assert losses == ref_losses
    assert_same(ref, masters)
    if clip == 0.5:
        # the clip redo ran from the compressed old slot, or the held step's one update
        assert all(r.redone for r in results) if clip_path == "speculate" else not any(r.redone for r in results)


def test_resume_after_a_failed_step_keeps_equality(make_model_dir, tmp_path):
    model_dir, model = make_model_dir("llama")
    data = batches(4)
    kw = dict(lr=1e-2, wd=0.1, clip=0.5, accum=1, precision="bf16")
    ref, ref_losses = reference(model, data, mode="int8", **kw)
    cfg = engine_cfg(tmp_path, "nvme", "int8", shard_elems=2048, **kw)
    eng = Engine.from_pretrained(model_dir, cfg)
    losses, _ = train(eng, data[:2], 1)
    eng.settle()  # step 2 committed (its update and commit run beside the next forward)
    write, seen = eng.store.write, []

    def failing(key, tensor, *a, **k):  # the disk fails halfway through step 3's new state
        seen.append(key)
        if sum(k.startswith("m") for k in seen) == 12:  # (a held step saves its gradients first)
            raise OSError("injected: the machine went down")
        return write(key, tensor, *a, **k)
    eng.store.write = failing
    with pytest.raises(OSError, match="injected"):
        train(eng, data[:3], 1, start=2)
        eng.settle()  # (the update of a held step ends beside the next forward)
    eng.close()
    assert any(k.startswith("m") for k in seen)  # it failed among the state writes
    eng = Engine.from_pretrained(model_dir, cfg, resume=True)
    try:
        assert eng.state["step"] == 2
        more, _ = train(eng, data, 1, start=2)
        masters = {n: eng.master(n) for n in eng.names}
    finally:
        eng.close()
    assert losses + more == ref_losses
    assert_same(ref, masters)
    # another format cannot pick the state up
    with pytest.raises(ValueError, match=r"optim_states: 'int8' there, None here"):
        Engine.from_pretrained(model_dir, engine_cfg(tmp_path, "nvme", "fp32", shard_elems=2048, **kw),
                               resume=True)


def test_ssd_bytes_per_step_drop(make_model_dir, tmp_path, monkeypatch):
    # Weights the window keeps across a commit depend on timing (tests/engine/test_weight_window.py):
    # read them all back here, so that the formats' bytes are the only difference.
    from tierlm.engine.weights import WeightWindow
    monkeypatch.setattr(WeightWindow, "offer", lambda self, *a: None)
    model_dir, _ = make_model_dir("llama")
    data = batches(3)
    kw = dict(lr=1e-3, wd=0.0, clip=None, accum=1, precision="bf16")
    io, infos = {}, None
    for mode in SQ.MODES:
        # nothing packed: this tiny model's tensors are all small, and packed ones are not read
        eng = Engine.from_pretrained(model_dir, engine_cfg(tmp_path, mode, mode, state_cache=False, pack_below=0, **kw))
        try:
            start = eng.store.stats.snapshot()
            train(eng, data, 1)
            infos = eng.infos
        finally:
            eng.close()  # waits for the weights read ahead after the last step, counted in both modes
        end = eng.store.stats.snapshot()
        io[mode] = {k: end[k] - start[k] for k in ("bytes_read", "bytes_written")}
    shards = [i.shard_numel(k) for i in infos.values() for k in range(len(i.shards))]
    n = sum(shards)
    for mode in ("bf16", "int8"):
        # m and v: 8 bytes a parameter in fp32, as stored otherwise; everything else is the same
        saved = sum(8 * s - 2 * SQ.stored_nbytes(mode, s) for s in shards)
        assert io["fp32"]["bytes_written"] - io[mode]["bytes_written"] == 3 * saved
        assert io["fp32"]["bytes_read"] - io[mode]["bytes_read"] == 2 * saved  # no m, v to read at step 1
    assert sum(8 * s - 2 * SQ.stored_nbytes("bf16", s) for s in shards) == 4 * n
    per_param = {m: total_state_bytes(infos, torch.bfloat16, m) / n for m in SQ.MODES}
    assert per_param["fp32"] == 14 and per_param["bf16"] == 10 and 8 < per_param["int8"] < 8.1
