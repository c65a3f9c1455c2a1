"""Where a bf16 decode token goes: the memory's read rate, the one-row kernel's rate per weight matrix,
and the engine's token split into the layers' C call, the head and everything else.

    flock /tmp/tierlm-bench.lock python benchmarks/decode_split.py --model DIR [--threads 2]
    flock /tmp/tierlm-bench.lock python benchmarks/decode_split.py --model DIR --gguf F.gguf \
        --llama-cpp /work/peers/llama.cpp --pairs 3        # llama.cpp's decode alternated with ours

DIR is a bf16 HF directory (benchmarks/peer_llamacpp.py --dir D --keep leaves D/model and
D/gguf/model-BF16.gguf). Parts, each printed as one JSON line:
- read: GB/s of a torch fp32 sum and of our bf16 one-row product (K = 2048) over --read-gib of one
  huge-page buffer, on 1 and on --threads threads (best and median of --reps);
- kernels: the engine's own installed weights multiplied by one row as the fused layer groups them
  (q/k/v, o, gate/up, down; the head), each group's matrices of every layer in one kernel call (far
  past the last-level cache): ms a token and GB/s per group, and their sum (the kernels' floor);
- token: the engine decoding --tokens after a --prompt-len prompt, the layers' one C call and the
  head (with its norm) timed inside; what is left is Python, sampling and the batcher;
- pairs (with --gguf): llama-bench's decode (-p 0 -n T -d P) and the engine's, alternated, a plain
  sum's read rate before each and after the last; the ratio's median over all pairs and over the
  steady ones (the three rates within 20%: no flip of the memory's state inside the pair);
- --toggle F: a native switch F(0)/F(1) A/B in one process, per pair a plain sum's rate beside it
  (this VM's memory flips between a ~35 and a ~63 GB/s state for seconds to minutes: a pair
  compares only within one state).
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout

from tierlm.bench.machine import machine_kind, machine_line  # noqa: E402
from tierlm.infer import native  # noqa: E402
from tierlm.storage.aligned import aligned_empty  # noqa: E402

GB = 1e9


def timed(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def rates(nbytes: int, ts: list[float]) -> dict:
    return {"best_gbps": round(nbytes / min(ts) / GB, 2), "median_gbps": round(nbytes / statistics.median(ts) / GB, 2)}


def read_rates(gib: float, threads: int, reps: int) -> dict:
    """A plain fp32 sum and our bf16 one-row product over the same huge-page buffer, 1 and `threads` threads."""
    K = 2048
    n = int(gib * (1 << 30)) // (2 * K)
    buf = aligned_empty(n * K * 2)
    buf.view(torch.int16).fill_(0x3F80)  # bf16 1.0: every page touched before timing
    w = buf.view(torch.bfloat16).view(n, K)
    f32 = buf.view(torch.float32)
    x = torch.ones(1, K)
    out = {"bytes": n * K * 2, "huge_pages": buf.data_ptr() % (2 << 20) == 0}
    for t in sorted({1, threads}):
        torch.set_num_threads(t)
        out[f"sum_{t}t"] = rates(n * K * 2, timed(lambda: f32.sum(), reps))
        out[f"bf16_gemv_{t}t"] = rates(n * K * 2, timed(lambda: native.products(x, [w]), reps))
    torch.set_num_threads(threads)
    return out


def weight_groups(model) -> dict[str, list[list[torch.Tensor]]]:
    """The fused layer's products, per group: each layer's list of weights multiplied by one x."""
    g = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for lay in model.model.layers:
        a, m = lay.self_attn, lay.mlp
        g["qkv"].append([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        g["o"].append([a.o_proj.weight])
        g["gate_up"].append([m.gate_proj.weight, m.up_proj.weight])
        g["down"].append([m.down_proj.weight])
    g["head"] = [[model.get_output_embeddings().weight]]
    return g


def kernel_rates(model, reps: int) -> dict:
    """Per group, every layer's matrices in one kernel call (one parallel region, as the fused layer's
    stage runs them, without its barriers, attention or norms): the kernel's own rate."""
    out, total_s, total_b = {}, 0.0, 0
    for name, calls in weight_groups(model).items():
        ws = [w for c in calls for w in c]
        x = torch.randn(1, ws[0].shape[1])
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        ts = timed(lambda: native.products(x, ws), reps)
        med = statistics.median(ts)
        out[name] = {"ms": round(med * 1e3, 2), "MB": round(nbytes / 1e6, 1), **rates(nbytes, ts)}
        total_s, total_b = total_s + med, total_b + nbytes
    out["all"] = {"ms": round(total_s * 1e3, 2), "MB": round(total_b / 1e6, 1),
                  "gbps": round(total_b / total_s / GB, 2)}
    return out


