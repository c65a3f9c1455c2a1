"""A fine-tuning step's time for one placement of its activations: the bytes each device moves,
the seconds each resource takes, and the step they overlap into (planner.py's model)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import cost as C
from .pipeline import combine, unhidden
from .records import Task
from .shapes import ModelShape

# The engine's default prefetch depth.
ENGINE_PREFETCH = 2
# Layers whose weights are still in the window when backward starts, so backward does not read them
# again: the window holds prefetch + 2 neighbouring blocks and the head and the computing layer take two.
KEPT_AT_TURN = ENGINE_PREFETCH


class Layout(NamedTuple):
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


def layout(task: Task) -> Layout:
    """bf16: bf16 working weights and gradients beside the fp32 master, m and v. fp32 (what
    `--precision auto` picks on a CPU without fast bf16): the master is the working weight, so
    nothing else is written, and gradients are fp32. (An fp32 Qwen2.5-0.5B step read 19.8 bytes a
    parameter and wrote 12.0; the bf16 layout counted 16 and 14.)"""
    if task.precision == "fp32":
        return Layout(torch.float32, 4, 4, 0, C.OPT_BYTES)
    return Layout(torch.bfloat16, C.W_BYTES, C.GRAD_BYTES, C.W_BYTES, C.OPT_BYTES)


@dataclass(frozen=True)
class Mix:
    """Where one candidate step keeps what."""
    resident: int     # parameters whose optimizer state stays in RAM
    k_ram: int        # layers whose activations are kept in host RAM
    act: int          # one layer's saved activations, bytes
    kept_w: int = 0   # weight bytes the window keeps between steps (budget.Split.weights_kept)
    n_ssd: int = 0    # layers whose activations are swapped to NVMe
    n_rec: int = 0    # layers recomputed in backward


class StepTimes(NamedTuple):
    devices: dict     # per physical device, seconds (what overlaps)
    step: float       # the step's seconds
    resources: dict   # per resource, seconds
    traffic: dict     # bytes per step by path
    flops: float      # FLOPs executed, recomputation included


def step_times(s: ModelShape, task: Task, r: C.Rates, T: int, mix: Mix, gpu: bool) -> StepTimes:
    """The step of `T` tokens with `mix`: each resource's seconds, the devices they load, and the
    step they overlap into, plus a clip's redo pass where every step clips (it overlaps nothing)."""
    flops = C.train_flops(s, T, task.seq_len) + mix.n_rec * C.layer_fwd_flops(s, T, task.seq_len)
    traffic = _traffic(s, task, r, mix, gpu)
    compute, engine_probe = _compute_s(s, r, T, flops, mix.n_rec, gpu)
    res = _resources(s, r, traffic, compute, gpu)
    devices = _devices(res, r, traffic["ssd_read"], gpu, engine_probe)
    _, step = combine(devices, s.layers)
    if engine_probe:
        # the store's threads beside compute: measured in the probe, but for the reads beyond it
        step += unhidden(r, {"cpu": devices["cpu"], "ssd": res["ssd_read_beyond_probe"]}, res)
    elif not gpu:
        step += unhidden(r, devices, res)
    if task.clip == "redo":
        step += _clip_redo(s, task, r, mix.resident, res, traffic)
    return StepTimes(devices, step, res, traffic, flops)


