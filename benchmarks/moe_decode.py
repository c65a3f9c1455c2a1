"""A mixture of experts larger than the memory it may use, decoded by tierlm and by llama.cpp side by side.

    benchmarks/peers/build_llama_cpp.sh          # once: llama.cpp built at /work/peers/llama.cpp
    python benchmarks/moe_decode.py --llama-cpp /work/peers/llama.cpp --prepare   # model, GGUF, store
    flock /tmp/tierlm-bench.lock python benchmarks/moe_decode.py --llama-cpp /work/peers/llama.cpp \
        --dir /work/bench-moe/qwen3-30b-a3b-9l --layers 9 --cpu-mem 2.75GiB --no-mmap --json moe_decode.json

A model of the preset's shape (default Qwen3-30B-A3B: 128 experts, 8 a token) with --layers decoder
layers is created with random weights (tierlm.hf.init, a tokenizer the converter reads), converted
by llama.cpp's own convert_hf_to_gguf.py to BF16 and quantized by llama-quantize (Q8_0, Q4_0 for
tierlm's int8, int4). Both engines are then held to the same memory: a memory cgroup of
--cpu-mem + --allowance bytes (benchmarks/peers/memlimit.py), which counts the page cache, so
llama.cpp's memory-mapped GGUF is read from the drive as its pages fall out, and tierlm runs with
--cpu-mem inside it. llama.cpp is also measured without a limit (the whole file cached in RAM) and,
under the limit, with --no-mmap (llama-bench -lm none: it reads the weights into its own memory, which cannot
hold them; recorded as it ends). Each limited run starts with the files it reads dropped from the
page cache, so every page it touches is charged to it. Prints the machine, llama.cpp's build, the
model's total and active sizes, the limit, each run's cgroup peak, and a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tierlm from this checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import llamacpp, memlimit  # noqa: E402
from tierlm.bench.machine import machine_kind, machine_line  # noqa: E402
from tierlm.units import fmt_bytes  # noqa: E402

GIB = 1 << 30


def model_config(preset: str, layers: int, init_std: float):
    from tierlm.hf.presets import make_config
    config = make_config(None, preset, {"layers": layers})
    config.initializer_range = init_std
    return config


def ensure_model(model: Path, config) -> None:
    """The HF directory (bf16 weights in the family's own tensor names) and a tokenizer the converter
    takes; kept when already there (and made with the same init std)."""
    if (model / "config.json").exists():
        have = json.loads((model / "config.json").read_text()).get("initializer_range")
        if have != config.initializer_range:
            raise SystemExit(f"{model} was made with initializer_range {have}, not {config.initializer_range}: "
                             f"remove its work directory (model, GGUF, store) or pass --init-std {have}")
    else:
        from tierlm.hf.init import init_model
        init_model(model, config, dtype="bfloat16", tokenizer=False)  # ensure_tokenizer writes it
    llamacpp.ensure_tokenizer(model, config.vocab_size)


def sizes(config, preset: str) -> dict:
    """Total and active (a token's: dense part + top_k experts a layer) parameters and bf16 bytes."""
    from tierlm.plan.shapes import shape_of
    moe = shape_of(config, preset, "config").moe
    if moe is None:
        raise SystemExit(f"{preset} is not a mixture of experts")
    return {"total_params": moe.total_params, "active_params": moe.active_params, "experts": moe.experts,
            "top_k": moe.top_k, "moe_layers": moe.moe_layers,
            "total_bf16_bytes": 2 * moe.total_params, "active_bf16_bytes": 2 * moe.active_params}


def ssd_read_gbps(directory: Path) -> float:
    """The drive's read rate right before a limited run (as `tierlm bench io`: 512 MiB, direct
    I/O): this virtual disk's rate moves within minutes, and a limited run reads from it."""
    from tierlm.bench.measure import bench_io
    return bench_io(directory, 512 << 20)["read_gbps"]


def store_read_gbps(store: Path, nbytes: int = 512 << 20, inflight: int = 4, seed: int = 0) -> float:
    """The drive's read rate for the expert store's own files: whole files in a random order, direct
    I/O, `inflight` at once, as decode's misses read them. On a virtual disk a file written
    minutes ago can read at twice the rate of older data (the host still holds it), so a probe
    that writes its own file measures another rate than the store's cold files; both are shown."""
    import mmap
    import random
    from concurrent.futures import ThreadPoolExecutor

    files = sorted(f for f in store.iterdir() if f.is_file() and f.stat().st_size >= 1 << 20)
    random.Random(seed).shuffle(files)
    picked, total = [], 0
    for f in files:
        if total >= nbytes:
            break
        picked.append(f)
        total += f.stat().st_size
    if not picked:
        raise RuntimeError(f"{store}: no expert files to probe")
    biggest = max(f.stat().st_size for f in picked)
    size = -(-biggest // 4096) * 4096
    bufs = [mmap.mmap(-1, size) for _ in range(inflight)]  # page-aligned, as O_DIRECT needs

    def read(i: int, f: Path) -> int:
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            return os.preadv(fd, [bufs[i % inflight]], 0)
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(inflight) as ex:
        got = 0
        for k in range(0, len(picked), inflight):  # `inflight` reads at a time, each in its own buffer
            got += sum(ex.map(read, range(inflight), picked[k:k + inflight]))
    return got / (time.perf_counter() - t) / 1e9


def llama_limited(peer, gguf: Path, a, limit: int, extra: tuple[str, ...] = ()) -> dict:
    """llama-bench inside a fresh memory cgroup of `limit` bytes, the GGUF evicted from the page
    cache first; the result carries the cgroup's peak, or how the run ended where it failed."""
    ssd = ssd_read_gbps(gguf.parent / "ssd-probe")
    memlimit.evict(gguf)
    with memlimit.MemoryLimit(limit) as g:
        t = time.perf_counter()
        try:
            r = llamacpp.measure(peer, gguf, a.prompt_len, a.tokens, a.threads, a.reps, extra, wrap=g.command)
        except RuntimeError as e:
            r = {"engine": "llama.cpp", "gguf": gguf.name, "error": " / ".join(str(e).splitlines()[-3:])[-400:]}
        r["wall_s"] = time.perf_counter() - t
        r["cgroup"] = g.stats()
    r["ssd_read_gbps"] = ssd
    return r


def llama_side(peer, gguf: Path, a, limit: int) -> dict:
    """Unlimited (after a read of the file, so its pages are cached), limited with mmap, and
    limited with --no-mmap (where asked)."""
    out = {}
    subprocess.run(["cat", str(gguf)], stdout=subprocess.DEVNULL, check=True)
    t = time.perf_counter()
    out["unlimited"] = llamacpp.measure(peer, gguf, a.prompt_len, a.tokens, a.threads, a.reps)
    out["unlimited"]["wall_s"] = time.perf_counter() - t
    print(json.dumps({"llama.cpp unlimited": _brief(out["unlimited"])}), flush=True)
    out["limited"] = llama_limited(peer, gguf, a, limit)
    print(json.dumps({"llama.cpp limited": _brief(out["limited"])}), flush=True)
    if a.no_mmap:
        out["limited_no_mmap"] = llama_limited(peer, gguf, a, limit, ("-lm", "none"))
        print(json.dumps({"llama.cpp limited --no-mmap": _brief(out["limited_no_mmap"])}), flush=True)
    return out


def _brief(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "commands"}


# ---- tierlm ---------------------------------------------------------------------------------

def engine_report(eng) -> dict:
    """What the engine says about where its weights live and how its expert cache did."""
    out = {"placement": eng.placement.describe(), "load_s": getattr(eng, "load_s", None),
           "store_written": getattr(eng, "store_written", None)}
    ep = getattr(eng, "expert_placement", None)
    if ep is not None:
        out["expert_placement"] = ep.describe()
    se = getattr(eng, "streamed_experts", None)
    if se is not None:
        out["expert_cache"] = se.cache.stats.to_dict()
        out["expert_cache_slots"] = se.cache.slots
    for name in ("describe", "report"):  # whatever fuller report the engine offers
        fn = getattr(eng, name, None)
        if callable(fn):
            out[name] = fn()
    return out


def measure_tierlm(model: Path, weights: str, cpu_mem: str, nvme: Path, prompt_len: int, tokens: int,
                   threads: int, reps: int, rates: dict | None = None) -> dict:
    """tierlm's engine with --cpu-mem: a warm-up request, then `reps` requests of `prompt_len`
    prompt tokens and `tokens` decoded; mean tokens/s (as llama-bench reports) and the engine's report."""
    import statistics
    import torch
    from peers.requests import NullTokenizer, prompt
    from tierlm.infer.batcher import Batcher, Request
    from tierlm.infer.engine import InferConfig, InferenceEngine
    from tierlm.infer.sampling import SamplingParams
    from tierlm.serve.report import experts_line

    torch.set_num_threads(threads)
    cfg = InferConfig(cpu_mem=cpu_mem, weights=weights, max_batch=1, max_seq_len=prompt_len + tokens,
                      nvme_dir=str(nvme), step_tokens=max(256, prompt_len), threads=threads)
    eng = InferenceEngine(model, cfg)
    phases = _count_phases(eng)
    b = Batcher(eng, NullTokenizer(), [])
    b.submit(Request(prompt(8), SamplingParams(max_tokens=2, ignore_eos=True)))
    b.run_until_idle()
    pre, dec, bound = [], [], []
    for _ in range(reps):
        b.stats.__init__()
        for v in phases.values():
            v[:] = [0, 0]
        b.submit(Request(prompt(prompt_len), SamplingParams(max_tokens=tokens, ignore_eos=True)))
        b.run_until_idle()
        s = b.stats
        pre.append(s.tokens["prefill"] / s.s["prefill"])
        dec.append(s.tokens["decode"] / s.s["decode"])
        if eng.expert_stats() is not None and rates:
            line, d = experts_line(eng.expert_stats(), s, rates)
            d["decode_hit_rate"] = phases["decode"][1] / max(phases["decode"][0], 1)
            bound.append(d)
    out = {"engine": "tierlm", "weights": weights, "cpu_mem": cpu_mem, "threads": threads,
           "prefill_tok_s": statistics.mean(pre), "prefill_tok_s_sd": statistics.pstdev(pre),
           "decode_tok_s": statistics.mean(dec), "decode_tok_s_sd": statistics.pstdev(dec),
           **engine_report(eng)}
    if bound:  # decode's bytes a token and the RAM+SSD bound, each rep
        out["decode_bound"] = bound
        out["decode_hit_rate"] = statistics.mean(d["decode_hit_rate"] for d in bound)
        out["of_bound"] = statistics.mean(d["of_bound"] for d in bound)
    eng.close()
    return out


def _count_phases(eng) -> dict:
    """[requests, hits] of the expert cache in prefill and decode steps (a step of one token a row
    is decode), counted around the engine's step."""
    phases = {"prefill": [0, 0], "decode": [0, 0]}
    step = eng.step

    def counted(tokens, starts):
        st = eng.expert_stats()
        r0, h0 = (st.requests, st.hits) if st else (0, 0)
        out = step(tokens, starts)
        if st:
            v = phases["decode" if all(len(t) == 1 for t in tokens) else "prefill"]
            v[0] += st.requests - r0
            v[1] += st.hits - h0
        return out
    eng.step = counted
    return phases


def _tierlm_cmd(model: Path, fmt: str, a, nvme: Path, reps: int, tokens: int, rates: dict | None = None) -> list[str]:
    job = {"model": str(model), "weights": fmt, "cpu_mem": a.cpu_mem, "nvme": str(nvme),
           "prompt_len": a.prompt_len, "tokens": tokens, "threads": a.threads, "reps": reps, "rates": rates}
    return [sys.executable, str(Path(__file__).resolve()), "--tierlm-job", json.dumps(job)]


def _last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return None


def tierlm_side(model: Path, fmt: str, a, limit: int, work: Path) -> dict:
    """tierlm in a child process: once without a limit, short, so the engine writes its expert store
    (a store write inside the cgroup would charge its dirty pages there), then the measured run
    inside the memory cgroup, the model's and the store's files evicted first."""
    nvme = work / "tierlm-store" / fmt
    prep = subprocess.run(_tierlm_cmd(model, fmt, a, nvme, 1, 2), capture_output=True, text=True)
    if prep.returncode:
        tail = "\n".join((prep.stdout + prep.stderr).splitlines()[-15:])
        return {"engine": "tierlm", "weights": fmt, "error": f"tierlm cannot run this model yet:\n{tail}"}
    files = [p for d in (model, nvme) for p in d.rglob("*") if p.is_file()]
    ssd = ssd_read_gbps(work / "ssd-probe")
    store_ssd = max(store_read_gbps(nvme, seed=k) for k in range(3))
    # the rates decode's RAM+SSD bound is taken at: memory as decode reads it (the report's roofline),
    # measured now, outside the limit; the drive at the fastest either probe saw. On a virtual disk
    # whose host caches what was written or read lately, decode's repeated misses read faster than
    # the store's cold files (1.0 GB/s against 1.6 achieved) and near a fresh file's rate: a bound
    # taken at the slower rate would be exceeded.
    from tierlm.bench.rooflines import machine_rates
    rates = {"mem_gbps": machine_rates(fresh=True)["mem_gbps"], "ssd_gbps": max(ssd, store_ssd)}
    memlimit.evict(*files)
    with memlimit.MemoryLimit(limit) as g:
        t = time.perf_counter()
        p = g.run(_tierlm_cmd(model, fmt, a, nvme, a.reps, a.tokens, rates), capture_output=True, text=True)
        r = _last_json(p.stdout) if p.returncode == 0 else None
        if r is None:
            tail = "\n".join((p.stdout + p.stderr).splitlines()[-15:])
            r = {"engine": "tierlm", "weights": fmt, "error": f"exit {p.returncode}:\n{tail}"}
        r["wall_s"] = time.perf_counter() - t
        r["cgroup"] = g.stats()
    r["ssd_read_gbps"], r["store_read_gbps"] = ssd, store_ssd
    r["mem_gbps"], r["bound_ssd_gbps"] = rates["mem_gbps"], rates["ssd_gbps"]
    return r


# ---- report ---------------------------------------------------------------------------------

def _rate(r: dict, key: str, digits: int) -> str:
    if key not in r:
        return "—"
    sd = r.get(key + "_sd")
    return f"{r[key]:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def _peak(r: dict) -> str:
    c = r.get("cgroup")
    if not c:
        return "—"
    return f"{c['peak'] / GIB:.2f} GiB" + (f", {c['oom_kills']} OOM kill" if c["oom_kills"] else "")


def _ssd(r: dict) -> str:
    if "ssd_read_gbps" not in r:
        return "—"
    out = f"{r['ssd_read_gbps']:.2f}"
    return out + (f" (store's files {r['store_read_gbps']:.2f})" if "store_read_gbps" in r else "")


def _note(r: dict) -> str:
    if "error" in r:
        if r.get("cgroup", {}).get("oom_kills"):
            return "killed at the limit (out of memory)"
        return r["error"].splitlines()[0][:120]
    ec = r.get("expert_cache")
    if "of_bound" in r:
        return (f"decode: expert cache hit rate {r['decode_hit_rate']:.1%}, {r['of_bound']:.0%} of its RAM+SSD bound "
                f"({1e3 * r['decode_bound'][-1]['bound_s']:.0f} ms a token at {r.get('mem_gbps', 0):.1f} GB/s from RAM "
                f"and {r.get('bound_ssd_gbps', 0):.2f} GB/s from the drive)")
    return f"expert cache hit rate {ec['hit_rate']:.1%}" if ec else ""


def table(rows: list[dict], limit: int) -> list[str]:
    """Markdown: one line per engine, format and memory condition."""
    out = ["| engine | weights | memory | prefill tok/s | decode tok/s | cgroup peak | SSD GB/s before | note |",
           "|---|---|---|---|---|---|---|---|"]
    lim = f"cgroup {limit / GIB:.2f} GiB"
    for row in rows:
        fmt, gguf = row["format"], llamacpp.FORMATS[row["format"]]
        runs = [("llama.cpp", gguf, "no limit", row["llama.cpp"]["unlimited"]),
                ("llama.cpp", gguf, f"{lim}, mmap", row["llama.cpp"]["limited"])]
        if "limited_no_mmap" in row["llama.cpp"]:
            runs.append(("llama.cpp", gguf, f"{lim}, --no-mmap", row["llama.cpp"]["limited_no_mmap"]))
        if "tierlm" in row:
            runs.append(("tierlm", fmt, f"{lim}, --cpu-mem {row['tierlm'].get('cpu_mem', '?')}", row["tierlm"]))
        for who, w, mem, r in runs:
            out.append(f"| {who} | {w} | {mem} | {_rate(r, 'prefill_tok_s', 1)} | {_rate(r, 'decode_tok_s', 2)} "
                       f"| {_peak(r)} | {_ssd(r)} | {_note(r)} |")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=None, help="llama.cpp build directory (default: llama-bench on PATH)")
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=9, help="decoder layers (the preset's shape, fewer of them)")
    # With random weights the attention output (~std^2 * sqrt(hidden * heads * head_dim)) drowns the
    # token's embedding (~std) at the usual 0.02, so every token after the first layer carries nearly
    # the same hidden state and routes to the same ~12 of 128 experts; at 5e-4 the two are comparable
    # and 32 tokens pick 94-120 distinct experts a layer (uniform routing: 112). Top-k routing only
    # ranks the logits, so their small scale does not matter.
    p.add_argument("--init-std", type=float, default=5e-4, help="initializer_range of the random weights")
    p.add_argument("--dir", default="/work/bench-moe/qwen3-30b-a3b-9l", help="work directory: model, GGUF, store")
    p.add_argument("--cpu-mem", default="2.75GiB", help="tierlm's --cpu-mem, and the memory limit's base")
    p.add_argument("--allowance", default="512MiB", help="added to --cpu-mem for the cgroup limit of both engines: "
                   "each process's own code, libraries and runtime outside the weights' budget")
    p.add_argument("--formats", nargs="*", default=["bf16"], choices=list(llamacpp.FORMATS))
    p.add_argument("--prompt-len", type=int, default=128, help="prefill: tokens in the prompt (llama-bench -p)")
    p.add_argument("--tokens", type=int, default=32, help="decode: tokens generated after the prompt (-n, -d)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=2, help="measured runs of each (llama-bench -r)")
    p.add_argument("--no-mmap", action="store_true", help="also run llama.cpp under the limit with -lm none (no mmap)")
    p.add_argument("--no-tierlm", action="store_true", help="llama.cpp's side only")
    p.add_argument("--prepare", action="store_true", help="only create the model, GGUF files and tierlm's store "
                   "(outside the timing lock), then exit")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--tierlm-job", default=None, help=argparse.SUPPRESS)  # the child process's work
    return p.parse_args(argv)


def _header(kind, peer, build: str, sz: dict, a, limit: int) -> list[str]:
    return [f"machine: {machine_line(kind)}",
            f"llama.cpp {build}, {llamacpp.source_version(peer)}",
            f"model: {a.preset} shape, {a.layers} layers, {sz['experts']} experts ({sz['top_k']} a token): "
            f"{sz['total_params'] / 1e9:.2f}B parameters ({fmt_bytes(sz['total_bf16_bytes'])} bf16), "
            f"{sz['active_params'] / 1e9:.2f}B active ({fmt_bytes(sz['active_bf16_bytes'])} bf16)",
            f"memory: tierlm --cpu-mem {a.cpu_mem}; both engines in a memory cgroup of {limit / GIB:.2f} GiB "
            f"(--cpu-mem + {a.allowance} allowance; page cache included); bf16 weights "
            f"{sz['total_bf16_bytes'] / memlimit.parse_bytes(a.cpu_mem):.1f}x --cpu-mem",
            f"prompt {a.prompt_len} tokens, {a.tokens} decoded after it, {a.threads} threads, "
            f"mean ± sd of {a.reps} runs", "command: " + " ".join(sys.argv)]


def main(argv=None):
    a = parse_args(argv)
    if a.tierlm_job:  # inside the cgroup: one tierlm measurement, its JSON on the last line
        job = json.loads(a.tierlm_job)
        job["model"], job["nvme"] = Path(job["model"]), Path(job["nvme"])
        print(json.dumps(measure_tierlm(**job)), flush=True)
        return None
    peer = llamacpp.find(a.llama_cpp)
    if peer is None:
        sys.exit("llama.cpp not found: pass --llama-cpp DIR (benchmarks/peers/build_llama_cpp.sh builds one)")
    limit = memlimit.parse_bytes(a.cpu_mem) + memlimit.parse_bytes(a.allowance)
    memlimit.controller()  # fails here, with the reason, where no memory limit can be set
    kind = machine_kind()
    print(f"machine: {machine_line(kind)}", flush=True)
    work = Path(a.dir)
    config = model_config(a.preset, a.layers, a.init_std)
    sz = sizes(config, a.preset)
    model = work / "model"
    ensure_model(model, config)
    ggufs, prep = llamacpp.gguf_files(peer, model, work / "gguf", a.formats, a.threads)
    if a.prepare:
        for fmt in [] if a.no_tierlm else a.formats:
            p = subprocess.run(_tierlm_cmd(model, fmt, a, work / "tierlm-store" / fmt, 1, 2))
            print(f"tierlm's {fmt} store: " + ("ready" if p.returncode == 0 else f"not made (exit {p.returncode})"))
        return None
    rows = []
    for fmt in a.formats:
        row = {"format": fmt, "gguf_bytes": ggufs[fmt].stat().st_size,
               "llama.cpp": llama_side(peer, ggufs[fmt], a, limit)}
        if not a.no_tierlm:
            row["tierlm"] = tierlm_side(model, fmt, a, limit, work)
            print(json.dumps({"tierlm": row["tierlm"]}), flush=True)
        rows.append(row)
    build = next((r["llama.cpp"]["unlimited"]["build"] for r in rows), "?")
    lines = _header(kind, peer, build, sz, a, limit)
    lines += [f"GGUF {llamacpp.FORMATS[r['format']]}: {fmt_bytes(r['gguf_bytes'])}" for r in rows]
    lines += ["llama.cpp: " + " ".join(c) for c in rows[0]["llama.cpp"]["unlimited"]["commands"]]
    lines += [""] + table(rows, limit)
    print("\n" + "\n".join(lines))
    if a.json:
        Path(a.json).write_text(json.dumps({"machine": kind, "llama_cpp": build, "sizes": sz, "limit": limit,
                                            "args": vars(a), "prepare": prep, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
