"""The in-memory reference: the same recipe as `tierlm finetune`, in plain PyTorch.

bf16 (or fp32) weights and compute, fp32 master weights, `torch.optim.AdamW` with the same kernel,
`LambdaLR` with the same schedule, `clip_grad_norm_`, the same data in the same order. What
`tierlm bench train` runs beside the out-of-core step; on the CPU its losses equal the out-of-core
run's bit for bit, so the comparison is of the same computation. With `--device cuda` everything
(master weights and AdamW too) is on the GPU, as a user would run it: the first step's loss is the
same bits, later ones differ by the GPU AdamW kernel's rounding.

    python -m tierlm.train.inmemory MODEL --data FILE --steps 3 [finetune options] --json OUT
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from ..bench.cpu_time import CpuClock
from ..config import add_arguments, from_args
from ..hf import checks  # called through the module: tests replace its checks
from ..hf.structure import causal_lm, kept_fp32
from ..rss import peak_rss
from .data import Batches, load_dataset
from .finetune import FinetuneConfig, _resolve
from .progress import use_bar
from .schedule import lr_factor


def reference_batches(cfg) -> tuple[Batches, int]:
    """The batches `tierlm finetune` would train on, in its order, and its number of steps (also
    what the DeepSpeed peer trains on); seeds torch as the fine-tune does."""
    tokenizer = checks.load_tokenizer(cfg.model)
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len)
    batches = Batches(dataset, cfg.batch_size, seed=cfg.seed)
    total = cfg.steps if cfg.steps is not None else \
        max(1, math.floor(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    torch.manual_seed(cfg.seed)
    return batches, total


def run(cfg) -> dict:
    from transformers import AutoModelForCausalLM

    batches, total = reference_batches(cfg)
    device = torch.device(cfg.device)
    from transformers.utils import logging as hf_logging

    if not use_bar(sys.stderr):  # transformers' "Loading weights" bar: frames in a redirected log
        hf_logging.disable_progress_bar()
    model = causal_lm(AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)).to(device)
    model.train()
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    if cfg.precision == "bf16":
        # weights only: buffers (rotary frequencies) stay fp32, and so do what transformers keeps in
        # fp32 in a bf16 model (a mixture's routers), as tierlm's engine does
        kept = kept_fp32(model, torch.bfloat16)
        for n, p in model.named_parameters():
            if n not in kept:
                p.data = p.data.to(torch.bfloat16)
    flags = {"fused": dict(fused=True), "foreach": dict(foreach=True), "single": dict(foreach=False)}[cfg.optim_impl]
    opt = torch.optim.AdamW(masters, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, **flags)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg.schedule, cfg.warmup_steps, total))
    params = list(model.parameters())
    rows = []
    clock = CpuClock()  # the same per-thread counters as the out-of-core run's cpu_s
    for step in range(total):
        clock.lap()
        t0 = time.perf_counter()
        losses = []
        for _ in range(cfg.grad_accum):
            ids, labels = next(batches)
            ids, labels = ids.to(device), labels.to(device)
            loss = model(input_ids=ids, labels=labels, use_cache=False).loss
            (loss / cfg.grad_accum).backward()
            losses.append(loss.item())
            for p, m in zip(params, masters):
                g = p.grad if p.grad.dtype == torch.float32 else p.grad.float()
                m.grad = g if m.grad is None else m.grad + g
                p.grad = None
        norm = torch.nn.utils.clip_grad_norm_(masters, cfg.max_grad_norm) if cfg.max_grad_norm else None
        opt.step()
        sched.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        rows.append({"step": step + 1, "loss": sum(losses) / len(losses), "s_per_step": time.perf_counter() - t0,
                     "grad_norm": float(norm) if norm is not None else None, "cpu_s": clock.lap()})
    return {"rows": rows, "peak_rss_bytes": peak_rss(),
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m tierlm.train.inmemory")
    add_arguments(ap, FinetuneConfig, positional=("model",))
    ap.add_argument("--json", dest="_json", required=True)
    args = ap.parse_args(argv)
    json_path = args._json
    del args._json
    try:
        cfg = _resolve(from_args(FinetuneConfig, args))
        out = run(cfg)
    except ValueError as e:  # bad input (model directory, data, settings): its message names the fix
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    with open(json_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
