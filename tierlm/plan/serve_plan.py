"""Serving's plan: where the weights and the KV cache are read from each decode step (GPU memory,
RAM over PCIe, RAM by the CPU, NVMe), each site costed, the fastest that fits chosen."""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

from ..storage import BudgetError
from ..units import fmt_bytes
from . import cost as C
from .catalog import Hardware
from .gpu_serve import DecodeBytes, does_not_fit, gpu_decode
from .inference import InferConfig, plan_placement, scratch_bytes
from .moe import MoeBytes, TierReads, moe_bytes, moe_decode_bound, tier_reads
from .pipeline import combine, unhidden
from .records import Plan, Task, usable_ram
from .serve_experts import engine_tiers
from .shapes import ModelShape

# The inference engine's process baseline beyond its libraries: 12 KiB in the runs of docs/planner.md at a2b1c1e
# (its library baseline is read after the model skeleton is built).
INFER_BASELINE = 0


class _Sizes(NamedTuple):
    """Bytes a request's decoding holds."""
    layer_w: int      # one decoder layer's weights in the serving format
    W: int            # all the weights
    kv: int           # the KV cache of the batch at its longest
    ram: int          # RAM the run may use
    scratch: int      # the prefill's transients, inference only (no gradients)
    kv_on_gpu: bool   # the KV cache and the prefill's transients fit in GPU memory
    read: float       # bytes a decode step reads: all the weights (a mixture of experts: those routed to)
    layers_read: float  # of which the decoder layers'
    moe: MoeBytes | None = None  # a mixture of experts' bytes
    engine: TierReads | None = None  # ... where the inference engine's own placement reads them (serve_experts)


