"""DeepSpeed as a measured peer: ZeRO-3 with parameters and optimizer states offloaded to NVMe.

The same recipe as `tierlm finetune` and the in-memory reference (`tierlm.train.inmemory`): the same
data loaded and packed the same way, in the same order, bf16 compute with fp32 master weights,
AdamW with the same lr, betas, eps, weight decay and schedule, the same gradient clipping. What
differs is who moves the bytes: DeepSpeed's ZeRO-Infinity (stage 3, `offload_param` and
`offload_optimizer` to a folder on the drive, read and written by its async_io op) and its own
CPU AdamW (the cpu_adam op). `tierlm bench train` runs it as a process of its own beside the other
two when DeepSpeed is importable; tierlm never needs it.

On a CPU-only machine it runs as one process: DS_ACCELERATOR=cpu, torch.distributed over gloo.
async_io needs libaio's headers to build (Debian: libaio-dev); where it cannot build, `--offload
auto` falls back to `cpu` (states in RAM) and the output says so: a CPU-offload figure is never an
NVMe one.

    python -m tierlm.train.peer_deepspeed MODEL --data FILE --steps 8 --batch-size 4 --seq-len 512 \\
        --nvme DIR --json OUT [--offload auto|nvme|cpu] [finetune options]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from ..config import add_arguments, from_args
from ..hf.structure import causal_lm
from ..rss import peak_rss
from .finetune import FinetuneConfig, _resolve
from .inmemory import reference_batches
from .schedule import lr_factor

OFFLOADS = ("auto", "nvme", "cpu")


def tuning_defaults() -> dict:
    """The async I/O and buffer settings used unless flags say otherwise.

    aio: 1 MiB blocks, queue depth 8 and 2 I/O threads per request (on 2 cores more threads only
    compete with the compute; DeepSpeed's default is 1). pin_memory off: its CPU accelerator pins
    nothing (torch cannot page-lock without a device), so `true` changes no byte moved. Buffers:
    DeepSpeed's defaults (5 parameter buffers, 4 optimizer buffers)."""
    return {"aio_block_size": 1 << 20, "aio_queue_depth": 8, "aio_threads": 2,
            "param_buffers": 16, "optim_buffers": 4, "pin_memory": False, "reuse_distance": 0}


def ds_config(cfg, offload: str, swap_dir: str, largest_numel: int, tune: dict) -> dict:
    """The DeepSpeed config of one run: ZeRO-3, parameters and optimizer offloaded to `offload`
    (nvme: files under swap_dir), bf16, AdamW as `cfg` sets it."""
    def where(extra: dict) -> dict:
        if offload != "nvme":
            return {"device": "cpu", "pin_memory": tune["pin_memory"]}
        return {"device": "nvme", "nvme_path": swap_dir, "pin_memory": tune["pin_memory"], **extra}

    # a parameter buffer holds the largest tensor whole (the embedding or the head); 1 MiB-aligned
    buffer = max(largest_numel, 1 << 20)
    buffer = -(-buffer // (1 << 20)) * (1 << 20)
    conf = {
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.max_grad_norm or 0.0,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": cfg.precision == "bf16"},
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": [cfg.beta1, cfg.beta2], "eps": cfg.eps,
                                                  "weight_decay": cfg.weight_decay}},
        "zero_optimization": {
            "stage": 3,
            # max_in_cpu 0: every parameter lives on the drive (DeepSpeed's default keeps up to 1e9
            # elements in RAM as well, which for a model this size is all of it: a CPU offload)
            "offload_param": where({"buffer_count": tune["param_buffers"], "buffer_size": buffer, "max_in_cpu": 0}),
            "offload_optimizer": where({"buffer_count": tune["optim_buffers"]}),
            "overlap_comm": False,  # one process: nothing to overlap the (local) collectives with
            "contiguous_gradients": True,
            "reduce_bucket_size": buffer,
            "stage3_prefetch_bucket_size": buffer,
            "stage3_param_persistence_threshold": 0,  # every tensor offloaded, as tierlm offloads them
            # a gathered parameter read from the drive holds a swap buffer until it is released: kept
            # for reuse (DeepSpeed's default distance, 1e9, keeps them all), the buffers run out
            # ("Not enough swap in buffers 0 for 1 params") after the first step
            "stage3_max_reuse_distance": tune["reuse_distance"],
            "stage3_max_live_parameters": tune["param_buffers"] * buffer,
            "sub_group_size": buffer,
        },
    }
    if offload == "nvme":
        conf["aio"] = {"block_size": tune["aio_block_size"], "queue_depth": tune["aio_queue_depth"],
                       "intra_op_parallelism": tune["aio_threads"], "single_submit": False,
                       "overlap_events": True}
    return conf


def _single_process(device: str) -> None:
    """One rank of one, before deepspeed is imported (it reads DS_ACCELERATOR at import)."""
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_SIZE", "1"),
                       ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000))):
        os.environ.setdefault(key, value)


