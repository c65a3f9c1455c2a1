"""fp32 against bf16 against int8 Adam moments: SSD bytes per step and the loss curves.

    flock /tmp/tierlm-bench.lock python benchmarks/optim_states_curve.py --steps 200

Writes a corpus of the standard library's docstrings and a small llama (4 layers, hidden 256, a BPE
tokenizer trained on that corpus) under --work, then runs `tierlm finetune ... --optim-states MODE`
for each mode in a fresh process with the same seed (the same data order and initial weights; no
clipping, so every step moves the same bytes: a clip redo would repeat the update's I/O), and
prints SSD bytes per step (read and write, median of the steps after the first: the first step has
no moments to read), s/step, the average and final losses, and draws the loss curves to --png.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

MODES = ("fp32", "bf16", "int8")


def run_mode(model: Path, corpus: Path, out: Path, mode: str, a) -> list[dict]:
    cmd = [sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(corpus), "--output", str(out),
           "--cpu-mem", a.cpu_mem, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
           "--steps", str(a.steps), "--lr", str(a.lr), "--schedule", "cosine", "--warmup-steps", "10",
           "--weight-decay", "0.01", "--max-grad-norm", "0", "--seed", "0", "--timeline-step", "0",
           "--optim-states", mode, "--overwrite"]
    print("$ tierlm finetune " + " ".join(cmd[4:]), flush=True)
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    if len(rows) != a.steps:
        raise RuntimeError(f"{out}/metrics.jsonl has {len(rows)} rows for {a.steps} steps")
    return rows


def summarise(rows: list[dict], n_params: int) -> dict:
    steady = rows[1:] or rows
    med = lambda k: statistics.median(r[k] for r in steady)
    losses = [r["loss"] for r in rows]
    tail = max(1, len(losses) // 10)
    return {"read": med("ssd_read_bytes"), "write": med("ssd_write_bytes"),
            "read_per_param": med("ssd_read_bytes") / n_params, "write_per_param": med("ssd_write_bytes") / n_params,
            "s_per_step": med("s_per_step"),
            "loss_mean": sum(losses) / len(losses), "loss_last10pct": sum(losses[-tail:]) / tail,
            "loss_final": losses[-1], "losses": losses}


def plot(results: dict, png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    smooth = lambda xs, k=10: [sum(xs[max(0, i - k + 1):i + 1]) / (i + 1 - max(0, i - k + 1)) for i in range(len(xs))]
    base = results["fp32"]["losses"]
    for mode, r in results.items():
        steps = range(1, len(r["losses"]) + 1)
        line, = ax.plot(steps, r["losses"], alpha=0.25, lw=0.8)
        ax.plot(steps, smooth(r["losses"]), color=line.get_color(), lw=1.6,
                label=f"{mode} states (mean of last 10%: {r['loss_last10pct']:.3f})")
        if mode != "fp32":
            dx.plot(steps, smooth([x - b for x, b in zip(r["losses"], base)]), color=line.get_color(),
                    label=f"{mode} - fp32")
    ax.set_ylabel("training loss (faint: per step; bold: 10-step mean)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    dx.axhline(0, color="grey", lw=0.8)
    dx.set_ylabel("loss difference to fp32 (10-step mean)")
    dx.set_xlabel("optimizer step")
    dx.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cpu-mem", default="112MiB", help="small enough that the optimizer state is not all cached")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--work", default="/tmp/tierlm-optim-states")
    ap.add_argument("--png", default="docs/optim-states-loss.png")
    ap.add_argument("--keep", action="store_true", help="keep --work (default: deleted at the end)")
    a = ap.parse_args()

    from tierlm.demo import stdlib_corpus
    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config, param_count

    work = Path(a.work)
    corpus = stdlib_corpus(work / "data" / "stdlib_docstrings.txt", max_bytes=2_000_000)
    config = make_config("llama", None, {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2,
                                         "intermediate": 688, "vocab": 2048, "max_positions": 256})
    n = param_count(config)
    model = work / "model"
    init_model(model, config, seed=0, tokenizer_text=[str(corpus)], overwrite=True)
    print(f"model: llama 4 layers, hidden 256, {n / 1e6:.2f}M parameters; corpus {corpus} "
          f"({corpus.stat().st_size / 1e6:.1f} MB)", flush=True)
    results = {}
    try:
        for mode in a.modes.split(","):
            results[mode] = summarise(run_mode(model, corpus, work / f"run-{mode}", mode, a), n)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{a.steps} steps, {a.batch_size}x{a.seq_len} tokens a step, --cpu-mem {a.cpu_mem}, {n / 1e6:.2f}M params")
    print("| states | SSD read/step | SSD write/step | s/step | mean loss | mean loss, last 10% | final loss |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        sps = f"{r['s_per_step']:.2f}"
        print(f"| {mode} | {r['read'] / 2**20:.1f} MiB ({r['read_per_param']:.1f} B/param) | "
              f"{r['write'] / 2**20:.1f} MiB ({r['write_per_param']:.1f} B/param) | {sps} | "
              f"{r['loss_mean']:.4f} | {r['loss_last10pct']:.4f} | {r['loss_final']:.4f} |")
    if "fp32" in results:
        plot(results, Path(a.png), f"llama 4x256 ({n / 1e6:.1f}M params) on stdlib docstrings: {a.steps} steps of "
             f"{a.batch_size}x{a.seq_len} tokens,\nAdamW lr {a.lr:g} cosine, no clipping, the same data order")
        print(f"loss curves: {a.png}")


if __name__ == "__main__":
    main()