def serve(p: Plan, s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> None:
    """Fill `p` for serving: the fastest site for the weights that fits, its decode step and
    prefill, or the problem where none fits."""
    if hw.gpu is not None and task.gpu_mem:
        r = replace(r, gpu_bytes=min(r.gpu_bytes, task.gpu_mem))  # the GPU memory the run may use
    _decode_assumptions(p, hw, r, task)
    sizes = _sizes(s, hw, task, r)
    engine_resident = None
    if hw.measured is not None and task.cpu_mem:
        if s.moe is None:
            engine_resident = _infer_resident_layers(s, task, p)
        else:  # dense parts first and an expert cache, as the engine places them
            engine, engine_resident = _infer_expert_tiers(s, task, p, sizes)
            sizes = sizes._replace(engine=engine)
    best = None
    for site, on_gpu in _sites(hw, r, sizes):
        cand = _option(s, hw, r, task, sizes, site, on_gpu, engine_resident)
        if cand is not None and (best is None or cand["total"] < best["total"]):
            best = cand
    if best is None:
        p.problems.append(f"weights {fmt_bytes(sizes.W)} and KV cache {fmt_bytes(sizes.kv)} do not fit in "
                          f"{fmt_bytes(sizes.ram)} of usable RAM and there is no NVMe to stream from; add RAM or drives")
        p.fits = False
        return
    _record(p, s, r, task, sizes, best)
    if hw.gpu is not None:
        p.extra["gpu_decode"] = _gpu_decode(s, r, task, sizes)


def _gpu_decode(s: ModelShape, r: C.Rates, task: Task, sizes: _Sizes) -> dict:
    """Decoding on the GPU as its engine places whole layers under --gpu-mem, with the resident
    (device memory) and streamed (host link, NVMe) bounds (gpu_serve), whichever site was chosen."""
    b = DecodeBytes(sizes.W - s.layers * sizes.layer_w, s.vocab * s.hidden * C.W_BYTES, int(sizes.layer_w),
                    sizes.layers_read / s.layers, s.layers, sizes.kv, sizes.scratch)
    rates = {"hbm": r.gpu_mem, "link": r.link, "ssd": r.ssd_read, "compute": r.compute_flops}
    g = gpu_decode(b, r.gpu_bytes, sizes.ram, _step_flops(s, task), rates, task.batch)
    return g.to_json() if g is not None else does_not_fit(b, r.gpu_bytes)


def _decode_assumptions(p: Plan, hw: Hardware, r: C.Rates, task: Task) -> None:
    """Where the decode rate comes from on a measured machine, and where it is missing."""
    if hw.measured is not None and hw.measured.get("decode_source"):
        p.assumptions.append(hw.measured["decode_source"])
    if hw.measured is not None and r.gemv and task.weights not in (r.decode or {}):
        p.assumptions.append(f"no {task.weights} decode rate in the measurements (cached by an older `tierlm bench "
                             f"compute`): its bytes are read at the bf16 rate; run `tierlm bench compute` again")


def _sizes(s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> _Sizes:
    """The weights, the KV cache and the prefill's transients of this task, and the RAM it may use."""
    # the decoder layers in the serving format; embeddings and the head stay bf16 (as the engine keeps them)
    layer_w = s.layer_params * C.weight_bytes_per_param(task.weights, s.hidden)
    fixed_w = (s.params - s.layers * s.layer_params) * C.W_BYTES
    kv = task.batch * (task.seq_len + task.new_tokens) * C.kv_bytes_per_token(s)
    scratch = C.compute_working_bytes(s, task.batch * task.seq_len) // 4
    kv_on_gpu = hw.gpu is not None and kv + scratch <= r.gpu_bytes
    W, layers_w = s.layers * layer_w + fixed_w, s.layers * layer_w
    if s.moe is None:
        return _Sizes(layer_w, W, kv, usable_ram(hw, task), scratch, kv_on_gpu, W, layers_w)
    # a step of `batch` rows reads the experts its tokens are routed to, each once
    b = moe_bytes(s.moe, W, C.weight_bytes_per_param(task.weights, s.hidden), task.batch)
    return _Sizes(layer_w, W, kv, usable_ram(hw, task), scratch, kv_on_gpu, b.dense + b.routed_read,
                  layers_w - b.routed + b.routed_read, b)


def _sites(hw: Hardware, r: C.Rates, sizes: _Sizes) -> list[tuple[str, int]]:
    """The compute sites to cost, each with the weight bytes it holds in GPU memory: a GPU holds
    what its memory has room for beside the prefill's transients and (where it fits) the KV cache."""
    sites = []
    if hw.gpu is not None:
        room = r.gpu_bytes - sizes.scratch - (sizes.kv if sizes.kv_on_gpu else 0)
        sites.append(("gpu", max(0, min(sizes.W, room))))
    sites.append(("cpu", 0))
    return sites


def _option(s: ModelShape, hw: Hardware, r: C.Rates, task: Task, sizes: _Sizes, site: str, on_gpu: int,
            engine_resident: int | None) -> dict | None:
    """One site's weights by tier, decode step, prefill and request time; None where it does not fit."""
    kv_where = "gpu" if site == "gpu" and sizes.kv_on_gpu else "ram"
    ram_for_w = max(0, sizes.ram - (sizes.kv if kv_where == "ram" else 0)
                    - (sizes.scratch if sizes.moe is not None else 0))  # an expert cache has what the rest leaves
    in_ram = min(sizes.W - on_gpu, ram_for_w)
    engine = sizes.engine if engine_resident is not None and site == "cpu" else None
    if engine is not None:
        # The inference engine's own placement of a mixture of experts: dense parts, expert cache.
        in_ram = engine.dense["ram"] + engine.experts["ram"] * sizes.moe.expert
    elif engine_resident is not None and site == "cpu":
        # The inference engine's own placement under --cpu-mem: whole layers, after its window.
        in_ram = sizes.W - (s.layers - engine_resident) * sizes.layer_w
    from_ssd = sizes.W - on_gpu - in_ram
    if (from_ssd and not hw.drive) or (kv_where == "ram" and sizes.kv > sizes.ram):
        return None
    weights = {"gpu": on_gpu, "ram": in_ram, "nvme": from_ssd}
    tiers = engine or (tier_reads(weights, sizes.moe, s.moe.all_experts) if sizes.moe is not None else None)
    res, devices = _decode_times(s, r, task, sizes, site, tiers.reads if tiers else weights, kv_where)
    binding, step = combine(devices, s.layers)
    if site == "cpu":
        step += unhidden(r, devices, res)
    if r.overhead and site == "cpu":
        step += _decode_overhead(s, r, engine_resident, res)
    prefill = _prefill(s, hw, r, task.batch, task.seq_len, on_gpu, in_ram, from_ssd)
    total = prefill + task.new_tokens * step
    return dict(site=site, weights=weights, kv_where=kv_where, res=res, devices=devices, binding=binding,
                step=step, prefill=prefill, total=total, tiers=tiers)


def _decode_times(s: ModelShape, r: C.Rates, task: Task, sizes: _Sizes, site: str, weights: dict,
                  kv_where: str) -> tuple[dict, dict]:
    """One decode step's seconds per resource, and per device, with the bytes it reads where `weights`
    has them."""
    B, Sp, N = task.batch, task.seq_len, task.new_tokens
    W, kv, on_gpu, in_ram, from_ssd = sizes.read, sizes.kv, weights["gpu"], weights["ram"], weights["nvme"]
    flops_tok = _step_flops(s, task)
    comp = r.compute_flops if site == "gpu" else r.cpu_flops
    t_comp = flops_tok / comp
    if site == "cpu" and r.gemv:
        # Measured CPU: one token through the layers at the measured decode rate of their
        # format (bench compute's decode step), the head at the bf16 one; more rows of a batch
        # add at the large-GEMM rate.
        rate = (r.decode or {}).get(task.weights) or r.gemv
        t_comp = sizes.layers_read / rate + s.vocab * s.hidden * C.W_BYTES / r.gemv \
            + (B - 1) * flops_tok / B / comp
    # The measured decode step reads its weights from RAM (256 MiB, past the caches): that rate
    # is already the memory's for those bytes. Counting them again at bench io's copy rate (read
    # and write bytes, ~2/3 of a pure read stream) bound a 2-vCPU Zen 4 VM's in-RAM decode at 22.8 GB/s
    # where it read 34 (docs/planner.md at a2b1c1e, a 2-vCPU Zen 4 VM).
    resident_read = in_ram if site == "cpu" and not r.gemv else 0
    res = {"compute": t_comp,
           "memory": (resident_read + from_ssd + (kv if kv_where == "ram" else 0)) / r.dram,
           "gpu_memory": ((on_gpu + (kv if kv_where == "gpu" else 0)) / r.gpu_mem) if site == "gpu" else 0.0,
           "link_h2d": ((W - on_gpu) + (kv if kv_where == "ram" else 0)) / r.link if site == "gpu" else 0.0,
           "ssd_read": from_ssd / r.ssd_read if from_ssd else 0.0}
    devices = {"gpu" if site == "gpu" else "cpu": res["compute"], "dram": res["memory"],
               "hbm": res["gpu_memory"], "pcie": res["link_h2d"], "ssd": res["ssd_read"]}
    return res, devices


def _step_flops(s: ModelShape, task: Task) -> float:
    """A decode step's FLOPs: every row's token through the parameters it multiplies by (a mixture
    of experts: those it is routed to) and its attention over the prompt and half the new tokens."""
    return 2.0 * s.matmul_params * task.batch + C.attention_fwd_flops(s, task.seq_len + task.new_tokens / 2, task.batch)


def _decode_overhead(s: ModelShape, r: C.Rates, engine_resident: int | None, res: dict) -> float:
    """The engine's fixed costs of a decode step, measured (bench compute): per step, and per
    layer resident or streamed (a streamed layer also waits on its read's hand-off). Recorded in `res`."""
    o, streamed = r.overhead, s.layers - (engine_resident if engine_resident is not None else s.layers)
    res["overhead"] = (o["decode_resident_per_step_s"] if not streamed else o["decode_streamed_per_step_s"]) \
        + (s.layers - streamed) * o["decode_resident_per_layer_s"] + streamed * o["decode_streamed_per_layer_s"]
    return res["overhead"]


def _record(p: Plan, s: ModelShape, r: C.Rates, task: Task, sizes: _Sizes, best: dict) -> None:
    """The chosen site's placement, times and request figures into `p`."""
    B, N = task.batch, task.new_tokens
    if best["weights"]["nvme"] > r.nvme_bytes:
        p.problems.append(f"NVMe capacity: {fmt_bytes(best['weights']['nvme'])} of weights on drives of "
                          f"{fmt_bytes(r.nvme_bytes)}; add drives")
    p.fits = not p.problems
    kv = sizes.kv
    p.placement = {"weights": best["weights"], "kv_cache": {best["kv_where"]: kv}, "compute": best["site"]}
    p.resources_s, p.devices_s, p.binding = best["res"], best["devices"], best["binding"]
    p.step_s = best["step"]
    p.tokens_per_s = B * N / best["total"]
    p.extra = {"decode_tokens_per_s": B / best["step"], "prefill_s": best["prefill"],
               "request_s": best["total"], "ttft_s": best["prefill"] + best["step"],
               "generated_tokens": B * N, "kv_cache_bytes": kv}
    if best["tiers"] is not None:
        p.extra["moe"] = _moe_record(s, r, task, sizes, best)
        p.assumptions.append(
            "mixture of experts: routing taken as uniform and independent between tokens and layers, so the expert "
            "cache's hit rate is the share of all experts it holds, min(1, cached / all) (an assumption: real "
            "routing is skewed, and a cache of the experts picked most hits more); a step of several rows reads "
            "E·(1 − (1 − k/E)^rows) distinct experts a layer")


def _moe_record(s: ModelShape, r: C.Rates, task: Task, sizes: _Sizes, best: dict) -> dict:
    """A mixture of experts' decode: its active bytes, the experts each tier holds, the hit rate
    assumed and, computing on the CPU, the decode bound (moe.moe_decode_bound) split by source."""
    b, t, m = sizes.moe, best["tiers"], s.moe
    out = {"total_params": m.total_params, "active_params": m.active_params, "experts": m.experts,
           "top_k": m.top_k, "moe_layers": m.moe_layers, "expert_bytes": b.expert,
           "active_bytes_per_token": b.active_token, "routed_bytes_per_step": b.routed_read,
           "experts_held": t.experts, "hit_rate": t.shares["ram"] + t.shares["gpu"], "bound": None}
    if best["site"] == "cpu" and r.dram:
        bound = moe_decode_bound(t.dense["ram"], b.routed_read, t.shares["ram"], r.dram, r.ssd_read,
                                 _step_flops(s, task) / r.cpu_flops, dense_ssd_bytes=t.dense["nvme"])
        out["bound"] = {**bound._asdict(), "total_s": bound.total_s, "shares": bound.shares()}
    return out


def _infer_resident_layers(s: ModelShape, task: Task, p: Plan) -> int | None:
    """Decoder layers `tierlm generate --cpu-mem` keeps in RAM (`tierlm.infer.engine.plan_placement`)."""
    max_len = task.seq_len + task.new_tokens
    cfg = InferConfig(cpu_mem=task.cpu_mem, max_batch=task.batch, max_seq_len=max_len, weights=task.weights)
    kv = task.batch * (max_len + 1) * C.kv_bytes_per_token(s)
    try:
        return plan_placement(cfg, INFER_BASELINE, (s.embed_params + s.head_params) * C.W_BYTES,
                              int(s.block_params * C.weight_bytes_per_param(task.weights, s.hidden)), s.layers, kv,
                              scratch_bytes(C.hf_like_config(s), cfg, max_len)).resident
    except BudgetError as e:
        p.problems.append(str(e))
        return None


def _infer_expert_tiers(s: ModelShape, task: Task, p: Plan, sizes: _Sizes) -> tuple[TierReads | None, int | None]:
    """A mixture of experts under `tierlm generate --cpu-mem`: where the engine's placement reads a
    step from, and the layers whose dense parts stay resident (serve_experts.engine_tiers)."""
    try:
        return engine_tiers(s, task, sizes.moe, sizes.layer_w, sizes.W - s.layers * sizes.layer_w, INFER_BASELINE)
    except BudgetError as e:
        p.problems.append(str(e))
        return None, None


def _prefill(s: ModelShape, hw: Hardware, r: C.Rates, batch: int, prompt: int, on_gpu: int, in_ram: int, from_ssd: int) -> float:
    """The prompt's forward on whichever compute site is faster for it: prefill is compute-heavy, so a
    GPU streaming the weights over PCIe often beats the CPU that decodes from RAM."""
    flops = 2.0 * s.matmul_params * batch * prompt + C.attention_fwd_flops(s, prompt / 2, batch * prompt)
    ssd = from_ssd / r.ssd_read if from_ssd else 0.0
    times = [combine({"cpu": flops / r.cpu_flops, "dram": (in_ram + from_ssd) / r.dram, "ssd": ssd}, s.layers)[1]]
    if hw.gpu is not None:
        off = in_ram + from_ssd
        times.append(combine({"gpu": flops / r.compute_flops, "hbm": on_gpu / r.gpu_mem, "pcie": off / r.link,
                              "dram": off / r.dram, "ssd": ssd}, s.layers)[1])
    return min(times)
