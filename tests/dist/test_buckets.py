"""Gradient buckets (tierlm/dist/buckets.py) and the choice of backend and device for data
parallelism (tierlm/dist/group.py), on the CPU: planning, fixed issue order whatever order the hooks
fire in, the flush at the end of backward, the same bits over gloo as the per-parameter path, and the
refusals. The GPU tests at the end run only where CUDA GPUs are visible."""
import random

import pytest
import torch

from tierlm.dist.buckets import BucketReducer, make_reducer, plan_buckets
from tierlm.dist.grads import GradReducer
from tierlm.dist.group import (DEFAULT_BUCKET_BYTES, Dist, check_gpus, check_group_backend, from_env, grad_backend,
                               rank_device)

from .test_data_parallel import ACCUM, BSZ, CLIP, SEQ, STEPS, rel
from .util import torchrun


# ---- planning ------------------------------------------------------------------------------
def test_plan_fills_each_owners_bucket_in_backward_order():
    order = ["a", "b", "c", "d", "e", "f"]
    numels = {"a": 10, "b": 10, "c": 10, "d": 30, "e": 5, "f": 10}
    owners = {"a": 0, "b": 1, "c": 0, "d": 0, "e": 1, "f": 0}
    plan = plan_buckets(order, numels, owners, bucket_bytes=25 * 4)
    got = [(b.owner, b.names, b.offsets) for b in plan]
    # owner 0: a+c fit (20 <= 25); d (30) closes it and is alone (larger than the size); f opens a
    # third. Owner 1: b+e. Issued by the position of their last parameter: c(2), d(3), e(4), f(5).
    assert got == [(0, ["a", "c"], [0, 10]), (0, ["d"], [0]), (1, ["b", "e"], [0, 10]), (0, ["f"], [0])]
    assert [b.numel for b in plan] == [20, 30, 15, 10]


def test_plan_with_no_size_is_one_parameter_a_bucket():
    order = list("abcd")
    plan = plan_buckets(order, dict.fromkeys(order, 7), dict.fromkeys(order, 0), bucket_bytes=0)
    assert [b.names for b in plan] == [["a"], ["b"], ["c"], ["d"]]


def test_plan_is_the_same_for_every_rank():
    """The plan depends on the order, sizes and owners only, which every rank shares."""
    names = [f"p{i}" for i in range(40)]
    numels = {n: (i * 7919) % 1000 + 1 for i, n in enumerate(names)}
    from tierlm.dist.group import owners_by_bytes
    owners = owners_by_bytes(numels, 3)
    a = [(b.owner, b.names) for b in plan_buckets(names, numels, owners, 2000)]
    b = [(b.owner, b.names) for b in plan_buckets(list(names), dict(numels), dict(owners), 2000)]
    assert a == b and sorted(n for _, ns in a for n in ns) == sorted(names)


# ---- the reducer on one rank ---------------------------------------------------------------
class Taken:
    """An optimizer stand-in: what the owner's optimizer is handed."""

    def __init__(self):
        self.got = {}

    def grad_ready(self, name, g):
        assert name not in self.got
        self.got[name] = g.clone()


SHAPES = {"w3": (4, 3), "b3": (4,), "w2": (3, 5), "b2": (3,), "w1": (6, 2), "emb": (9, 2)}
ORDER = list(SHAPES)  # the fixed backward order
OWNERS = {"w3": 0, "b3": 1, "w2": 1, "b2": 0, "w1": 0, "emb": 1}


def reducer(bucket_bytes=16 * 4, owners=OWNERS):
    dist = Dist(0, 1, bucket_bytes=bucket_bytes)
    dist.owners = dict(owners)
    opt = Taken()
    return BucketReducer(dist, ORDER, opt, 1 << 20, SHAPES), opt


def grads(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in SHAPES.items()}


def test_buckets_go_out_in_one_order_whatever_order_the_hooks_fire_in():
    gs = grads()
    seen = []
    for seed in range(6):
        red, opt = reducer()
        names = list(ORDER)
        random.Random(seed).shuffle(names)
        red.begin()
        for n in names:
            red.grad(n, gs[n])
        red.flush()
        seen.append(list(red.issued))
        mine = {n for n in ORDER if OWNERS[n] == 0}
        assert set(opt.got) == mine  # only the owner's sums reach its optimizer
        for n in mine:  # one rank: the sum is the gradient, in fp32, in its own shape
            assert opt.got[n].dtype == torch.float32 and torch.equal(opt.got[n], gs[n])
    assert all(s == seen[0] for s in seen) and sorted(seen[0]) == list(range(len(red.buckets)))


