"""The planner's prediction against a measured `tierlm finetune` on this machine.

    tierlm bench io --nvme /path/on/ssd && tierlm bench compute
    python benchmarks/plan_vs_measured.py --work /path/on/ssd/planbench

For each configuration (two model sizes x two batch sizes x activations keep/recompute) it creates
the model once, runs `tierlm finetune` for a few steps in a fresh process, and compares the mean of
the steps after the first with `tierlm plan --hardware this` under the same --cpu-mem, batch,
sequence length and activation policy (--no-state-cache: today's engine streams all state through
the SSD; clipping off, so no step redoes its update). Prints one row per configuration: predicted and measured s/step, their ratio, the
predicted binding resource, and predicted against measured SSD bytes per step.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from tierlm.demo import stdlib_corpus
from tierlm.plan.command import hardware_from_measurements
from tierlm.plan.planner import Task, plan
from tierlm.plan.shapes import model_shape
from tierlm.units import parse_bytes

MODELS = {"llama-12m": ["--arch", "llama", "--layers", "4", "--hidden", "512"],
          "llama-28m": ["--arch", "llama", "--layers", "6", "--hidden", "640"]}


def run(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/tierlm-planbench")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--activations", default="keep,recompute")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--cpu-mem", default="1GiB")
    ap.add_argument("--reuse", action="store_true", help="compare runs already in --work instead of running them")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    if not corpus.exists():
        stdlib_corpus(corpus)
    from tierlm.bench import cache
    hw = hardware_from_measurements(cache.load())
    rows = []
    for name in a.models.split(","):
        model = work / name
        if not (model / "config.json").exists():
            run([sys.executable, "-m", "tierlm", "init", str(model), *MODELS[name]])
        shape = model_shape(str(model))
        for batch in map(int, a.batches.split(",")):
            for acts in a.activations.split(","):
                out = work / f"run-{name}-b{batch}-{acts}"
                if not (a.reuse and (out / "metrics.jsonl").exists()):
                    run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(corpus),
                        "--output", str(out), "--cpu-mem", a.cpu_mem, "--steps", str(a.steps), "--seq-len",
                        str(a.seq_len), "--batch-size", str(batch), "--activations", acts, "--lr", "1e-5",
                        "--max-grad-norm", "0"])
                m = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][1:]
                meas = sum(r["s_per_step"] for r in m) / len(m)
                ssd = sum(r["ssd_read_bytes"] + r["ssd_write_bytes"] for r in m) / len(m)
                p = plan(shape, hw, Task(batch=batch, seq_len=a.seq_len, activations=acts, state_cache=False,
                                         cpu_mem=parse_bytes(a.cpu_mem), clip="off"))
                pred_ssd = p.traffic_bytes["ssd_read"] + p.traffic_bytes["ssd_write"]
                rows.append((name, shape.params, batch, acts, p.step_s, meas, p.binding, pred_ssd, ssd,
                             {k: round(v, 3) for k, v in p.devices_s.items() if v}))
                subprocess.run(["rm", "-rf", str(out / "nvme")])  # the disk is shared; keep only metrics
    print(f"\nrates: {json.dumps(hw.measured['matmul_tflops'])} TFLOPS, AdamW "
          f"{hw.measured['adamw_elems_per_s'] / 1e9:.2f} G/s, NVMe r/w {hw.nvme_read_gbps:.2f}/"
          f"{hw.nvme_write_gbps:.2f} GB/s, memory {hw.measured['mem_gbps']:.1f} GB/s")
    print("| model | params | batch x seq | activations | predicted s/step | measured s/step | measured/predicted "
          "| binding (predicted) | SSD bytes/step predicted / measured | devices (predicted s) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, n, b, acts, pred, meas, bind, ps, ms, dev in rows:
        print(f"| {name} | {n / 1e6:.1f}M | {b} x {a.seq_len} | {acts} | {pred:.2f} | {meas:.2f} | {meas / pred:.2f} "
              f"| {bind} | {ps / 1e6:.0f} MB / {ms / 1e6:.0f} MB | {dev} |")


if __name__ == "__main__":
    main()
