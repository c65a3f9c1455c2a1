"""What `tierlm plan` and `tierlm bench` do, so the CLI only maps verbs to these functions.

The recipe runs the profiler (`tierlm.bench`) where the plan needs it: `--hardware this` with
no cached measurements measures the machine first, as `tierlm bench io` and `bench compute` would.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
from pathlib import Path

import torch

from ..bench import cache, measure, model_step, overhead, overlap
from ..bench.progress import Stages
from ..config import to_dict
from ..plan import cost as C
from ..plan.catalog import CPU, Catalog, Drive, Hardware
from ..plan.finetune_time import probe_seconds, probe_store_bytes
from ..plan.planner import Plan, Task, _usable_ram, plan
from ..units import fmt_bytes, parse_bytes
from . import report
from .models import _config_for, load_catalog, model_shape
from .options import PlanConfig


def hardware_from_measurements(m: dict, spec: str = "this") -> Hardware:
    """A Hardware whose rates are the measured ones (no datasheet, no efficiency factor)."""
    io, comp, mach = m["io"], m["compute"], m["machine"]
    cpu = CPU("this", 1, mach["cores"], comp["matmul_tflops"]["bfloat16"], 0, m["io"]["mem_gbps"],
              mach["ram_bytes"], 0.0, 0.0, f"tierlm bench on this machine, {mach['when']}")
    drive = Drive("this-nvme", io["read_gbps"], io["write_gbps"], io["free_bytes"], 0.0, 0.0,
                  f"tierlm bench io --nvme {io['dir']}, {mach['when']}")
    measured = {"matmul_tflops": comp["matmul_tflops"], "adamw_elems_per_s": comp["adamw_elems_per_s"],
                "mem_gbps": io["mem_gbps"], "nvme": io, "when": mach["when"],
                # absent in caches written before `bench compute` measured them: the plan says so
                "layer_tflops": comp.get("layer_tflops"), "layer_dtype": comp.get("layer_dtype", "bf16"),
                "layer_tflops_by_tokens": comp.get("layer_tflops_by_tokens"),
                "gemv_gbps": comp.get("gemv_gbps"),  # caches from before decode_gbps
                "decode_gbps": comp.get("decode_gbps"),
                "crc32c_gbps": comp.get("crc32c_gbps"),
                # what `--precision auto` picked when `bench compute` ran (its reference layers' dtype)
                "precision": comp.get("layer_dtype", "bf16"),
                "overhead": comp.get("overhead"),
                # absent in caches from before bench compute measured it: perfect overlap assumed
                "overlap": comp.get("overlap")}
    hw = Hardware(spec, cpu, mach["ram_bytes"], None, drive, 1, measured=measured)
    if not io.get("direct_io", True):
        hw.notes.append(io.get("note") or "measured without direct I/O")
    return hw


def measured_this(nvme: str | None, quiet: bool = False) -> dict:
    """The cached measurements, measuring what is missing first (announced: it takes minutes). The
    drive is measured where the runs write (--nvme), else in the working directory, with at most an
    eighth of the free space there (bench.measure.probe_size)."""
    data = cache.load()
    if "io" not in data or (nvme and Path(data["io"]["dir"]) != Path(nvme).resolve()):
        where = nvme or "."
        size, why = measure.probe_size(where, 2 << 30)
        if not size:
            raise ValueError(f"--hardware this: cannot measure the drive under {Path(where).resolve()}: {why}; "
                             f"pass --nvme DIR on the drive the runs will use")
        if not quiet:
            print(f"--hardware this: nothing measured on this machine yet (cache {cache.cache_path()}); "
                  f"measuring it once, as `tierlm bench io` and `tierlm bench compute` would", file=sys.stderr)
        run_bench("io", where, size=size, quiet=quiet)
    if "compute" not in data:
        run_bench("compute", nvme, quiet=quiet)
    return cache.load()


def _existing(directory: str) -> str:
    """The cached `bench io` folder, or where it was removed (a scratch folder), its nearest
    surviving parent: the same file system, as the cache's mount-point match assumes."""
    p = Path(directory)
    while not p.is_dir() and p != p.parent:
        p = p.parent
    return str(p)