def _traffic(s: ModelShape, task: Task, r: C.Rates, mix: Mix, gpu: bool) -> dict:
    """Bytes a step moves over each path: the drives (read, write), the link (each way), DRAM."""
    P, L, act = s.params, s.layers, mix.act
    # The engine's traffic: weights read in forward, and again in backward for the layers the window
    # no longer holds; master, m and v read unless cached in RAM; every step writes the new state
    # and weights (a cached shard's writes are not skipped, so each step stays durable), plus the
    # gradient saved for an exact clip redo when clipping is on. Weights the window keeps between
    # steps (kept_w: the room the state cache could not use, budget.Split.weights_kept) are not read.
    # Catalog hardware is planned with the cache tierlm is designed for (LoHan's: resident state
    # holds the weights too and is written only when evicted), which the engine does not have yet.
    lay = layout(task)
    grad = lay.grad if task.clip != "off" else 0
    if r.measured:
        reread = P - min(L, KEPT_AT_TURN) * s.layer_params - s.head_params
        unkept = max(1 - mix.kept_w / (P * lay.w), 0)
        ssd_r = (P + reread) * lay.w * unkept + (P - mix.resident) * lay.state + mix.n_ssd * act
        ssd_w = P * (lay.state + lay.w_write + grad) + mix.n_ssd * act
    else:
        ssd_r = (P - mix.resident) * (2 * lay.w + lay.state) + mix.n_ssd * act
        ssd_w = (P - mix.resident) * (lay.state + lay.w_write + grad) + mix.n_ssd * act
    swapped = (mix.k_ram + mix.n_ssd) * act if gpu else 0
    h2d = (2 * P * lay.w + swapped) if gpu else 0
    d2h = (P * lay.grad + swapped) if gpu else 0
    # DRAM: every SSD and PCIe byte lands in or leaves from RAM, plus the optimizer's own passes;
    # without a GPU, activations kept in RAM are written and read back once.
    dram = ssd_r + ssd_w + h2d + d2h + P * C.OPT_DRAM_PER_PARAM + (0 if gpu else 2 * mix.k_ram * act)
    return {"ssd_read": ssd_r, "ssd_write": ssd_w, "link_h2d": h2d, "link_d2h": d2h, "dram": dram}


def _compute_s(s: ModelShape, r: C.Rates, T: int, flops: float, n_rec: int, gpu: bool) -> tuple[float, bool]:
    """The compute's seconds, from the best measurement there is, and whether it is the engine's
    own step (whose time already holds the optimizer and checksums)."""
    L = s.layers
    own = r.model_step_s(T) if not gpu else None
    engine_probe = own is not None and r.model_step.get("source") == "engine"
    if engine_probe:
        # Measured CPU, this model's step run by the engine at this micro-batch and budget
        # (bench_engine_step): a layer's compute as the engine's profile took it, beside the
        # optimizer, checksums, hooks and writes that share these cores in a run, and the rest of
        # the step (embedding, head and loss, commit, waits). The engine's fixed costs are in both.
        layer_s, rest_s = own
        return L * layer_s + n_rec * layer_s / 3 + rest_s, True
    if own is not None:
        # Measured CPU, this model's own step measured at this micro-batch (bench_model_step): its
        # layers' forward + backward, a recomputed layer's forward again (a third of the pair, as
        # in the FLOP count), the embedding, head and loss, plus the engine's fixed costs.
        o = r.overhead or {}
        layer_s, rest_s = own
        n_keep = L - n_rec
        return (L * layer_s + n_rec * layer_s / 3 + rest_s + o.get("train_per_step_s", 0.0)
                + n_keep * o.get("train_per_layer_s", 0.0) + n_rec * o.get("train_per_layer_recompute_s", 0.0)), False
    if not gpu and (r.layer_rate(s.hidden, T) or r.overhead):
        # Measured CPU: a real layer's rate (where it was measured in this precision), not a large
        # GEMM's, plus the engine's fixed costs per layer (recomputed layers pay the recompute
        # profile's) and per step, all on the same cores.
        o = r.overhead or {}
        n_keep = L - n_rec
        return (flops / (r.layer_rate(s.hidden, T) or r.compute_flops) + o.get("train_per_step_s", 0.0)
                + n_keep * o.get("train_per_layer_s", 0.0) + n_rec * o.get("train_per_layer_recompute_s", 0.0)), False
    return flops / r.compute_flops, False


