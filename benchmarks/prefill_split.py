"""Where a prefill's time goes: one prompt through tierlm's engine, split by kind of work, and the CPU
seconds it takes beside llama.cpp's for the same prompt.

    flock /tmp/tierlm-bench.lock python benchmarks/prefill_split.py --preset tinyllama-1.1b \
        --weights bf16 --prompt-len 512 --threads 2 [--llama-cpp /work/peers/llama.cpp --gguf FILE]

Printed, as JSON lines and a markdown table:
- the step's self time on one thread (torch.profiler; the least of --rounds steps) in products (each shape, its GFLOP/s, and
  a bare F.linear of the same shape and dtype timed beside it: what the machine does for that
  product, its weight in cache: the best the machine does), attention, norms, rotary, activation, residual adds, casts/copies and the rest; the
  elementwise ops are told apart by their shapes (a [..., 1] operand: a norm; 4-D head tensors:
  rotary; the MLP's width: activation);
- CPU seconds of a step on one thread (process time: other work on the cores does not count, it
  only slows the wall clock) and the wall clock at --threads, best of --rounds each;
- with --llama-cpp and --gguf: llama-bench's CPU seconds for the same prompt on one thread (the
  children's user+sys time of a run of 3 repetitions less one of 1, so its load and warm-up cancel).

CPU seconds on one thread compare the work each engine does for a prompt; the wall clock at
several threads adds how well that work splits over the cores, which a machine shared with other
work disturbs (an OpenMP region waits for every thread to get a core).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

from tierlm.hf.init import init_model  # noqa: E402
from tierlm.hf.presets import make_config  # noqa: E402
from tierlm.infer.engine import InferConfig, InferenceEngine  # noqa: E402

# oneDNN's inner product: tierlm.infer.fp32_product's many-row fp32 products (inputs [M, K], [N, K])
LINEAR = "mkldnn::_linear_pointwise"
PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", LINEAR}
NORMS = {"aten::pow", "aten::mean", "aten::rsqrt", "aten::sum", "aten::var_mean", "aten::native_layer_norm",
         "aten::div_", "aten::_fused_rms_norm"}
ACTIVATIONS = {"aten::silu", "aten::gelu", "aten::tanh", "aten::sigmoid"}
COPIES = {"aten::copy_", "aten::clone", "aten::contiguous"}


def kind(name: str, shapes: list, cfg) -> str:
    """The kind of work of one profiled op, from its name and its inputs' shapes."""
    if name in PRODUCTS:
        return "products"
    if "scaled_dot_product" in name or "attention" in name:
        return "attention"
    if name in NORMS:
        return "norms"
    if name in ACTIVATIONS:
        return "activation"
    if name in COPIES:
        return "casts/copies"
    if name in ("aten::cat", "aten::neg"):
        return "rotary"
    if name in ("aten::mul", "aten::add", "aten::add_", "aten::mul_"):
        dims = [s for s in shapes if isinstance(s, list) and s]
        if any(s[-1] == 1 for s in dims) or any(len(s) == 1 for s in dims):
            return "norms"  # x * rsqrt(var) [.., 1], weight [hidden] * x
        if any(len(s) == 4 for s in dims):
            return "rotary"  # q, k [B, heads, T, d] times cos/sin
        if any(s[-1] == cfg.intermediate_size for s in dims):
            return "activation"  # act(gate) * up
        return "residual adds" if name.startswith("aten::add") else "other"
    return "other"


def bare_gflops(shapes: list, dtype: torch.dtype, reps: int = 5) -> float:
    """GFLOP/s of F.linear on one thread on random tensors of an aten::mm's shapes ([M, K] @ [K, N]),
    the best wall clock of `reps` (the weight stays in cache between them; in a step it does not)."""
    (m, k), (_, n) = shapes[0], shapes[1]
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    F.linear(x, w)
    best = min(_wall(lambda: F.linear(x, w)) for _ in range(reps))
    return 2 * m * n * k / best / 1e9


