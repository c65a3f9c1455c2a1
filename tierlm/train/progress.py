"""One line per step (loss, lr, s/step, tokens/s, RSS against the budget, SSD GB/s), and a progress
bar below the lines where a terminal shows it."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .. import rss
from ..bench.cpu_time import CpuClock, describe
from ..engine.expert_io import describe as describe_experts
from ..units import count, fmt_bytes


def use_bar(stream) -> bool:
    """A bar redraws itself with carriage returns: on a terminal that is one line moving; in a file
    or a pipe (`> log 2>&1`, a CI log) every frame stays, mixed into the log lines."""
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty (a wrapper), or closed
        return False


class _Lines:
    """The bar's place where no terminal shows one: the lines alone, each flushed when written (a
    `tail -f` or a pipe sees a step when it ends)."""

    def write(self, s: str, file=None) -> None:
        print(s, file=file or sys.stdout, flush=True)

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def make_bar(total: int, start: int, stream=None):
    """A tqdm bar on `stream` (stderr) where it is a terminal; else plain lines."""
    stream = stream or sys.stderr
    if not use_bar(stream):
        return _Lines()
    from tqdm.auto import tqdm
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, leave=False, file=stream)


class Progress:
    def __init__(self, total: int, start: int, engine, cfg, metrics_path: Path, data_summary: str,
                 fresh: bool = True):
        self.total, self.engine, self.cfg = total, engine, cfg
        self.budget = engine.cfg.cpu_mem  # parsed once, by the engine's options
        self.metrics = open(metrics_path, "w" if fresh else "a")
        self.rows: list[dict] = []
        self.cpu = CpuClock()  # each row's CPU seconds by component (the engine's own work beside the layers')
        self.t_start = time.perf_counter()
        self.bar = make_bar(total, start)
        self.bar.write(f"data: {data_summary}")
        st = engine.split
        self.bar.write(f"--cpu-mem {fmt_bytes(st.budget)} beyond the libraries' {fmt_bytes(engine.library_rss)}: "
                       f"{st.describe()}; "
                       f"direct I/O {'on' if engine.store.direct else 'off'}, {count(engine.io_threads, 'read')} and {count(engine.io_threads, 'write')} in flight "
                       f"({engine.io_threads_why}), optimizer shards of {fmt_bytes(4 * engine.shard_elems)} in fp32 "
                       f"({engine.shard_why}), {count(engine.prefetch, 'block')} read ahead ({engine.prefetch_why}); "
                       f"nvme {engine.root}")

    def step(self, step: int, loss: float, lr: float, res, tokens: int, dt: float, io0: dict, io: dict) -> None:
        """io0, io: the store's counters where the step's time starts and ends."""
        rd = io["bytes_read"] - io0["bytes_read"]
        wr = io["bytes_written"] - io0["bytes_written"]
        lib = self.engine.library_rss
        now = rss.current_rss() - lib
        peak = rss.peak_rss() - lib
        row = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": res.grad_norm,
               "clip_coef": res.clip_coef, "clip_path": res.clip_path, "skipped": not res.finite,
               "committed": self.engine.step_commits, "s_per_step": dt,
               "tokens": tokens, "tokens_per_s": tokens / dt, "rss_bytes": now, "peak_rss_bytes": peak, "library_rss_bytes": lib,
               "budget_bytes": self.budget, "ssd_read_bytes": rd, "ssd_write_bytes": wr,
               "ssd_read_gbps": rd / dt / 1e9, "ssd_write_gbps": wr / dt / 1e9, "cpu_s": self.cpu.lap(),
               "time": time.time()}
        if getattr(res, "experts", None):  # a mixture of experts' state bytes, per expert (engine/expert_io.py)
            row["experts"] = res.experts
        self.rows.append(row)
        self.metrics.write(json.dumps(row) + "\n")
        self.metrics.flush()
        skipped = " SKIPPED (non-finite gradients)" if not res.finite else ""
        clip = f" clip {res.clip_coef:.2f}" if res.clip_coef < 1 else ""
        self.bar.write(
            f"step {step + 1}/{self.total} loss {loss:.4f} lr {lr:.2e} gnorm {res.grad_norm:.3f}{clip} | "
            f"{dt:.2f} s/step {tokens / dt:,.0f} tok/s | RAM {fmt_bytes(now)} (peak {fmt_bytes(peak)}) "
            f"of {fmt_bytes(self.budget)} | SSD read {rd / dt / 1e9:.2f} GB/s "
            f"write {wr / dt / 1e9:.2f} GB/s | CPU s {describe(dict(list(row['cpu_s'].items())[:4]))}{skipped}"
            + (f" | {describe_experts(row['experts'])}" if "experts" in row else ""))
        self.bar.update(1)

    def summary(self, final_dir) -> dict:
        rows = self.rows
        return {"steps": len(rows), "first_loss": rows[0]["loss"] if rows else None,
                "last_loss": rows[-1]["loss"] if rows else None,
                "mean_s_per_step": sum(r["s_per_step"] for r in rows) / max(len(rows), 1),
                "peak_rss_bytes": rss.peak_rss(), "library_rss_bytes": self.engine.library_rss,
                "budget_bytes": self.budget, "peak_gpu_bytes": self.engine.stats()["peak_gpu"],
                # freed memory kept for reuse between blocks (tierlm/heap.py), and how often it went back
                "heap_kept": self.engine.heap.active, "heap_trims": self.engine.heap.trims,
                # forwards whose embedding lookup took its rows from the step before (next_rows)
                "lookups_from_update": self.engine.next_rows.used if self.engine.next_rows is not None else 0,
                "final_model": str(final_dir), "wall_s": time.perf_counter() - self.t_start,
                "cpu_s_per_step": cpu_per_step(rows)}

    def close(self) -> None:
        if not self.metrics.closed:
            self.bar.close()
            self.metrics.close()


def cpu_per_step(rows: list[dict]) -> dict[str, float]:
    """Mean CPU seconds a step by component, over the steps after the first (which creates the
    state files), or over the one step there is."""
    steady = rows[1:] or rows
    comps = {k for r in steady for k in r.get("cpu_s", {})}
    mean = {k: sum(r.get("cpu_s", {}).get(k, 0.0) for r in steady) / max(len(steady), 1) for k in comps}
    return {k: round(v, 3) for k, v in sorted(mean.items(), key=lambda kv: -kv[1])}
