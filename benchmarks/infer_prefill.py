"""Prefill tokens/s of each weight format, int8/int4 on the 8-bit integer kernel (kernels/qgemm.c)
and on the fallback (PyTorch's int8 kernel, int4 dequantised to fp32), side by side in one process.

    flock /tmp/tierlm-bench.lock python benchmarks/infer_prefill.py --preset tinyllama-1.1b --threads 2

TIERLM_NATIVE_ISA=avx2 measures our kernels' AVX2 path on an AVX-512 CPU; ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 cap PyTorch's (the fallback's) the same way, as
on an AVX2-only CPU. The first line printed names both.

One engine per format (resident), one prompt of --prompt-len tokens prefilled into a KV slot per
measurement; each round measures every variant in turn (drift hits all alike), and the table shows
the best round of each (a run sharing the cores with other work slows some rounds, never speeds
one up).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config
from tierlm.infer import native, qgemm, quant
from tierlm.infer.engine import InferConfig, InferenceEngine


def prefill_s(eng, prompt: list[int]) -> float:
    t = time.perf_counter()
    eng.step([prompt], [0])
    return time.perf_counter() - t


def measure(model: Path, weights: str, prompt_len: int, threads: int, rounds: int, nvme: Path) -> dict:
    """{variant: [seconds of each round]}: "integer" and "fallback" for int8/int4, "as is" else."""
    cfg = InferConfig(cpu_mem="20GiB", weights=weights, max_batch=1, max_seq_len=prompt_len + 8,
                      nvme_dir=str(nvme), step_tokens=max(256, prompt_len))
    eng = InferenceEngine(model, cfg)
    torch.set_num_threads(threads)
    prompt = [(7 * i) % 200 + 3 for i in range(prompt_len)]
    variants = {"integer": True, "fallback": False} if weights in quant.MODES else {"as is": True}
    times = {v: [] for v in variants}
    try:
        for on in variants.values():  # warm-up: first calls, scratch buffers
            quant.use_integer_rows(on)
            prefill_s(eng, prompt)
        for _ in range(rounds):
            for v, on in variants.items():
                quant.use_integer_rows(on)
                times[v].append(prefill_s(eng, prompt))
    finally:
        quant.use_integer_rows(True)
        eng.close()
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the model goes (default: a temp dir)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--formats", nargs="*", default=["bf16", "int8", "int4"])
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="tierlm-prefill-"))
    over = {k: v for k, v in (("layers", a.layers), ("hidden", a.hidden)) if v is not None}
    model = root / "model"
    if not (model / "config.json").exists():
        init_model(model, make_config(None if a.preset else "llama", a.preset, over), dtype="bfloat16", tokenizer=False)
    print(json.dumps({"kernels": native.isa(), "integer_rows": qgemm.fast(), "threads": a.threads,
                      "torch_cpu": torch.backends.cpu.get_cpu_capability(), "prompt_len": a.prompt_len}),
          flush=True)
    rows = []
    for w in a.formats:
        for v, ts in measure(model, w, a.prompt_len, a.threads, a.rounds, root / f"nvme-{w}").items():
            r = {"weights": w, "variant": v, "tok_s": a.prompt_len / min(ts), "rounds_s": ts}
            print(json.dumps(r), flush=True)
            rows.append(r)
    print(f"\n| weights | products | prefill tok/s ({a.prompt_len} tokens, {a.threads} threads, best of {a.rounds}) |")
    print("|---|---|---|")
    for r in rows:
        how = {"integer": "8-bit x, integer sums (qgemm)", "fallback": "x as is (fallback)"}.get(r["variant"], "bf16/fp32")
        print(f"| {r['weights']} | {how} | {r['tok_s']:.1f} |")


if __name__ == "__main__":
    main()
