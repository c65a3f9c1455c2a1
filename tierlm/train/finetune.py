"""The fine-tuning loop: data, steps, metrics, the final model. `tierlm finetune` calls `finetune`."""
from __future__ import annotations

import gc
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

# torch at import: the command line builds its flags from train/options.py, which has none, and
# imports this module only when a run starts.
from ..bench import rates
from ..bench.cpu_time import describe as describe_cpu
from ..config import build, check, to_dict
from ..dist import from_env
from ..dist.data import global_losses, split_batch
from ..dist.state import rank_dir
from ..engine.baseline import warm_kernels
from ..engine.device import resolve_device
from ..engine.commit_schedule import AUTO_AFTER
from ..engine.engine import Engine, EngineConfig
from ..engine.optimizer import AdamWConfig
from ..engine.timeline import fmt_share
from ..faults import fault
from ..hf import checks, fields  # checks called through the module: tests replace them
from ..hf.baseline import library_baseline
from ..hf.presets import param_count
from ..infer.sampling import generate
from ..plan.budget import moment_bytes_per_param
from ..precision import resolve
from ..storage import BudgetError
from ..storage.commit import list_manifests, read_manifest
from ..units import count, parse_bytes
from .data import Batches, load_dataset
from .options import FinetuneConfig
from .progress import Progress
from .rank_progress import RankProgress
from .rundir import (RESULT_OPTIONS, RunLock, check_nvme, config_diff, created_by_us, rng_state, set_rng_state,
                     truncate_metrics, undo_refused)
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
    for root in (Path(cfg.nvme), Path(cfg.nvme) / "rank0"):
        for m in list_manifests(root):
            try:
                return read_manifest(m)["fingerprint"]["precision"]
            except (KeyError, TypeError, ValueError, OSError, RuntimeError):  # a damaged manifest: the next
                continue
    return None


def _auto_precision(cfg: FinetuneConfig) -> str:
    """From the CPU's ISA flags or the GPU's capability, never timed; summary.json records why."""
    chosen, why = resolve("auto", cfg.device)
    print(why, file=sys.stderr)
    cfg.precision_reason = why
    return chosen


def _save_timeline(tl, out: Path, step: int, end: float, progress):
    """The step's timeline to [its start, `end`]: the window of its s/step (its log line and metrics
    row), so the picture's title, axis and lane shares are that step's numbers. Called after the
    step, outside its time; returns the process drawing the PNG, still running."""
    tl.stop(end)
    dt, stall = tl.span_s(), tl.stall_s()
    tl.save_chrome(out / "timeline.json")
    cpu = progress.rows[-1].get("cpu_s", {}) if progress.rows else {}
    drawing = tl.save_png_in_child(out / "timeline.json", out / "timeline.png",
                                   title=f"step {step}: {dt:.2f} s, compute waited {stall:.2f} s on I/O"
                                   + (f"; CPU s: {describe_cpu(dict(list(cpu.items())[:5]))}" if cpu else ""))
    progress.bar.write(f"timeline of step {step} ({dt:.2f} s): {out / 'timeline.json'} (Perfetto), "
                       f"{out / 'timeline.png'}; busy: "
                       + ", ".join(f"{k} {fmt_share(v)}" for k, v in tl.lane_shares().items())
                       + f"; compute stalled {fmt_share(stall / dt)} of the step")
    return drawing


class TrainingStopped(RuntimeError):
    """The run cannot go on (repeated non-finite steps); the committed state is intact."""


def finetune(cfg: FinetuneConfig | None = None, **options) -> dict:
    """Fine-tune every parameter of `cfg.model` out-of-core; returns the run summary.

    Accepts a FinetuneConfig or the same options as keywords: finetune(model=..., data=..., cpu_mem="4GiB").
    """

    if cfg is None:
        cfg = build(FinetuneConfig, options, source="finetune() arguments")
    cfg = _resolve(cfg)
    out = Path(cfg.output)
    created = created_by_us(out, cfg.nvme)  # what a refusal removes again, before mkdir makes it exist
    out.mkdir(parents=True, exist_ok=True)
    dist = from_env(cfg.dist_timeout, cfg.device, parse_bytes(cfg.grad_bucket, "--grad-bucket"))
    if dist is not None:
        cfg.device = str(dist.device)  # on CUDA each rank computes on a GPU of its own, cuda:LOCAL_RANK
    if dist is not None:
        # Ranks started by torchrun directly measured on their own: they must have chosen alike.
        dist.same_on_all(int(cfg.precision == "bf16"), "--precision (pass it explicitly)")
    lock = RunLock(out) if dist is None or dist.rank == 0 else None
    try:
        return _run(cfg, out, dist)
    except (ValueError, FileNotFoundError, FileExistsError, RuntimeError) as e:
        # Refused (bad data, a budget too small, the model's positions: what exits 2) before a step
        # was recorded: the directories this call made go again, so the refusal leaves nothing
        # behind. A failure (a disk error, an interrupt) or anything after a step keeps them: its
        # message may point at the state, and --resume auto continues from it.
        if dist is None and (isinstance(e, BudgetError) or not isinstance(e, RuntimeError)):
            undo_refused(out, created)
        raise
    finally:
        if lock:
            lock.release()
        if dist:
            dist.close()