def test_a_full_bucket_goes_out_during_backward_and_the_rest_at_flush():
    red, opt = reducer()
    gs = grads(1, torch.bfloat16)  # bf16 gradients: summed as fp32 (exactly their values)
    red.begin()
    first = red.buckets[0]
    for n in ORDER[:ORDER.index(first.names[-1]) + 1]:
        red.grad(n, gs[n])
    assert red.issued == [0], "the first bucket waited for the end of backward"
    red.grad("emb", gs["emb"])  # out of order: waits for the cursor
    assert red.issued == [0]
    for n in ORDER[ORDER.index(first.names[-1]) + 1:-1]:
        red.grad(n, gs[n])
    red.flush()
    assert red.issued == list(range(len(red.buckets)))
    assert all(torch.equal(opt.got[n], gs[n].float()) for n in opt.got)


def test_a_parameter_without_a_gradient_is_skipped_and_its_bucket_still_goes():
    red, opt = reducer(owners=dict.fromkeys(ORDER, 0))
    gs = grads(2)
    red.begin()
    for n in ORDER:
        if n != "b2":  # no gradient on any rank (unused in the forward)
            red.grad(n, gs[n])
    red.flush()
    assert sorted(red.issued) == list(range(len(red.buckets)))
    assert set(opt.got) == set(ORDER) - {"b2"}
    # and the next micro-batch starts clean
    opt.got.clear()
    red.begin()
    for n in ORDER:
        red.grad(n, gs[n])
    red.flush()
    assert set(opt.got) == set(ORDER) and all(torch.equal(opt.got[n], gs[n]) for n in ORDER)


def test_the_cpu_path_keeps_its_per_parameter_reducer():
    dist = Dist(0, 1)
    dist.owners = dict(OWNERS)
    assert type(make_reducer(dist, ORDER, Taken(), 1 << 20, SHAPES)) is GradReducer
    dist.bucket_bytes = 1024
    assert type(make_reducer(dist, ORDER, Taken(), 1 << 20, SHAPES)) is BucketReducer


# ---- backend and device choice -------------------------------------------------------------
def test_nccl_only_for_cuda():
    assert grad_backend(torch.device("cpu")) == "gloo"
    assert grad_backend(torch.device("cuda:1")) == "nccl"
    assert grad_backend("cuda") == "nccl"


def test_each_rank_takes_the_gpu_of_its_local_rank():
    assert rank_device("cpu", 3, 4, 0) == "cpu"
    assert rank_device("cuda:0", 1, 2, 2) == "cuda:1"
    assert rank_device("cuda", 0, 1, 8) == "cuda:0"
    with pytest.raises(ValueError, match="2 ranks on this machine.*1 GPU\\(s\\) are visible.*--nproc 1"):
        rank_device("cuda:0", 0, 2, 1)


def test_launch_refuses_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="3 ranks on this machine"):
        check_gpus("cuda:0", 3)
    check_gpus("cuda:0", 1)
    check_gpus("cpu", 64)  # the CPU path has no such limit


def test_cpu_collectives_need_a_group_that_carries_host_tensors():
    for ok in ("gloo", "cpu:gloo,cuda:nccl"):
        check_group_backend("cpu", ok)
        check_group_backend("cuda:0", ok)
    with pytest.raises(ValueError, match="--device cpu with a nccl process group"):
        check_group_backend("cpu", "nccl")
    with pytest.raises(ValueError, match="cannot carry the host tensors"):
        check_group_backend("cuda:0", "nccl")


def test_from_env_keeps_the_cpu_path_per_parameter(monkeypatch):
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    d = from_env(30, "cpu", 1 << 20)
    assert d.device == torch.device("cpu") and d.bucket_bytes == 0 and d.grad_group is None
    assert DEFAULT_BUCKET_BYTES == 25 * 2**20


def test_finetune_refuses_more_ranks_than_gpus_with_exit_2(tmp_path, monkeypatch, capsys):
    from tierlm.cli import main
    from tierlm.train import finetune as ft
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ft, "resolve_device", lambda name: torch.device("cuda", 0))  # a machine with one GPU
    out = tmp_path / "run"
    assert main(["finetune", str(tmp_path / "m"), "--data", "d", "--output", str(out), "--nproc", "2",
                 "--device", "cuda", "--precision", "fp32"]) == 2
    err = capsys.readouterr().err
    assert "2 ranks on this machine" in err and "1 GPU(s) are visible" in err, err
    assert not out.exists(), "a refusal leaves nothing behind"