# Rates the announcement's time estimates assume before anything is measured (bytes/s of the drive
# moving a probe's files, create + overwrite + read); the I/O stages are rescaled once the first
# has run. The compute stages' seconds are about what they took on a 2-core EPYC Zen 4 (AVX-512)
# with other work on it; a slower CPU takes a few times more.
ASSUMED_DRIVE_BPS = 1.0e9
# An engine-step probe predicted to take longer (plan.finetune_time.probe_seconds) times the model's
# layer alone: Qwen3-30B-A3B's two-layer copy has 1.8B parameters, 54 GB of store and ~29 GB of
# state traffic a step; LongCat-Flash's tiny default ran past 15 min.
ENGINE_PROBE_MAX_S = 600.0
COMPUTE_STAGES = [("matmul per dtype and the AdamW kernel", 8),
                  ("decoder layers fwd+bwd (3 widths x 2 token counts)", 50),
                  ("batch-1 decode (bf16, int8, int4)", 35), ("CRC32C", 1),
                  ("the engine's fixed costs (tiny runs)", 45), ("compute beside drive I/O", 20)]


def run_bench(what: str, nvme: str | None, size: int = 2 << 30, quiet: bool = False) -> dict:
    """`tierlm bench io|compute`: measure, cache and return the results. `size` bounds every file
    the I/O probes write (the depth and request-size sweeps write at most 512 MiB, or `size`)."""

    say = (lambda *a: None) if quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    if what == "io":
        sweep, small = min(size, 512 << 20), min(size, 128 << 20)
        moved = {"one pass": 3 * size, "depths": 2 * len(measure.DEPTHS) * 3 * (sweep + small),
                 "blocks": 2 * len(measure.BLOCKS) * 3 * sweep}
        st = Stages("bench io", [(f"sequential write and read of {fmt_bytes(size)} in {nvme}", moved["one pass"] / ASSUMED_DRIVE_BPS),
                                 (f"requests in flight ({', '.join(map(str, measure.DEPTHS))}), 2 rounds",
                                  moved["depths"] / ASSUMED_DRIVE_BPS),
                                 (f"request sizes ({', '.join(fmt_bytes(b) for b in measure.BLOCKS)}), 2 rounds",
                                  moved["blocks"] / ASSUMED_DRIVE_BPS),
                                 ("host memory copy", 1)],
                    note=f"direct I/O where allowed, {fmt_bytes(sum(moved.values()))} moved in all, "
                         f"at most {fmt_bytes(size)} on the drive at once", quiet=quiet)
        res = st(measure.bench_io, nvme, size)
        seen = 3 * res["bytes"] / st.took if st.took > 0 else ASSUMED_DRIVE_BPS
        st.rescale(ASSUMED_DRIVE_BPS / seen, {st.names[1], st.names[2]})
        res.update(st(measure.bench_queue_depth, nvme, size_bytes=sweep, small_size=small))
        res.update(st(measure.bench_block_size, nvme, res["queue_depth"], size_bytes=sweep))
        res.update(st(measure.bench_memory))
    else:
        st = Stages("bench compute", COMPUTE_STAGES, note=f"{torch.get_num_threads()} threads",
                    quiet=quiet)
        res = st(measure.bench_compute)
        res.update(st(measure.bench_layer))
        res.update(st(measure.bench_decode))
        res.update(st(measure.bench_checksum))
        # The commit's syncfs is part of the overhead: measure on the drive the runs use.
        where = nvme if nvme and nvme != "." else _existing(cache.load().get("io", {}).get("dir", "."))
        res["overhead"] = st(overhead.bench_overhead, where)
        res.update(st(overlap.bench_overlap, where))
    res_machine = measure.machine()
    path = cache.update(what, res, also_next_to=nvme if what == "io" else None)
    cache.update("machine", res_machine)
    say(f"cached in {path}")
    return res