@dataclass
class _Run:
    """One fine-tuning run's parts, made by _start and used by the step loop and _finish."""
    cfg: FinetuneConfig
    out: Path
    dist: object
    engine: object
    batches: object
    tokenizer: object
    progress: object
    total: int
    start: int
    result_options: dict   # the options that change results, kept in each commit (resume checks them)
    bad_streak: int = 0
    drawing: object = None  # the process drawing timeline.png (waited for when the run ends)

    @property
    def lead(self) -> bool:  # prints progress, writes the metrics, summary and final model
        return self.dist is None or self.dist.rank == 0


def _run(cfg: FinetuneConfig, out: Path, dist=None) -> dict:
    run = _start(cfg, out, dist)
    # What exists now (the model's modules, the tokenised data, the libraries' objects) lives for
    # the whole run: out of the collector's sight until the run ends, a full collection no longer
    # walks it. Walking it held the GIL 0.1-0.22 s each time, the I/O and optimizer threads stalled
    # behind it (measured on a 2-vCPU AMD EPYC Zen 4).
    gc.freeze()
    try:
        _steps(run)
        run.progress.close()
        if not run.lead:
            return dict(run.progress.summary(None), final_model=None)
        return _finish(run)
    finally:
        run.progress.close()
        run.engine.close()
        gc.unfreeze()  # a caller's objects (the Python API, the tests) are collected as before
        _drawn(run)


def _drawn(run: _Run) -> None:
    """Wait for the timeline's picture (drawn beside the steps that followed its own)."""
    if run.drawing is not None and run.drawing.wait() != 0:
        print(f"warning: drawing {run.out / 'timeline.png'} failed (exit {run.drawing.returncode}); "
              f"{run.out / 'timeline.json'} holds the same timeline (Perfetto)", file=sys.stderr)


def _model_config(cfg: FinetuneConfig, dist):
    """The model's config, once the directory, an earlier run's state and --seq-len are checked."""
    checks.check_model_dir(cfg.model)
    if dist is None and any((Path(cfg.nvme) / "rank0").glob("manifest-*.json")):
        raise ValueError(f"--nvme {cfg.nvme} holds a data-parallel run's state (rank folders); continue it "
                         f"with --nproc N --resume auto (any N, 1 included), or choose another --nvme")
    hf_config = AutoConfig.from_pretrained(cfg.model)
    max_pos = fields.get(hf_config, "max_positions")
    if max_pos and max_pos > 0 and cfg.seq_len > max_pos:  # (XLNet's -1: no limit)
        raise ValueError(f"--seq-len {cfg.seq_len} is beyond the {max_pos} positions of {cfg.model}; "
                         f"use --seq-len {max_pos} or less")
    return hf_config


def _nvme_dir(cfg: FinetuneConfig, dist, hf_config) -> str:
    """This rank's state directory, checked for room: two slots of master, m, v and weights, and the
    saved gradients (a rank holds its share of the states and all working weights)."""

    wbytes = 2 if cfg.precision == "bf16" else 0
    per_param = 2 * (4 + moment_bytes_per_param(cfg.optim_states) + wbytes) + 4
    nvme = cfg.nvme
    if dist is not None:
        nvme = str(rank_dir(cfg.nvme, dist.rank))
        per_param = per_param / dist.world + 2 * max(wbytes, 4)
    check_nvme(nvme, int(per_param * param_count(hf_config)))
    return nvme


