"""`tierlm bench train MODEL`: the same model, data and batch, in memory and out-of-core, side by side.

Each run is a process of its own (so each peak RSS is its own). The in-memory run is plain PyTorch
(`tierlm.train.inmemory`): bf16 weights, fp32 master, torch.optim.AdamW. The out-of-core run is
`tierlm finetune` with its timeline recorded on the last step. Printed: the ratio of steady step
times, SSD bytes per step against the measured bandwidth (`tierlm bench io`), the share of the step
the computation waited on I/O, and the peak RSS of each. When the in-memory run cannot fit in RAM,
it is not run, and the out-of-core step is compared with its I/O bound instead. Where DeepSpeed is
installed (it is optional), a third process runs it on the same model, data and batch: ZeRO-3 with
parameters and optimizer states offloaded to NVMe (`tierlm.train.peer_deepspeed`); `--peers none`
leaves it out. The machine (CPU, cores, RAM, ISA flags) is printed above the figures.

The drive is measured right before and right after the out-of-core run, on the run's own folder,
and the bound uses the mean of the two: a virtual disk's rates move by 2x within an hour (read 2.43
then 1.37 GB/s 25 minutes apart on a 2-vCPU Zen 4 VM), so a cached `bench io` can be far from what the run
saw. Reads and writes share one device, so the drive's use is the sum of each direction's bytes
over its own rate: the share of the step the drive would be busy at those rates (= bound / step).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil

from ..bench.machine import machine_kind, machine_line
from ..bench.measure import bench_io
from ..config import add_arguments, from_args
from ..engine.device import resolve_device
from ..hf import checks
from ..hf.presets import param_count
from ..precision import resolve
from ..units import fmt_bytes
from .options import FinetuneConfig

# Steps left out of the steady means: the out-of-core run's first two create the files of its two
# state slots (a step writes the slot the last one did not), and creating a file writes 2-3x slower
# than overwriting one in place, as every later step does (TinyLlama 1x128 under 4 GiB, a 2-vCPU Zen 4 VM:
# step 2 took 13.7-15.3 s, steps 3-5 11.2-13.5). Both runs leave out the same number.
WARMUP_STEPS = 2
# Where the bounds by the probe before and by the probe after alone differ by more than this, the
# drive's rate moved during the run and the step / bound ratio is not settled by it (a 2-vCPU Zen 4 VM,
# Qwen2.5-0.5B 1x32: a 1.26 GB/s read before and 2.49 after gave 6.07 and 3.99 s, and a mean-rate
# ratio of 1.03x where the runs on either side of it measured 1.19-1.20x with probes within 14%).
PROBES_DISAGREE = 0.20


class RunFailed(RuntimeError):
    """One of the two runs exited with an error (printed above by the run itself)."""


def _run(what: str, cmd: list[str], **kw) -> None:
    try:
        subprocess.run(cmd, check=True, **kw)
    except subprocess.CalledProcessError as e:
        raise RunFailed(f"the {what} run failed (exit status {e.returncode}); its own error is above. "
                        f"Command: {' '.join(cmd)}") from None


def _steady(rows: list[dict], key: str) -> float:
    xs = [r[key] for r in (rows[WARMUP_STEPS:] or rows[-1:])]
    return sum(xs) / len(xs)


def _steady_cpu(rows: list[dict]) -> dict[str, float]:
    """Mean CPU seconds a steady step by component (bench.cpu_time's names), largest first."""
    steady = rows[WARMUP_STEPS:] or rows[-1:]
    comps = {k for r in steady for k in r.get("cpu_s", {})}
    mean = {k: sum(r.get("cpu_s", {}).get(k, 0.0) for r in steady) / len(steady) for k in comps}
    return dict(sorted(mean.items(), key=lambda kv: -kv[1]))


def _cpu_line(name: str, cpu: dict[str, float], s_per_step: float) -> str:
    """One run's CPU seconds a step, the cores they fill, and by component: on few cores the
    engine's own work takes the cores the layers compute on."""
    total = sum(cpu.values())
    parts = ", ".join(f"{k} {v:.2f}" for k, v in cpu.items() if v >= 0.005)
    return f"    {name}: {total:.2f} CPU s a step ({total / s_per_step:.2f} cores busy): {parts}"


def _inmemory_fits(model_dir: str) -> tuple[bool, int]:
    from transformers import AutoConfig

    need = 18 * param_count(AutoConfig.from_pretrained(model_dir))  # bf16 + fp32 master + m, v + grads
    return need < 0.8 * psutil.virtual_memory().available, need


def _probe_io(nvme_dir: str) -> dict:
    """`bench io` of the run's own NVMe folder, measured now (not the cache)."""

    io = bench_io(nvme_dir)
    return {"read_gbps": io["read_gbps"], "write_gbps": io["write_gbps"], "dir": io["dir"]}


def _mean_io(probes: list[dict]) -> dict:
    return {"read_gbps": sum(p["read_gbps"] for p in probes) / len(probes),
            "write_gbps": sum(p["write_gbps"] for p in probes) / len(probes),
            "dir": probes[0]["dir"], "probes": probes}


def _check_finetune_args(argv: list[str]) -> None:
    """Both runs' options, checked as `tierlm finetune` checks them (ranges included) before the
    work directory exists: a `--lr nan` is one clear line, not a child's failure and a directory."""
    import argparse

    ap = argparse.ArgumentParser(prog="tierlm bench train --finetune-args", add_help=False)
    add_arguments(ap, FinetuneConfig, positional=("model",))
    from_args(FinetuneConfig, ap.parse_args(argv))


def _inmemory_run(model: str, common: list[str], work_dir: Path, inmemory: str) -> tuple[dict | None, str | None]:
    """The in-memory reference's steps and peak, or None and why it was skipped."""
    fits, need = _inmemory_fits(model)
    if inmemory not in ("auto", "always", "never"):
        raise ValueError(f"--inmemory must be auto, always or never; got {inmemory!r}")
    if not (inmemory == "always" or (fits and inmemory == "auto")):
        return None, ("--inmemory never" if inmemory == "never" else
                      f"needs ~{fmt_bytes(need)}, more than the RAM available; --inmemory always runs it anyway")
    out = work_dir / "inmemory.json"
    # plain PyTorch, as a user would run it: glibc's own malloc settings, not tierlm's (which
    # give every large tensor fresh pages, ~9% slower in memory)
    _run("in-memory", [sys.executable, "-m", "tierlm.train.inmemory", *common, "--json", str(out)],
         env=dict(os.environ, TIERLM_MALLOC="glibc"))
    mem = json.loads(out.read_text())
    return {"s_per_step": _steady(mem["rows"], "s_per_step"),
            "steps_s": [r["s_per_step"] for r in mem["rows"]], "peak_rss_bytes": mem["peak_rss_bytes"],
            "peak_gpu_bytes": mem.get("peak_gpu_bytes"), "losses": [r["loss"] for r in mem["rows"]],
            "cpu_s": _steady_cpu(mem["rows"])}, None


def _outofcore_run(common: list[str], work_dir: Path, nvme: str | None, cpu_mem: str, steps: int) -> tuple[dict, dict]:
    """The out-of-core run's steps, SSD traffic against the drive's measured rates, stalls and peak;
    and the drive's rates, measured before and after it."""
    run = work_dir / "outofcore"
    shutil.rmtree(run, ignore_errors=True)
    nvme_dir = nvme or str(run / "nvme")
    before = _probe_io(nvme_dir)
    _run("out-of-core", [sys.executable, "-m", "tierlm", "finetune", *common, "--output", str(run), "--nvme", nvme_dir,
                         "--cpu-mem", cpu_mem, "--overwrite", "--timeline-step", str(steps)])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    trace = json.loads((run / "timeline.json").read_text())["traceEvents"]
    wait = sum(e["dur"] for e in trace if e.get("cat") == "wait") / 1e6
    last = rows[-1]
    io = _mean_io([before, _probe_io(nvme_dir)])
    rd, wr = _steady(rows, "ssd_read_bytes"), _steady(rows, "ssd_write_bytes")
    # each direction's bytes at its own measured rate; one device serves both, so they add up
    t_rd, t_wr = rd / (io["read_gbps"] * 1e9), wr / (io["write_gbps"] * 1e9)
    bound = t_rd + t_wr
    ooc = {"s_per_step": _steady(rows, "s_per_step"), "steps_s": [r["s_per_step"] for r in rows],
           "peak_rss_bytes": summary["peak_rss_bytes"],
           "peak_gpu_bytes": summary.get("peak_gpu_bytes"),
           "library_rss_bytes": summary["library_rss_bytes"], "ssd_read_bytes": rd, "ssd_write_bytes": wr,
           "read_gbps": _steady(rows, "ssd_read_gbps"), "write_gbps": _steady(rows, "ssd_write_gbps"),
           "stall_pct": 100 * wait / last["s_per_step"], "io_bound_s": bound,
           "io_bound_by_probe_s": [rd / (p["read_gbps"] * 1e9) + wr / (p["write_gbps"] * 1e9) for p in io["probes"]],
           "losses": [r["loss"] for r in rows], "timeline": str(run / "timeline.png"), "cpu_s": _steady_cpu(rows)}
    ooc["ssd_read_share"], ooc["ssd_write_share"] = t_rd / ooc["s_per_step"], t_wr / ooc["s_per_step"]  # sum: bound / step
    return ooc, io


PEERS = ("auto", "none")


def deepspeed_version() -> str | None:
    """DeepSpeed's version where it is installed, else None; without importing it (its import picks
    an accelerator and takes seconds)."""
    if importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        return importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _peer_run(common: list[str], work_dir: Path, nvme: str | None, peers: str) -> tuple[dict | None, str | None]:
    """DeepSpeed ZeRO-3 offloaded (tierlm.train.peer_deepspeed) on the same model, data and batch;
    or None and why not. A peer that fails is a line in the report, not the benchmark's failure."""
    if peers not in PEERS:
        raise ValueError(f"--peers must be auto or none; got {peers!r}")
    if peers == "none":
        return None, "--peers none"
    version = deepspeed_version()
    if version is None:
        return None, "DeepSpeed is not installed (pip install deepspeed to compare with it)"
    out = work_dir / "deepspeed.json"
    out.unlink(missing_ok=True)
    swap = str(Path(nvme) / "deepspeed" if nvme else work_dir / "deepspeed" / "nvme")
    try:
        _run("DeepSpeed", [sys.executable, "-m", "tierlm.train.peer_deepspeed", *common, "--nvme", swap,
                           "--json", str(out)], env=dict(os.environ, TIERLM_MALLOC="glibc"))
    except RunFailed as e:
        return None, f"DeepSpeed {version}: {e}"
    ds = json.loads(out.read_text())
    return {"s_per_step": _steady(ds["rows"], "s_per_step"), "steps_s": [r["s_per_step"] for r in ds["rows"]],
            "peak_rss_bytes": ds["peak_rss_bytes"], "losses": [r["loss"] for r in ds["rows"]],
            "offload": ds["offload"], "offload_why": ds["offload_why"], "version": ds["deepspeed_version"],
            "swap_bytes": ds["swap_bytes"], "tuning": ds["tuning"]}, None


def bench_train(model: str, data: str, cpu_mem: str, steps: int, work: str, finetune_args: list[str],
                nvme: str | None = None, inmemory: str = "auto", peers: str = "auto") -> dict:
    """inmemory: auto (run the in-memory reference where its estimate fits the RAM available),
    always (run it anyway: the estimate keeps a fifth of the RAM spare, and TinyLlama-1.1B at
    1x512 tokens, estimated 18.44 GiB against 22 available, peaked 21.3 GiB and ran), never.
    peers: auto (run DeepSpeed ZeRO-3 offloaded as a third process where it is installed), none."""
    if peers not in PEERS:
        raise ValueError(f"--peers must be auto or none; got {peers!r}")
    _check_finetune_args([model, "--data", data, "--steps", str(steps), "--cpu-mem", cpu_mem, *finetune_args])
    checks.check_model_dir(model)  # both runs would fail on these: one clear line now, not two tracebacks later
    checks.load_tokenizer(model)
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    given = [finetune_args[i + 1] for i, a in enumerate(finetune_args[:-1]) if a == "--device"]
    device = str(resolve_device(given[-1] if given else "auto"))  # both runs compute on the same device
    finetune_args = [*finetune_args, "--device", device]
    if not any(a.split("=")[0] == "--precision" for a in finetune_args):
        precision, why = resolve("auto", device)
        print(why, file=sys.stderr)
        finetune_args = [*finetune_args, "--precision", precision]
    common = [model, "--data", data, "--steps", str(steps), *finetune_args]
    result: dict = {"model": model, "steps": steps, "cpu_mem": cpu_mem, "device": device, "machine": machine_kind()}

    result["inmemory"], skipped = _inmemory_run(model, common, work_dir, inmemory)
    if skipped:
        result["inmemory_skipped"] = skipped
    ooc, io = _outofcore_run(common, work_dir, nvme, cpu_mem, steps)
    result["outofcore"] = ooc
    result["measured_io"] = io
    result["deepspeed"], why = _peer_run(common, work_dir, nvme, peers)
    if why:
        result["deepspeed_skipped"] = why
    (work_dir / "bench_train.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _agreement(losses: list[float], reference: list[float]) -> str:
    if losses == reference:
        return "identical"
    rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference))
    return f"differ by at most {rel:.1e} (relative)"


