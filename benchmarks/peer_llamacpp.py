"""llama.cpp beside tierlm, per weight format, on the same weights in one run: prefill and decode tokens/s.

    benchmarks/peers/build_llama_cpp.sh          # once: llama.cpp built at /work/peers/llama.cpp
    flock /tmp/tierlm-bench.lock python benchmarks/peer_llamacpp.py --llama-cpp /work/peers/llama.cpp \
        --preset tinyllama-1.1b --threads 2 --json llamacpp_peer.json

A model of the preset's shape is created with random weights (tierlm.hf.init, with a byte-level
tokenizer the converter reads), converted by llama.cpp's own convert_hf_to_gguf.py to BF16 (the
checkpoint's own bits, as tierlm's bf16 serves them), then quantized to Q8_0 and Q4_0 by
llama-quantize. Per format, llama-bench (prefill of --prompt-len tokens; --tokens decoded after
a prompt that long, -d) and tierlm's engine on the HF directory (the same prompt, the same tokens,
the same threads) run one after the other, the order swapped each format so that drift in the
machine's rates hits both. Prints the machine kind, both versions, the commands and a markdown table
with the ratios; --json writes it all. The model and GGUF files live in a work directory removed at
the end (--keep keeps it; --dir names it, and files already there are reused).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

from peers import llamacpp  # noqa: E402
from peers.requests import NullTokenizer as _Tok, prompt as _prompt  # noqa: E402
from tierlm.bench.machine import machine_kind, machine_line  # noqa: E402
from tierlm.hf.init import init_model  # noqa: E402
from tierlm.hf.presets import make_config, param_count  # noqa: E402
from tierlm.infer.batcher import Batcher, Request  # noqa: E402
from tierlm.infer.engine import InferConfig, InferenceEngine  # noqa: E402
from tierlm.infer.sampling import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def measure_tierlm(model: Path, weights: str, prompt_len: int, tokens: int, threads: int, reps: int,
                   nvme: Path) -> dict:
    """tierlm's engine in RAM (the serving path: fused native layers where they apply) on one format:
    after a warm-up, `reps` requests of `prompt_len` prompt tokens and `tokens` generated; the mean
    of each run's prefill and decode tokens/s (as llama-bench reports), with their spread."""
    torch.set_num_threads(threads)
    cfg = InferConfig(cpu_mem="20GiB", weights=weights, max_batch=1, max_seq_len=prompt_len + tokens,
                      nvme_dir=str(nvme), step_tokens=max(256, prompt_len))
    t = time.perf_counter()
    eng = InferenceEngine(model, cfg)
    load_s = time.perf_counter() - t
    b = Batcher(eng, _Tok(), [])
    b.submit(Request(_prompt(8), SamplingParams(max_tokens=2, ignore_eos=True)))
    b.run_until_idle()
    pre, dec = [], []
    for _ in range(reps):
        b.stats.__init__()
        b.submit(Request(_prompt(prompt_len), SamplingParams(max_tokens=tokens, ignore_eos=True)))
        b.run_until_idle()
        s = b.stats
        pre.append(s.tokens["prefill"] / s.s["prefill"])
        dec.append(s.tokens["decode"] / s.s["decode"])
    layers = "transformers" if eng.lean is None else ("fused" if eng.lean.fused is not None else "lean")
    eng.close()
    return {"engine": "tierlm", "weights": weights, "threads": threads, "prompt_len": prompt_len, "tokens": tokens,
            "layers": layers, "load_s": load_s,
            "prefill_tok_s": statistics.mean(pre), "prefill_tok_s_sd": statistics.pstdev(pre),
            "decode_tok_s": statistics.mean(dec), "decode_tok_s_sd": statistics.pstdev(dec)}


def git_commit() -> str:
    p = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return p.stdout.strip() or "unknown"


def git_changed() -> list[str]:
    """tierlm's files that differ from the commit (a figure from a dirty tree names what it ran)."""
    p = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "tierlm"], capture_output=True, text=True)
    return [ln[3:] for ln in p.stdout.splitlines()]