def _engine(cfg: FinetuneConfig, out: Path, dist, nvme: str, library_rss: int):
    """The engine, its settings resolved from what `tierlm bench` measured of this machine."""

    optim = AdamWConfig(lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, impl=cfg.optim_impl)
    plan = "plan.json" if dist is None or dist.rank == 0 else f"plan-rank{dist.rank}.json"
    ecfg = EngineConfig(nvme_dir=nvme, cpu_mem=cfg.cpu_mem, precision=cfg.precision,
                        grad_accum=cfg.grad_accum, activations=cfg.activations, prefetch=cfg.prefetch,
                        direct_io=cfg.direct_io, optim=optim, optim_states=cfg.optim_states,
                        clip_path=cfg.clip_path, commit_every=cfg.commit_every, device=cfg.device, gpu_mem=cfg.gpu_mem,
                        tokens_per_micro_batch=cfg.batch_size * cfg.seq_len, micro_batch_size=cfg.batch_size,
                        plan_path=str(out / plan), precision_why=getattr(cfg, "precision_reason", ""))
    return Engine.from_pretrained(cfg.model, ecfg, resume=cfg.resume == "auto", overwrite=cfg.overwrite,
                                  measured=rates.measured(nvme), library_rss=library_rss, dist=dist)


def _start(cfg: FinetuneConfig, out: Path, dist) -> _Run:
    hf_config = _model_config(cfg, dist)
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    # measured first: what the tokenizer and the data hold counts against --cpu-mem
    library_rss = library_baseline(hf_config, dtype, cfg.device, warm=lambda: warm_kernels(
        hf_config, dtype, cfg.device, (cfg.batch_size, cfg.seq_len)))
    tokenizer = checks.load_tokenizer(cfg.model)
    dataset = load_dataset(cfg.data, tokenizer, cfg.seq_len)
    batches = Batches(dataset, cfg.batch_size, seed=cfg.seed)
    total = cfg.steps if cfg.steps is not None else \
        max(1, math.floor(cfg.epochs * batches.batches_per_epoch / cfg.grad_accum))
    engine = _engine(cfg, out, dist, _nvme_dir(cfg, dist, hf_config), library_rss)
    if dist is not None:
        dist.same_on_all(engine.state["step"], "step to resume from")
    run = _Run(cfg, out, dist, engine, batches, tokenizer, None, total, engine.state["step"],
               {k: v for k, v in to_dict(cfg).items() if k in RESULT_OPTIONS})
    trainer = _resume_or_seed(run)
    run.progress = _progress(run, dataset, fresh=not trainer)
    run.bad_streak = trainer["bad_streak"] if trainer else 0
    return run


def _metrics_name(dist) -> str:
    return "metrics.jsonl" if dist is None or dist.rank == 0 else f"metrics-rank{dist.rank}.jsonl"


def _resume_or_seed(run: _Run) -> dict | None:
    """A resumed run's trainer state (data position, RNG), checked against this run's options; a new
    run's seed. Returns the trainer state, or None for a new run."""
    cfg, engine = run.cfg, run.engine
    trainer = engine.state.get("trainer")
    for fb in engine.fallbacks:
        print(f"resume: passed over {fb}", file=sys.stderr)
    if not trainer:
        torch.manual_seed(cfg.seed)
        return None
    diff = config_diff(trainer["settings"], run.result_options)
    if diff and not cfg.allow_config_change:
        engine.close()
        raise ValueError("the run in --nvme was made with other options that change results: "
                         + "; ".join(diff) + ". Use the run's options, or --allow-config-change")
    run.batches.load_state_dict(trainer["data"])
    set_rng_state(trainer["rng"])
    truncate_metrics(run.out / _metrics_name(run.dist), run.start)
    if run.lead:
        # "at step N" left open whether N was done or next: the state holds N steps, the next is N+1
        then = f"continuing with step {run.start + 1} of {run.total}" if run.start < run.total else "no steps are left"
        print(f"resumed after step {run.start} (the last committed, in {engine.root}); {then}", file=sys.stderr)
    return trainer


def _progress(run: _Run, dataset, fresh: bool):
    """The lead rank prints, and writes config.json and settings.json (every automatic choice and
    why); the others only record their own metrics."""

    metrics = run.out / _metrics_name(run.dist)
    if not run.lead:
        return RankProgress(run.total, run.start, run.engine, run.cfg, metrics, fresh=fresh)
    (run.out / "config.json").write_text(json.dumps(to_dict(run.cfg), indent=2) + "\n")
    (run.out / "settings.json").write_text(json.dumps(run.engine.settings_record(), indent=2) + "\n")
    return Progress(run.total, run.start, run.engine, run.cfg, metrics, dataset.summary(), fresh=fresh)


