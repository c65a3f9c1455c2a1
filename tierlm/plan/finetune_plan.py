"""Fine-tuning's plan: what each tier holds (weights, gradients, optimizer state, activations), the
fastest placement of the activations that fits, and its step (finetune_time.py times each one)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

from ..storage import BudgetError
from ..units import fmt_bytes
from . import budget
from . import cost as C
from .catalog import Hardware
from .finetune_time import Layout, Mix, StepTimes, layout, step_times
from .pipeline import combine
from .records import Plan, Task, usable_ram
from .settings import Measured, ModelFacts, TrainSettings, resolve_train
from .shapes import ModelShape

# The engine's process baseline beyond the libraries (Python and transformers objects, the model's
# module tree; 63 MiB in every run of docs/planner.md at a2b1c1e).
ENGINE_BASELINE = 64 << 20


class _Room(NamedTuple):
    """One step's memory, in bytes, on the compute device and the host."""
    T: int           # tokens per step
    gpu: bool        # a GPU computes
    lay: Layout
    act: int         # one layer's saved activations
    working: int     # one layer's compute transients
    lw: int          # one layer's weights
    ram: int         # RAM the run may use
    staging: int     # host buffers the layers stream through
    inputs: int      # every layer's input (the recompute checkpoints), kept on the host
    dev_spare: int   # GPU memory beyond one layer's working set
    host_free: int   # RAM beyond the staging buffers and checkpoints


class _Acts(NamedTuple):
    """Layers whose activations are kept on the device, in RAM, swapped to NVMe, recomputed."""
    on_device: int
    in_ram: int
    on_nvme: int
    recomputed: int


