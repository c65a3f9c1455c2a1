"""Decode on a GPU against its bounds: layers resident in GPU memory against the card's memory
bandwidth, and layers streamed from pinned host memory against the host-to-device copy rate.

    python benchmarks/gpu_decode.py --preset qwen2.5-7b --layers 8 --json gpu_decode.json

A model of the preset's shape (tierlm.hf.presets; --layers decoder layers) is written with random
weights (tierlm.hf.init) to --dir, once. Then, on one GPU:
- the pinned host -> device rate: a buffer registered with CUDA as the engine pins its host layers
  (tierlm.storage.aligned), copied to the device, best of --repeats;
- the device memory rate: a device-to-device copy, (bytes read + bytes written) / time, best of
  --repeats;
- resident decode: every layer in GPU memory (`tierlm generate --device cuda`'s placement under a
  --gpu-mem that holds them); tok/s against bandwidth / (weight bytes a token reads + KV bytes);
- streamed decode: every decoder layer copied from pinned host RAM each step (--resident-layers 0),
  the next one's copy overlapped with this one's compute; tok/s against H2D rate / (bytes copied a
  token, counted by the schedule).
Batch 1, greedy, a --prompt-tokens prompt then --tokens decode steps timed (logits reach the host
every step, so the time covers the GPU's work). Writes every figure and the machine to --json.
Exits with status 2 and says so where PyTorch sees no CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

import torch  # noqa: E402

from tierlm.bench.machine import machine_line  # noqa: E402
from tierlm.units import fmt_bytes  # noqa: E402

GIB = 1 << 30


def pinned_h2d_gbps(nbytes: int, repeats: int) -> float:
    from tierlm.storage.aligned import aligned_empty
    src = aligned_empty(nbytes, pin=True)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return src.numel() / best / 1e9


def device_copy_gbps(nbytes: int, repeats: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.fill_(1)
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9  # each byte read once and written once


def make_model(d: Path, preset: str, layers: int | None) -> None:
    if (d / "config.json").exists():
        return
    from tierlm.hf.init import init_model
    from tierlm.hf.presets import make_config
    config = make_config(preset=preset, overrides={"layers": layers} if layers else None)
    init_model(d, config, dtype="bfloat16", tokenizer=False)


def decode(d: Path, args, **place) -> dict:
    from tierlm.infer.engine import InferConfig, InferenceEngine
    cfg = InferConfig(cpu_mem=args.cpu_mem, weights=args.weights, nvme_dir=str(Path(args.dir) / "store"), max_batch=1,
                      max_seq_len=args.prompt_tokens + args.tokens + 1, device="cuda", **place)
    eng = InferenceEngine(d, cfg, library_rss=0)
    try:
        vocab = eng.config.vocab_size
        prompt = [(7 * i + 3) % vocab for i in range(args.prompt_tokens)]
        tok = int(eng.step([prompt], [0])[0].argmax())
        eng.step([[tok]], [len(prompt)])  # one warm-up decode step (kernels chosen, copies under way)
        copied0 = eng.dev.layers.copied_bytes if eng.dev.layers else 0
        kv0 = eng.cache.bytes_read
        pos = len(prompt) + 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.tokens):
            tok = int(eng.step([[tok]], [pos])[0].argmax())  # the logits come to the host: the step is done
            pos += 1
        dt = time.perf_counter() - t0
        copied = (eng.dev.layers.copied_bytes if eng.dev.layers else 0) - copied0
        layer_idx = [b.index for b in eng.blocks if b.kind == "layer"]
        layer_bytes = sum(p.nbytes for i in layer_idx for p in eng.pieces[i])
        head = eng.config.vocab_size * eng.config.hidden_size * torch.empty((), dtype=eng.dtype).element_size()
        return {"describe": eng.describe(), "device_placement": eng.dev.placement.__dict__,
                "tokens": args.tokens, "decode_s": dt, "tok_s": args.tokens / dt,
                "layer_bytes": layer_bytes, "head_bytes": head,
                "kv_bytes_per_token": (eng.cache.bytes_read - kv0) / args.tokens,
                "copied_bytes_per_token": copied / args.tokens,
                "peak_gpu_bytes": torch.cuda.max_memory_allocated()}
    finally:
        eng.close()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen2.5-7b")
    ap.add_argument("--layers", type=int, default=8, help="decoder layers of the preset's shape (0: the preset's)")
    ap.add_argument("--dir", default="/tmp/gpu-decode", help="where the model and its store are written")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "int8", "int4"))
    ap.add_argument("--cpu-mem", default="64GiB", help="host memory for the streamed layers (pinned)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--copy-size", default="1GiB", help="bytes of the H2D and device copy measurements")
    ap.add_argument("--json", default="gpu_decode.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode.py: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is False); run it on a "
              "GPU machine with a CUDA build of torch", file=sys.stderr)
        return 2
    from tierlm.units import parse_bytes
    size = parse_bytes(args.copy_size, "--copy-size")
    d = Path(args.dir) / f"{args.preset}-{args.layers or 'all'}"
    make_model(d, args.preset, args.layers or None)
    h2d = pinned_h2d_gbps(size, args.repeats)
    hbm = device_copy_gbps(size, args.repeats)
    print(f"{torch.cuda.get_device_name()}: pinned H2D {h2d:.1f} GB/s, device copy {hbm:.0f} GB/s", flush=True)
    out = {"machine": machine_line(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "preset": args.preset, "layers": args.layers, "weights": args.weights,
           "pinned_h2d_gbps": h2d, "device_copy_gbps": hbm}
    res = decode(d, args)
    per_token = res["layer_bytes"] + res["head_bytes"] + res["kv_bytes_per_token"]
    res["bound_tok_s"] = hbm * 1e9 / per_token
    res["of_bound"] = res["tok_s"] / res["bound_tok_s"]
    out["resident"] = res
    print(f"resident: {res['tok_s']:.1f} tok/s, {res['of_bound']:.0%} of {res['bound_tok_s']:.0f} tok/s "
          f"(device copy rate / {fmt_bytes(per_token)} a token)", flush=True)
    res = decode(d, args, resident_layers=0)
    res["bound_tok_s"] = h2d * 1e9 / max(res["copied_bytes_per_token"], 1)
    res["of_bound"] = res["tok_s"] / res["bound_tok_s"]
    out["streamed"] = res
    print(f"streamed: {res['tok_s']:.2f} tok/s, {res['of_bound']:.0%} of {res['bound_tok_s']:.2f} tok/s "
          f"(pinned H2D rate / {fmt_bytes(res['copied_bytes_per_token'])} copied a token)", flush=True)
    Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
