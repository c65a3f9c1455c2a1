"""The planner's prediction against measured `tierlm finetune` and `tierlm generate` on this machine.

    flock /tmp/tierlm-bench.lock python benchmarks/plan_vs_measured.py --work /path/on/ssd/planbench \
        --bench /path/on/ssd --activations keep,swap,recompute

`--bench DIR` first measures the rates (`bench io` in DIR, 1 GiB, and `bench compute`: matmul, two
reference decoder layers, the one-row decode product, AdamW, the engine's fixed costs on tiny
models), so on a shared machine the rates and the runs see about the same load. For each
configuration (two model sizes x two batch sizes x each activation policy) it creates the model once,
runs `tierlm finetune` for a few steps in a fresh process, and compares the measured step with
`tierlm plan --hardware this` under the same --cpu-mem, batch, sequence length and activation policy
(clipping off, so no step redoes its update). Then `tierlm generate` decodes with every layer in RAM
and with every layer streamed from the SSD, against the plan's decode tokens/s.

Measured step = the wall time between consecutive steps' metrics rows (steps 2..N), mean and
fastest: it includes the commit (syncfs, manifest) that `s_per_step` leaves out, since the next step
waits for it. Measured SSD bytes are the state store's; swapped activations go to a store of their
own and are not in them (the prediction's are). `--reuse` compares runs already in --work without
running them again. Nothing here is fitted to the runs.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tierlm.demo import stdlib_corpus
from tierlm.advise.command import hardware_from_measurements
from tierlm.plan.planner import Task, plan
from tierlm.advise.models import model_shape
from tierlm.units import parse_bytes

# Realistic shapes (head dim 64, grouped KV heads), small enough for a few minutes a run.
MODELS = {"llama-48m": ["--arch", "llama", "--layers", "4", "--hidden", "1024", "--heads", "16",
                        "--kv-heads", "8", "--max-positions", "1024"],
          "llama-208m": ["--arch", "llama", "--layers", "8", "--hidden", "1536", "--heads", "24",
                         "--kv-heads", "8", "--max-positions", "1024"]}
# RAM enough to keep every optimizer shard resident (the state cache), so the SSD carries the
# write-through state and the weights; see docs/planner.md at a2b1c1e for why not a partial cache.
CPU_MEM = {"llama-48m": "2GiB", "llama-208m": "6GiB"}
# Decoding: every layer resident, or every layer streamed from the SSD (the budget leaves no room
# for a resident one beside the window of three).
INFER_MEM = {"in RAM": "2GiB", "streamed": "250MiB"}
PROMPT = "The planner predicts how long a step takes on this machine, and the benchmark checks it"


def run(cmd: list[str], log: Path) -> None:
    print("$ " + " ".join(cmd), flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)


def measured(out: Path) -> dict:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    if any(r["skipped"] for r in rows):
        raise SystemExit(f"{out}: a step was skipped (non-finite loss); its time is not a step's")
    full = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    later = rows[1:]
    return {"step_s": sum(full) / len(full), "best_s": min(full), "s_per_step": sum(r["s_per_step"] for r in later) / len(later),
            "ssd_read": sum(r["ssd_read_bytes"] for r in later) / len(later),
            "ssd_write": sum(r["ssd_write_bytes"] for r in later) / len(later)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/tierlm-planbench")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--activations", default="keep,recompute")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--reuse", action="store_true", help="compare runs already in --work instead of running them")
    ap.add_argument("--infer-models", default="llama-208m", help="models to decode with (empty: none)")
    ap.add_argument("--infer-weights", default="bf16",
                    help="weight formats of the in-RAM decode rows, e.g. bf16,int8,int4 (streamed rows: bf16)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--skip-train", action="store_true")
    ap.add_argument("--stream-repeats", type=int, default=3,
                    help="streamed decode runs, each between two `bench io` of the store's drive (with --bench)")
    ap.add_argument("--bench", metavar="NVME_DIR", help="measure the rates first (bench io in NVME_DIR, 1 GiB, and "
                    "bench compute), so rates and runs see the same load on a shared machine")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.txt"
    if not corpus.exists():
        stdlib_corpus(corpus)
    from tierlm.bench import cache
    load0 = os.getloadavg()[0]
    if a.bench and not a.reuse:
        from tierlm.advise.command import run_bench
        run_bench("io", a.bench, size=1 << 30)
        run_bench("compute", a.bench)
    hw = hardware_from_measurements(cache.load())
    rows = []
    for name in a.models.split(","):
        model = work / name
        if not (model / "config.json").exists():
            run([sys.executable, "-m", "tierlm", "init", str(model), *MODELS[name]], work / f"init-{name}.log")
        shape = model_shape(str(model))
        for batch in ([] if a.skip_train else map(int, a.batches.split(","))):
            for acts in a.activations.split(","):
                out = work / f"run-{name}-b{batch}-{acts}"
                if not (a.reuse and (out / "metrics.jsonl").exists()):
                    run([sys.executable, "-m", "tierlm", "finetune", str(model), "--data", str(corpus),
                         "--output", str(out), "--cpu-mem", CPU_MEM[name], "--steps", str(a.steps), "--seq-len",
                         str(a.seq_len), "--batch-size", str(batch), "--activations", acts, "--lr", "1e-5",
                         "--max-grad-norm", "0", "--timeline-step", "0", "--overwrite"], out.with_suffix(".log"))
                    subprocess.run(["rm", "-rf", str(out / "nvme"), str(out / "final")])  # keep only metrics
                m = measured(out)
                p = plan(shape, hw, Task(batch=batch, seq_len=a.seq_len, activations=acts,
                                         cpu_mem=parse_bytes(CPU_MEM[name]), clip="off"))
                rows.append({"model": name, "params": shape.params, "batch": batch, "seq_len": a.seq_len,
                             "activations": acts, "cpu_mem": CPU_MEM[name], "predicted_s": p.step_s,
                             "measured_s": m["step_s"], "best_s": m["best_s"], "measured_s_per_step": m["s_per_step"],
                             "binding": p.binding, "pred_ssd": p.traffic_bytes["ssd_read"] + p.traffic_bytes["ssd_write"],
                             "meas_ssd": m["ssd_read"] + m["ssd_write"],
                             "devices": {k: round(v, 2) for k, v in p.devices_s.items() if v}})
    inf = []
    for name in (a.infer_models.split(",") if a.infer_models else []):
        for fmt in a.infer_weights.split(","):
            inf.append(infer_row(work, name, "in RAM", a.new_tokens, hw, a.reuse, weights=fmt))
        for rep in range(a.stream_repeats):
            inf.append(streamed_row(work, name, a.new_tokens, a.bench, rep, a.reuse))
    io = hw.measured["nvme"]
    print(f"\nrates: {json.dumps({k: round(v, 3) for k, v in hw.measured['matmul_tflops'].items()})} TFLOPS, "
          f"AdamW {hw.measured['adamw_elems_per_s'] / 1e9:.2f} G/s, NVMe r/w {io['read_gbps']:.2f}/"
          f"{io['write_gbps']:.2f} GB/s, memory {hw.measured['mem_gbps']:.1f} GB/s, "
          f"layer TFLOPS by tokens and width {json.dumps(hw.measured.get('layer_tflops_by_tokens') or hw.measured.get('layer_tflops'))}, "
          f"compute/SSD overlap {hw.measured.get('overlap')}, batch-1 decode step "
          f"{json.dumps(hw.measured.get('decode_gbps') or hw.measured.get('gemv_gbps'))} GB/s, CRC32C {hw.measured.get('crc32c_gbps') or 0:.1f} GB/s, overheads {json.dumps(hw.measured.get('overhead'))}; "
          f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| model | params | batch x seq | activations | --cpu-mem | predicted s/step | measured s/step (mean; "
          "fastest) | measured/predicted (mean; fastest) | binding (predicted) | SSD bytes/step predicted / measured | devices (predicted s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['params'] / 1e6:.1f}M | {r['batch']} x {r['seq_len']} | {r['activations']} | "
              f"{r['cpu_mem']} | {r['predicted_s']:.2f} | {r['measured_s']:.2f}; {r['best_s']:.2f} | "
              f"{r['measured_s'] / r['predicted_s']:.2f}; {r['best_s'] / r['predicted_s']:.2f} | {r['binding']} | {r['pred_ssd'] / 1e6:.0f} MB / "
              f"{r['meas_ssd'] / 1e6:.0f} MB | {r['devices']} |")
    print("\n| model | weights | --cpu-mem | resident layers (engine) | predicted decode tok/s | measured decode tok/s "
          "| measured/predicted | binding (predicted) | resources (predicted s/token) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in inf:
        if "read_gbps" in r:
            print(f"| {r['model']} | {r['mode']} (bench io read {r['read_gbps'][0]:.2f} before, {r['read_gbps'][1]:.2f} after) "
                  f"| {r['cpu_mem']} | {r['resident']} | {r['predicted_tok_s']:.2f} | "
                  f"{r['measured_tok_s']:.2f} | {r['measured_tok_s'] / r['predicted_tok_s']:.2f} | {r['binding']} | "
                  f"{r['resources']} |")
            continue
        print(f"| {r['model']} | {r['mode']} | {r['cpu_mem']} | {r['resident']} | {r['predicted_tok_s']:.2f} | "
              f"{r['measured_tok_s']:.2f} | {r['measured_tok_s'] / r['predicted_tok_s']:.2f} | {r['binding']} | "
              f"{r['resources']} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"train": rows, "decode": inf}, indent=2) + "\n")


def streamed_row(work: Path, name: str, new_tokens: int, bench: str | None, rep: int, reuse: bool) -> dict:
    """Streamed decoding is bound by the drive's read rate, which on a virtual disk moves several-fold
    within an hour (docs/planner.md at a2b1c1e): `bench io` of the same drive runs right before and right after
    the decode, and the plan uses the mean of the two read rates (the rest of the cache as measured)."""
    from tierlm.bench import cache
    from tierlm.advise.command import run_bench

    if bench is None:  # no drive to measure: the cached rates, once
        return infer_row(work, name, "streamed", new_tokens, hardware_from_measurements(cache.load()), reuse)
    before = run_bench("io", bench, size=1 << 30, quiet=True)["read_gbps"]
    tag = f"streamed-{rep}"
    infer_row(work, name, "streamed", new_tokens, None, reuse, tag=tag)  # the run; re-planned below
    after = run_bench("io", bench, size=1 << 30, quiet=True)["read_gbps"]
    m = cache.load()
    m["io"] = dict(m["io"], read_gbps=(before + after) / 2)
    return infer_row(work, name, "streamed", new_tokens, hardware_from_measurements(m), True, tag=tag) | {
        "read_gbps": (before, after)}


def infer_row(work: Path, name: str, mode: str, new_tokens: int, hw, reuse: bool, tag: str | None = None,
              weights: str = "bf16") -> dict:
    """Runs `tierlm generate` unless reusing its report; with hw=None only runs it."""
    from tierlm.hf.checks import load_tokenizer

    model = work / name
    fmt = "" if weights == "bf16" else f"-{weights}"
    out = work / f"gen-{name}-{(tag or mode).replace(' ', '-')}{fmt}.json"
    if not (reuse and out.exists()):
        run([sys.executable, "-m", "tierlm", "generate", str(model), "--cpu-mem", INFER_MEM[mode], "--prompt", PROMPT,
             "--max-new-tokens", str(new_tokens), "--ignore-eos", "--nvme", str(work / f"store-{name}{fmt}"),
             "--weights", weights, "--json", str(out)], out.with_suffix(".log"))
    if hw is None:
        return {}
    rep = json.loads(out.read_text())
    prompt = len(load_tokenizer(str(model))(PROMPT).input_ids)
    p = plan(model_shape(str(model)), hw, Task(kind="serve", batch=1, seq_len=prompt, new_tokens=new_tokens,
                                               cpu_mem=parse_bytes(INFER_MEM[mode]), weights=weights))
    return {"model": name, "mode": f"{mode}, {weights}", "cpu_mem": INFER_MEM[mode], "resident": rep["placement"]["resident"],
            "predicted_tok_s": p.extra["decode_tokens_per_s"], "measured_tok_s": rep["decode"]["tok_s"],
            "binding": p.binding, "resources": {k: round(v, 4) for k, v in p.resources_s.items() if v}}


if __name__ == "__main__":
    main()
