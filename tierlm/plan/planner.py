"""The planner: placement per tier, each resource's time, the binding one, throughput and cost.

tierlm's pipeline runs every resource at once (layer i+1 loads while layer i computes while the
optimizer updates layer i-1), so a step takes as long as its busiest device, plus the pipeline's
fill and drain: one layer's worth of the other devices' work, (sum - max) / layers. Devices are
physical: the GPU (compute), the CPU (optimizer; and compute too when there is no GPU, since they
share the cores), DRAM, the PCIe link (per direction, full duplex) and the SSDs, which serve reads
and writes from the same flash: mixed traffic takes read time + write time.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch

from ..storage import BudgetError
from ..units import fmt_bytes
from . import budget
from . import cost as C
from .catalog import GiB, Hardware
from .inference import InferConfig, plan_placement, scratch_bytes
from .shapes import ModelShape

# Host RAM the planner leaves to the OS, the libraries and the allocator (assumption).
HOST_RESERVE_BYTES = 8 * GiB
HOST_RESERVE_FRACTION = 0.05


@dataclass
class Task:
    kind: str = "finetune"           # finetune | serve
    batch: int = 1                   # sequences per micro-batch / concurrent requests
    seq_len: int = 1024              # training sequence, or prompt length when serving
    new_tokens: int = 256            # serve: tokens generated per request
    activations: str = "auto"        # auto | keep | swap (to NVMe) | recompute
    state_cache: bool = True         # keep optimizer state resident in RAM where it fits
    cpu_mem: int | None = None       # RAM the run may use (default: the machine's, less a reserve)
    precision: str = "auto"          # auto: what `tierlm finetune` would pick on the hardware (its ISA flags)
    clip: str = "on"                 # on: gradients saved for an exact clip redo; off; redo: every step clips
    weights: str = "bf16"            # serve: the decoder layers' weight format (bf16 | int8 | int4)

    def validate(self) -> "Task":
        if self.kind not in ("finetune", "serve"):
            raise ValueError(f"--task {self.kind!r}: use finetune or serve")
        for name in ("batch", "seq_len", "new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.activations not in ("auto", "keep", "swap", "recompute"):
            raise ValueError(f"--activations {self.activations!r}: use auto, keep, swap or recompute")
        if self.clip not in ("on", "off", "redo"):
            raise ValueError(f"--clip {self.clip!r}: use on, off or redo")
        if self.weights not in ("bf16", "int8", "int4"):
            raise ValueError(f"--weights {self.weights!r}: use bf16, int8 or int4")
        if self.weights != "bf16" and self.kind != "serve":
            raise ValueError(f"--weights {self.weights} is for --task serve (fine-tuning keeps bf16/fp32 weights)")
        return self


@dataclass
class Plan:
    model: dict
    hardware: dict
    task: dict
    fits: bool
    problems: list[str]                       # what does not fit, by how much, and what to change
    placement: dict = field(default_factory=dict)   # tier -> {what: bytes}
    activations: dict = field(default_factory=dict)  # layers kept / in RAM / on NVMe / recomputed
    resources_s: dict = field(default_factory=dict)  # per resource, seconds per step
    devices_s: dict = field(default_factory=dict)    # per physical device (what overlaps)
    binding: str | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None               # model FLOPs per second achieved (6PT + attention)
    traffic_bytes: dict = field(default_factory=dict)
    cost: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


def _usable_ram(hw: Hardware, task: Task) -> int:
    if task.cpu_mem is not None:
        return task.cpu_mem
    if hw.measured is not None:
        return int(hw.ram_bytes * (1 - HOST_RESERVE_FRACTION))
    return int(hw.ram_bytes - HOST_RESERVE_BYTES - HOST_RESERVE_FRACTION * hw.ram_bytes)


def _unhidden(r: C.Rates, devices: dict[str, float], res: dict) -> float:
    """Without a GPU the store's threads take cycles from the cores that compute: the shorter of
    CPU and SSD time is hidden only by the measured share (bench/overlap.py). Recorded in `res`."""
    if r.overlap >= 1.0 or not devices.get("ssd") or not devices.get("cpu"):
        return 0.0
    res["overlap_penalty"] = (1.0 - r.overlap) * min(devices["cpu"], devices["ssd"])
    return res["overlap_penalty"]


def _combine(devices: dict[str, float], layers: int) -> tuple[str, float]:
    busy = {k: v for k, v in devices.items() if v > 0}
    binding = max(busy, key=busy.get)
    top = busy[binding]
    return binding, top + (sum(busy.values()) - top) / max(layers, 1)


def _cost(hw: Hardware, tokens_per_s: float | None, lifetime_years: float, usd_per_kwh: float) -> dict:
    price = hw.parts_price()
    out = {"hardware_usd": price, "power_w": None if hw.measured else hw.power_w(),
           "lifetime_years": lifetime_years, "usd_per_kwh": usd_per_kwh, "usd_per_hour": None,
           "usd_per_million_tokens": None}
    if price is None:
        out["note"] = "no price for this machine: give one with price_usd under [this] in --catalog"
        return out
    power_kw = (hw.power_w() if hw.measured is None else 0.0) / 1000
    per_hour = price / (lifetime_years * 365 * 24) + power_kw * usd_per_kwh
    out["usd_per_hour"] = per_hour
    if tokens_per_s:
        out["usd_per_million_tokens"] = per_hour / (tokens_per_s * 3600 / 1e6)
    return out


def _assumptions(eff: C.Efficiency, hw: Hardware, lifetime_years: float, usd_per_kwh: float) -> list[str]:
    a = list(hw.notes)
    if hw.measured is None:
        a.append("rates: datasheet peaks x efficiency " + ", ".join(f"{k} {v}" for k, v in eff.to_json().items()))
        a.append(f"CPU optimizer: {C.ADAM_ELEMS_PER_CORE:.0e} AdamW elements/s per core (assumption)")
    else:
        a.append("rates: measured by `tierlm bench` on this machine (" + hw.measured.get("when", "?") + ")")
        if not hw.measured.get("overhead"):
            a.append("no decoder-layer rate or engine fixed costs in the measurements (cached by an older "
                     "`tierlm bench compute`): the large-GEMM rate is used and fixed costs are left out; run "
                     "`tierlm bench compute` again")
    a.append("overlap: step = busiest device + (sum of the others) / layers; SSD reads and writes share the drives")
    ov = (hw.measured or {}).get("overlap")
    if ov is not None and hw.gpu is None:
        a.append(f"CPU compute and SSD I/O share the cores: {ov:.0%} of the shorter is hidden (measured, "
                 f"bench/overlap.py)")
    a.append(f"cost: hardware over {lifetime_years:g} years at 100% use + TDP power at ${usd_per_kwh}/kWh")
    return a


def plan(shape: ModelShape, hw: Hardware, task: Task, eff: C.Efficiency | None = None,
         lifetime_years: float = 3.0, usd_per_kwh: float = 0.15) -> Plan:
    eff = eff or C.Efficiency()
    task.validate()
    if task.precision == "auto":
        # catalog parts all multiply bf16 natively; finetune computes in what `--precision auto` reads
        # from this CPU's ISA flags; generate/serve hold bf16 weights whatever the CPU (their --weights default)
        task.precision = (hw.measured or {}).get("precision", "bf16") if task.kind == "finetune" else "bf16"
    r = C.rates(hw, eff, task.precision)
    p = Plan(model=shape.to_json(), hardware={"spec": hw.spec, "describe": hw.describe(), "rates": r.to_json()},
             task=asdict(task), fits=True, problems=[],
             assumptions=_assumptions(eff, hw, lifetime_years, usd_per_kwh))
    (_finetune if task.kind == "finetune" else _serve)(p, shape, hw, task, r)
    p.cost = _cost(hw, p.tokens_per_s if p.fits else None, lifetime_years, usd_per_kwh)
    return p


# ---- fine-tuning --------------------------------------------------------------------------------

class _Layout(NamedTuple):
    """Bytes per parameter of the engine's state in a precision, and its compute dtype."""
    dtype: torch.dtype  # activations, layer inputs and transients
    w: int        # working weights, as read for compute
    grad: int     # a gradient
    w_write: int  # working weights written each step besides the master
    state: int    # what the optimizer reads and writes: master, m, v

    @property
    def ram_state(self) -> int:  # held in RAM to keep a parameter off the SSD
        return self.w_write + self.state

    @property
    def ssd_state(self) -> int:  # on disk: two slots of state and weights, and a saved gradient
        return 2 * (self.state + self.w_write) + self.grad