def _micro_batches(run: _Run, step: int) -> tuple[list[float], int]:
    """Forward and backward of the step's micro-batches; their losses and tokens."""
    cfg, engine, dist = run.cfg, run.engine, run.dist
    losses, tokens = [], 0
    for micro in range(cfg.grad_accum):
        ids, labels = next(run.batches)
        tokens += ids.numel()
        weight = 1.0
        if dist is not None:  # this rank's rows of the global batch
            ids, labels, weight = split_batch(dist, ids, labels)
        loss = engine.forward(ids, labels=labels).loss
        if dist is not None:
            loss = loss * weight
        if fault("loss") == "nan":
            loss = loss * float("nan")
        if dist is None and micro == cfg.grad_accum - 1 and step + 1 < run.total:
            # the next step's first lookup takes its rows from this update (next_rows)
            engine.expect(run.batches.peek()[0])
        engine.backward(loss)
        losses.append(loss.item())
    if dist is not None:
        losses = global_losses(dist, losses)
    return losses, tokens


def _steps(run: _Run) -> None:
    cfg, engine = run.cfg, run.engine
    # A step's time and bytes run from the end of the one before (its commit included: the
    # commit's writes land during this step's forward) to this one's end; drawing a timeline,
    # writing a checkpoint and the activation planner's one-off drive probe are left out.
    t0, io0 = time.perf_counter(), engine.store.stats.snapshot()
    for step in range(run.start, run.total):
        if cfg.timeline_step and run.lead and step + 1 == cfg.timeline_step:
            engine.timeline.start(origin=t0)  # the step's window, the same as its s/step
        lr = lr_at(cfg.lr, cfg.schedule, cfg.warmup_steps, run.total, step)
        engine.set_lr(lr)
        # the last step and a checkpoint's commit whatever --commit-every says
        engine.force_commit = step + 1 == run.total or bool(cfg.save_every and (step + 1) % cfg.save_every == 0)
        losses, tokens = _micro_batches(run, step)
        res = engine.finish()
        run.bad_streak = 0 if res.finite else run.bad_streak + 1
        engine.state["trainer"] = {"settings": run.result_options, "data": run.batches.state_dict(),
                                   "rng": rng_state(), "bad_streak": run.bad_streak}
        # The metrics row goes first: a crash before the commit leaves a row that resume drops.
        now, io = time.perf_counter(), engine.store.stats.snapshot()
        run.progress.step(step, sum(losses) / len(losses), lr, res, tokens, now - t0, io0, io)
        t0, io0 = now, io
        probed = engine.acts.measure_s
        engine.commit()
        if run.lead and engine.commits.every.auto and engine.commits.done == AUTO_AFTER:
            print(f"commit: {engine.commits.why}", file=sys.stderr)
        off = time.perf_counter()
        if engine.timeline.recording:
            run.drawing = _save_timeline(engine.timeline, run.out, step + 1, now, run.progress)
        _stop_if_stuck(run, step)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            engine.checkpoint(f"step-{step + 1:08d}")
        t0 += time.perf_counter() - off + (engine.acts.measure_s - probed)


def _stop_if_stuck(run: _Run, step: int) -> None:
    if run.bad_streak >= run.cfg.max_bad_steps:
        n = run.bad_streak
        raise TrainingStopped(
            f"{count(n, 'consecutive step')} had non-finite loss or gradients (steps "
            f"{step + 2 - n}..{step + 1}, each skipped); the state of step "
            f"{step + 1 - n} is intact in {run.engine.root}. Lower --lr or check the data, "
            f"then --resume auto")


def _finish(run: _Run) -> dict:
    """The final model, the summary (and a sample of the fine-tuned model, where asked)."""
    cfg, engine = run.cfg, run.engine
    engine.release_step_memory()
    save_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(cfg.save_dtype or "", None)
    final = engine.save_pretrained(run.out / "final", dtype=save_dtype)
    summary = run.progress.summary(final)
    # config.json holds the options (it loads as --config); why this precision is beside the result
    summary["precision"] = cfg.precision
    summary["precision_reason"] = getattr(cfg, "precision_reason", f"--precision {cfg.precision}")
    if cfg.sample_prompt:
        summary["sample"] = generate(engine, run.tokenizer, cfg.sample_prompt, cfg.sample_tokens,
                                     cfg.sample_temperature, seed=cfg.seed)
    (run.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