def bench_text(what: str, res: dict) -> str:
    if what == "io":
        return (f"NVMe {res['dir']}: read {res['read_gbps']:.2f} GB/s, write {res['write_gbps']:.2f} GB/s "
                f"({fmt_bytes(res['block_bytes'])} blocks, {res['inflight']} in flight, direct I/O "
                f"{'on' if res['direct_io'] else 'OFF: ' + res['note']}"
                + (f"; a read {res['read_ms_p50']:.0f} ms typical, {res['read_ms_p99']:.0f} ms at p99"
                   if "read_ms_p99" in res else "")
                + f"); host memory copy {res['mem_gbps']:.1f} GB/s"
                + (f"; requests in flight for training: {res['queue_depth']} (read / write GB/s at "
                   + "; at ".join(f"{fmt_bytes(res[b])}: " + ", ".join(f"{d}: {v['read_gbps']:.2f} / {v['write_gbps']:.2f}"
                                                                       for d, v in res[k].items())
                                  for b, k in (("depth_block_bytes", "by_depth"), ("depth_small_bytes", "by_depth_small"))
                                  if k in res)
                   + ")" if "queue_depth" in res else "")
                + (f"; optimizer shards of {fmt_bytes(res['shard_bytes'])} (read / write GB/s: "
                   + ", ".join(f"{fmt_bytes(int(b))}: {v['read_gbps']:.2f} / {v['write_gbps']:.2f}"
                               for b, v in res["by_block"].items())
                   + ")" if "shard_bytes" in res else ""))
    mm = ", ".join(f"{k} {v:.3f}" for k, v in res["matmul_tflops"].items())
    o = res["overhead"]
    return (f"matmul TFLOPS ({res['matmul_n']}^3, {res['threads']} threads): {mm}; decoder layer fwd+bwd "
            + "; ".join(f"{t} tokens: " + ", ".join(f"{v:.3f} at hidden {k}" for k, v in row.items())
                        for t, row in (res.get("layer_tflops_by_tokens")
                                       or {res.get("layer_tokens", 2048): res["layer_tflops"]}).items())
            + f" TFLOPS ({res.get('layer_dtype', 'bf16')}); batch-1 decode step ({res['decode_path']} layers) "
            + ", ".join(f"{k} {v:.2f}" for k, v in res["decode_gbps"].items()) + " GB/s of weights; CRC32C "
            f"{res['crc32c_gbps']:.1f} GB/s; AdamW (fused) {res['adamw_elems_per_s'] / 1e9:.2f} "
            f"G elements/s; engine overhead: training {o['train_per_step_s'] * 1e3:.0f} ms/step + "
            f"{o['train_per_layer_s'] * 1e3:.0f} ms/layer, decode in RAM {o['decode_resident_per_step_s'] * 1e3:.1f} ms + "
            f"{o['decode_resident_per_layer_s'] * 1e3:.1f} ms/layer, streamed {o['decode_streamed_per_step_s'] * 1e3:.1f} ms + "
            f"{o['decode_streamed_per_layer_s'] * 1e3:.1f} ms/layer; compute beside SSD I/O hides "
            f"{res['overlap']:.0%} of the shorter (rounds {res['overlap_rounds']})")


def _decode_probe(config, task: Task, threads: int):
    """Serving: this model's decode step in the task's weight format (bench.measure.bench_decode on its
    own layers): (cache key, (what is measured, about how many seconds), the probe)."""
    key = "decode|" + model_step.model_step_key(config, 1, 1, torch.bfloat16) + f"|{task.weights}"
    # bf16 too: the head stays bf16 whatever the layers' format (the planner reads it at that rate)
    formats = tuple(dict.fromkeys((task.weights, "bf16")))
    what = (f"this model's own decode step ({config.model_type} code, {' and '.join(formats)} weights, batch 1, "
            f"{threads} threads, 256 MiB of layer copies, 30 rounds)", 5 * len(formats))
    return key, what, lambda: {"decode_gbps": measure.bench_decode(formats, config=config)["decode_gbps"]}