def resolve_offload(offload: str) -> tuple[str, str]:
    """(nvme | cpu, why): `auto` is nvme where DeepSpeed's async_io op can be built here."""
    if offload not in OFFLOADS:
        raise ValueError(f"--offload must be one of {', '.join(OFFLOADS)}; got {offload!r}")
    if offload != "auto":
        return offload, f"--offload {offload}"
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return "nvme", "--offload auto: DeepSpeed's async_io op builds here"
    return "cpu", ("--offload auto: DeepSpeed's async_io op cannot be built here (libaio's headers: Debian's "
                   "libaio-dev); parameters and optimizer states offloaded to CPU RAM, not NVMe")


def _model(cfg):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return causal_lm(AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32))


def _engine(cfg, offload: str, swap_dir: Path, tune: dict, total: int):
    import deepspeed

    model = _model(cfg)
    model.train()
    largest = max(p.numel() for p in model.parameters())
    conf = ds_config(cfg, offload, str(swap_dir), largest, tune)
    deepspeed.init_distributed(dist_backend="gloo" if cfg.device == "cpu" else None, verbose=False)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=conf,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_factor(cfg.schedule, cfg.warmup_steps, total)))
    return engine, conf


def run(cfg, offload: str = "auto", tune: dict | None = None) -> dict:
    tune = {**tuning_defaults(), **(tune or {})}
    _single_process(cfg.device)
    import deepspeed

    offload, why = resolve_offload(offload)
    print(f"peer: DeepSpeed {deepspeed.__version__} ZeRO-3, offload {offload} ({why})", file=sys.stderr)
    batches, total = reference_batches(cfg)
    swap_dir = Path(cfg.nvme) / "deepspeed-swap"
    shutil.rmtree(swap_dir, ignore_errors=True)
    swap_dir.mkdir(parents=True)
    try:
        engine, conf = _engine(cfg, offload, swap_dir, tune, total)
        rows = _steps(engine, batches, cfg, total)
        swapped = _du(swap_dir)
    finally:
        shutil.rmtree(swap_dir, ignore_errors=True)
    return {"rows": rows, "peak_rss_bytes": peak_rss(), "offload": offload, "offload_why": why,
            "deepspeed_version": deepspeed.__version__, "swap_bytes": swapped, "tuning": tune, "ds_config": conf}


def _steps(engine, batches, cfg, total: int) -> list[dict]:
    device = engine.device
    rows = []
    for step in range(total):
        t0 = time.perf_counter()
        losses = []
        for _ in range(cfg.grad_accum):
            ids, labels = next(batches)
            loss = engine(input_ids=ids.to(device), labels=labels.to(device), use_cache=False).loss
            engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps itself
            engine.step()          # the optimizer steps at the accumulation boundary only
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        rows.append({"step": step + 1, "loss": sum(losses) / len(losses), "s_per_step": time.perf_counter() - t0,
                     "grad_norm": float(norm) if norm is not None else None})
        print(f"peer: step {step + 1}/{total} loss {rows[-1]['loss']:.4f} {rows[-1]['s_per_step']:.2f} s",
              file=sys.stderr)
    return rows


def _du(path: Path) -> int:
    """Bytes of the files DeepSpeed swapped to (the offloaded state's size on the drive)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m tierlm.train.peer_deepspeed")
    add_arguments(ap, FinetuneConfig, positional=("model",))
    ap.add_argument("--json", dest="_json", required=True, help="write the steps and peak RSS here")
    ap.add_argument("--offload", dest="_offload", default="auto", choices=OFFLOADS,
                    help="where ZeRO-3 puts parameters and optimizer states (auto: nvme where async_io builds)")
    d = tuning_defaults()
    ap.add_argument("--aio-block-size", dest="_aio_block_size", type=int, default=d["aio_block_size"])
    ap.add_argument("--aio-queue-depth", dest="_aio_queue_depth", type=int, default=d["aio_queue_depth"])
    ap.add_argument("--aio-threads", dest="_aio_threads", type=int, default=d["aio_threads"])
    ap.add_argument("--param-buffers", dest="_param_buffers", type=int, default=d["param_buffers"])
    ap.add_argument("--optim-buffers", dest="_optim_buffers", type=int, default=d["optim_buffers"])
    ap.add_argument("--reuse-distance", dest="_reuse_distance", type=int, default=d["reuse_distance"],
                    help="stage3_max_reuse_distance (elements)")
    ap.add_argument("--pin-memory", dest="_pin_memory", action=argparse.BooleanOptionalAction,
                    default=d["pin_memory"])
    return ap


def main(argv=None) -> None:
    ap = _parser()
    args = ap.parse_args(argv)
    tune = {k: getattr(args, "_" + k) for k in tuning_defaults()}
    ours = {k: getattr(args, k) for k in ("_json", "_offload")}
    for k in [*ours, *("_" + k for k in tune)]:
        delattr(args, k)
    try:
        cfg = _resolve(from_args(FinetuneConfig, args))
        out = run(cfg, ours["_offload"], tune)
    except ValueError as e:  # bad input (model directory, data, settings): its message names the fix
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    with open(ours["_json"], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
