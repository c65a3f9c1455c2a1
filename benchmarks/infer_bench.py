"""Inference benchmarks, side by side in one process (numbers for docs/benchmarks.md).

    flock /tmp/tierlm-bench.lock python benchmarks/infer_bench.py --preset tinyllama-1.1b --tokens 16
    flock /tmp/tierlm-bench.lock python benchmarks/infer_bench.py --layers 16 --hidden 1024 \
        --stream-budget 200MiB --batches 1 8 32

In RAM: decode tokens/s at batch 1 against the memory roofline (measured read bandwidth / bytes
read per token) for each weight format and each --threads count, and transformers.generate on the
same model at the same thread count (the speed-up). Streamed (--stream-budget): tokens/s at each
batch against the SSD roofline (SSD bandwidth / streamed bytes per forward x batch). Prefill:
tokens/s and GFLOP/s against the measured bf16 matmul rate. `--kernels ours torch` runs each format
twice, on tierlm's own few-row kernels (tierlm.infer.native) and on PyTorch's, side by side. The rates are measured again at the
start of the run (not the cached ones), and the last lines are a markdown table of the ratios.

The machine kind (CPU model, ISA flags, cores) is printed first and last. Where llama.cpp is installed
(--llama-cpp DIR, a build by benchmarks/peers/build_llama_cpp.sh, or llama-bench on PATH), the same
model is converted to GGUF (BF16, Q8_0, Q4_0 for bf16, int8, int4), llama-bench measures each right
after tierlm's run of that format (the same prompt, tokens and threads), and a table puts its
prefill and decode tokens/s beside ours; --no-peer leaves it out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from tierlm.hf.init import init_model
from tierlm.hf.presets import make_config, param_count
from tierlm.infer import native
from tierlm.infer.batcher import Batcher, Request
from tierlm.infer.gemv import bf16_matmul_is_slow
from tierlm.infer.engine import InferConfig, InferenceEngine
from tierlm.bench.machine import machine_kind, machine_line
from tierlm.bench.rooflines import machine_rates
from peers import llamacpp
from peers.requests import NullTokenizer as _Tok, prompt as _prompt
from tierlm.infer.sampling import SamplingParams


_READ_BUF = None


def read_gbps(threads: int) -> float:
    """The memory read rate now, as `tierlm.bench.rooflines`' probe measures it (best of 3 sums of
    512 MiB): taken beside each decode measurement, since this machine's rate drifts by 30% or
    more within minutes and a roofline measured once at the start can be far from the run's."""
    global _READ_BUF
    if _READ_BUF is None:
        _READ_BUF = torch.ones(128 << 20, dtype=torch.float32)
    torch.set_num_threads(threads)
    _READ_BUF.sum()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        _READ_BUF.sum()
        best = max(best, _READ_BUF.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return best


def weights_read_gbps(eng, threads: int) -> float:
    """The rate at which this process reads the weights a decode step reads, where they lie: a
    torch sum over each resident matrix (best of 2). On this VM a buffer's read rate depends on
    where its pages landed (two 700 MB buffers of one process, read alike, differed by 1.5x;
    docs/inference.md at a2b1c1e), so beside the fresh-buffer probe this is the rate of the model's own bytes."""
    # a step reads one row of the input embedding: left out unless it is the head too (tied)
    embed = eng.model.get_input_embeddings().weight
    head = getattr(eng.model.get_output_embeddings(), "weight", None)
    skip = set() if head is not None and embed.data_ptr() == head.data_ptr() else {embed.data_ptr()}
    mats = [t for _, t in list(eng.model.named_parameters()) + list(eng.model.named_buffers())
            if t.dim() == 2 and t.dtype in (torch.bfloat16, torch.float32, torch.int8, torch.uint8)
            and t.numel() >= 1 << 16 and t.data_ptr() not in skip]
    nbytes = sum(t.numel() * t.element_size() for t in mats)
    torch.set_num_threads(threads)
    best = 0.0
    for _ in range(2):
        t = time.perf_counter()
        for m in mats:
            (m.view(torch.uint8) if m.dtype == torch.int8 else m).sum()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    return best


def ssd_read_gbps(directory: Path) -> float:
    """The drive's read rate now, as `tierlm bench io` measures it (512 MiB, 16 MiB blocks, 4 in
    flight, direct I/O): taken beside each streamed measurement, since this virtual disk's rate
    moves 2-3x within minutes and a rate measured once at the start is not the one the steps saw."""
    from tierlm.bench.measure import bench_io
    return bench_io(directory, 512 << 20)["read_gbps"]


# What --x, --layout, --share and --calls switch between, side by side on one engine: each axis's
# values, and how a value is put in place (the first value of each is the engine's default).
AXES = {
    # how the AVX-512 one-row loops round x: bf16 / 8 bits a group (light), or to 2^-17 (exact)
    "x": ("light", "exact"),
    # resident weights: each block's in one huge-page buffer as loaded, or each tensor an allocation
    "layout": ("block", "separate"),
    # a fused layer's thread done with its share takes rows from another's, or waits
    "share": ("steal", "even"),
    # every layer in one C call a step (fused.FusedStack), or a call a layer
    "calls": ("stack", "layers"),
    # decode steps on the path the engine chose (native where it applies), or transformers' modules
    "path": ("default", "hf"),
}


def _separate(eng) -> dict:
    """Each resident piece copied to a tensor of its own: an allocation each, as each was read."""
    each = {}
    for blk in eng.blocks:
        if eng.stream and blk.index in eng.stream.layer_bytes:
            continue
        for p in eng.pieces[blk.index]:
            each[p.key] = p.installed().clone()
    return each


def _apply(eng, axis: str, value: str, state: dict) -> None:
    if axis == "x":
        native.set_light_x(value == "light")
    elif axis == "share":
        native.set_steal(value == "steal")
    elif axis == "layout":
        if "block" not in state:
            sep = _separate(eng)
            state["block"], state["separate"] = eng.reinstall(sep), sep
        eng.reinstall(state[value])
    elif axis == "path":
        if "default" not in state:
            state["default"] = eng.lean
        eng.lean = state["default"] if value == "default" else None
    elif axis == "calls" and eng.lean is not None:
        if "stack" not in state:
            state["stack"] = eng.lean.stack
        eng.lean.stack = state["stack"] if value == "stack" else None


def run(model, weights, batch, tokens, prompt_len, cpu_mem, nvme, rates, threads, path="fused", rounds=1,
        compare=None):
    """One engine; per thread count, `rounds` measured generations, each between two read probes
    (memory in RAM, the drive when streamed), and in RAM a read of the weights themselves. With
    `compare` ({axis: values}, AXES), each round measures every combination in turn on the same
    engine. Returns a result per thread count and combination: the round with the median share of
    its probes' roofline among the steady rounds (_steady: the memory probes before and after
    agree), with every round's share, steadiness and tokens/s."""
    cfg = InferConfig(cpu_mem=cpu_mem, weights=weights, max_batch=batch, max_seq_len=prompt_len + tokens,
                      nvme_dir=str(nvme), step_tokens=max(256, prompt_len), lean=path != "hf", fused=path == "fused")
    eng = InferenceEngine(model, cfg)
    b = Batcher(eng, _Tok(), [])
    outs = []
    compare = compare or {}
    variants = [()]
    for axis, values in compare.items():
        variants = [v + ((axis, val),) for v in variants for val in values]
    state = {}
    for th in threads:
        torch.set_num_threads(th)
        # warm-up: the kernels' first calls at this thread count and, streamed, the window's buffers
        b.submit(Request(_prompt(8), SamplingParams(max_tokens=2, ignore_eos=True)))
        b.run_until_idle()
        per_round = {v: [] for v in variants}
        for _, v in [(r, v) for r in range(rounds) for v in variants]:
            for axis, value in v:
                _apply(eng, axis, value, state.setdefault(axis, {}))
            probe = read_gbps(th) if not eng.stream else None
            ssd_probe = ssd_read_gbps(Path(nvme).parent / "ssd-probe") if eng.stream else None
            torch.set_num_threads(th)
            b.stats.__init__()
            if eng.stream:
                eng.stream.stall_s = 0.0
            for _ in range(batch):
                b.submit(Request(_prompt(prompt_len), SamplingParams(max_tokens=tokens, ignore_eos=True)))
            b.run_until_idle()
            own = None
            pair = None
            if probe is not None:
                pair = (probe, read_gbps(th))
                probe = max(pair)
                own = weights_read_gbps(eng, th)
                torch.set_num_threads(th)
            if ssd_probe is not None:
                ssd_probe = max(ssd_probe, ssd_read_gbps(Path(nvme).parent / "ssd-probe"))
            r = _result(eng, b.stats, weights, batch, th, rates, probe, ssd_probe, own)
            if pair is not None:
                r["probe_pair"] = pair
            per_round[v].append(r)
        for v, rs in per_round.items():
            # A round whose probes before and after differ by more than STEADY straddled a switch of
            # this machine's memory state: its share compares a mix of both states with one of them.
            steady = [r for r in rs if _steady(r)] or rs
            out = sorted(steady, key=_share)[len(steady) // 2]
            out["probe_shares"] = [_share(r) for r in rs]
            out["steady_rounds"] = [_steady(r) for r in rs]
            out["decode_tok_s_rounds"] = [r["decode_tok_s"] for r in rs]
            if own is not None:
                out["own_shares"] = [r["own_share"] for r in rs]
            out.update(dict(v))
            outs.append(out)
            print(json.dumps(out), flush=True)
    for axis in compare:  # back to the defaults
        _apply(eng, axis, AXES[axis][0], state.setdefault(axis, {}))
    eng.close()
    return outs


def _layers(eng) -> str:
    """Which decode path ran: fused layers, lean per-product calls, or transformers' layers."""
    if eng.lean is None:
        return "transformers"
    return "fused" if eng.lean.fused is not None else "lean"


STEADY = 1.2  # the most the two read probes around a round may differ by (ratio) for it to count


def _steady(r: dict) -> bool:
    pair = r.get("probe_pair")
    return pair is None or max(pair) <= STEADY * min(pair)


def _share(r: dict) -> float:
    """A round's share of the roofline its probes measured (memory in RAM, the drive streamed)."""
    return r.get("probe_share", r.get("ssd_probe_share") or 0.0)


def _result(eng, s, weights, batch, th, rates, probe, ssd_probe=None, own=None):
    dec_s, steps = s.s["decode"], max(s.steps["decode"], 1)
    per_fwd = eng.ram_weight_bytes()
    kv_step = s.kv["decode"] / steps
    out = {"weights": weights, "batch": batch, "threads": th, "placement": eng.placement.describe(),
           "lean": eng.lean is not None, "layers": _layers(eng),
           "prefill_tok_s": s.tokens["prefill"] / s.s["prefill"],
           "prefill_gflops": 2 * eng.flop_params * s.tokens["prefill"] / s.s["prefill"] / 1e9,
           "decode_tok_s": s.tokens["decode"] / dec_s,
           "decode_ram_gbps": (s.ram["decode"] + s.kv["decode"]) / dec_s / 1e9,
           "decode_ssd_gbps": s.ssd["decode"] / dec_s / 1e9,
           "bytes_per_forward": per_fwd + kv_step}
    out["mem_roofline_tok_s"] = rates["mem_gbps"] * 1e9 / (per_fwd + kv_step) * batch
    out["mem_share"] = out["decode_tok_s"] / out["mem_roofline_tok_s"]
    if probe is not None:
        out["probe_gbps"] = probe
        out["probe_share"] = out["decode_tok_s"] * (per_fwd + kv_step) / batch / (probe * 1e9)
    if own:
        out["own_gbps"] = own
        out["own_share"] = out["decode_tok_s"] * (per_fwd + kv_step) / batch / (own * 1e9)
    if eng.stream:
        streamed = s.ssd["decode"] / steps
        out["ssd_bytes_per_forward"] = streamed
        out["ssd_roofline_tok_s"] = rates["ssd_gbps"] * 1e9 / streamed * batch if streamed else None
        out["ssd_share"] = out["decode_tok_s"] / out["ssd_roofline_tok_s"] if streamed else None
        out["stall_s"] = eng.stream.stall_s
        if ssd_probe and streamed:
            out["ssd_probe_gbps"] = ssd_probe
            out["ssd_probe_share"] = out["decode_tok_s"] * streamed / batch / (ssd_probe * 1e9)
    return out


def hf_generate(model, tokens, prompt_len, threads):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    ids = torch.tensor([_prompt(prompt_len)])
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    outs = []
    for th in threads:
        torch.set_num_threads(th)
        m.generate(ids[:, :8], max_new_tokens=2, **kw)
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        tn = time.perf_counter() - t
        out = {"weights": "transformers.generate bf16", "threads": th, "hf_ttft_s": t1,
               "prefill_tok_s": prompt_len / t1, "decode_tok_s": (tokens - 1) / (tn - t1)}
        outs.append(out)
        print(json.dumps(out), flush=True)
    del m
    return outs


def table_ram(results, rates):
    hf = {r["threads"]: r["decode_tok_s"] for r in results if r["weights"].startswith("transformers")}
    # Where bf16 products are slow, the engine's prefill converts bf16 weights to fp32 (tierlm.infer.gemv):
    # its rate is then measured against the fp32 matmul.
    mm_dtype = "fp32" if bf16_matmul_is_slow() else "bf16"
    mm = rates[f"matmul_{mm_dtype}_gflops"]
    rows = ["| weights | threads | GB read / token | decode tok/s | roofline tok/s | share | share of the read rate "
            "probed beside it (median of the steady rounds; each round) | share of a read of the weights themselves, beside it | "
            "vs transformers.generate "
            f"| prefill tok/s | prefill GFLOP/s (share of {mm_dtype} matmul) |", "|" + "---|" * 11]
    for r in results:
        if r["weights"].startswith("transformers"):
            rows.append(f"| {r['weights']} | {r['threads']} | | {r['decode_tok_s']:.2f} | | | | | 1.00x | "
                        f"{r['prefill_tok_s']:.1f} | |")
            continue
        sp = f"{r['decode_tok_s'] / hf[r['threads']]:.2f}x" if r["threads"] in hf else ""
        rows.append(f"| {r['weights']} | {r['threads']} | {r['bytes_per_forward'] / 1e9:.2f} | {r['decode_tok_s']:.2f} "
                    f"| {r['mem_roofline_tok_s']:.2f} | {100 * r['mem_share']:.0f}% | {_shares(r)} | {_own(r)} | {sp} "
                    f"| {r['prefill_tok_s']:.1f} "
                    f"| {r['prefill_gflops']:.0f} ({100 * r['prefill_gflops'] / mm:.0f}%) |")
    return rows


def _shares(r):
    if "probe_share" not in r:
        return ""
    each = ", ".join(f"{100 * x:.0f}%" + ("" if ok else " (unsteady)")
                     for x, ok in zip(r["probe_shares"], r.get("steady_rounds", [True] * len(r["probe_shares"]))))
    return f"**{100 * r['probe_share']:.0f}%** of {r['probe_gbps']:.1f} GB/s ({each})"


def _own(r):
    if "own_share" not in r:
        return ""
    each = ", ".join(f"{100 * x:.0f}%" for x in r["own_shares"])
    return f"{100 * r['own_share']:.0f}% of {r['own_gbps']:.1f} GB/s ({each})"


def table_stream(results):
    rows = ["| layers | batch | SSD MB / forward | decode tok/s | SSD roofline tok/s (start probe) | share | "
            "share of the read rate probed beside it (median; each round) | stall s |",
            "|---|---|---|---|---|---|---|---|"]
    for r in results:
        layers = r.get("layers", "lean" if r.get("lean") else "transformers")
        layers += "".join(f", {r[axis]} {axis}" for axis in AXES if axis in r)
        if "ssd_bytes_per_forward" not in r:
            rows.append(f"| {layers} | {r['batch']} | nothing streamed: {r['placement']} (lower --stream-budget) | | | | | |")
            continue
        beside = (f"**{100 * r['ssd_probe_share']:.0f}%** of {r['ssd_probe_gbps']:.2f} GB/s ("
                  + ", ".join(f"{100 * x:.0f}%" for x in r["probe_shares"]) + ")") if "ssd_probe_share" in r else ""
        rows.append(f"| {layers} | {r['batch']} | {r['ssd_bytes_per_forward'] / 1e6:.0f} | {r['decode_tok_s']:.2f} | "
                    f"{r['ssd_roofline_tok_s']:.2f} | {100 * r['ssd_share']:.0f}% | {beside} | {r['stall_s']:.1f} |")
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--dir", default=None, help="where the model and stores go (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--formats", nargs="*", default=["bf16", "int8", "int4"])
    p.add_argument("--threads", nargs="*", type=int, default=[os.cpu_count(), 1])
    p.add_argument("--stream-budget", default=None, help="run streamed under this --cpu-mem instead")
    p.add_argument("--batches", nargs="*", type=int, default=[1, 8, 32])
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--rounds", type=int, default=1,
                   help="measured generations per configuration, each between two read probes (memory in "
                        "RAM, the drive's `bench io` read rate when streamed)")
    p.add_argument("--kernels", nargs="*", default=["ours"], choices=["ours", "torch"],
                   help="few-row products on tierlm's kernels, PyTorch's, or both side by side")
    p.add_argument("--paths", nargs="*", default=["fused"], choices=["fused", "lean", "hf"],
                   help="decode steps with each layer one C call (tierlm.infer.fused), on tierlm.infer.lean's "
                        "per-product calls, on transformers' forward; several: side by side")
    for axis, values in AXES.items():
        p.add_argument(f"--{axis}", nargs="*", default=None, choices=values,
                       help=f"side by side on one engine, round after round: {' / '.join(values)} (see AXES)")
    p.add_argument("--prefetch", nargs="*", type=int, default=[1024],
                   help="bytes our kernels prefetch ahead of the row they multiply (0: off), side by side")
    p.add_argument("--llama-cpp", default=None, help="llama.cpp build directory: its figures beside ours (default: "
                   "llama-bench on PATH, if there)")
    p.add_argument("--no-peer", action="store_true", help="leave llama.cpp out even where it is installed")
    a = p.parse_args()
    kind = machine_kind()
    print(f"machine: {machine_line(kind)}", flush=True)
    peer = None if a.no_peer or a.stream_budget else llamacpp.find(a.llama_cpp)
    root = Path(a.dir or tempfile.mkdtemp(prefix="tierlm-bench-"))
    over = {k: v for k, v in (("layers", a.layers), ("hidden", a.hidden)) if v is not None}
    config = make_config(None if a.preset else "llama", a.preset, over)
    model = root / "model"
    if not (model / "config.json").exists():
        t = time.perf_counter()
        init_model(model, config, dtype="bfloat16", tokenizer=False)
        print(f"created {model} ({param_count(config) / 1e9:.2f}B parameters) in {time.perf_counter() - t:.0f} s",
              file=sys.stderr)
    ggufs = None
    if peer is not None:
        llamacpp.ensure_tokenizer(model, config.vocab_size)
        ggufs, _ = llamacpp.gguf_files(peer, model, root / "gguf", [w for w in a.formats if w in llamacpp.FORMATS],
                                       max(a.threads),
                                       log=lambda m: print(m, file=sys.stderr))
    print(json.dumps({"load_before": os.getloadavg()}), flush=True)
    rates = machine_rates(str(root / "nvme"), fresh=True)
    print(json.dumps({"rates": rates}), flush=True)
    results = []
    compare = {axis: tuple(getattr(a, axis)) for axis in AXES if getattr(a, axis)}
    peer_rows = []
    if not a.stream_budget:
        for w in a.formats:
            for kern in a.kernels:
                native.use(kern == "ours")
                for path, pf in [(path, pf) for path in a.paths for pf in (a.prefetch if kern == "ours" else [0])]:
                    native.set_prefetch(pf)
                    for r in run(model, w, 1, a.tokens, a.prompt_len, "20GiB", root / f"nvme-{w}", rates, a.threads,
                                 path=path, rounds=a.rounds, compare=compare if kern == "ours" else None):
                        k = kern if kern == "torch" or native.available() else "torch"
                        k += f", prefetch {pf}" if len(a.prefetch) > 1 and k == "ours" else ""
                        k += "".join(f", {r[axis]} {axis}" for axis in compare if axis in r)
                        results.append(r | {"weights": f"{w} ({k}, {r['layers']} layers)"})
                native.set_prefetch(1024)
            native.use(True)
            for th in a.threads if ggufs and w in ggufs else []:  # right after ours: drift hits both alike
                p = llamacpp.measure(peer, ggufs[w], a.prompt_len, a.tokens, th, max(a.rounds, 3))
                peer_rows.append({"format": w, "threads": th, "llama.cpp": p})
                print(json.dumps({k: v for k, v in p.items() if k != "commands"}), flush=True)
        if not a.no_hf:
            results += hf_generate(model, a.tokens, a.prompt_len, a.threads)
        rows = table_ram(results, rates)
    else:
        for path in a.paths:
            for bsz in a.batches:
                results += [r | {"path": path} for r in run(model, "bf16", bsz, a.tokens, a.prompt_len, a.stream_budget,
                                                            root / "nvme-stream", rates, a.threads[:1],
                                                            path=path, rounds=a.rounds, compare=compare)]
        rows = table_stream(results)
    print(json.dumps({"load_after": os.getloadavg()}), flush=True)
    print(f"\nrates: memory {rates['mem_gbps']:.1f} GB/s (by threads {rates.get('mem_gbps_by_threads')}), "
          f"bf16 matmul {rates['matmul_bf16_gflops']:.0f} GFLOP/s, fp32 {rates['matmul_fp32_gflops']:.0f}, SSD {rates.get('ssd_gbps', 0):.2f} GB/s")
    print("\n".join(rows))
    if peer_rows:
        print_peer(peer, peer_rows, results)
    print(f"\nmachine: {machine_line(kind)}")
    return results


def print_peer(peer, peer_rows, results):
    """llama.cpp's figures beside ours: our first run of each format and thread count (tierlm's own
    kernels where --kernels has them), as a markdown table, with llama.cpp's build and commands."""
    for row in peer_rows:
        ours = [r for r in results if r["weights"].startswith(f"{row['format']} (") and r["threads"] == row["threads"]]
        ours.sort(key=lambda r: "(torch" in r["weights"])
        row["tierlm"] = ours[0]
    p = peer_rows[0]["llama.cpp"]
    print(f"\nllama.cpp {p['build']} ({p['backends']}; {llamacpp.source_version(peer)}), prompt {p['prompt_len']} tokens, {p['tokens']} decoded "
          "after it, mean ± sd of its runs:")
    for c in p["commands"]:
        print("  " + " ".join(c))
    print("\n".join(llamacpp.side_by_side(peer_rows)))


if __name__ == "__main__":
    main()