def _train_probe(config, shape, task: Task, hw: Hardware, nvme: str | None, threads: int):
    """Fine-tuning: this model's training step at the task's micro-batch through the engine, at the
    task's budget and clipping (bench.model_step.bench_engine_step); where the engine cannot run it,
    the layer alone (bench_model_step): (cache key, (what, about how many seconds), the probe)."""
    precision = task.precision if task.precision != "auto" else hw.measured.get("precision", "bf16")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    T, seq = task.batch * task.seq_len, task.seq_len
    budget = _usable_ram(hw, task)  # the run's --cpu-mem, or what the plan assumes it would be
    key = model_step.engine_step_key(config, T, seq, dtype, budget, task.clip, task.state_cache)
    where = nvme or _existing((hw.measured.get("io") or {}).get("dir") or ".")
    # about how long: building the copy and writing its first state, then each step's compute,
    # optimizer and state traffic for all its parameters (a mixture's idle experts too)
    run = dataclasses.replace(task, precision=precision)
    est = probe_seconds(shape, run, C.rates(hw, C.Efficiency(), precision), T, model_step.ENGINE_PROBE_LAYERS,
                        model_step.ENGINE_PROBE_STEPS, parse_bytes(budget or model_step.ENGINE_PROBE_BUDGET)) + 5
    store = probe_store_bytes(shape, run, model_step.ENGINE_PROBE_LAYERS)
    free = shutil.disk_usage(where).free
    if est > ENGINE_PROBE_MAX_S or store > free / 2:
        # a many-expert mixture's probe copy moves its whole state every step and holds it on the
        # drive: its layer alone instead, as where the engine cannot run it
        key = model_step.model_step_key(config, T, seq, dtype)
        what = (f"this model's own decoder layer, forward and backward ({config.model_type} code, {T} tokens in rows "
                f"of {seq}, {precision}, {threads} threads; its step through the engine would take about "
                f"{est / 60:.0f} min and {fmt_bytes(store)} of {where}'s {fmt_bytes(free)} free)",
                2 * model_step.MODEL_PROBE_S + 10)
        return key, what, lambda: _found(model_step.bench_model_step(config, T, seq, dtype))
    what = (f"this model's own training step through the engine ({config.model_type} code, "
            f"{model_step.ENGINE_PROBE_LAYERS} of its layers, {T} tokens in rows of {seq}, {precision}, {threads} "
            f"threads, {model_step.ENGINE_PROBE_STEPS} steps in {where})", est)

    def probe():
        try:
            res = model_step.bench_engine_step(config, T, seq, dtype, where, budget, task.clip, task.state_cache)
        except Exception as e:  # noqa: BLE001 - e.g. a budget the probe's engine refuses: the bare layer
            print(f"plan: the engine could not run this model's step ({type(e).__name__}: {e}); "
                  f"timing its layer alone", file=sys.stderr)
            res = None
        if res is None:  # the engine failed, or its probe model is too large to build quickly
            res = model_step.bench_model_step(config, T, seq, dtype)
        return _found(res)
    return key, what, probe


def _found(res: dict | None) -> dict:
    return {"model_step": res} if res else {}