# ---- two ranks over gloo: buckets change no bit --------------------------------------------
def _dp_run(model_dir, out, nproc, *extra):
    """dp_worker on `nproc` ranks; extra: the device, and the bucket bytes."""
    r = torchrun(nproc, "tests/dist/dp_worker.py", model_dir, out, STEPS, ACCUM, BSZ, SEQ, CLIP, "fp32", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return [torch.load(out / f"rank{i}.pt") for i in range(nproc)]


def _same_bits(a, b):
    for ra, rb in zip(a, b):
        assert ra["masters"].keys() == rb["masters"].keys()
        assert all(torch.equal(ra["masters"][n], rb["masters"][n]) for n in ra["masters"])
        assert all(torch.equal(ra["weights"][n], rb["weights"][n]) for n in ra["weights"])
        assert str(ra["results"]) == str(rb["results"]) and str(ra["losses"]) == str(rb["losses"])  # nan too


def _close(a, b, tol):
    ma = {k: v for r in a for k, v in r["masters"].items()}
    mb = {k: v for r in b for k, v in r["masters"].items()}
    assert ma.keys() == mb.keys()
    worst = max(rel(ma[n], mb[n]) for n in mb)
    assert worst < tol, f"relative difference {worst:.2e}"


def test_bucketed_reduction_over_gloo_gives_the_per_parameter_bits(make_model_dir, tmp_path):
    model_dir, _ = make_model_dir("llama")
    per_param = _dp_run(model_dir, tmp_path / "per-param", 2)
    # 64 KiB: several buckets a rank, most holding several parameters
    bucketed = _dp_run(model_dir, tmp_path / "bucketed", 2, "cpu", 64 << 10)
    _same_bits(per_param, bucketed)


# ---- on GPUs (skipped without them) --------------------------------------------------------
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_one_rank_nccl_bucket_reduce_smoke(tmp_path):
    """A 1-rank NCCL group beside a 1-rank gloo one: the buckets go through NCCL on the GPU and the
    owner's sums come back to the host, bf16 gradients summed as fp32."""
    import torch.distributed as td
    td.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        torch.cuda.set_device(0)
        dist = Dist(0, 1, device="cuda:0", bucket_bytes=16 * 4, grad_group=td.new_group(backend="nccl"))
        dist.owners = dict.fromkeys(ORDER, 0)
        opt = Taken()
        red = BucketReducer(dist, ORDER, opt, 1 << 20, SHAPES)
        gs = grads(3, torch.bfloat16)
        for _ in range(2):
            opt.got.clear()
            red.begin()
            for n in reversed(ORDER):
                red.grad(n, gs[n].cuda())
            red.flush()
            assert set(opt.got) == set(ORDER)
            assert all(opt.got[n].device.type == "cpu" and torch.equal(opt.got[n], gs[n].float()) for n in ORDER)
    finally:
        td.destroy_process_group()


@pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")
def test_one_rank_on_a_gpu(make_model_dir, tmp_path):
    """torchrun, 1 rank on cuda:0: the engine hands its gradients to the buckets on the GPU; buckets
    or one parameter a bucket, the same bits; and near the same rank on the CPU."""
    model_dir, _ = make_model_dir("llama")
    bucketed = _dp_run(model_dir, tmp_path / "bucketed", 1, "cuda")
    _same_bits(bucketed, _dp_run(model_dir, tmp_path / "per-param", 1, "cuda", 1))
    _close(bucketed, _dp_run(model_dir, tmp_path / "cpu", 1), 1e-4)


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_two_gpus_over_nccl(make_model_dir, tmp_path):
    """2 ranks on 2 GPUs: bucketed NCCL reductions give the bits of per-parameter ones (two terms an
    element), and the run ends near where the same 2 ranks end on the CPU over gloo."""
    model_dir, _ = make_model_dir("llama")
    bucketed = _dp_run(model_dir, tmp_path / "bucketed", 2, "cuda")
    _same_bits(bucketed, _dp_run(model_dir, tmp_path / "per-param", 2, "cuda", 1))
    _close(bucketed, _dp_run(model_dir, tmp_path / "cpu", 2), 1e-4)
