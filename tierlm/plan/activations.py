"""The activation planner: per layer, keep, swap (to host or NVMe) or recompute, to minimise the
predicted step time under the memory budget.

The cost model is the one the engine's pipeline runs:
    forward  = max(compute_fwd + copies,             SSD reads_fwd / read_bw + SSD writes_fwd / write_bw)
    backward = max(compute_bwd + recompute + copies,  SSD reads_bwd / read_bw + SSD writes_bwd / write_bw)
    step     = forward + backward + fixed (commit, head, Python: what the profile measured outside layers)
Weights and optimizer states already move through the SSD in every step (measured in the profiled
step); a swapped layer adds its activation bytes to the forward's writes and the backward's reads,
a recomputed layer adds its forward time to the backward, a kept layer costs RAM.

Choice: keep the layers whose recompute time per byte is highest while the allowance has room
(the value of keeping is the time it saves per byte it holds); then, of the rest, switch layers from
recompute to swap, most recompute time per swapped byte first, while the predicted step time falls.
Both variants (a swap pool reserved, or none) are evaluated and the faster is taken.

With a GPU computing (`choose_gpu`), kept activations hold GPU memory (the allowance under
--gpu-mem), and a swapped layer's saved tensors cross the GPU's host link: device -> pinned host in
its forward, host -> device before its backward (`Rates.d2h`, `Rates.h2d`, measured where the engine
profiles). swap-host holds them in the pinned host pool until backward; swap goes on from that pool
to NVMe (GPU -> CPU -> SSD, the SSD write and read overlapped with compute as above). The engine
makes both copies on a side CUDA stream, overlapped with the layers that compute meanwhile, so on a
GPU a phase takes the longer of its compute and its copies, not their sum:
    forward  = max(compute_fwd, d2h copies,              SSD_fwd)
    backward = max(compute_bwd + recompute, h2d copies,  SSD_bwd)
(a CPU's staging copies run on the compute thread and still add to it). Every policy gives the same bits (the copies are exact, a recompute runs the same kernels on the
same inputs), so a choice made from measured rates changes the run's speed, never its numbers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class LayerProfile:
    index: int          # block index
    fwd_s: float
    bwd_s: float        # backward alone (a recompute's forward excluded)
    act_bytes: int      # saved-for-backward bytes (measured)


@dataclass
class Rates:
    ssd_read: float     # bytes/s
    ssd_write: float
    host_copy: float    # bytes/s of a staging copy (memory bandwidth / 2)
    source: str = ""
    d2h: float = 0.0    # bytes/s of a GPU's pinned device -> host copy; 0 where no GPU computes
    h2d: float = 0.0    # bytes/s of its pinned host -> device copy


# What the planner assumes of the drive and memory where nothing measured them (the probe was
# skipped or failed): a modest SATA-class drive, and a memory rate far above it, so a plan made from
# them leans towards keeping and recomputing rather than swapping.
DEFAULT_RATES = (0.5e9, 0.5e9, 5e9)


def default_rates(why: str) -> Rates:
    return Rates(*DEFAULT_RATES, f"defaults ({why})")


def describe(r: Rates) -> str:
    link = f", GPU link {r.d2h / 1e9:.1f} GB/s to host, {r.h2d / 1e9:.1f} GB/s to device" if _on_gpu(r) else ""
    return (f"drive read {r.ssd_read / 1e9:.1f} GB/s, write {r.ssd_write / 1e9:.1f} GB/s, "
            f"memory {r.host_copy / 1e9:.0f} GB/s{link}")


def _on_gpu(r: Rates) -> bool:
    """A GPU computes: the swap copies cross its host link (both directions measured)."""
    return r.d2h > 0 and r.h2d > 0


@dataclass
class Base:
    """What a step moves and spends regardless of the activation policy (from the profile)."""
    read_fwd: int = 0
    write_fwd: int = 0
    read_bwd: int = 0
    write_bwd: int = 0
    fixed_s: float = 0.0


@dataclass
class Plan:
    policies: dict[int, str]          # block index -> keep | swap-host | swap | recompute
    predicted: dict = field(default_factory=dict)
    allowance: int = 0
    pool: int = 0
    reason: str = ""

    def to_json(self) -> dict:
        return asdict(self)


def predict(layers: list[LayerProfile], pol: dict[int, str], rates: Rates, base: Base) -> dict:
    cf = sum(p.fwd_s for p in layers)
    cb = sum(p.bwd_s for p in layers)
    rec = sum(p.fwd_s for p in layers if pol[p.index] == "recompute")
    swap = sum(p.act_bytes for p in layers if pol[p.index] == "swap")
    host = sum(p.act_bytes for p in layers if pol[p.index] == "swap-host")
    if _on_gpu(rates):  # out to host in forward, back to the device in backward
        copy, copy_b = (swap + host) / rates.d2h, (swap + host) / rates.h2d
    else:
        copy = copy_b = (swap + host) / rates.host_copy if rates.host_copy else 0.0
    ssd_f = base.read_fwd / rates.ssd_read + (base.write_fwd + swap) / rates.ssd_write
    ssd_b = (base.read_bwd + swap) / rates.ssd_read + base.write_bwd / rates.ssd_write
    if _on_gpu(rates):  # the copies run on a side stream, beside the layers' compute
        busy_f, busy_b = max(cf, copy), max(cb + rec, copy_b)
    else:
        busy_f, busy_b = cf + copy, cb + rec + copy_b
    fwd = max(busy_f, ssd_f)
    bwd = max(busy_b, ssd_b)
    return {"step_s": fwd + bwd + base.fixed_s, "forward_s": fwd, "backward_s": bwd,
            "compute_fwd_s": cf, "compute_bwd_s": cb, "recompute_s": rec, "copy_s": copy, "copy_bwd_s": copy_b,
            "ssd_fwd_s": ssd_f, "ssd_bwd_s": ssd_b, "fixed_s": base.fixed_s,
            "swap_bytes": swap, "host_bytes": host,
            "kept_bytes": sum(p.act_bytes for p in layers if pol[p.index] == "keep"),
            "bound_fwd": _bound(busy_f, ssd_f, cf, copy, _on_gpu(rates)),
            "bound_bwd": _bound(busy_b, ssd_b, cb + rec, copy_b, _on_gpu(rates))}


def _bound(busy: float, ssd: float, compute: float, copy: float, gpu: bool) -> str:
    """What a phase waits on: the drive, the layers' compute, or (copies overlapped on a GPU) the
    host link."""
    if ssd > busy:
        return "ssd"
    return "link" if gpu and copy > compute else "compute"


def _keep_greedy(layers, room: int) -> dict[int, str]:
    pol = {p.index: "recompute" for p in layers}
    for p in sorted(layers, key=lambda p: -p.fwd_s / max(p.act_bytes, 1)):
        if p.act_bytes <= room:
            pol[p.index] = "keep"
            room -= p.act_bytes
    return pol


def choose(layers: list[LayerProfile], allowance: int, pool: int, rates: Rates, base: Base,
           can_swap: bool = True) -> Plan:
    """allowance: RAM for kept activations (and the swap pool, when used); pool: the swap
    pool's size (enough for the largest layer's in-flight storages). Only NVMe is chosen: on a
    CPU-only machine the compute memory *is* host memory, so a host tier would only add copies
    (a GPU engine would add "swap-host" here, priced by the host link)."""
    options = [(_keep_greedy(layers, allowance), 0)]
    if can_swap and layers and allowance >= pool:
        pol = _keep_greedy(layers, allowance - pool)
        best = predict(layers, pol, rates, base)["step_s"]
        rest = [p for p in layers if pol[p.index] == "recompute"]
        for p in sorted(rest, key=lambda p: -p.fwd_s / max(p.act_bytes, 1)):
            trial = {**pol, p.index: "swap"}
            t = predict(layers, trial, rates, base)["step_s"]
            if t <= best:
                pol, best = trial, t
        options.append((pol, pool))
    scored = [(predict(layers, pol, rates, base), pol, pl) for pol, pl in options]
    pred, pol, pl = min(scored, key=lambda x: x[0]["step_s"])
    if not any(v in ("swap", "swap-host") for v in pol.values()):
        pl = 0
    return Plan(pol, pred, allowance, pl, _reason(pol, pred))


def _reason(pol: dict[int, str], pred: dict) -> str:
    counts = {k: sum(v == k for v in pol.values()) for k in ("keep", "swap-host", "swap", "recompute")}
    host = f", swap-host {counts['swap-host']}" if counts["swap-host"] else ""
    return (f"keep {counts['keep']}{host}, swap {counts['swap']}, recompute {counts['recompute']} of {len(pol)} "
            f"layers: predicted {pred['step_s']:.2f} s/step (forward {pred['bound_fwd']}-bound, "
            f"backward {pred['bound_bwd']}-bound)")


def choose_gpu(layers: list[LayerProfile], allowance: int, host_room: int, pool: int, rates: Rates,
               base: Base) -> Plan:
    """A GPU computes. allowance: GPU memory for kept activations (under --gpu-mem); host_room: host
    RAM for the pinned pool, which holds every swap-host layer's activations until its backward and,
    when NVMe swapping is used, `pool` bytes of staging on the way to the drive.

    Keep what GPU memory holds, most recompute time per byte first (the copies cost the same per
    byte for every layer, so this is also the order of time saved per byte held); then each other
    layer, in the same order, swaps to host while the pool has room, or through it to NVMe, where
    that predicts a step no slower than recomputing it. Without and with the NVMe staging reserved;
    the fastest of these and of keep/recompute alone is taken (ties: the earlier, fewer moves)."""
    keep = _keep_greedy(layers, allowance)
    options = [(keep, 0)]
    for staging in [0] + ([pool] if 0 < pool <= host_room else []):
        pol, room = dict(keep), host_room - staging
        best = predict(layers, pol, rates, base)["step_s"]
        for p in sorted((p for p in layers if keep[p.index] == "recompute"), key=lambda p: -p.fwd_s / max(p.act_bytes, 1)):
            tries = (["swap-host"] if p.act_bytes <= room else []) + (["swap"] if staging else [])
            scored = [(predict(layers, {**pol, p.index: how}, rates, base)["step_s"], how) for how in tries]
            if not scored:
                continue
            t, how = min(scored, key=lambda x: x[0])  # a tie: swap-host (no SSD traffic)
            if t <= best:
                pol, best = {**pol, p.index: how}, t
                room -= p.act_bytes if how == "swap-host" else 0
        host = sum(p.act_bytes for p in layers if pol[p.index] == "swap-host")
        options.append((pol, host + (staging if "swap" in pol.values() else 0)))
    scored = [(predict(layers, pol, rates, base), pol, pl) for pol, pl in options]
    pred, pol, pl = min(scored, key=lambda x: x[0]["step_s"])
    return Plan(pol, pred, allowance, pl, _reason(pol, pred))


def fixed_policy(layers: list[LayerProfile], policy: str, rates: Rates, base: Base) -> Plan:
    pol = {p.index: policy for p in layers}
    return Plan(pol, predict(layers, pol, rates, base), reason=f"--activations {policy}")


SETTLE_TOLERANCE = 0.10  # two profiles whose layer compute differs by less are taken to agree
MAX_PROFILED_STEPS = 6   # after this many profiled steps the plan stays, agreed or not


def _compute_s(layers: list[LayerProfile]) -> float:
    return sum(p.fwd_s + p.bwd_s for p in layers)


def settle(profiles: list[list[LayerProfile]], tolerance: float | None = None,
           max_steps: int | None = None) -> tuple[list[LayerProfile], bool]:
    """The profile to plan with, and whether it is final.

    `profiles` are the steps profiled after the first (which pays for page faults and kernel
    set-up), oldest first. One step disturbed by another process (a core taken away for seconds)
    would otherwise fix the plan and its prediction for the whole run: the profile is final when
    the last two steps agree (total layer compute within `tolerance`), and is then their mean per
    layer; after `max_steps` it is the per-layer median of them all, agreed or not."""
    tolerance = SETTLE_TOLERANCE if tolerance is None else tolerance
    max_steps = MAX_PROFILED_STEPS if max_steps is None else max_steps
    if not profiles:
        raise ValueError("no profiled step")
    last = profiles[-1]
    if len(profiles) >= 2:
        a, b = _compute_s(profiles[-2]), _compute_s(last)
        if abs(a - b) <= tolerance * max(a, b):
            return _combine(profiles[-2:], lambda xs: sum(xs) / len(xs)), True
    if len(profiles) >= max_steps:
        return _combine(profiles, _median), True
    return last, False


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _combine(profiles: list[list[LayerProfile]], f) -> list[LayerProfile]:
    return [LayerProfile(ps[0].index, f([p.fwd_s for p in ps]), f([p.bwd_s for p in ps]),
                         max(p.act_bytes for p in ps)) for ps in zip(*profiles)]