def _layout(task: Task) -> _Layout:
    """bf16: bf16 working weights and gradients beside the fp32 master, m and v. fp32 (what
    `--precision auto` picks on a CPU without fast bf16): the master is the working weight, so
    nothing else is written, and gradients are fp32. (An fp32 Qwen2.5-0.5B step read 19.8 bytes a
    parameter and wrote 12.0; the bf16 layout counted 16 and 14.)"""
    if task.precision == "fp32":
        return _Layout(torch.float32, 4, 4, 0, C.OPT_BYTES)
    return _Layout(torch.bfloat16, C.W_BYTES, C.GRAD_BYTES, C.W_BYTES, C.OPT_BYTES)


def _finetune(p: Plan, s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> None:
    T, L, P = task.batch * task.seq_len, s.layers, s.params
    gpu = hw.gpu is not None
    lay = _layout(task)
    act = C.layer_activation_bytes(s, T, fused_kernels=gpu, dtype=lay.dtype)
    working = C.compute_working_bytes(s, T, lay.w)
    lw = s.layer_params * lay.w
    # The compute device's floor: the layer computing and the one prefetched, one layer's gradients,
    # one layer's saved activations (rebuilt or reloaded for its backward) and the transients.
    floor = 2 * lw + s.layer_params * lay.grad + act + working
    ram = _usable_ram(hw, task)
    # Host staging: with a GPU, pinned buffers for three layers of weights and two of gradients;
    # without one, RAM is the compute device and its floor is the window itself.
    staging = (3 * lw + 2 * s.layer_params * lay.grad) if gpu else floor
    inputs = L * C.layer_input_bytes(s, T, lay.w)  # recompute checkpoints, kept on the host
    dev_spare = 0
    if gpu:
        if floor > r.gpu_bytes:
            p.problems.append(
                f"{hw.gpu.name} memory: one layer's working set needs {fmt_bytes(floor)} (weights of two "
                f"layers {fmt_bytes(2 * lw)}, saved activations {fmt_bytes(act)}, transients "
                f"{fmt_bytes(working)}), {fmt_bytes(floor - r.gpu_bytes)} more than its {fmt_bytes(r.gpu_bytes)}; "
                f"lower --batch or --seq-len")
        dev_spare = max(0, r.gpu_bytes - floor)
    host_free = ram - staging - inputs
    if host_free < 0:
        p.problems.append(
            f"RAM: streaming buffers {fmt_bytes(staging)} and layer checkpoints {fmt_bytes(inputs)} need "
            f"{fmt_bytes(-host_free)} more than the {fmt_bytes(ram)} usable; raise --cpu-mem or add RAM, "
            f"or lower --batch / --seq-len")
        host_free = 0
    # Optimizer state resident in RAM saves 32 SSD bytes per 14 RAM bytes, more than an activation
    # byte (2 SSD bytes per byte), so it takes RAM first.
    resident = min(P, host_free // lay.ram_state) if task.state_cache else 0
    split = None
    if hw.measured is not None and not gpu and task.cpu_mem is not None:
        # This machine under --cpu-mem: the state the engine will cache is what its own budget split
        # leaves (activations of every layer come first), not the planner's greedy order.
        split = _engine_split(s, task, T, act, p)
        resident = min(P, split.state_cache // C.OPT_BYTES) if split and task.state_cache else 0
    host_free -= resident * lay.ram_state
    on_ssd = P - resident
    if on_ssd and not hw.drive:
        p.problems.append(f"no NVMe: {fmt_bytes(on_ssd * lay.ram_state)} of optimizer state does not "
                          f"fit in RAM; add drives (e.g. +pm9a3*4) or RAM")
    need_ssd = on_ssd * lay.ssd_state
    # Activations: on the device while it has room, then host RAM, then NVMe or recomputed.
    k_dev = min(L, dev_spare // act) if gpu else 0
    k_ram = min(L - k_dev, host_free // act)
    if split is not None and task.activations == "auto":
        # the engine keeps what its split's activation share holds; a layer beyond it is swapped
        # or recomputed (a policy the user forces is followed whatever the share)
        k_ram = min(k_ram, split.activations // act)
    rest = L - k_dev - k_ram
    if task.activations == "recompute":
        k_dev = k_ram = rest = 0
        choices = [(0, L)]
    elif task.activations == "swap":
        k_dev = k_ram = rest = 0
        choices = [(L, 0)]
    elif task.activations == "keep" or not hw.drive:
        choices = [(rest, 0)] if hw.drive else [(0, rest)]
    else:
        choices = [(n, rest - n) for n in range(rest + 1)]
    best = None
    for n_ssd, n_rec in choices:
        res = _finetune_times(s, task, r, T, resident, k_ram, n_ssd, n_rec, act, gpu,
                              split.weights_kept if split is not None else 0)
        if best is None or res[1] < best[1][1] - 1e-12:
            best = ((n_ssd, n_rec), res)
    (n_ssd, n_rec), (devices, step, resources, traffic, flops) = best
    if r.measured and not gpu:
        ms = r.model_step
        if r.model_step_s(T) is not None and ms.get("source") == "engine":
            p.assumptions.append(
                f"compute: this model's own step run by the engine here ({ms['model_type']} code from transformers, "
                f"{ms['layers']} of its layers, random weights, {ms['dtype']}, {ms['threads']} threads, {T} tokens in "
                f"rows of {ms['seq']}, median of its last {ms['steps']} steps): a decoder layer "
                f"{ms['layer_s']:.3f} s (the engine's profile: forward + backward beside the optimizer, checksums and "
                f"writes on the same cores), the rest of the step {ms['rest_s']:.3f} s; the optimizer and checksum "
                f"times are inside these, only reads beyond the probe's are added")
        elif r.model_step_s(T) is not None:
            p.assumptions.append(
                f"compute: this model's own step measured here ({ms['model_type']} code from transformers, "
                f"{ms['dtype']}, {ms['threads']} threads, rows of {ms['seq']} tokens"
                + (f", {ms['probed_tokens']} of the micro-batch's {T} tokens timed and scaled per token"
                   if ms["probed_tokens"] != T else "")
                + f"): a decoder layer {ms['layer_s']:.3f} s forward + backward, embedding, head and loss "
                  f"{ms['rest_s']:.3f} s")
        elif r.layer_rate(s.hidden, T):
            p.assumptions.append(f"compute: bench compute's reference llama layers, interpolated to hidden {s.hidden} "
                                 f"and {T} tokens (this model's own step was not measured)")
    need_ssd += n_ssd * act
    if hw.drive and need_ssd > r.nvme_bytes:
        p.problems.append(f"NVMe capacity: state (two slots) and swapped activations need {fmt_bytes(need_ssd)}, "
                          f"{fmt_bytes(need_ssd - r.nvme_bytes)} more than the {fmt_bytes(r.nvme_bytes)} of the drives; "
                          f"add drives (NAME*N) or larger ones")
    p.activations = {"per_layer_bytes": act, "on_device": k_dev, "in_ram": k_ram, "on_nvme": n_ssd,
                     "recomputed": n_rec, "policy": task.activations}
    dev = "gpu" if gpu else "ram"
    p.placement = {
        # this machine under --cpu-mem: the engine's own window and gradients' share
        dev: {"weight_window": split.window if split else 2 * lw,
              "gradients": split.grads if split else s.layer_params * lay.grad, "activations_working": act,
              "transients": working, "activations_kept": k_dev * act},
        "ram" if gpu else "ram_beyond_window": {"staging_buffers": staging if gpu else 0, "layer_checkpoints": inputs,
                                                "resident_state": resident * lay.ram_state,
                                                "activations": k_ram * act, "usable": ram},
        "nvme": {"state_two_slots": on_ssd * lay.ssd_state, "activations": n_ssd * act,
                 "capacity": r.nvme_bytes},
    }
    p.resources_s, p.traffic_bytes = resources, traffic
    p.devices_s = devices
    p.fits = not p.problems
    binding, _ = _combine(devices, L)
    p.binding, p.step_s = binding, step
    p.tokens_per_s = T / step
    p.tflops = C.train_flops(s, T, task.seq_len) / step / 1e12
    p.extra = {"tokens_per_step": T, "executed_flops": flops,
               "model_flops": C.train_flops(s, T, task.seq_len), "resident_params": resident}


def _engine_split(s: ModelShape, task: Task, T: int, act: int, p: Plan):
    """The engine's budget split (`tierlm.plan.budget.plan_split`) for this model and --cpu-mem."""

    block = max(s.layer_params, s.embed_params, s.head_params)
    tied = s.head_params < s.vocab * s.hidden
    lay = _layout(task)
    tok = s.vocab * s.hidden * lay.w  # a tied head uses the token embedding's matrix
    blocks = ([{"tok": tok, "pos": s.embed_params * lay.w - tok}]
              + [{f"layer{i}": s.layer_params * lay.w} for i in range(s.layers)]
              + [{"tok": tok, "head": s.head_params * lay.w} if tied else {"head": s.head_params * lay.w}])
    shard = min(budget.shard_elems_for(task.cpu_mem), max(s.hidden * s.intermediate, s.vocab * s.hidden))
    try:
        needs = budget.Needs(
            budget.window_size(blocks, ENGINE_PREFETCH), block * lay.grad, shard * (C.OPT_BYTES + 4 + lay.w),
            act, C.layer_input_bytes(s, T, lay.w), s.layers,
            budget.head_loss_bytes(C.hf_like_config(s), T, lay.dtype, tied=tied),
            # a tied head (no matrix of its own) holds its gradient through backward
            s.vocab * s.hidden * lay.grad if tied else 0,
            max_layer_grad=s.layer_params * lay.grad,
            state_total=s.params * lay.state if task.state_cache else None,
            weights_total=s.params * lay.w)
        return budget.plan_split(task.cpu_mem, ENGINE_BASELINE, needs)
    except BudgetError as e:
        p.problems.append(str(e))
        return None


# The engine's process baseline beyond the libraries (Python and transformers objects, the model's
# module tree; 63 MiB in every run of docs/planner.md at a2b1c1e) and its default prefetch depth.
ENGINE_BASELINE = 64 << 20
# The inference engine's process baseline beyond its libraries: 12 KiB in the runs of docs/planner.md at a2b1c1e
# (its library baseline is read after the model skeleton is built).
INFER_BASELINE = 0
ENGINE_PREFETCH = 2
# Layers whose weights are still in the window when backward starts, so backward does not read them
# again: the window holds prefetch + 2 neighbouring blocks and the head and the computing layer take two.
KEPT_AT_TURN = ENGINE_PREFETCH


def _finetune_times(s, task, r: C.Rates, T, resident, k_ram, n_ssd, n_rec, act, gpu, kept_w=0):
    P, L = s.params, s.layers
    flops = C.train_flops(s, T, task.seq_len) + n_rec * C.layer_fwd_flops(s, T, task.seq_len)
    # The engine's traffic: weights read in forward, and again in backward for the layers the window
    # no longer holds; master, m and v read unless cached in RAM; every step writes the new state
    # and weights (a cached shard's writes are not skipped, so each step stays durable), plus the
    # gradient saved for an exact clip redo when clipping is on. Weights the window keeps between
    # steps (kept_w: the room the state cache could not use, budget.Split.weights_kept) are not read.
    # Catalog hardware is planned with the cache tierlm is designed for (LoHan's: resident state
    # holds the weights too and is written only when evicted), which the engine does not have yet.
    lay = _layout(task)
    grad = lay.grad if task.clip != "off" else 0
    if r.measured:
        reread = P - min(L, KEPT_AT_TURN) * s.layer_params - s.head_params
        unkept = max(1 - kept_w / (P * lay.w), 0)
        ssd_r = (P + reread) * lay.w * unkept + (P - resident) * lay.state + n_ssd * act
        ssd_w = P * (lay.state + lay.w_write + grad) + n_ssd * act
    else:
        ssd_r = (P - resident) * (2 * lay.w + lay.state) + n_ssd * act
        ssd_w = (P - resident) * (lay.state + lay.w_write + grad) + n_ssd * act
    swapped = (k_ram + n_ssd) * act if gpu else 0
    h2d = (2 * P * lay.w + swapped) if gpu else 0
    d2h = (P * lay.grad + swapped) if gpu else 0
    # DRAM: every SSD and PCIe byte lands in or leaves from RAM, plus the optimizer's own passes;
    # without a GPU, activations kept in RAM are written and read back once.
    dram = ssd_r + ssd_w + h2d + d2h + P * C.OPT_DRAM_PER_PARAM + (0 if gpu else 2 * k_ram * act)
    compute = flops / r.compute_flops
    own = r.model_step_s(T) if not gpu else None
    engine_probe = own is not None and r.model_step.get("source") == "engine"
    if engine_probe:
        # Measured CPU, this model's step run by the engine at this micro-batch and budget
        # (bench_engine_step): a layer's compute as the engine's profile took it, beside the
        # optimizer, checksums, hooks and writes that share these cores in a run, and the rest of
        # the step (embedding, head and loss, commit, waits). The engine's fixed costs are in both.
        layer_s, rest_s = own
        compute = L * layer_s + n_rec * layer_s / 3 + rest_s
    elif own is not None:
        # Measured CPU, this model's own step measured at this micro-batch (bench_model_step): its
        # layers' forward + backward, a recomputed layer's forward again (a third of the pair, as
        # in the FLOP count), the embedding, head and loss, plus the engine's fixed costs.
        o = r.overhead or {}
        layer_s, rest_s = own
        n_keep = L - n_rec
        compute = (L * layer_s + n_rec * layer_s / 3 + rest_s + o.get("train_per_step_s", 0.0)
                   + n_keep * o.get("train_per_layer_s", 0.0) + n_rec * o.get("train_per_layer_recompute_s", 0.0))
    elif not gpu and (r.layer_rate(s.hidden, T) or r.overhead):
        # Measured CPU: a real layer's rate (where it was measured in this precision), not a large
        # GEMM's, plus the engine's fixed costs per layer (recomputed layers pay the recompute
        # profile's) and per step, all on the same cores.
        o = r.overhead or {}
        n_keep = L - n_rec
        compute = (flops / (r.layer_rate(s.hidden, T) or r.compute_flops) + o.get("train_per_step_s", 0.0)
                   + n_keep * o.get("train_per_layer_s", 0.0) + n_rec * o.get("train_per_layer_recompute_s", 0.0))
    res = {"compute": compute, "optimizer": P / r.adam_elems, "memory": dram / r.dram,
           "link_h2d": h2d / r.link if gpu else 0.0, "link_d2h": d2h / r.link if gpu else 0.0,
           # no drives: the traffic has nowhere to go, and the plan already says so in its problems
           "ssd_read": ssd_r / r.ssd_read if r.ssd_read else 0.0, "ssd_write": ssd_w / r.ssd_write if r.ssd_write else 0.0}
    if r.crc:
        # every byte through the store is checksummed by a CPU thread (CRC32C), beside the rest
        res["checksum"] = (ssd_r + ssd_w) / r.crc
    if gpu:
        devices = {"gpu": res["compute"], "cpu": res["optimizer"] + res.get("checksum", 0.0)}
    elif engine_probe:
        # The probe's step already held the optimizer and the checksums of what it wrote and read;
        # only the reads this model makes beyond the probe's (state its budget does not cache) add.
        extra = max(ssd_r - r.model_step.get("read_bytes", 0), 0)
        res["checksum_beyond_probe"] = extra / r.crc if r.crc else 0.0
        res["ssd_read_beyond_probe"] = extra / r.ssd_read if r.ssd_read else 0.0
        devices = {"cpu": res["compute"] + res["checksum_beyond_probe"]}
    else:
        devices = {"cpu": res["compute"] + res["optimizer"] + res.get("checksum", 0.0)}
    devices.update({"dram": res["memory"], "pcie": max(res["link_h2d"], res["link_d2h"]),
                    "ssd": res["ssd_read"] + res["ssd_write"]})
    _, step = _combine(devices, L)
    if engine_probe:
        # the store's threads beside compute: measured in the probe, but for the reads beyond it
        step += _unhidden(r, {"cpu": devices["cpu"], "ssd": res["ssd_read_beyond_probe"]}, res)
    elif not gpu:
        step += _unhidden(r, devices, res)
    if task.clip == "redo":
        # A step that clips knows it only once backward has ended: the update is redone from the old
        # slot in a second pass (state and saved gradient read, new state written) after the pipeline,
        # with nothing to overlap it.
        streamed = P if r.measured else P - resident
        rr, rw = (P - resident) * lay.state + streamed * lay.grad, streamed * (lay.state + lay.w_write)
        res["clip_redo"] = max((rr / r.ssd_read if r.ssd_read else 0.0) + (rw / r.ssd_write if r.ssd_write else 0.0),
                               P / r.adam_elems)
        step += res["clip_redo"]
        ssd_r, ssd_w = ssd_r + rr, ssd_w + rw
    traffic = {"ssd_read": ssd_r, "ssd_write": ssd_w, "link_h2d": h2d, "link_d2h": d2h, "dram": dram}
    return devices, step, res, traffic, flops


# ---- serving ------------------------------------------------------------------------------------

def _serve(p: Plan, s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> None:
    B, Sp, N = task.batch, task.seq_len, task.new_tokens
    # the decoder layers in the serving format; embeddings and the head stay bf16 (as the engine keeps them)
    layer_w = s.layer_params * C.weight_bytes_per_param(task.weights, s.hidden)
    fixed_w = (s.params - s.layers * s.layer_params) * C.W_BYTES
    W = s.layers * layer_w + fixed_w
    if hw.measured is not None and hw.measured.get("decode_source"):
        p.assumptions.append(hw.measured["decode_source"])
    if hw.measured is not None and r.gemv and task.weights not in (r.decode or {}):
        p.assumptions.append(f"no {task.weights} decode rate in the measurements (cached by an older `tierlm bench "
                             f"compute`): its bytes are read at the bf16 rate; run `tierlm bench compute` again")
    kv = B * (Sp + N) * C.kv_bytes_per_token(s)
    ram = _usable_ram(hw, task)
    scratch = C.compute_working_bytes(s, B * Sp) // 4  # prefill transients, inference only (no gradients)
    options = []
    # Weights where they are read from each decode step: GPU memory, RAM over PCIe, RAM by the CPU,
    # NVMe. Each option is costed; the fastest that fits is the plan.
    if hw.gpu is not None:
        kv_on_gpu = kv + scratch <= r.gpu_bytes
        options.append(("gpu", max(0, min(W, r.gpu_bytes - scratch - (kv if kv_on_gpu else 0)))))
    options.append(("cpu", 0))
    best = None
    engine_resident = _infer_resident_layers(s, task, p) if hw.measured is not None and task.cpu_mem else None
    for site, on_gpu in options:
        kv_where = "gpu" if site == "gpu" and kv_on_gpu else "ram"
        ram_for_w = max(0, ram - (kv if kv_where == "ram" else 0))
        in_ram = min(W - on_gpu, ram_for_w)
        if engine_resident is not None and site == "cpu":
            # The inference engine's own placement under --cpu-mem: whole layers, after its window.
            in_ram = W - (s.layers - engine_resident) * layer_w
        from_ssd = W - on_gpu - in_ram
        if (from_ssd and not hw.drive) or (kv_where == "ram" and kv > ram):
            continue
        flops_tok = 2.0 * s.matmul_params * B + C.attention_fwd_flops(s, Sp + N / 2, B)
        comp = r.compute_flops if site == "gpu" else r.cpu_flops
        t_comp = flops_tok / comp
        if site == "cpu" and r.gemv:
            # Measured CPU: one token through the layers at the measured decode rate of their
            # format (bench compute's decode step), the head at the bf16 one; more rows of a batch
            # add at the large-GEMM rate.
            rate = (r.decode or {}).get(task.weights) or r.gemv
            t_comp = s.layers * layer_w / rate + s.vocab * s.hidden * C.W_BYTES / r.gemv \
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
        binding, step = _combine(devices, s.layers)
        if site == "cpu":
            step += _unhidden(r, devices, res)
        if r.overhead and site == "cpu":
            # The engine's fixed costs of a decode step, measured (bench compute): per step, and per
            # layer resident or streamed (a streamed layer also waits on its read's hand-off).
            o, streamed = r.overhead, s.layers - (engine_resident if engine_resident is not None else s.layers)
            res["overhead"] = (o["decode_resident_per_step_s"] if not streamed else o["decode_streamed_per_step_s"]) \
                + (s.layers - streamed) * o["decode_resident_per_layer_s"] + streamed * o["decode_streamed_per_layer_s"]
            step += res["overhead"]
        prefill = _prefill(s, hw, r, B, Sp, on_gpu, in_ram, from_ssd)
        total = prefill + N * step
        cand = dict(site=site, weights={"gpu": on_gpu, "ram": in_ram, "nvme": from_ssd}, kv_where=kv_where,
                    res=res, devices=devices, binding=binding, step=step, prefill=prefill, total=total)
        if best is None or total < best["total"]:
            best = cand
    if best is None:
        p.problems.append(f"weights {fmt_bytes(W)} and KV cache {fmt_bytes(kv)} do not fit in "
                          f"{fmt_bytes(ram)} of usable RAM and there is no NVMe to stream from; add RAM or drives")
        p.fits = False
        return
    if best["weights"]["nvme"] > r.nvme_bytes:
        p.problems.append(f"NVMe capacity: {fmt_bytes(best['weights']['nvme'])} of weights on drives of "
                          f"{fmt_bytes(r.nvme_bytes)}; add drives")
    p.fits = not p.problems
    p.placement = {"weights": best["weights"], "kv_cache": {best["kv_where"]: kv}, "compute": best["site"]}
    p.resources_s, p.devices_s, p.binding = best["res"], best["devices"], best["binding"]
    p.step_s = best["step"]
    p.tokens_per_s = B * N / best["total"]
    p.extra = {"decode_tokens_per_s": B / best["step"], "prefill_s": best["prefill"],
               "request_s": best["total"], "ttft_s": best["prefill"] + best["step"],
               "generated_tokens": B * N, "kv_cache_bytes": kv}


def _infer_resident_layers(s: ModelShape, task: Task, p: Plan) -> int | None:
    """Decoder layers `tierlm generate --cpu-mem` keeps in RAM (`tierlm.infer.engine.plan_placement`)."""
    max_len = task.seq_len + task.new_tokens
    cfg = InferConfig(cpu_mem=task.cpu_mem, max_batch=task.batch, max_seq_len=max_len, weights=task.weights)
    kv = task.batch * (max_len + 1) * C.kv_bytes_per_token(s)
    try:
        return plan_placement(cfg, INFER_BASELINE, (s.embed_params + s.head_params) * C.W_BYTES,
                              int(s.layer_params * C.weight_bytes_per_param(task.weights, s.hidden)), s.layers, kv,
                              scratch_bytes(C.hf_like_config(s), cfg, max_len)).resident
    except BudgetError as e:
        p.problems.append(str(e))
        return None


def _prefill(s: ModelShape, hw: Hardware, r: C.Rates, batch: int, prompt: int, on_gpu: int, in_ram: int, from_ssd: int) -> float:
    """The prompt's forward on whichever compute site is faster for it: prefill is compute-heavy, so a
    GPU streaming the weights over PCIe often beats the CPU that decodes from RAM."""
    flops = 2.0 * s.matmul_params * batch * prompt + C.attention_fwd_flops(s, prompt / 2, batch * prompt)
    ssd = from_ssd / r.ssd_read if from_ssd else 0.0
    times = [_combine({"cpu": flops / r.cpu_flops, "dram": (in_ram + from_ssd) / r.dram, "ssd": ssd}, s.layers)[1]]
    if hw.gpu is not None:
        off = in_ram + from_ssd
        times.append(_combine({"gpu": flops / r.compute_flops, "hbm": on_gpu / r.gpu_mem, "pcie": off / r.link,
                               "dram": off / r.dram, "ssd": ssd}, s.layers)[1])
    return min(times)
