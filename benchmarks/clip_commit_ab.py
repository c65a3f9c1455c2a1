"""Exact clipping and the durability interval, side by side in one sitting: `tierlm finetune` on one
model, data and budget with clipping off, clipping on (the default: --clip-path auto, which holds
when steps clip, and --commit-every auto), and the previous behaviour (a speculative update
redone on every step that clips, a commit every step). Each run is a process of its own; the
steady s/step is the mean of steps 3..N (the first two create both state slots' files), with the
peak RSS beyond the libraries and the share of steps that committed.

    flock /tmp/tierlm-bench.lock python benchmarks/clip_commit_ab.py MODEL --data FILE \
        --cpu-mem 2GiB --steps 8 --work DIR [-- more finetune flags]

Prints the machine, a markdown table and the ratios to the clip-off run.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout
from tierlm.bench.machine import machine_kind, machine_line  # noqa: E402

VARIANTS = {  # name: finetune flags
    "clip off": ["--max-grad-norm", "0"],
    "clip on (auto: hold, commit auto)": ["--max-grad-norm", "1.0"],
    "clip on, speculate + redo, commit every step": ["--max-grad-norm", "1.0", "--clip-path", "speculate",
                                                     "--commit-every", "1"],
    "clip off, commit every step": ["--max-grad-norm", "0", "--commit-every", "1"],
}


def run(name: str, flags: list[str], args, extra: list[str]) -> dict:
    out = Path(args.work) / name.replace(" ", "_").replace(",", "").replace(":", "").replace("(", "").replace(")", "")
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tierlm", "finetune", args.model, "--data", args.data, "--output", str(out),
           "--cpu-mem", args.cpu_mem, "--steps", str(args.steps), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--timeline-step", "3", *flags, *extra]
    print("$ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{name}: finetune failed:\n{r.stderr[-3000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steady = rows[2:]
    res = {"s_per_step": sum(x["s_per_step"] for x in steady) / len(steady),
           "peak_rss": max(x["peak_rss_bytes"] for x in rows),
           "committed": sum(bool(x.get("committed", True)) for x in steady), "steady": len(steady),
           "clip_paths": sorted({x.get("clip_path", "") for x in rows}),
           "cpu_s": {k: sum(x["cpu_s"].get(k, 0.0) for x in steady) / len(steady) for k in steady[-1]["cpu_s"]},
           "final_sha": sorted(p.name for p in (out / "final").glob("*.safetensors")),
           "commit_line": next((ln for ln in r.stderr.splitlines() if ln.startswith("commit:")), "")}
    shutil.rmtree(out / "nvme", ignore_errors=True)  # the state is the big part; metrics stay
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", required=True)
    ap.add_argument("--cpu-mem", default="2GiB")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", nargs="*", help="variants to run (default: all)")
    args, extra = ap.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    print(machine_line(machine_kind()), flush=True)
    results = {}
    for name, flags in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        results[name] = run(name, flags, args, extra)
        r = results[name]
        print(f"{name}: {r['s_per_step']:.2f} s/step, peak {r['peak_rss'] / 2**30:.2f} GiB, committed "
              f"{r['committed']}/{r['steady']} steady steps, clip path {r['clip_paths']} {r['commit_line']}", flush=True)
    base = results.get("clip off")
    print(f"\n{machine_line(machine_kind())}\n")
    print(f"| run (--cpu-mem {args.cpu_mem}, {args.batch_size}x{args.seq_len}) | s/step (steps 3-{args.steps}) "
          f"| vs clip off | peak RSS | steps committed | CPU s/step (top 4) |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        ratio = f"{r['s_per_step'] / base['s_per_step']:.2f}x" if base else "-"
        top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["cpu_s"].items(), key=lambda kv: -kv[1])[:4])
        print(f"| {name} | {r['s_per_step']:.2f} | {ratio} | {r['peak_rss'] / 2**30:.2f} GiB "
              f"| {r['committed']}/{r['steady']} | {top} |")
    Path(args.work, "clip_commit_ab.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
