"""The activation planner against a sweep of fixed policies, at a long sequence under a small budget.

    python benchmarks/activation_sweep.py --preset qwen2.5-0.5b --layers 4 --vocab 2048 --seq-len 16384 --cpu-mem 4GiB

Creates the model (the preset's layer shapes; --layers keeps N decoder layers and --vocab shrinks
the head, so that a sweep fits on a small machine: the head's work is the same under every policy,
and 16K tokens of a 152K-entry vocabulary would need 10+ GB of logits) and a corpus from the standard library's docstrings, then
runs `tierlm finetune` once per policy in a fresh process: --activations auto (the planner), swap
(every layer to NVMe), recompute, and swap fractions in between (the first k layers swapped, the
rest recomputed). Step 1 warms up; auto re-plans after every step until two consecutive steps
agree (normally after step 3); the step time reported is the mean of steps 4 and later, for every policy. Prints, per policy: measured s/step, the plan's predicted s/step, the
bytes swapped, and the planner's measured time against the best of the sweep.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tierlm.demo import stdlib_corpus
from tierlm.hf.presets import make_config


def run(model: Path, corpus: Path, work: Path, policy: str, a) -> dict:
    tag = policy.replace(",", "")[:40] if "," not in policy else f"mix{policy.count('swap')}"
    out = work / f"run-{tag}"
    cmd = [sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(corpus), "--output", str(out),
           "--nvme", str(work / "nvme"), "--cpu-mem", a.cpu_mem, "--steps", str(a.steps), "--seq-len",
           str(a.seq_len), "--batch-size", "1", "--lr", "1e-5", "--overwrite", "--activations", policy,
           "--timeline-step", str(a.steps)]
    t = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if res.returncode != 0:
        return {"policy": policy, "error": res.stderr.strip().splitlines()[-1] if res.stderr else "failed"}
    plan = json.loads((out / "plan.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    # The same steps for every policy: those after the first three (step 1 warms up; auto's plan
    # settles after step 3 when steps 2 and 3 agree). plan.json's own "measured_since_plan" starts
    # later when a disturbed step delayed the settling.
    steps = plan["steps"]
    tail = [h["step_s"] for h in steps[3:]] or [steps[-1]["step_s"]]
    last = steps[-1]
    return {"policy": policy, "measured_s": sum(tail) / len(tail), "steps_s": [round(h["step_s"], 2) for h in steps],
            "settled": plan.get("profile_settled"), "plan_after_step": plan["plan"]["made_after_step"],
            "load": os.getloadavg(), "predicted_s": plan["plan"]["predicted"]["step_s"],
            "chosen": plan["plan"]["layers"], "reason": plan["plan"]["reason"],
            "swapped_gb": last["swapped_bytes"]["nvme"] / 1e9, "peak_rss": summary["peak_rss_bytes"],
            "acts_gb": sum(p["act_bytes"] for p in plan["profile"]) / 1e9, "wall_s": wall,
            "timeline": str(out / "timeline.png")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen2.5-0.5b")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers")
    ap.add_argument("--vocab", type=int, default=None, help="a smaller vocabulary (the head is the same work under every policy)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--cpu-mem", default="2GiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fractions", default="0.5", help="swap fractions between all-recompute and all-swap")
    ap.add_argument("--work", default="/tmp/tierlm-act-sweep")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (it holds the model and NVMe state)")
    a = ap.parse_args()

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    over = {k: v for k, v in (("layers", a.layers), ("vocab", a.vocab)) if v}
    config = make_config(None, a.preset, over)
    layers = config.num_hidden_layers
    model = work / "model"
    if not (model / "config.json").exists():
        extra = [f"--{k}={v}" for k, v in over.items()]
        subprocess.run([sys.executable, "-m", "tierlm", "init", str(model), "--preset", a.preset,
                        f"--max-positions={max(a.seq_len, 2048)}"] + extra, check=True)
    corpus = work / "corpus.txt"
    if not corpus.exists():
        stdlib_corpus(corpus)
    fixed = ["swap", "recompute"]
    for f in a.fractions.split(","):
        k = round(float(f) * layers)
        if 0 < k < layers:
            fixed.append(",".join(["swap"] * k + ["recompute"] * (layers - k)))
    rows = [run(model, corpus, work, p, a) for p in ["auto"] + fixed]
    print(f"\n{a.preset} ({layers} layers), seq {a.seq_len}, --cpu-mem {a.cpu_mem}, {a.steps} steps per policy")
    print(f"{'policy':<28} {'measured s/step':>15} {'predicted':>10} {'pred/meas':>9} {'swapped GB':>10} {'peak RSS GiB':>12}")
    for r in rows:
        if "error" in r:
            print(f"{r['policy'][:28]:<28} error: {r['error']}")
            continue
        name = r["policy"] if "," not in r["policy"] else f"swap {r['policy'].count('swap')}/{layers}"
        print(f"{name:<28} {r['measured_s']:>15.2f} {r['predicted_s']:>10.2f} {r['predicted_s'] / r['measured_s']:>9.2f} "
              f"{r['swapped_gb']:>10.2f} {r['peak_rss'] / 2**30:>12.2f}   steps {r['steps_s']} load {r['load'][0]:.1f}")
    ok = [r for r in rows if "error" not in r]
    auto = next((r for r in ok if r["policy"] == "auto"), None)
    sweep = [r for r in ok if r["policy"] != "auto"]
    if auto and sweep:
        best = min(sweep, key=lambda r: r["measured_s"])
        print(f"\nactivations {auto['acts_gb']:.2f} GB per step; planner chose: {auto['reason']}")
        print(f"planner measured {auto['measured_s']:.2f} s/step = {auto['measured_s'] / best['measured_s']:.3f}x the best "
              f"of the sweep ({best['policy'] if ',' not in best['policy'] else 'swap fraction'}: {best['measured_s']:.2f} s); "
              f"its prediction {auto['predicted_s']:.2f} s = {auto['predicted_s'] / auto['measured_s']:.3f}x its measured")
        print(f"timeline of the planner's run: {auto['timeline']}")
    (work / "sweep.json").write_text(json.dumps(rows, indent=1) + "\n")
    if not a.keep:
        shutil.rmtree(work / "nvme", ignore_errors=True)


if __name__ == "__main__":
    main()
