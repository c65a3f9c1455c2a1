"""The GPU engine: layers compute on the GPU, the optimizer and the state stay on the CPU and NVMe.

The reference is the ordinary loop with the same split: the whole model on the GPU, its fp32
master weights and `torch.optim.AdamW` on the CPU, gradients copied down after backward. The
out-of-core engine must give the same bits. Skipped where PyTorch sees no GPU.
"""
import copy
import json
import subprocess
import sys

import pytest
import torch

from tierlm.engine.engine import Engine, EngineConfig
from tierlm.engine.optimizer import AdamWConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


def batches(n, vocab=128, bsz=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (bsz, seq), generator=g) for _ in range(n)]


def reference(model, data, *, lr, clip, accum, precision):
    model = copy.deepcopy(model).to(CUDA)
    masters = [p.detach().cpu().clone().requires_grad_(True) for p in model.parameters()]
    if precision == "bf16":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.AdamW(masters, lr=lr, weight_decay=0.1, fused=True)
    losses = []
    for s in range(len(data) // accum):
        for x in data[s * accum:(s + 1) * accum]:
            x = x.to(CUDA)
            loss = model(input_ids=x, labels=x).loss
            (loss / accum).backward()
            losses.append(loss.item())
            for p, m in zip(model.parameters(), masters):
                g = p.grad.cpu().float()
                m.grad = g if m.grad is None else m.grad + g
                p.grad = None
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, clip)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters):
                p.copy_(m.to(CUDA))
    names = [n for n, _ in model.named_parameters()]
    return dict(zip(names, [m.detach() for m in masters])), losses


def run_engine(model_dir, tmp_path, data, *, lr, clip, accum, precision, activations="keep", tag=""):
    cfg = EngineConfig(nvme_dir=str(tmp_path / f"nvme-{precision}-{activations}{tag}"), cpu_mem="1GiB",
                       precision=precision, grad_accum=accum, activations=activations, device="cuda",
                       optim=AdamWConfig(lr=lr, weight_decay=0.1, max_grad_norm=clip),
                       tokens_per_micro_batch=data[0].numel())
    eng = Engine.from_pretrained(model_dir, cfg)
    losses = []
    try:
        assert eng.device.type == "cuda"
        for s in range(len(data) // accum):
            for x in data[s * accum:(s + 1) * accum]:
                loss = eng.forward(x, labels=x).loss
                assert loss.device.type == "cuda"
                eng.backward(loss)
                losses.append(loss.item())
            eng.step()
        masters = {n: eng.master(n) for n in eng.names}
        uploaded = eng.uploads.bytes
    finally:
        eng.close()
    return masters, losses, uploaded


def assert_same(ref, got):
    for n, t in ref.items():
        assert torch.equal(got[n], t), f"{n}: max diff {(got[n].float() - t.float()).abs().max().item()}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpu_engine_equals_gpu_model_with_cpu_adamw(make_model_dir, tmp_path, arch, precision):
    model_dir, model = make_model_dir(arch)
    data = batches(4)
    kw = dict(lr=1e-2, clip=0.5, accum=2, precision=precision)
    ref_master, ref_losses = reference(model, data, **kw)
    masters, losses, uploaded = run_engine(model_dir, tmp_path, data, **kw)
    assert losses == ref_losses
    assert_same(ref_master, masters)
    assert uploaded > 0


@pytest.mark.parametrize("activations", ["recompute", "swap", "swap-host", "keep,swap,recompute"])
def test_gpu_activation_policies_do_not_change_bits(make_model_dir, tmp_path, activations):
    model_dir, _ = make_model_dir("llama")
    data = batches(3)
    kw = dict(lr=1e-2, clip=None, accum=1, precision="fp32")
    keep, keep_losses, _ = run_engine(model_dir, tmp_path, data, **kw)
    got, losses, _ = run_engine(model_dir, tmp_path, data, activations=activations, tag="b", **kw)
    assert losses == keep_losses
    assert_same(keep, got)


def test_gpu_budget_names_gpu_mem(make_model_dir, tmp_path):
    from tierlm.storage import BudgetError

    model_dir, _ = make_model_dir("llama")
    with pytest.raises(BudgetError, match="--gpu-mem"):
        Engine.from_pretrained(model_dir, EngineConfig(nvme_dir=str(tmp_path / "n"), cpu_mem="1GiB",
                                                       device="cuda", gpu_mem="64MiB"))


def test_finetune_cli_on_gpu(tmp_path):
    """The whole loop on the GPU in a subprocess: steps, the final model, a sample from it, and the
    in-memory reference (bench train's) with the same losses."""
    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config

    model_dir = tmp_path / "qwen"
    init_model(model_dir, make_config("qwen2", None, {"layers": 2, "hidden": 64}))
    data = tmp_path / "data.txt"
    data.write_text(" ".join(f"word{i % 37} and number {i}." for i in range(3000)))
    common = [str(model_dir), "--data", str(data), "--steps", "3", "--seq-len", "64", "--batch-size", "2",
              "--precision", "fp32", "--device", "cuda", "--max-grad-norm", "0", "--lr", "1e-3"]
    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "tierlm", "finetune", *common, "--output", str(run),
                    "--cpu-mem", "512MiB", "--sample-prompt", "word1 and", "--sample-tokens", "8"], check=True)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["peak_gpu_bytes"] > 0
    # the pinned window is host memory within the budget, as on the CPU
    assert summary["peak_rss_bytes"] - summary["library_rss_bytes"] <= 512 << 20
    assert isinstance(summary["sample"], str)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    out = tmp_path / "inmemory.json"
    subprocess.run([sys.executable, "-m", "tierlm.train.inmemory", *common, "--json", str(out)], check=True)
    mem = json.loads(out.read_text())
    # the reference's AdamW runs on the GPU (a different kernel): the first step's loss is
    # the same bits, later ones agree to rounding
    got, ref = [r["loss"] for r in rows], [r["loss"] for r in mem["rows"]]
    assert got[0] == ref[0]
    assert got == pytest.approx(ref, rel=1e-4)
    assert (run / "timeline.json").exists()