def compare(peer, model: Path, ggufs: dict, a, nvme: Path) -> list[dict]:
    """Per format and thread count, llama.cpp and tierlm one after the other, the order swapped each time."""
    rows, flip = [], False
    for fmt in a.formats:
        for th in a.threads:
            row = {"format": fmt, "threads": th}
            order = ("tierlm", "llama.cpp") if flip else ("llama.cpp", "tierlm")
            for who in order:
                t = time.perf_counter()
                if who == "llama.cpp":
                    row[who] = llamacpp.measure(peer, ggufs[fmt], a.prompt_len, a.tokens, th, a.reps)
                else:
                    row[who] = measure_tierlm(model, fmt, a.prompt_len, a.tokens, th, a.reps, nvme / fmt)
                row[who]["wall_s"] = time.perf_counter() - t
                print(json.dumps({"format": fmt, "threads": th, who: {k: v for k, v in row[who].items()
                                                                      if k != "commands"}}), flush=True)
            row["order"] = list(order)
            rows.append(row)
            flip = not flip
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=None, help="llama.cpp build directory (default: llama-bench on PATH)")
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--formats", nargs="*", default=list(llamacpp.FORMATS), choices=list(llamacpp.FORMATS))
    p.add_argument("--prompt-len", type=int, default=512, help="prefill: tokens in the prompt (llama-bench -p)")
    p.add_argument("--tokens", type=int, default=64, help="decode: tokens generated after the prompt (-n, -d)")
    p.add_argument("--threads", nargs="*", type=int, default=[os.cpu_count()])
    p.add_argument("--reps", type=int, default=3, help="measured runs of each (llama-bench -r)")
    p.add_argument("--dir", default=None, help="work directory for the model and GGUF files (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    peer = llamacpp.find(a.llama_cpp)
    if peer is None:
        sys.exit("llama.cpp not found: pass --llama-cpp DIR (benchmarks/peers/build_llama_cpp.sh builds one) "
                 "or put llama-bench and llama-quantize on PATH")
    kind = machine_kind()
    print(f"machine: {machine_line(kind)}", flush=True)
    work = Path(a.dir or tempfile.mkdtemp(prefix="tierlm-peer-llamacpp-"))
    try:
        config = make_config(None, a.preset, {"layers": a.layers} if a.layers else None)
        model = work / "model"
        if not (model / "config.json").exists():
            init_model(model, config, dtype="bfloat16", tokenizer=False)  # ensure_tokenizer writes it
            print(f"created {model} ({param_count(config) / 1e9:.2f}B parameters)", flush=True)
        llamacpp.ensure_tokenizer(model, config.vocab_size)
        ggufs, prep = llamacpp.gguf_files(peer, model, work / "gguf", a.formats, max(a.threads))
        info = {fmt: llamacpp.system_info(peer, g) for fmt, g in ggufs.items()}
        print(json.dumps({"load_before": os.getloadavg()}), flush=True)
        rows = compare(peer, model, ggufs, a, work / "nvme")
        load_after = os.getloadavg()
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    build = rows[0]["llama.cpp"]["build"]
    peer_info = {"build": build, "source": llamacpp.source_version(peer), "features": info[a.formats[0]].get("features"),
                 "repacked": {f: i["repacked"] for f, i in info.items()},
                 "cpu_info": rows[0]["llama.cpp"]["cpu_info"], "prepare": prep}
    report = {"machine": kind, "load_after": load_after, "llama_cpp": peer_info, "tierlm_commit": git_commit(),
              "tierlm_changed": git_changed(), "preset": a.preset, "layers": config.num_hidden_layers,
              "params": param_count(config), "prompt_len": a.prompt_len, "tokens": a.tokens, "reps": a.reps,
              "command": " ".join(sys.argv), "rows": rows}
    print(f"\nmachine: {machine_line(kind)}")
    print(f"llama.cpp {build}, {report['llama_cpp']['source']}")
    print(f"llama.cpp {report['llama_cpp']['features'] or 'features: build llama-system-info to see them'}")
    print("llama.cpp repacked the weights to: " + "; ".join(f"{f}: {', '.join(i['repacked']) or 'none'}"
                                                           for f, i in info.items()))
    if report["tierlm_changed"]:
        print("tierlm's files changed since that commit: " + " ".join(report["tierlm_changed"]))
    print(f"tierlm {report['tierlm_commit']}; model {a.preset} ({param_count(config) / 1e9:.2f}B, "
          f"{config.num_hidden_layers} layers); prompt {a.prompt_len} tokens, {a.tokens} decoded after it, "
          f"mean ± sd of {a.reps} runs; load average after {load_after[0]:.2f}")
    print("command: " + report["command"])
    for c in rows[0]["llama.cpp"]["commands"]:
        print("llama.cpp: " + " ".join(c))
    print("\n".join([""] + llamacpp.side_by_side(rows)))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