class Timed:
    """A callable that adds its time to `acc[key]` and calls the one it wraps."""

    def __init__(self, fn, acc: dict, key: str):
        self.fn, self.acc, self.key = fn, acc, key

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.acc[self.key] = self.acc.get(self.key, 0.0) + time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self.fn, name)


def token_split(eng, prompt_len: int, tokens: int, reps: int) -> dict:
    from peers.requests import NullTokenizer, prompt
    from tierlm.infer.batcher import Batcher, Request
    from tierlm.infer.sampling import SamplingParams

    lean = eng.lean
    acc: dict = {}
    b = Batcher(eng, NullTokenizer(), [])
    b.submit(Request(prompt(8), SamplingParams(max_tokens=2, ignore_eos=True)))
    b.run_until_idle()
    stack, head = lean.stack, lean.head
    lean.stack, lean.head = Timed(stack, acc, "layers"), Timed(head, acc, "head")
    runs = []
    try:
        for _ in range(reps):
            b.stats.__init__()
            b.submit(Request(prompt(prompt_len), SamplingParams(max_tokens=tokens, ignore_eos=True)))
            acc.clear()
            b.run_until_idle()
            s = b.stats
            runs.append({"decode_tok_s": s.tokens["decode"] / s.s["decode"], "decode_s": s.s["decode"],
                         "prefill_s": s.s["prefill"], "n": s.tokens["decode"], **acc})
    finally:
        lean.stack, lean.head = stack, head
    r = min(runs, key=lambda r: r["decode_s"])  # the quietest run
    n = r["n"]
    # the prefill's one call of each counts toward acc; it runs the many-row path (not stack) mostly
    per = {"token_ms": round(r["decode_s"] / n * 1e3, 2), "decode_tok_s": round(r["decode_tok_s"], 2),
           "all_runs_tok_s": [round(x["decode_tok_s"], 2) for x in runs],
           "layers_ms": round(r.get("layers", 0) / n * 1e3, 2), "head_ms": round(r.get("head", 0) / n * 1e3, 2)}
    per["other_ms"] = round(per["token_ms"] - per["layers_ms"] - per["head_ms"], 2)
    return per


def toggle_ab(eng, a) -> dict:
    """The switch off and on in adjacent pairs (the order swapped each pair, so drift in the
    machine's rates hits both): per pair one pass of every group's kernels, then (token part) one
    request; the medians of each side and of the pairs' on/off ratios of time. Leaves it at 1."""
    set_ = getattr(native.library(), a.toggle)
    groups = {n: [w for c in calls for w in c] for n, calls in weight_groups(eng.model).items()}
    xs = {n: torch.randn(1, ws[0].shape[1]) for n, ws in groups.items()}

    def kernels_pass():
        t = time.perf_counter()
        for n, ws in groups.items():
            native.products(xs[n], ws)
        return time.perf_counter() - t
    kt, tt = {0: [], 1: []}, {0: [], 1: []}
    probe = aligned_empty(256 << 20).view(torch.float32)
    probe.fill_(1.0)
    sums = []
    for i in range(a.pairs):
        sums.append(probe.numel() * 4 / min(timed(lambda: probe.sum(), 3)) / GB)
        for v in ((0, 1) if i % 2 == 0 else (1, 0)):
            set_(v)
            if "kernels" in a.parts:
                kernels_pass()
                kt[v].append(min(kernels_pass() for _ in range(3)))
            if "token" in a.parts:
                tt[v].append(token_split(eng, a.prompt_len, a.tokens, 1)["token_ms"] / 1e3)
    set_(1)
    out = {"sum_gbps_per_pair": [round(g, 1) for g in sums]}
    for name, d in (("kernels_ms", kt), ("token_ms", tt)):
        if d[0]:
            out[name] = {v: round(statistics.median(d[v]) * 1e3, 2) for v in (0, 1)}
            out[name + "_on_over_off"] = round(statistics.median(b / o for o, b in zip(d[0], d[1])), 3)
            out[name + "_pairs"] = [[round(o * 1e3, 1), round(b * 1e3, 1)] for o, b in zip(d[0], d[1])]
    return out


def anon_huge_mb() -> float | None:
    try:
        for ln in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if ln.startswith("AnonHugePages:"):
                return int(ln.split()[1]) / 1024
    except OSError:
        pass
    return None