def finetune(p: Plan, s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> None:
    """Fill `p` for fine-tuning: optimizer state resident in RAM where it fits (the rest on the
    drives), activations kept, swapped or recomputed as the fastest step that fits has them, and
    what does not fit in `p.problems`."""
    room = _room(p, s, hw, task, r)
    resident, split = _resident_state(p, s, hw, task, room)
    host_free = room.host_free - resident * room.lay.ram_state
    on_ssd = s.params - resident
    if on_ssd and not hw.drive:
        p.problems.append(f"no NVMe: {fmt_bytes(on_ssd * room.lay.ram_state)} of optimizer state does not "
                          f"fit in RAM; add drives (e.g. +pm9a3*4) or RAM")
    k_dev, k_ram, choices = _activation_choices(task, hw, s.layers, room, host_free, split)
    base = Mix(resident, k_ram, room.act, split.weights_kept if split is not None else 0)
    (n_ssd, n_rec), times = _fastest(s, task, r, room, choices, base)
    if r.measured and not room.gpu:
        _compute_assumption(p, s, r, room.T)
    need_ssd = on_ssd * room.lay.ssd_state + n_ssd * room.act
    if hw.drive and need_ssd > r.nvme_bytes:
        p.problems.append(f"NVMe capacity: state (two slots) and swapped activations need {fmt_bytes(need_ssd)}, "
                          f"{fmt_bytes(need_ssd - r.nvme_bytes)} more than the {fmt_bytes(r.nvme_bytes)} of the drives; "
                          f"add drives (NAME*N) or larger ones")
    acts = _Acts(k_dev, k_ram, n_ssd, n_rec)
    p.activations = {"per_layer_bytes": room.act, "on_device": k_dev, "in_ram": k_ram, "on_nvme": n_ssd,
                     "recomputed": n_rec, "policy": task.activations}
    p.placement = _placement(s, r, room, acts, resident, split)
    _record_step(p, s, task, room.T, times, resident)
    if s.moe is not None:
        _moe_assumption(p, s)


def _moe_assumption(p: Plan, s: ModelShape) -> None:
    """A mixture of experts: compute from the parameters a token goes through, bytes from all."""
    m = s.moe
    p.extra["moe"] = {**m.to_json(), "flops_params": s.matmul_params}
    p.assumptions.append(
        f"mixture of experts: FLOPs from the {m.active_params / 1e9:,.2f}B parameters a token goes through (6 x "
        f"active x tokens: the dense part and {m.top_k} of {m.experts} experts in each of {m.moe_layers} layers); "
        f"weights, gradients and optimizer state of all {m.total_params / 1e9:,.2f}B parameters are read and "
        f"written every step, because transformers stacks a layer's experts into one tensor, so each step "
        f"updates every expert (one no token picked has a zero gradient; its state is still read, updated and written)")


def _room(p: Plan, s: ModelShape, hw: Hardware, task: Task, r: C.Rates) -> _Room:
    """The compute device's floor and the host's buffers for one step, and what each leaves;
    where either does not fit, a problem that names the flag to change."""
    T = task.batch * task.seq_len
    gpu = hw.gpu is not None
    lay = layout(task)
    act = C.layer_activation_bytes(s, T, fused_kernels=gpu, dtype=lay.dtype)
    working = C.compute_working_bytes(s, T, lay.w)
    lw = s.block_params * lay.w
    # The compute device's floor: the layer computing and the one prefetched, one layer's gradients,
    # one layer's saved activations (rebuilt or reloaded for its backward) and the transients.
    floor = 2 * lw + s.block_params * lay.grad + act + working
    ram = usable_ram(hw, task)
    # Host staging: with a GPU, pinned buffers for three layers of weights and two of gradients;
    # without one, RAM is the compute device and its floor is the window itself.
    staging = (3 * lw + 2 * s.block_params * lay.grad) if gpu else floor
    inputs = s.layers * C.layer_input_bytes(s, T, lay.w)  # recompute checkpoints, kept on the host
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
    return _Room(T, gpu, lay, act, working, lw, ram, staging, inputs, dev_spare, host_free)


def _resident_state(p: Plan, s: ModelShape, hw: Hardware, task: Task, room: _Room) -> tuple[int, budget.Split | None]:
    """Parameters whose optimizer state stays in RAM, and on this machine under --cpu-mem the
    engine's own budget split (None elsewhere, or where the budget is refused)."""
    # Optimizer state resident in RAM saves 32 SSD bytes per 14 RAM bytes, more than an activation
    # byte (2 SSD bytes per byte), so it takes RAM first.
    resident = min(s.params, room.host_free // room.lay.ram_state) if task.state_cache else 0
    split = None
    if hw.measured is not None and not room.gpu and task.cpu_mem is not None:
        # This machine under --cpu-mem: the state the engine will cache is what its own budget split
        # leaves (activations of every layer come first), not the planner's greedy order.
        split = _engine_split(s, task, room.T, room.act, p, hw)
        resident = min(s.params, split.state_cache // C.OPT_BYTES) if split and task.state_cache else 0
    return resident, split


def _activation_choices(task: Task, hw: Hardware, L: int, room: _Room, host_free: int,
                        split: budget.Split | None) -> tuple[int, int, list[tuple[int, int]]]:
    """Layers whose activations are kept on the device and in RAM, and the (swapped, recomputed)
    splits of the rest to try."""
    act = room.act
    # Activations: on the device while it has room, then host RAM, then NVMe or recomputed.
    k_dev = min(L, room.dev_spare // act) if room.gpu else 0
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
    return k_dev, k_ram, choices


def _fastest(s: ModelShape, task: Task, r: C.Rates, room: _Room, choices: list[tuple[int, int]],
             base: Mix) -> tuple[tuple[int, int], StepTimes]:
    """The (swapped, recomputed) split whose step is shortest, the first of equals, and its times."""
    best = None
    for n_ssd, n_rec in choices:
        times = step_times(s, task, r, room.T, Mix(base.resident, base.k_ram, base.act, base.kept_w, n_ssd, n_rec),
                           room.gpu)
        if best is None or times.step < best[1].step - 1e-12:
            best = ((n_ssd, n_rec), times)
    return best


def _compute_assumption(p: Plan, s: ModelShape, r: C.Rates, T: int) -> None:
    """On a measured CPU: say which measurement the compute's time comes from."""
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


def _placement(s: ModelShape, r: C.Rates, room: _Room, acts: _Acts, resident: int,
               split: budget.Split | None) -> dict:
    """Bytes per tier: the compute device's working set, the RAM beyond it, the drives."""
    lay, act, on_ssd = room.lay, room.act, s.params - resident
    return {
        # this machine under --cpu-mem: the engine's own window and gradients' share
        "gpu" if room.gpu else "ram": {
            "weight_window": split.window if split else 2 * room.lw,
            "gradients": split.grads if split else s.layer_params * lay.grad, "activations_working": act,
            "transients": room.working, "activations_kept": acts.on_device * act},
        "ram" if room.gpu else "ram_beyond_window": {
            "staging_buffers": room.staging if room.gpu else 0, "layer_checkpoints": room.inputs,
            "resident_state": resident * lay.ram_state, "activations": acts.in_ram * act, "usable": room.ram},
        "nvme": {"state_two_slots": on_ssd * lay.ssd_state, "activations": acts.on_nvme * act,
                 "capacity": r.nvme_bytes},
    }


def _record_step(p: Plan, s: ModelShape, task: Task, T: int, times: StepTimes, resident: int) -> None:
    """The chosen step's times, traffic, binding device and throughput into `p`."""
    p.resources_s, p.traffic_bytes = times.resources, times.traffic
    p.devices_s = times.devices
    p.fits = not p.problems
    binding, _ = combine(times.devices, s.layers)
    p.binding, p.step_s = binding, times.step
    p.tokens_per_s = T / times.step
    p.tflops = C.train_flops(s, T, task.seq_len) / times.step / 1e12
    p.extra = {"tokens_per_step": T, "executed_flops": times.flops,
               "model_flops": C.train_flops(s, T, task.seq_len), "resident_params": resident}


def _engine_split(s: ModelShape, task: Task, T: int, act: int, p: Plan, hw: Hardware) -> budget.Split | None:
    """The engine's budget split (`tierlm.plan.budget.plan_split`) for this model and --cpu-mem."""
    block = max(s.block_params, s.embed_params, s.head_params)
    tied = s.head_params < s.vocab * s.hidden
    lay = layout(task)
    tok = s.vocab * s.hidden * lay.w  # a tied head uses the token embedding's matrix
    blocks = ([{"tok": tok, "pos": s.embed_params * lay.w - tok}]
              + [{f"layer{i}": s.block_params * lay.w} for i in range(s.layers)]
              + [{"tok": tok, "head": s.head_params * lay.w} if tied else {"head": s.head_params * lay.w}])
    run = _run_settings(s, task, T, hw)
    p.settings = run.to_dict()
    shard = min(run.shard_elems.value, max(s.hidden * s.intermediate, s.vocab * s.hidden))
    try:
        # one optimizer shard: master, m, v, fp32 gradient, working weights and (a clipped step's
        # update from held gradients) the gradient as saved in the working dtype
        item = shard * (C.OPT_BYTES + 4 + lay.w + (lay.grad if lay.w_write else 0))
        needs = budget.Needs(
            budget.window_size(blocks, run.prefetch.value), block * lay.grad, item,
            act, C.layer_input_bytes(s, T, lay.w), s.layers,
            budget.head_loss_bytes(C.hf_like_config(s), T, lay.dtype, tied=tied),
            # a tied head (no matrix of its own) holds its gradient through backward
            s.vocab * s.hidden * lay.grad if tied else 0,
            max_layer_grad=s.block_params * lay.grad,
            state_total=s.params * lay.state if task.state_cache else None,
            weights_total=s.params * lay.w)
        return budget.plan_split(task.cpu_mem, ENGINE_BASELINE, needs)
    except BudgetError as e:
        p.problems.append(str(e))
        return None


def _run_settings(s: ModelShape, task: Task, T: int, hw: Hardware) -> TrainSettings:
    """What `tierlm finetune` on this machine will choose (plan.settings.resolve_train, from the
    same `bench` measurements the run reads): its read-ahead and shard size size the split here."""
    m = hw.measured or {}
    compute = {k: m.get(k) for k in ("matmul_tflops", "layer_dtype", "layer_tflops_by_tokens")}
    cfg = SimpleNamespace(shard_elems=None, io_threads=None, prefetch=None, cpu_mem=task.cpu_mem, grad_accum=1,
                          precision="fp32" if task.precision == "fp32" else "bf16", optim_states="fp32",
                          tokens_per_micro_batch=T, device="cpu", activations=task.activations)
    return resolve_train(cfg, Measured(io=m.get("nvme"), compute=compute), ModelFacts(s.layer_params, s.hidden))
