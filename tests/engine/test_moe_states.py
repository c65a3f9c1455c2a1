"""A mixture of experts' optimizer state, expert by expert.

The stacked experts' parameters are cut on expert boundaries; with weight decay 0, an expert no
token has reached yet keeps its state untouched (no read, no write), which is exactly what
torch.optim.AdamW does to it; with weight decay it moves, and every expert's state is read and
written. Tiny qwen3_moe: 8 experts, top-1 routing, a few tokens, so that some experts get none.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.expert_io import describe
from tierlm.engine.optimizer import AdamWConfig
from tierlm.storage.layout import make_param_info
from tierlm.train.schedule import lr_factor

from ..families import family_config
from .test_exactness import assert_same, reference_loop

EXPERTS = 8
SHARD = 2048  # an expert's down_proj (64 x 32) is one shard, its gate_up_proj (64 x 64) two
LR = 1e-3


def _model_dir(tmp_path):
    torch.manual_seed(0)
    cfg = family_config("qwen3_moe", num_experts=EXPERTS, num_experts_per_tok=1)
    model = AutoModelForCausalLM.from_config(cfg).float()
    d = tmp_path / "moe"
    model.save_pretrained(d)
    return d, model


def _data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (1, 3), generator=g) for _ in range(n)]


def _reference(model, data, *, wd, clip, accum):
    def make_step(params):
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=wd, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor("cosine", 0, len(data) // accum))
        make_step.opt = opt

        def step(s):
            opt.step()
            sched.step()
            opt.zero_grad()
        return step
    ref, masters, losses, _ = reference_loop(model, data, clip=clip, accum=accum, precision="fp32",
                                             make_step=make_step)
    moments = {n: make_step.opt.state[p]["exp_avg"] for n, p in ref.named_parameters()}
    return masters, losses, moments


def _config(tmp_path, *, wd, clip, accum, clip_path="auto", tag=""):
    return EngineConfig(nvme_dir=str(tmp_path / f"nvme{tag}"), cpu_mem="1GiB", precision="fp32", grad_accum=accum,
                        shard_elems=SHARD, pack_below=0, clip_path=clip_path,
                        optim=AdamWConfig(lr=LR, weight_decay=wd, max_grad_norm=clip), tokens_per_micro_batch=3)


def _steps(eng, data, accum, first=0, last=None):
    """Steps first..last of the run (the lr schedule of the whole run); their results."""
    total = len(data) // accum
    sched = lr_factor("cosine", 0, total)
    out = []
    for s in range(first, total if last is None else last):
        eng.set_lr(LR * sched(s))
        for x in data[s * accum:(s + 1) * accum]:
            eng.backward(eng.forward(x, labels=x).loss)
        out.append(eng.step())
    return out


class KeyLog:
    """Every key the store is asked to read or write."""

    def __init__(self, store):
        self.reads, self.writes = [], []
        read_into, write = store.read_into, store.write
        store.read_into = lambda k, *a, **kw: (self.reads.append(k), read_into(k, *a, **kw))[1]
        store.write = lambda k, *a, **kw: (self.writes.append(k), write(k, *a, **kw))[1]


def _expert_keys(eng, keys, layer_module, e):
    """Of `keys`, those of shards holding expert e of the experts module `layer_module`."""
    out = []
    for k in keys:
        name, _, shard = k.partition("/")[2].rpartition(".")
        info = eng.infos.get(name)
        if info is not None and info.experts and name.startswith(layer_module + ".") \
                and e in info.shard_experts(int(shard)):
            out.append(k)
    return out


def _run(tmp_path, data, *, wd, clip, accum, clip_path="auto"):
    d, model = _model_dir(tmp_path)
    eng = Engine.from_pretrained(d, _config(tmp_path, wd=wd, clip=clip, accum=accum, clip_path=clip_path))
    log = KeyLog(eng.store)
    try:
        results = _steps(eng, data, accum)
        eng.flush()
        masters = {n: eng.master(n) for n in eng.names}
    finally:
        eng.close()
    return model, eng, log, results, masters


def _never_routed(moments):
    """(experts module, expert) whose moments stayed zero in torch: no token reached them."""
    out = []
    for n, m in moments.items():
        if n.endswith("experts.down_proj"):
            out += [(n.rpartition(".")[0], e) for e in range(m.shape[0]) if not m[e].any()]
    return out


@pytest.mark.parametrize("clip_path", ["hold", "speculate"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_bits_equal_torch_adamw_with_clipping_and_accumulation(tmp_path, wd, clip_path):
    data = _data(4)
    _, ref_model = _model_dir(tmp_path)
    ref_masters, ref_losses, moments = _reference(ref_model, data, wd=wd, clip=100.0, accum=2)
    assert _never_routed(moments), "the test wants an expert no token reaches"
    _, _, _, _, masters = _run(tmp_path, data, wd=wd, clip=100.0, accum=2, clip_path=clip_path)
    assert_same(ref_masters, masters)


@pytest.mark.parametrize("clip_path", ["hold", "speculate"])
def test_bits_equal_torch_adamw_when_the_clip_scales(tmp_path, clip_path):
    # (without accumulation: an accumulated split tensor's norm is combined from its shards',
    # equal to torch's to within rounding, which a clip that scales would show)
    data = _data(3)
    _, ref_model = _model_dir(tmp_path)
    ref_masters, _, moments = _reference(ref_model, data, wd=0.0, clip=0.05, accum=1)
    assert _never_routed(moments)
    _, _, _, results, masters = _run(tmp_path, data, wd=0.0, clip=0.05, accum=1, clip_path=clip_path)
    assert all(r.clip_coef < 1 for r in results)
    assert_same(ref_masters, masters)


def test_an_expert_never_routed_to_is_neither_read_nor_written(tmp_path):
    data = _data(4)
    _, ref_model = _model_dir(tmp_path)
    _, _, moments = _reference(ref_model, data, wd=0.0, clip=100.0, accum=2)
    idle = _never_routed(moments)
    assert idle
    _, eng, log, results, _ = _run(tmp_path, data, wd=0.0, clip=100.0, accum=2)
    steps = results[:2]  # (eng.flush and eng.master after them read every shard: not counted)
    for module, e in idle:
        assert not _expert_keys(eng, log.writes, module, e), (module, e)
        for r in steps:
            assert r.experts["per_expert"][module][e] == [0, 0]
    # an expert that was routed to had its state read and written
    routed = [(n.rpartition(".")[0], e) for n, m in moments.items() if n.endswith("experts.down_proj")
              for e in range(m.shape[0]) if m[e].any()]
    module, e = routed[0]
    assert _expert_keys(eng, log.writes, module, e)
    assert sum(r.experts["per_expert"][module][e][1] for r in steps) > 0
    assert all(r.experts["idle"] >= len(idle) and r.experts["shards_left_alone"] >= 3 * len(idle) for r in steps)
    assert "untouched" in describe(steps[-1].experts)


def test_reads_of_an_unrouted_expert_are_none_during_the_steps(tmp_path):
    data = _data(4)
    d, model = _model_dir(tmp_path)
    _, _, moments = _reference(model, data, wd=0.0, clip=None, accum=2)
    idle = _never_routed(moments)
    eng = Engine.from_pretrained(d, _config(tmp_path, wd=0.0, clip=None, accum=2))
    try:
        log = KeyLog(eng.store)
        _steps(eng, data, 2)
        # only the weight window reads an idle expert's working weights (forward and backward
        # need them); no master, moment or gradient of it is read
        for module, e in idle:
            assert not [k for k in _expert_keys(eng, log.reads, module, e) if not k.startswith("master")]
    finally:
        eng.close()


def test_with_weight_decay_every_experts_state_is_read_and_written(tmp_path):
    data = _data(4)
    _, eng, log, results, _ = _run(tmp_path, data, wd=0.1, clip=100.0, accum=2)
    for name, info in eng.infos.items():
        if not info.experts:
            continue
        for e in range(info.experts):
            keys = _expert_keys(eng, log.writes, name.rpartition(".")[0], e)
            assert any(k.startswith("m") and not k.startswith("master") for k in keys), (name, e)
    for r in results:
        assert r.experts["shards_left_alone"] == 0 and r.experts["idle"] == 0


def test_a_resumed_run_keeps_the_untouched_experts_and_equals_torch(tmp_path):
    data = _data(4)
    d, model = _model_dir(tmp_path)
    ref_masters, _, moments = _reference(model, data, wd=0.0, clip=100.0, accum=2)
    cfg = _config(tmp_path, wd=0.0, clip=100.0, accum=2)
    eng = Engine.from_pretrained(d, cfg)
    try:
        _steps(eng, data, 2, 0, 1)
        eng.flush()
    finally:
        eng.close()
    eng = Engine.from_pretrained(d, cfg, resume=True)
    try:
        assert eng.optimizer.experts.fresh  # the untouched shards came back with the manifest
        _steps(eng, data, 2, 1, None)
        eng.flush()
        masters = {n: eng.master(n) for n in eng.names}
    finally:
        eng.close()
    assert_same(ref_masters, masters)


@pytest.mark.parametrize("shape,shard", [((8, 64, 64), 2048), ((8, 64, 32), 4096), ((8, 64, 32), 1 << 22),
                                         ((32, 1024, 512), 1 << 18), ((4, 5760), 1 << 22), ((6, 3, 1024), 6144)])
def test_shards_of_stacked_experts_never_straddle_two(shape, shard):
    experts = shape[0]
    info = make_param_info("x", shape, shard, experts)
    per = info.numel // experts
    assert info.experts == experts
    assert info.shards[0][0] == 0 and info.shards[-1][1] == info.numel
    for (a, b), (c, _) in zip(info.shards, info.shards[1:]):
        assert b == c
    for a, b in info.shards:
        assert b - a <= shard and a % 2048 == 0
        whole = a % per == 0 and b % per == 0
        assert whole or a // per == (b - 1) // per, (a, b, per)


def test_an_expert_no_whole_block_group_fits_keeps_the_plain_cut():
    # 3072 elements an expert: two make a 2048-element block multiple (6144), over a 4096 shard,
    # and one expert is no block multiple: cut by expert, a shard would start off a block
    info = make_param_info("x", (6, 3, 1024), 4096, 6)
    assert info.experts == 0 and info.shards == make_param_info("x", (6, 3, 1024), 4096).shards


def test_the_engine_cuts_the_models_stacked_experts_by_expert(tmp_path):
    d, _ = _model_dir(tmp_path)
    eng = Engine.from_pretrained(d, _config(tmp_path, wd=0.0, clip=None, accum=1))
    try:
        stacked = {n: i for n, i in eng.infos.items() if i.experts}
        assert sorted(n.rpartition(".")[2] for n in stacked) == ["down_proj", "gate_up_proj"]
        for n, info in stacked.items():
            assert all(len(info.shard_experts(k)) == 1 for k in range(len(info.shards)))
        assert all(not i.experts for n, i in eng.infos.items() if "experts" not in n)
    finally:
        eng.close()


MODES = [
    dict(precision="bf16", optim_states="int8", commit_every="2", clip=100.0, clip_path="hold"),
    dict(precision="bf16", optim_states="bf16", commit_every="3", clip=0.05, clip_path="speculate"),
    dict(precision="fp32", optim_states="fp32", commit_every="2", clip=None, clip_path="auto", state_cache=False),
]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
def test_leaving_fresh_experts_alone_changes_no_bit_in_any_mode(tmp_path, mode, monkeypatch):
    """The same run with fresh shards tracked and not (every shard updated, as before): the same
    masters and working weights, bit for bit, with the untracked run reading and writing more."""
    from tierlm.engine import expert_state

    data = _data(6)
    d, _ = _model_dir(tmp_path)
    mode = dict(mode)
    clip, clip_path = mode.pop("clip"), mode.pop("clip_path")
    out = {}
    for tracked in (True, False):
        if not tracked:
            monkeypatch.setattr(expert_state.ExpertShards, "initial", staticmethod(lambda infos: {}))
        cfg = EngineConfig(nvme_dir=str(tmp_path / f"nvme-{tracked}"), cpu_mem="1GiB", grad_accum=2,
                           shard_elems=SHARD, pack_below=0, clip_path=clip_path, tokens_per_micro_batch=3,
                           optim=AdamWConfig(lr=LR, weight_decay=0.0, max_grad_norm=clip), **mode)
        eng = Engine.from_pretrained(d, cfg)
        try:
            results = _steps(eng, data, 2)
            out[tracked] = ({n: eng.master(n) for n in eng.names}, {n: eng.weights(n) for n in eng.names},
                            sum(r.experts["written_bytes"] for r in results),
                            sum(r.experts["shards_left_alone"] for r in results))
        finally:
            eng.close()
    assert_same(out[False][0], out[True][0])
    assert_same(out[False][1], out[True][1])
    assert out[True][3] > 0 and out[False][3] == 0
    assert out[True][2] < out[False][2]
