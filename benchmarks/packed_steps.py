"""Requests arriving while others decode: packed steps against padded ones, side by side.

    flock /tmp/tierlm-bench.lock python benchmarks/packed_steps.py --dir /tmp/packbench

Continuous batching puts a new request's prompt chunk in the same step as the running requests'
one token each. Padded, every row is as long as the chunk; packed (`tierlm.infer.packed`), the
rows' tokens run as one sequence. The workload: `--requests` requests of `--prompt-len` tokens
and `--new` new tokens each, one submitted every `--gap` steps (arrivals counted in steps, so both
modes see the same schedule), greedy, fp32 (what this AVX2-only machine computes fast). The modes
alternate over `--rounds`; each round prints wall time, time to first token, the mixed steps'
mean time, the tokens each mode computed, and whether both generated the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config, param_count
from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.sampling import SamplingParams


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def workload(eng, a) -> dict:
    b = Batcher(eng, _Tok(), [])
    computed = []
    real_step = eng.step

    def step(tokens, starts):  # what the step computes: padded rows are as long as the longest
        lens = [len(t) for t in tokens]
        computed.append(sum(lens) if eng.cfg.packed else len(lens) * max(lens))
        ts = time.perf_counter()
        out = real_step(tokens, starts)
        if len(lens) > 1 and min(lens) == 1 < max(lens):  # a prompt chunk beside decoding rows
            mixed.append(time.perf_counter() - ts)
        return out
    eng.step = step
    reqs, mixed, n = [], [], 0
    t0 = time.perf_counter()
    while len(reqs) < a.requests or b.busy():
        if len(reqs) < a.requests and n % a.gap == 0:
            prompt = [(7 * i + 13 * len(reqs)) % 200 + 3 for i in range(a.prompt_len)]
            reqs.append(b.submit(Request(prompt, SamplingParams(max_tokens=a.new, ignore_eos=True))))
        b.step()
        n += 1
    wall = time.perf_counter() - t0
    del eng.step
    ttft = [r.t_first - r.t_submit for r in reqs]
    return {"packed": eng.cfg.packed, "wall_s": wall, "steps": n, "ttft_mean_s": statistics.mean(ttft),
            "ttft_max_s": max(ttft), "mixed_steps": len(mixed),
            "mixed_step_mean_s": statistics.mean(mixed) if mixed else None,
            "tokens_computed": sum(computed), "tokens_real": sum(len(r.prompt_ids) + len(r.out_ids) - 1 for r in reqs),
            "out": [r.out_ids for r in reqs]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="folder for the model (created once, reused)")
    p.add_argument("--preset", default=None, help="a published shape (default: a 304M-parameter llama: 8 layers, hidden 1536, vocabulary 32000)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=192)
    p.add_argument("--new", type=int, default=24)
    p.add_argument("--gap", type=int, default=4, help="steps between two arrivals")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    a = p.parse_args()
    root = Path(a.dir)
    over = {} if a.preset else {"layers": 8, "hidden": 1536, "heads": 24, "kv_heads": 8,
                                "intermediate": 4224, "vocab": 32000}
    config = make_config(None if a.preset else "llama", a.preset, over)
    model = root / "model"
    if not (model / "config.json").exists():
        init_model(model, config, dtype="float32", tokenizer=False)
        print(f"created {model} ({param_count(config) / 1e6:.0f}M parameters)", file=sys.stderr)
    if a.threads:
        torch.set_num_threads(a.threads)
    print(json.dumps({"load_before": os.getloadavg(), "threads": torch.get_num_threads()}), flush=True)
    engines = {}
    for packed in (True, False):
        cfg = InferConfig(cpu_mem="16GiB", dtype="fp32", max_batch=a.requests,
                          max_seq_len=a.prompt_len + a.new, step_tokens=256, packed=packed,
                          nvme_dir=str(root / "nvme"))
        engines[packed] = InferenceEngine(model, cfg)
    results = {True: [], False: []}
    for r in range(a.rounds):
        for packed in ((True, False) if r % 2 == 0 else (False, True)):
            res = workload(engines[packed], a)
            results[packed].append(res)
            print(json.dumps({k: v for k, v in res.items() if k != "out"}), flush=True)
    same = all(x["out"] == results[True][0]["out"] for x in results[True] + results[False])
    for e in engines.values():
        e.close()
    best = {k: min(v, key=lambda x: x["wall_s"]) for k, v in results.items()}
    ratio = best[False]["wall_s"] / best[True]["wall_s"]
    mixed = [best[k]["mixed_step_mean_s"] for k in (False, True)]
    mix = f"{mixed[0] / mixed[1]:.2f}x a mixed step" if all(mixed) else "no mixed steps"
    print(json.dumps({"load_after": os.getloadavg(), "same_tokens": same}))
    print(f"| mode | wall s (best of {a.rounds}) | mean TTFT s | mixed step s | tokens computed |")
    print("|---|---|---|---|---|")
    for k, name in ((False, "padded"), (True, "packed")):
        x = best[k]
        print(f"| {name} | {x['wall_s']:.2f} | {x['ttft_mean_s']:.2f} | {x['mixed_step_mean_s'] or 0:.3f} | "
              f"{x['tokens_computed']} |")
    print(f"packed against padded: {ratio:.2f}x the workload, {mix}; same tokens: {same}")


if __name__ == "__main__":
    main()
