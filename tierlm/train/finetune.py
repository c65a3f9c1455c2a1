"""The fine-tuning loop: data, steps, metrics, the final model. `tierlm finetune` calls `finetune`."""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import option, to_dict
from ..units import parse_bytes
from .progress import Progress
from .schedule import SCHEDULES, lr_at


@dataclass
class FinetuneConfig:
    model: str = option(help="Hugging Face model directory (config.json, safetensors, tokenizer)")
    data: str = option(help="training data: a .jsonl file (text | prompt+completion | messages), a text file, or a folder")
    output: str | None = option(None, help="run directory (config, metrics.jsonl, final model); default runs/finetune-<time>")
    nvme: str | None = option(None, help="directory on the SSD for weights and optimizer states; default <output>/nvme")
    cpu_mem: str = option("4GiB", help="RAM the run may use beyond the torch import", metavar="SIZE")
    precision: str = option("bf16", help="bf16: bf16 compute + fp32 master weights; fp32: all fp32", choices=("bf16", "fp32"))
    seq_len: int = option(512, help="tokens per packed training row")
    batch_size: int = option(1, help="rows per micro-batch")
    grad_accum: int = option(1, help="micro-batches per optimizer step")
    steps: int | None = option(None, help="optimizer steps (default: --epochs over the data)")
    epochs: float = option(1.0, help="passes over the data when --steps is not given")
    lr: float = option(1e-5, help="peak learning rate")
    schedule: str = option("constant", help="learning-rate schedule after warm-up", choices=SCHEDULES)
    warmup_steps: int = option(0, help="linear warm-up steps from 0")
    weight_decay: float = option(0.0, help="AdamW decoupled weight decay")
    beta1: float = option(0.9, help="AdamW beta1")
    beta2: float = option(0.999, help="AdamW beta2")
    eps: float = option(1e-8, help="AdamW epsilon")
    max_grad_norm: float | None = option(1.0, help="clip the global gradient norm to this (exact); 0 disables")
    optim_impl: str = option("fused", help="torch AdamW kernel the update uses", choices=("fused", "foreach", "single"))
    activations: str = option("auto", help="keep activations in RAM, recompute them, or auto (keep while the budget allows)",
                              choices=("auto", "keep", "recompute"))
    prefetch: int = option(2, help="layers read ahead of the one computing")
    seed: int = option(0, help="seed for data order and dropout")
    save_dtype: str | None = option(None, help="dtype of the saved model (default: the compute dtype)", choices=("bf16", "fp32"))
    sample_prompt: str | None = option(None, help="generate from this prompt with the fine-tuned model at the end")
    sample_tokens: int = option(40, help="tokens to generate for --sample-prompt")
    sample_temperature: float = option(0.0, help="sampling temperature for --sample-prompt (0: greedy)")
    direct_io: bool | None = option(None, help="force direct I/O on or off (default: where the file system allows)")
    resume: bool = option(False, help="continue from the state in --nvme instead of starting over")


def _resolve(cfg: FinetuneConfig) -> FinetuneConfig:
    if cfg.output is None:
        cfg.output = str(Path("runs") / time.strftime("finetune-%Y%m%d-%H%M%S"))
    if cfg.nvme is None:
        cfg.nvme = str(Path(cfg.output) / "nvme")
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        cfg.max_grad_norm = None
    for name in ("seq_len", "batch_size", "grad_accum"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    parse_bytes(cfg.cpu_mem, "--cpu-mem")
    return cfg


def finetune(cfg: FinetuneConfig | None = None, **options) -> dict:
    """Fine-tune every parameter of `cfg.model` out-of-core; returns the run summary.

    Accepts a FinetuneConfig or the same options as keywords: finetune(model=..., data=..., cpu_mem="4GiB").
    """
    from ..config import build
    from ..engine.engine import Engine, EngineConfig
    from ..engine.optimizer import AdamWConfig
    from ..hf.checks import check_model_dir, load_tokenizer
    from .data import Batches, load_dataset

    if cfg is None:
        cfg = build(FinetuneConfig, options, source="finetune() arguments")
    cfg = _resolve(cfg)
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    check_model_dir(cfg.model)
    from transformers import AutoConfig
    from ..engine.budget import library_baseline
    library_rss = library_baseline(AutoConfig.from_pretrained(cfg.model),
                                   torch.bfloat16 if cfg.precision == "bf16" else torch.float32)
    tokenizer = load_tokenizer(cfg.model)
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len)
    batches = Batches(dataset, cfg.batch_size, seed=cfg.seed)
    per_step = cfg.grad_accum
    total = cfg.steps if cfg.steps is not None else max(1, math.floor(cfg.epochs * batches.batches_per_epoch / per_step))
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")

    torch.manual_seed(cfg.seed)
    optim = AdamWConfig(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, impl=cfg.optim_impl)
    ecfg = EngineConfig(nvme_dir=cfg.nvme, cpu_mem=cfg.cpu_mem, precision=cfg.precision,
                        grad_accum=cfg.grad_accum, activations=cfg.activations, prefetch=cfg.prefetch,
                        direct_io=cfg.direct_io, optim=optim,
                        tokens_per_micro_batch=cfg.batch_size * cfg.seq_len)
    engine = Engine.from_pretrained(cfg.model, ecfg, resume=cfg.resume, library_rss=library_rss)
    start = engine.state["step"] if cfg.resume else 0
    if cfg.resume and "data" in engine.state:
        batches.load_state_dict(engine.state["data"])
    progress = Progress(total, start, engine, cfg, out / "metrics.jsonl", dataset.summary())
    try:
        for step in range(start, total):
            t0 = time.perf_counter()
            io0 = engine.store.stats.snapshot()
            lr = lr_at(cfg.lr, cfg.schedule, cfg.warmup_steps, total, step)
            engine.set_lr(lr)
            losses, tokens = [], 0
            for _ in range(cfg.grad_accum):
                ids, labels = next(batches)
                loss = engine.forward(ids, labels=labels).loss
                engine.backward(loss)
                losses.append(loss.item())
                tokens += ids.numel()
            engine.state["data"] = batches.state_dict()  # committed with the step
            res = engine.step()
            progress.step(step, sum(losses) / len(losses), lr, res, tokens, time.perf_counter() - t0, io0)
        progress.close()
        save_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.save_dtype or "", None)
        final = engine.save_pretrained(out / "final", dtype=save_dtype)
        summary = progress.summary(final)
        if cfg.sample_prompt:
            from ..infer.generate import generate
            summary["sample"] = generate(engine, tokenizer, cfg.sample_prompt, cfg.sample_tokens,
                                         cfg.sample_temperature, seed=cfg.seed)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        progress.close()
        engine.close()