def _each(run: dict) -> str:
    return ", ".join(f"{t:.2f}" for t in run.get("steps_s", []))


def peer_lines(r: dict) -> list[str]:
    """The DeepSpeed row: its steady s/step, its ratio to in-memory (to out-of-core where in-memory did
    not run), its peak RSS, where it offloaded to; or one line saying why it did not run."""
    d = r.get("deepspeed")
    if not d:
        return [f"  DeepSpeed:    not run ({r['deepspeed_skipped']})"] if r.get("deepspeed_skipped") else []
    base, name = (r["inmemory"], "in-memory") if r.get("inmemory") else (r["outofcore"], "out-of-core")
    where = {"nvme": "NVMe", "cpu": "CPU RAM (not NVMe: async_io unavailable or --offload cpu)"}.get(d["offload"],
                                                                                                d["offload"])
    return [f"  DeepSpeed:    {d['s_per_step']:.2f} s/step, peak RSS {fmt_bytes(d['peak_rss_bytes'])} "
            f"(DeepSpeed {d['version']} ZeRO-3, parameters and optimizer offloaded to {where}; steps {_each(d)})",
            f"  ratio DeepSpeed / {name}: {d['s_per_step'] / base['s_per_step']:.2f}x; "
            f"out-of-core / DeepSpeed: {r['outofcore']['s_per_step'] / d['s_per_step']:.2f}x; "
            f"losses against {name} {_agreement(d['losses'], base['losses'])} (its own AdamW kernel and rounding)"]


