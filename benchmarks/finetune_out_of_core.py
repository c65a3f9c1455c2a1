"""Fine-tune a real-model-shaped network out-of-core under a RAM budget and report the step.

    python benchmarks/finetune_out_of_core.py --preset tinyllama-1.1b --cpu-mem 4GiB --steps 3

Creates the model (random weights, the preset's shapes) and a text corpus from the standard
library's docstrings under --work, runs `tierlm finetune` in a fresh process (so its peak RSS is its
own), and prints peak RSS against the budget, s/step, SSD bytes per step and tokens/s, measured
(the first step, which includes warm-up, is reported apart).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from tierlm.demo import stdlib_corpus
from tierlm.hf.presets import make_config, param_count
from tierlm.units import fmt_bytes, parse_bytes


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tinyllama-1.1b")
    ap.add_argument("--cpu-mem", default="4GiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--work", default="/tmp/tierlm-bench")
    ap.add_argument("--tag", default="", help="suffix of the run directory, to keep runs apart")
    ap.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more tierlm finetune flags")
    a = ap.parse_args()

    work = Path(a.work)
    model = work / a.preset
    config = make_config(None, a.preset, {})
    n = param_count(config)
    if not (model / "config.json").exists():
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tierlm", "init", str(model), "--preset", a.preset], check=True)
        print(f"init: {time.perf_counter() - t:.0f} s")
    corpus = work / "corpus.txt"
    if not corpus.exists():
        stdlib_corpus(corpus)
    run = work / f"run-{a.preset}-{a.cpu_mem}{a.tag}"
    cmd = [sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(corpus),
           "--output", str(run), "--cpu-mem", a.cpu_mem, "--steps", str(a.steps),
           "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size), "--precision", a.precision,
           "--lr", "1e-5", "--overwrite"] + a.extra
    print(" ".join(cmd), flush=True)
    t = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-a.steps:]
    summary = json.loads((run / "summary.json").read_text())
    budget = parse_bytes(a.cpu_mem)
    steady = rows[1:] or rows
    mean = lambda k: sum(r[k] for r in steady) / len(steady)  # noqa: E731
    lib = summary["library_rss_bytes"]
    print(f"\n{a.preset}: {n / 1e9:.2f}B parameters, training state {fmt_bytes(16 * n)} "
          f"({16 * n / budget:.1f}x --cpu-mem {a.cpu_mem}), {a.batch_size}x{a.seq_len} tokens/step, {a.precision}")
    print(f"peak RSS {fmt_bytes(summary['peak_rss_bytes'])} = libraries {fmt_bytes(lib)} "
          f"+ {fmt_bytes(summary['peak_rss_bytes'] - lib)} (budget {fmt_bytes(budget)})")
    print(f"first step {rows[0]['s_per_step']:.1f} s; steady steps {mean('s_per_step'):.1f} s/step, "
          f"{mean('tokens_per_s'):.1f} tokens/s")
    print(f"SSD per step: read {fmt_bytes(mean('ssd_read_bytes'))} write {fmt_bytes(mean('ssd_write_bytes'))} "
          f"= {(mean('ssd_read_bytes') + mean('ssd_write_bytes')) / n:.1f} bytes/parameter; "
          f"{mean('ssd_read_gbps'):.2f} GB/s read, {mean('ssd_write_gbps'):.2f} GB/s write")
    print(f"loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}; wall {wall:.0f} s including the import of the weights")


if __name__ == "__main__":
    main()