def own_measurements(model: str, shape, task: Task, hw: Hardware, quiet: bool = False,
                     nvme: str | None = None) -> dict:
    """What this model's own code does on this machine, measured at the task's shapes, dtype and
    threads, for hw.measured: fine-tuning, its training step ("model_step", _train_probe); serving,
    its decode step in the task's weight format ("decode_gbps", _decode_probe). Cached in bench.json
    by what each depends on. Nothing for catalog hardware or beside a GPU; where a probe cannot run,
    the planner keeps bench compute's reference layers and says so."""
    if hw.measured is None or hw.gpu is not None:
        return {}
    config, _ = _config_for(model)
    threads = torch.get_num_threads()
    key, what, probe = (_decode_probe(config, task, threads) if task.kind == "serve"
                        else _train_probe(config, shape, task, hw, nvme, threads))
    known = dict(cache.load().get("model_steps") or {})
    if key in known:
        return known[key]
    st = Stages("plan", [what], note="once per model shape and task; cached", quiet=quiet)
    try:
        res = st(probe)
    except Exception as e:  # noqa: BLE001 - a family whose code the probe cannot drive: the plan goes on
        print(f"plan: this model's own step could not be measured ({type(e).__name__}: {e}); "
              f"keeping bench compute's reference layers", file=sys.stderr)
        return {}  # not cached: the next plan tries again
    known[key] = res  # {} (too large to build, or no row fits) is cached as such
    cache.update("model_steps", known)
    return res


def _with_own(hw: Hardware, model: str, shape, task: Task, nvme: str | None = None) -> Hardware:
    own = own_measurements(model, shape, task, hw, nvme=nvme)
    if "decode_gbps" in own:
        hw.measured["decode_gbps"] = {**(hw.measured.get("decode_gbps") or {}), **own["decode_gbps"]}
        hw.measured["decode_source"] = ("decode rates measured on this model's own layers: "
                                        + ", ".join(f"{k} {v:.2f} GB/s" for k, v in own["decode_gbps"].items()))
    if "model_step" in own:
        hw.measured["model_step"] = own["model_step"]
    return hw


def resolve(spec: str, catalog: Catalog, nvme: str | None = None) -> Hardware:
    if spec.strip().lower() == "this":
        return hardware_from_measurements(measured_this(nvme))
    return catalog.parse(spec)


def task_of(cfg: PlanConfig) -> Task:
    """The planner's Task for these options (cpu_mem in bytes)."""
    return Task(kind=cfg.task, batch=cfg.batch, seq_len=cfg.seq_len, new_tokens=cfg.tokens,
                activations=cfg.activations, state_cache=cfg.state_cache,
                cpu_mem=parse_bytes(cfg.cpu_mem, "--cpu-mem") if cfg.cpu_mem else None, precision=cfg.precision,
                clip=cfg.clip, weights=cfg.weights,
                gpu_mem=parse_bytes(cfg.gpu_mem, "--gpu-mem") if cfg.gpu_mem else None)


def run_plan(cfg: PlanConfig) -> list[Plan]:
    """`tierlm plan`: print the plan (or, with --compare, rank and chart several) and write --json,
    each plan with the config it ran with (under the flags' names)."""
    task = task_of(cfg).validate()  # a bad flag is said before `--hardware this` measures the machine (minutes)
    model, nvme, logged = cfg.model, cfg.nvme, to_dict(cfg)
    catalog = load_catalog(cfg.catalog) if cfg.catalog else Catalog()
    shape = model_shape(model)
    if cfg.compare:
        specs = (catalog.everything() if cfg.compare.strip().lower() == "all"
                 else [s for s in cfg.compare.split(",") if s.strip()])
        plans = []
        for spec in specs:
            plans.append(plan(shape, _with_own(resolve(spec, catalog, nvme), model, shape, task, nvme), Task(**vars(task))))
        print(report.compare_text(plans))
        chart = Path(cfg.chart or f"plan-{shape.name}-{task.kind}.png")
        report.chart(plans, chart, f"{shape.name}, {task.kind}, batch {task.batch} x {task.seq_len}")
        print(f"trade-off chart: {chart}")
        if cfg.json:
            report.write_json([{**p.to_json(), "config": logged} for p in report.rank(plans)], cfg.json)
        return plans
    p = plan(shape, _with_own(resolve(cfg.hardware, catalog, nvme), model, shape, task, nvme), task)
    print(report.text(p))
    if cfg.json:
        report.write_json({**p.to_json(), "config": logged}, cfg.json)
    return [p]