def report(r: dict) -> str:
    o = r["outofcore"]
    lines = [f"bench train {r['model']}: {r['steps']} steps (steady = from step {WARMUP_STEPS + 1}; the first "
             f"{WARMUP_STEPS} create the state files), computing on {r.get('device', 'cpu')}"]
    if r.get("machine"):
        lines.append(f"  machine: {machine_line(r['machine'])}")
    each = _each
    if r["inmemory"]:
        m = r["inmemory"]
        same = _agreement(o["losses"], m["losses"])
        lines.append(f"  in memory:    {m['s_per_step']:.2f} s/step, peak RSS {fmt_bytes(m['peak_rss_bytes'])} "
                     f"(steps {each(m)})")
        lines.append(f"  out-of-core:  {o['s_per_step']:.2f} s/step, peak RSS {fmt_bytes(o['peak_rss_bytes'])} "
                     f"(--cpu-mem {r['cpu_mem']} beyond the libraries' {fmt_bytes(o['library_rss_bytes'])}; "
                     f"steps {each(o)})")
        lines.append(f"  ratio out-of-core / in-memory: {o['s_per_step'] / m['s_per_step']:.2f}x; losses {same}")
        if m.get("peak_gpu_bytes"):
            lines.append(f"  GPU memory peak: in memory {fmt_bytes(m['peak_gpu_bytes'])}, out-of-core "
                         f"{fmt_bytes(o['peak_gpu_bytes'] or 0)}")
    else:
        lines.append(f"  in memory: not run ({r['inmemory_skipped']})")
        lines.append(f"  out-of-core:  {o['s_per_step']:.2f} s/step, peak RSS {fmt_bytes(o['peak_rss_bytes'])} "
                     f"(steps {each(o)})")
    cpu = [(n, x) for n, x in (("in memory", r["inmemory"]), ("out-of-core", o)) if x and x.get("cpu_s")]
    if cpu:
        lines.append("  CPU seconds a steady step, by thread (torch_threads: torch's compute pool; main: the layers' "
                     "Python and its share of their products):")
        lines += [_cpu_line(n, x["cpu_s"], x["s_per_step"]) for n, x in cpu]
    lines += peer_lines(r)
    io = r["measured_io"]
    probes = "; ".join(f"{p['read_gbps']:.2f} / {p['write_gbps']:.2f}" for p in io.get("probes", []))
    lines.append(f"  SSD per step: read {fmt_bytes(o['ssd_read_bytes'])}, write {fmt_bytes(o['ssd_write_bytes'])}; "
                 f"achieved {o['read_gbps']:.2f} / {o['write_gbps']:.2f} GB/s against measured "
                 f"{io['read_gbps']:.2f} / {io['write_gbps']:.2f} GB/s (bench io, {io['dir']}"
                 + (f"; before and after the run {probes})" if probes else ")"))
    if "ssd_read_share" in o:
        lines.append(f"  drive use: read {100 * o['ssd_read_share']:.0f}% + write {100 * o['ssd_write_share']:.0f}% "
                     f"= {100 * (o['ssd_read_share'] + o['ssd_write_share']):.0f}% of the step at the measured rates "
                     f"(one device: reads and writes share it)")
    by_probe = o.get("io_bound_by_probe_s") or []
    alone = ""
    if len(by_probe) == 2:
        alone = (f" (by the probe before / after alone: {by_probe[0]:.2f} / {by_probe[1]:.2f} s, "
                 f"{o['s_per_step'] / by_probe[0]:.2f} / {o['s_per_step'] / by_probe[1]:.2f}x)")
    lines.append(f"  I/O bound (bytes / measured bandwidth): {o['io_bound_s']:.2f} s; step / bound = "
                 f"{o['s_per_step'] / o['io_bound_s']:.2f}x{alone}")
    if by_probe and max(by_probe) > (1 + PROBES_DISAGREE) * min(by_probe):
        lines.append(f"  the drive's rate moved during the run (the bounds by each probe differ by "
                     f"{100 * (max(by_probe) / min(by_probe) - 1):.0f}%): this run does not settle step / bound; "
                     f"run it again")
    lines.append(f"  compute waited on I/O {o['stall_pct']:.0f}% of the last step; timeline {o['timeline']}")
    return "\n".join(lines)


def main_args(args) -> int:
    extra = list(args.finetune_args or [])
    r = bench_train(args.model, args.data, args.cpu_mem, args.steps, args.work, extra, nvme=args.nvme,
                    peers=args.peers)
    print(report(r))
    return 0


__all__ = ["PEERS", "bench_train", "deepspeed_version", "peer_lines", "report", "main_args", "RunFailed"]