def build_engine(model: Path, threads: int, prompt_len: int, tokens: int, nvme: Path):
    from tierlm.infer.engine import InferConfig, InferenceEngine
    torch.set_num_threads(threads)
    cfg = InferConfig(cpu_mem="20GiB", weights="bf16", max_batch=1, max_seq_len=prompt_len + tokens,
                      nvme_dir=str(nvme), step_tokens=max(256, prompt_len))
    return InferenceEngine(model, cfg)


def pairs(a, nvme: Path) -> list[dict]:
    """llama.cpp's decode and ours, alternated, with a plain sum's read rate before each and after the
    last: a pair is steady where the three agree within STEADY (the memory kept one state through
    it). A pair across a flip compares two states, not two decoders."""
    from peer_llamacpp import measure_tierlm
    from peers import llamacpp
    peer = llamacpp.find(a.llama_cpp)
    out = []
    probe = aligned_empty(256 << 20).view(torch.float32)
    probe.fill_(1.0)

    def sum_gbps() -> float:
        return round(probe.numel() * 4 / min(timed(lambda: probe.sum(), 3)) / GB, 1)
    for i in range(a.pairs):
        order = ("tierlm", "llama.cpp") if i % 2 else ("llama.cpp", "tierlm")
        row = {"order": order, "sum_gbps": []}
        for who in order:
            row["sum_gbps"].append(sum_gbps())
            if who == "llama.cpp":
                r = llamacpp.measure(peer, Path(a.gguf), a.prompt_len, a.tokens, a.threads, a.reps)
            else:
                r = measure_tierlm(Path(a.model), "bf16", a.prompt_len, a.tokens, a.threads, a.reps, nvme)
            row[who] = round(r["decode_tok_s"], 2)
        row["sum_gbps"].append(sum_gbps())
        row["steady"] = max(row["sum_gbps"]) <= STEADY * min(row["sum_gbps"])
        row["ratio"] = round(row["tierlm"] / row["llama.cpp"], 3)
        print(json.dumps({"pair": i, **row}), flush=True)
        out.append(row)
    return out


STEADY = 1.2  # a pair's three read rates within 20%: one memory state (this VM's two are ~1.5-1.9x apart)


def pairs_summary(rows: list[dict]) -> dict:
    """The median ratio over all pairs and over the steady ones; the steady pairs by their read rate."""
    steady = sorted((r for r in rows if r["steady"]), key=lambda r: statistics.median(r["sum_gbps"]))
    return {"ratio_median": statistics.median(r["ratio"] for r in rows), "ratios": [r["ratio"] for r in rows],
            "ratio_median_steady": statistics.median(r["ratio"] for r in steady) if steady else None,
            "steady_by_read_rate": [[statistics.median(r["sum_gbps"]), r["ratio"]] for r in steady]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="bf16 HF model directory")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--read-gib", type=float, default=2.0)
    p.add_argument("--parts", nargs="*", default=["read", "kernels", "token"], choices=["read", "kernels", "token"])
    p.add_argument("--gguf", default=None, help="with --llama-cpp: alternate llama-bench's decode with ours")
    p.add_argument("--llama-cpp", default=None)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--toggle", default=None, help="a switch of the native library taking 0 or 1 (e.g. "
                   "tierlm_gemv_set_light_x): the kernels and token parts in --pairs pairs, off and on, in one process")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    nvme = Path(tempfile.mkdtemp(prefix="tierlm-decode-split-"))
    print(json.dumps({"machine": machine_line(machine_kind()), "threads": a.threads,
                      "native_isa": native.library().tierlm_gemv_isa() if native.available() else None}), flush=True)
    if a.gguf:
        try:
            rows = pairs(a, nvme)
        finally:
            shutil.rmtree(nvme, ignore_errors=True)
        print(json.dumps(pairs_summary(rows)))
        return 0
    if "read" in a.parts:
        print(json.dumps({"read": read_rates(a.read_gib, a.threads, max(a.reps, 4))}), flush=True)
    if {"kernels", "token"} & set(a.parts):
        eng = build_engine(Path(a.model), a.threads, a.prompt_len, a.tokens, nvme)
        print(json.dumps({"anon_huge_pages_mb": anon_huge_mb()}), flush=True)  # the weights' buffer on 2 MiB pages
        if a.toggle is None:
            if "kernels" in a.parts:
                print(json.dumps({"kernels": kernel_rates(eng.model, max(a.reps, 5))}), flush=True)
            if "token" in a.parts:
                print(json.dumps({"token": token_split(eng, a.prompt_len, a.tokens, a.reps)}), flush=True)
        else:
            print(json.dumps({"toggle": a.toggle, **toggle_ab(eng, a)}), flush=True)
        eng.close()
    shutil.rmtree(nvme, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
