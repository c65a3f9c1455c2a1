"""The fine-tuning loop: data, steps, metrics, the final model. `tierlm finetune` calls `finetune`."""
from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# No torch at import (nor modules that import it): the command line builds its flags from
# FinetuneConfig, and `tierlm finetune --help` answers without torch's seconds; the run imports it.
from ..config import check, to_dict
from ..faults import fault
from ..units import count
from .options import FinetuneConfig
from .schedule import lr_at


def _resolve(cfg: FinetuneConfig) -> FinetuneConfig:
    if cfg.output is None:
        cfg.output = str(Path("runs") / time.strftime("finetune-%Y%m%d-%H%M%S"))
    if cfg.nvme is None:
        cfg.nvme = str(Path(cfg.output) / "nvme")
    # a config made in Python (FinetuneConfig(...)) skipped build()'s range checks; before anything is written
    check(cfg)
    if cfg.max_grad_norm is not None and cfg.max_grad_norm <= 0:
        cfg.max_grad_norm = None
    from ..engine.device import resolve_device
    cfg.device = str(resolve_device(cfg.device))
    if cfg.precision == "auto":
        saved = _saved_precision(cfg)
        if saved:
            cfg.precision_reason = f"--precision auto: a resumed run keeps the precision its state was made in ({saved})"
        cfg.precision = saved or _auto_precision(cfg)
    elif not hasattr(cfg, "precision_reason"):  # resolved once already keeps its reason (not an option: an attribute)
        cfg.precision_reason = f"--precision {cfg.precision}"
    return cfg


def _saved_precision(cfg: FinetuneConfig) -> str | None:
    """A resumed run keeps the precision its state was made in (the state's fingerprint has it)."""
    if cfg.resume != "auto":
        return None
    from ..storage.commit import list_manifests, read_manifest
    for root in (Path(cfg.nvme), Path(cfg.nvme) / "rank0"):
        for m in list_manifests(root):
            try:
                return read_manifest(m)["fingerprint"]["precision"]
            except (KeyError, TypeError, ValueError, OSError, RuntimeError):  # a damaged manifest: the next
                continue
    return None


def _auto_precision(cfg: FinetuneConfig) -> str:
    """From the CPU's ISA flags or the GPU's capability, never timed; summary.json records why."""
    from ..precision import resolve
    chosen, why = resolve("auto", cfg.device)
    print(why, file=sys.stderr)
    cfg.precision_reason = why
    return chosen


def _save_timeline(tl, out: Path, step: int, end: float, progress) -> None:
    """The step's timeline to [its start, `end`]: the window of its s/step (its log line and metrics
    row), so the picture's title, axis and lane shares are that step's numbers. Called after the
    step, outside its time."""
    from ..engine.timeline import fmt_share
    tl.stop(end)
    dt, stall = tl.span_s(), tl.stall_s()
    tl.save_chrome(out / "timeline.json")
    tl.save_png_in_child(out / "timeline.json", out / "timeline.png",
                         title=f"step {step}: {dt:.2f} s, compute waited {stall:.2f} s on I/O")
    progress.bar.write(f"timeline of step {step} ({dt:.2f} s): {out / 'timeline.json'} (Perfetto), "
                       f"{out / 'timeline.png'}; busy: "
                       + ", ".join(f"{k} {fmt_share(v)}" for k, v in tl.lane_shares().items())
                       + f"; compute stalled {fmt_share(stall / dt)} of the step")


class TrainingStopped(RuntimeError):
    """The run cannot go on (repeated non-finite steps); the committed state is intact."""


def finetune(cfg: FinetuneConfig | None = None, **options) -> dict:
    """Fine-tune every parameter of `cfg.model` out-of-core; returns the run summary.

    Accepts a FinetuneConfig or the same options as keywords: finetune(model=..., data=..., cpu_mem="4GiB").
    """
    from ..config import build

    if cfg is None:
        cfg = build(FinetuneConfig, options, source="finetune() arguments")
    cfg = _resolve(cfg)
    out = Path(cfg.output)
    from .rundir import created_by_us, undo_refused
    created = created_by_us(out, cfg.nvme)  # what a refusal removes again, before mkdir makes it exist
    out.mkdir(parents=True, exist_ok=True)
    from ..dist import from_env
    dist = from_env(cfg.dist_timeout)
    if dist is not None:
        # Ranks started by torchrun directly measured on their own: they must have chosen alike.
        dist.same_on_all(int(cfg.precision == "bf16"), "--precision (pass it explicitly)")
    from .rundir import RunLock
    lock = RunLock(out) if dist is None or dist.rank == 0 else None
    try:
        return _run(cfg, out, dist)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        # Refused (bad data, a budget too small, the model's positions: what exits 2) before a step
        # was recorded: the directories this call made go again, so the refusal leaves nothing
        # behind. A failure (a disk error, an interrupt) or anything after a step keeps them: its
        # message may point at the state, and --resume auto continues from it.
        from ..storage import BudgetError
        if dist is None and (isinstance(e, BudgetError) or not isinstance(e, RuntimeError)):
            undo_refused(out, created)
        raise
    finally:
        if lock:
            lock.release()
        if dist:
            dist.close()