def _resources(s: ModelShape, r: C.Rates, traffic: dict, compute: float, gpu: bool) -> dict:
    """Each resource's seconds for the step's compute and traffic."""
    ssd_r, ssd_w = traffic["ssd_read"], traffic["ssd_write"]
    res = {"compute": compute, "optimizer": s.params / r.adam_elems, "memory": traffic["dram"] / r.dram,
           "link_h2d": traffic["link_h2d"] / r.link if gpu else 0.0,
           "link_d2h": traffic["link_d2h"] / r.link if gpu else 0.0,
           # no drives: the traffic has nowhere to go, and the plan already says so in its problems
           "ssd_read": ssd_r / r.ssd_read if r.ssd_read else 0.0, "ssd_write": ssd_w / r.ssd_write if r.ssd_write else 0.0}
    if r.crc:
        # every byte through the store is checksummed by a CPU thread (CRC32C), beside the rest
        res["checksum"] = (ssd_r + ssd_w) / r.crc
    return res


def _devices(res: dict, r: C.Rates, ssd_r: float, gpu: bool, engine_probe: bool) -> dict[str, float]:
    """The physical devices' seconds: the resources that share one device add up on it."""
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
    return devices


def _clip_redo(s: ModelShape, task: Task, r: C.Rates, resident: int, res: dict, traffic: dict) -> float:
    """A step that clips knows it only once backward has ended: the update is redone from the old
    slot in a second pass (state and saved gradient read, new state written) after the pipeline,
    with nothing to overlap it. Its seconds (recorded in `res`); its bytes are added to `traffic`."""
    P, lay = s.params, layout(task)
    streamed = P if r.measured else P - resident
    rr, rw = (P - resident) * lay.state + streamed * lay.grad, streamed * (lay.state + lay.w_write)
    res["clip_redo"] = max((rr / r.ssd_read if r.ssd_read else 0.0) + (rw / r.ssd_write if r.ssd_write else 0.0),
                           P / r.adam_elems)
    traffic["ssd_read"], traffic["ssd_write"] = traffic["ssd_read"] + rr, traffic["ssd_write"] + rw
    return res["clip_redo"]


# Parameters a second that transformers' from_config builds with random weights (its init_weights):
# 23-49 M/s for a 133M llama and a 236M qwen3_moe on a 2-core AMD EPYC (AVX2) VM.
INIT_PARAMS_PER_S = 30e6


def probe_seconds(s: ModelShape, task: Task, r: C.Rates, T: int, layers: int, steps: int, budget: int) -> float:
    """About how long the engine's step probe (bench.model_step.bench_engine_step) runs: building a
    `layers`-layer copy of the model and writing its first state, then `steps` steps, each the
    compute of the parameters a token goes through plus, for every parameter (a mixture's idle
    experts too), the optimizer and the state written to the drive and read back beyond what
    `budget` caches. (Counting only the compute said "about 48 s" for LongCat-Flash's default 512
    experts, whose probe moves ~8 GB of state a step and ran past 15 min.)"""
    P = _probe_params(s, layers)
    lay = layout(task)
    rate = r.layer_rate(s.hidden, T) or r.cpu_flops or 1e11
    compute = 6.0 * T * (layers * s.active_layer_params + s.vocab * s.hidden) / rate
    resident = min(P, max(int(budget), 0) // lay.ram_state)
    grad = lay.grad if task.clip != "off" else 0
    rd, wr = (P - resident) * lay.state, P * (lay.state + lay.w_write + grad)
    io = (rd / r.ssd_read if r.ssd_read else 0.0) + (wr / r.ssd_write if r.ssd_write else 0.0) \
        + ((rd + wr) / r.crc if r.crc else 0.0)
    build = P / INIT_PARAMS_PER_S + (P * lay.ssd_state / r.ssd_write if r.ssd_write else 0.0)
    return build + steps * (compute + P / r.adam_elems + io)


def probe_store_bytes(s: ModelShape, task: Task, layers: int) -> int:
    """The drive space the engine's step probe holds: its `layers`-layer copy's state, two slots."""
    return int(_probe_params(s, layers) * layout(task).ssd_state)


def _probe_params(s: ModelShape, layers: int) -> int:
    return s.embed_params + s.head_params + layers * s.layer_params
