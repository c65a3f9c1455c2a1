"""Inference benchmarks, side by side in one process (numbers for docs/inference.md).

    python benchmarks/infer_bench.py --preset tinyllama-1.1b --tokens 32          # in RAM, bf16 + int8 vs HF
    python benchmarks/infer_bench.py --layers 16 --hidden 1024 --stream-budget 200MiB --batches 1 8 32

In RAM: decode tokens/s at batch 1 against the memory roofline (measured read bandwidth / bytes
read per token) for each weight format, and against transformers.generate on the same model.
Streamed (--stream-budget): tokens/s at each batch against the SSD roofline (SSD bandwidth /
streamed bytes per forward x batch). Prefill: tokens/s and GFLOP/s against the measured matmul rate.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config, param_count
from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.infer.report import machine_rates
from tierlm.infer.sampling import SamplingParams


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


def run(model, weights, batch, tokens, prompt_len, cpu_mem, nvme, rates, resident_layers=None):
    cfg = InferConfig(cpu_mem=cpu_mem, weights=weights, max_batch=batch, max_seq_len=prompt_len + tokens,
                      nvme_dir=str(nvme), resident_layers=resident_layers, step_tokens=max(256, prompt_len))
    eng = InferenceEngine(model, cfg)
    b = Batcher(eng, _Tok(), [])
    prompt = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    # warm-up: the kernels' first calls and, streamed, the window's buffers
    b.submit(Request(prompt[:8], SamplingParams(max_tokens=2, ignore_eos=True)))
    b.run_until_idle()
    b.stats.__init__()
    for _ in range(batch):
        b.submit(Request(list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True)))
    b.run_until_idle()
    s = b.stats
    dec_s, dec_tok = s.s["decode"], s.tokens["decode"]
    per_fwd = eng.ram_weight_bytes()
    out = {"weights": weights, "batch": batch, "placement": eng.placement.describe(),
           "prefill_tok_s": s.tokens["prefill"] / s.s["prefill"],
           "prefill_gflops": 2 * eng.flop_params * s.tokens["prefill"] / s.s["prefill"] / 1e9,
           "decode_tok_s": dec_tok / dec_s,
           "decode_ram_gbps": s.ram["decode"] / dec_s / 1e9, "decode_ssd_gbps": s.ssd["decode"] / dec_s / 1e9,
           "bytes_per_forward": per_fwd, "kv_gbps": s.kv["decode"] / dec_s / 1e9}
    steps = s.steps["decode"]
    if eng.stream:
        streamed = s.ssd["decode"] / max(steps, 1)
        out["ssd_roofline_tok_s"] = rates["ssd_gbps"] * 1e9 / streamed * batch if streamed else None
        out["ssd_share"] = s.ssd["decode"] / (rates["ssd_gbps"] * 1e9) / dec_s
    out["mem_roofline_tok_s"] = rates["mem_gbps"] * 1e9 / (per_fwd + s.kv["decode"] / max(steps, 1)) * batch
    out["mem_share"] = (s.ram["decode"] + s.kv["decode"]) / (rates["mem_gbps"] * 1e9) / dec_s
    out["stall_s"] = eng.stream.stall_s if eng.stream else 0.0
    eng.close()
    return out


def hf_generate(model, tokens, prompt_len):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = torch.tensor([[(7 * i) % 200 + 3 for i in range(prompt_len)]])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    m.generate(ids[:, :8], max_new_tokens=2, **kw)
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
    tn = time.perf_counter() - t
    del m
    return {"hf_ttft_s": t1, "hf_decode_tok_s": (tokens - 1) / (tn - t1)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the model and stores go (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--formats", nargs="*", default=["bf16", "int8", "int4"])
    p.add_argument("--stream-budget", default=None, help="also run streamed under this --cpu-mem")
    p.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    p.add_argument("--no-hf", action="store_true")
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="tierlm-bench-"))
    over = {k: v for k, v in (("layers", a.layers), ("hidden", a.hidden)) if v is not None}
    config = make_config(None if a.preset else "llama", a.preset, over)
    model = root / "model"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        init_model(model, config, dtype="bfloat16", tokenizer=False)
        print(f"created {model} ({param_count(config) / 1e9:.2f}B parameters) in {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
    rates = machine_rates(str(root / "nvme"))
    print(json.dumps({"rates": rates}), flush=True)
    results = []
    if not a.stream_budget:
        for w in a.formats:
            r = run(model, w, 1, a.tokens, a.prompt_len, "20GiB", root / f"nvme-{w}", rates)
            results.append(r)
            print(json.dumps(r), flush=True)
        if not a.no_hf:
            r = hf_generate(model, a.tokens, a.prompt_len)
            results.append(r)
            print(json.dumps(r), flush=True)
    else:
        for bsz in a.batches:
            r = run(model, "bf16", bsz, a.tokens, a.prompt_len, a.stream_budget, root / "nvme-stream", rates)
            results.append(r)
            print(json.dumps(r), flush=True)
    return results


if __name__ == "__main__":
    main()