def _run(cfg: FinetuneConfig, out: Path, dist=None) -> dict:
    import torch
    from transformers import AutoConfig

    from ..engine.baseline import warm_kernels
    from ..hf.baseline import library_baseline
    from ..bench import rates
    from ..engine.engine import Engine, EngineConfig
    from ..engine.optimizer import AdamWConfig
    from ..hf.checks import check_model_dir, load_tokenizer
    from ..hf.presets import param_count
    from .data import Batches, load_dataset
    from .progress import Progress
    from .rundir import RESULT_OPTIONS, check_nvme, config_diff, rng_state, set_rng_state, truncate_metrics

    check_model_dir(cfg.model)
    if dist is None and any((Path(cfg.nvme) / "rank0").glob("manifest-*.json")):
        raise ValueError(f"--nvme {cfg.nvme} holds a data-parallel run's state (rank folders); continue it "
                         f"with --nproc N --resume auto (any N, 1 included), or choose another --nvme")
    hf_config = AutoConfig.from_pretrained(cfg.model)
    max_pos = getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)
    if max_pos and cfg.seq_len > max_pos:
        raise ValueError(f"--seq-len {cfg.seq_len} is beyond the {max_pos} positions of {cfg.model}; "
                         f"use --seq-len {max_pos} or less")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    library_rss = library_baseline(hf_config, dtype, cfg.device, warm=lambda: warm_kernels(
        hf_config, dtype, cfg.device, (cfg.batch_size, cfg.seq_len)))
    tokenizer = load_tokenizer(cfg.model)
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len)
    batches = Batches(dataset, cfg.batch_size, seed=cfg.seed)
    total = cfg.steps if cfg.steps is not None else \
        max(1, math.floor(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    from ..engine.state_quant import moment_bytes_per_param
    # two slots of master, m, v and weights, and the saved gradients
    wbytes = 2 if cfg.precision == "bf16" else 0
    per_param = 2 * (4 + moment_bytes_per_param(cfg.optim_states) + wbytes) + 4
    nvme = cfg.nvme
    lead = dist is None or dist.rank == 0  # prints progress, writes the metrics, summary and final model
    if dist is not None:
        from ..dist.state import rank_dir
        nvme = str(rank_dir(cfg.nvme, dist.rank))
        per_param = per_param / dist.world + 2 * max(wbytes, 4)  # a share, and all working weights
    check_nvme(nvme, int(per_param * param_count(hf_config)))

    optim = AdamWConfig(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, impl=cfg.optim_impl)
    ecfg = EngineConfig(nvme_dir=nvme, cpu_mem=cfg.cpu_mem, precision=cfg.precision,
                        grad_accum=cfg.grad_accum, activations=cfg.activations, prefetch=cfg.prefetch,
                        direct_io=cfg.direct_io, optim=optim, optim_states=cfg.optim_states,
                        device=cfg.device, gpu_mem=cfg.gpu_mem,
                        tokens_per_micro_batch=cfg.batch_size * cfg.seq_len, micro_batch_size=cfg.batch_size,
                        plan_path=str(out / ("plan.json" if lead else f"plan-rank{dist.rank}.json")))
    engine = Engine.from_pretrained(cfg.model, ecfg, resume=cfg.resume == "auto", overwrite=cfg.overwrite,
                                    measured=rates.measured(nvme), library_rss=library_rss, dist=dist)
    if dist is not None:
        dist.same_on_all(engine.state["step"], "step to resume from")
    settings = {k: v for k, v in to_dict(cfg).items() if k in RESULT_OPTIONS}
    metrics_name = "metrics.jsonl" if dist is None or dist.rank == 0 else f"metrics-rank{dist.rank}.jsonl"
    trainer = engine.state.get("trainer")
    start = engine.state["step"]
    for fb in engine.fallbacks:
        print(f"resume: passed over {fb}", file=sys.stderr)
    if trainer:
        diff = config_diff(trainer["settings"], settings)
        if diff and not cfg.allow_config_change:
            engine.close()
            raise ValueError("the run in --nvme was made with other options that change results: "
                             + "; ".join(diff) + ". Use the run's options, or --allow-config-change")
        batches.load_state_dict(trainer["data"])
        set_rng_state(trainer["rng"])
        truncate_metrics(out / metrics_name, start)
        if lead:
            # "at step N" left open whether N was done or next: the state holds N steps, the next is N+1
            then = f"continuing with step {start + 1} of {total}" if start < total else "no steps are left"
            print(f"resumed after step {start} (the last committed, in {engine.root}); {then}", file=sys.stderr)
    else:
        torch.manual_seed(cfg.seed)
    if lead:
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        (out / "settings.json").write_text(json.dumps(engine.settings_record(), indent=2) + "\n")
        progress = Progress(total, start, engine, cfg, out / metrics_name, dataset.summary(), fresh=not trainer)
    else:
        from .rank_progress import RankProgress
        progress = RankProgress(total, start, engine, cfg, out / metrics_name, fresh=not trainer)
    bad_streak = trainer["bad_streak"] if trainer else 0
    # What exists now (the model's modules, the tokenised data, the libraries' objects) lives for
    # the whole run: out of the collector's sight until the run ends, a full collection no longer
    # walks it. Walking it held the GIL 0.1-0.22 s each time, the I/O and optimizer threads stalled
    # behind it (docs/benchmarks.md at a2b1c1e, "Full collections").
    gc.freeze()
    try:
        # A step's time and bytes run from the end of the one before (its commit included: the
        # commit's writes land during this step's forward) to this one's end; drawing a timeline,
        # writing a checkpoint and the activation planner's one-off drive probe are left out.
        t0, io0 = time.perf_counter(), engine.store.stats.snapshot()
        for step in range(start, total):
            if cfg.timeline_step and lead and step + 1 == cfg.timeline_step:
                engine.timeline.start(origin=t0)  # the step's window, the same as its s/step
            lr = lr_at(cfg.lr, cfg.schedule, cfg.warmup_steps, total, step)
            engine.set_lr(lr)
            losses, tokens = [], 0
            for micro in range(cfg.grad_accum):
                ids, labels = next(batches)
                tokens += ids.numel()
                weight = 1.0
                if dist is not None:  # this rank's rows of the global batch
                    from ..dist.data import split_batch
                    ids, labels, weight = split_batch(dist, ids, labels)
                loss = engine.forward(ids, labels=labels).loss
                if dist is not None:
                    loss = loss * weight
                if fault("loss") == "nan":
                    loss = loss * float("nan")
                if dist is None and micro == cfg.grad_accum - 1 and step + 1 < total:
                    # the next step's first lookup takes its rows from this update (next_rows)
                    engine.expect(batches.peek()[0])
                engine.backward(loss)
                losses.append(loss.item())
            if dist is not None:
                from ..dist.data import global_losses
                losses = global_losses(dist, losses)
            res = engine.finish()
            bad_streak = 0 if res.finite else bad_streak + 1
            engine.state["trainer"] = {"settings": settings, "data": batches.state_dict(),
                                       "rng": rng_state(), "bad_streak": bad_streak}
            # The metrics row goes first: a crash before the commit leaves a row that resume drops.
            now, io = time.perf_counter(), engine.store.stats.snapshot()
            progress.step(step, sum(losses) / len(losses), lr, res, tokens, now - t0, io0, io)
            t0, io0 = now, io
            probed = engine.acts.measure_s
            engine.commit()
            off = time.perf_counter()
            if engine.timeline.recording:
                _save_timeline(engine.timeline, out, step + 1, now, progress)
            if bad_streak >= cfg.max_bad_steps:
                raise TrainingStopped(
                    f"{count(bad_streak, 'consecutive step')} had non-finite loss or gradients (steps "
                    f"{step + 2 - bad_streak}..{step + 1}, each skipped); the state of step "
                    f"{step + 1 - bad_streak} is intact in {engine.root}. Lower --lr or check the data, "
                    f"then --resume auto")
            if cfg.save_every and (step + 1) % cfg.save_every == 0:
                engine.checkpoint(f"step-{step + 1:08d}")
            t0 += time.perf_counter() - off + (engine.acts.measure_s - probed)
        progress.close()
        if not lead:
            return dict(progress.summary(None), final_model=None)
        engine.release_step_memory()
        save_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.save_dtype or "", None)
        final = engine.save_pretrained(out / "final", dtype=save_dtype)
        summary = progress.summary(final)
        # config.json holds the options (it loads as --config); why this precision is beside the result
        summary["precision"] = cfg.precision
        summary["precision_reason"] = getattr(cfg, "precision_reason", f"--precision {cfg.precision}")
        if cfg.sample_prompt:
            from ..infer.sampling import generate
            summary["sample"] = generate(engine, tokenizer, cfg.sample_prompt, cfg.sample_tokens,
                                         cfg.sample_temperature, seed=cfg.seed)
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        progress.close()
        engine.close()
        gc.unfreeze()  # a caller's objects (the Python API, the tests) are collected as before