def _wall(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _timed(fn) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


def split(eng, prompt: list[int], cfg, rounds: int) -> tuple[dict, list[dict]]:
    """({kind: self CPU s}, [per product shape: calls, s, GFLOP/s, bare F.linear GFLOP/s]) of a step
    on one thread: each the least of `rounds` profiled steps (other work on the cores only adds)."""
    torch.set_num_threads(1)
    runs = [_profiled(eng, prompt, cfg) for _ in range(rounds)]
    kinds = {k: min(r[0].get(k, 0.0) for r in runs) for k in runs[0][0]}
    mms = {k: min((r[1][k] for r in runs if k in r[1]), key=lambda v: v[1]) for k in runs[0][1]}
    products = []
    for key, (calls, s) in sorted(mms.items(), key=lambda kv: -kv[1][1]):
        shapes = json.loads(key)
        (m, k), (_, n) = shapes
        products.append({"shape": f"[{m}, {k}] @ [{k}, {n}]", "calls": calls, "self_s": s,
                         "gflops": 2 * m * n * k * calls / s / 1e9, "bare_gflops": bare_gflops(shapes, eng.dtype)})
    return kinds, products


def _profiled(eng, prompt: list[int], cfg) -> tuple[dict, dict]:
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        eng.step([prompt], [0])
    kinds, mms = defaultdict(float), defaultdict(lambda: [0, 0.0])
    for e in p.key_averages(group_by_input_shape=True):
        s = e.self_cpu_time_total / 1e6
        if s <= 0:
            continue
        kinds[kind(e.key, e.input_shapes, cfg)] += s
        if e.key in ("aten::mm", LINEAR) and len(e.input_shapes) >= 2:
            x, w = e.input_shapes[:2]
            key = json.dumps([x, w if e.key == "aten::mm" else w[::-1]])
            mms[key][0] += e.count
            mms[key][1] += s
    return dict(kinds), dict(mms)


def step_times(eng, prompt: list[int], threads: int, rounds: int) -> dict:
    """Best CPU seconds of a step on one thread, and best wall seconds at `threads`."""
    out = {}
    torch.set_num_threads(1)
    out["cpu_s_1_thread"] = min(_timed(lambda: eng.step([prompt], [0])) for _ in range(rounds))
    torch.set_num_threads(threads)
    walls = []
    for _ in range(rounds):
        t = time.perf_counter()
        eng.step([prompt], [0])
        walls.append(time.perf_counter() - t)
    out[f"wall_s_{threads}_threads"] = min(walls)
    return out


def llama_cpu_s(bench: Path, gguf: Path, prompt_len: int) -> float:
    """CPU seconds llama-bench spends on one prefill of `prompt_len` tokens on one thread."""
    def run(reps: int) -> float:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run([str(bench), "-m", str(gguf), "-p", str(prompt_len), "-n", "0", "-t", "1", "-r", str(reps),
                        "-o", "json"], check=True, capture_output=True)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return (run(3) - run(1)) / 2


def table(kinds: dict, products: list[dict], times: dict, prompt_len: int, llama: float | None) -> list[str]:
    total = sum(kinds.values())
    out = ["| work (one thread, profiled self time) | s | share |", "|---|---|---|"]
    out += [f"| {k} | {v:.3f} | {v / total:.1%} |" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])]
    out += ["", "| product | calls | s | GFLOP/s | bare F.linear GFLOP/s |", "|---|---|---|---|---|"]
    out += [f"| {p['shape']} | {p['calls']} | {p['self_s']:.3f} | {p['gflops']:.0f} | {p['bare_gflops']:.0f} |"
            for p in products]
    out += ["", "| engine | CPU s a prompt, one thread | tokens per CPU s |", "|---|---|---|",
            f"| tierlm | {times['cpu_s_1_thread']:.2f} | {prompt_len / times['cpu_s_1_thread']:.1f} |"]
    if llama is not None:
        out.append(f"| llama.cpp | {llama:.2f} | {prompt_len / llama:.1f} |")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tinyllama-1.1b")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--weights", default="bf16")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where the model goes (default: a temp dir); reused if there")
    p.add_argument("--llama-cpp", default=None, help="llama.cpp build directory (its bin/llama-bench)")
    p.add_argument("--gguf", default=None, help="the same model as GGUF, for --llama-cpp")
    a = p.parse_args(argv)
    root = Path(a.dir or tempfile.mkdtemp(prefix="tierlm-prefill-split-"))
    config = make_config(None, a.preset, {"layers": a.layers} if a.layers else None)
    model = root / "model"
    if not (model / "config.json").exists():
        init_model(model, config, dtype="bfloat16", tokenizer=False)
    cfg = InferConfig(cpu_mem="20GiB", weights=a.weights, max_batch=1, max_seq_len=a.prompt_len + 8,
                      nvme_dir=str(root / "nvme"), step_tokens=max(256, a.prompt_len))
    eng = InferenceEngine(model, cfg)
    prompt = [(7 * i) % 200 + 3 for i in range(a.prompt_len)]
    try:
        eng.step([prompt], [0])  # warm-up: first calls, scratch
        times = step_times(eng, prompt, a.threads, a.rounds)
        kinds, products = split(eng, prompt, config, a.rounds)
    finally:
        eng.close()
    llama = None
    if a.llama_cpp and a.gguf:
        llama = llama_cpu_s(Path(a.llama_cpp) / "bin" / "llama-bench", Path(a.gguf), a.prompt_len)
    print(json.dumps({"weights": a.weights, "prompt_len": a.prompt_len, "threads": a.threads, **times,
                      "tok_s_wall": a.prompt_len / times[f"wall_s_{a.threads}_threads"], "split_s": kinds,
                      "products": products, "llama_cpp_cpu_s_1_thread": llama}))
    print("\n".join([""] + table(kinds, products, times, a.prompt_len, llama)))


if __name__ == "__main__":
    main()
