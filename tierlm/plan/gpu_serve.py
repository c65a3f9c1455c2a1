"""Decode on a GPU under --gpu-mem, as the GPU inference engine places it, and the bounds it meets.

Placement (plan_device_placement, the GPU inference engine's own rule): the device holds the
embeddings and the head, the KV cache and the compute scratch first, then as many whole decoder
layers as fit; the rest are copied from pinned host memory every step, the next one while the
current one computes, so the device keeps room for two streamed layers. Streamed layers live in
RAM while it has room, the rest are read from NVMe on their way.

The bounds, each resource alone (the copies overlap the compute, so the step is the busiest):
- device memory: the bytes a step reads there (every layer's weights, resident or just copied,
  the head and the KV cache) / the memory's bandwidth: the resident decode bound;
- host link: the streamed layers' bytes / the link's host-to-device rate: the streamed bound;
- NVMe: the streamed bytes RAM cannot hold / the drives' read rate;
- compute: the step's FLOPs / the tensor cores' rate (small at decode's few rows).
Rates are the catalog's datasheet values times cost.Efficiency (or measured, `--hardware this`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from ..storage import BudgetError
from ..units import fmt_bytes
from .device_placement import DEVICE_WINDOW_LAYERS, plan_device_placement


@dataclass
class GpuDecode:
    gpu_mem: int            # --gpu-mem, or the card's memory
    layers: int
    resident_layers: int    # whole decoder layers in device memory
    device_read: float      # bytes a step reads from device memory
    streamed: int           # bytes a step copies host -> device (the streamed layers)
    from_ssd: int           # of which RAM cannot hold: read from NVMe on their way
    flops: float            # a step's FLOPs
    rates: dict             # bytes/s (hbm, link, ssd) and FLOP/s (compute) the bounds use
    batch: int = 1

    @property
    def bounds_s(self) -> dict[str, float]:
        r = self.rates
        return {"hbm": self.device_read / r["hbm"], "link": self.streamed / r["link"] if self.streamed else 0.0,
                "ssd": self.from_ssd / r["ssd"] if self.from_ssd else 0.0, "compute": self.flops / r["compute"]}

    @property
    def step_s(self) -> float:
        return max(self.bounds_s.values())

    @property
    def binding(self) -> str:
        b = self.bounds_s
        return max(b, key=b.get)

    def to_json(self) -> dict:
        return {**asdict(self), "streamed_layers": self.layers - self.resident_layers, "bounds_s": self.bounds_s,
                "step_s": self.step_s, "binding": self.binding, "decode_tokens_per_s": self.batch / self.step_s}


@dataclass
class DecodeBytes:
    """What a decode step holds and reads, in the serving format."""
    fixed: int          # embeddings, final norm and head (kept bf16)
    head_read: int      # of which a step reads (the head; an embedding lookup reads a row a token)
    layer: int          # one decoder layer held
    layer_read: float   # of one decoder layer a step reads (a mixture of experts: the routed share)
    layers: int
    kv: int             # the KV cache of the batch at its longest
    scratch: int        # the prefill's transients


def place(b: DecodeBytes, gpu_mem: int) -> int | None:
    """Decoder layers resident in device memory under `gpu_mem`, by the GPU inference engine's own
    rule (device_placement.py); None where not even the copy window fits beside the embeddings, the
    head, the KV cache and the scratch."""
    try:
        return plan_device_placement(gpu_mem, b.fixed, b.layer, b.layers, b.kv, b.scratch).resident
    except BudgetError:
        return None


def gpu_decode(b: DecodeBytes, gpu_mem: int, ram: int, flops: float, rates: dict, batch: int) -> GpuDecode | None:
    """The decode step on the GPU under `gpu_mem`, with `ram` bytes of RAM for the streamed layers."""
    resident = place(b, gpu_mem)
    if resident is None:
        return None
    streamed = (b.layers - resident) * b.layer
    from_ssd = max(0, streamed - max(0, ram))
    device_read = b.head_read + b.layers * b.layer_read + b.kv
    return GpuDecode(gpu_mem, b.layers, resident, device_read, streamed, from_ssd, flops, rates, batch)


def describe(g: dict) -> list[str]:
    """The text lines of a GpuDecode's JSON (`tierlm plan --task serve` on hardware with a GPU)."""
    if g.get("why"):
        return [f"  on the GPU under --gpu-mem {fmt_bytes(g['gpu_mem'])}: {g['why']}"]
    r, t = g["rates"], g["bounds_s"]
    streamed = g["streamed_layers"]
    where = (f", {streamed} copied from host memory each step" + (f" ({fmt_bytes(g['from_ssd'])} of them read "
             f"from NVMe)" if g["from_ssd"] else "") if streamed else "")
    lines = [f"  on the GPU under --gpu-mem {fmt_bytes(g['gpu_mem'])}: {g['resident_layers']}/{g['layers']} layers "
             f"in device memory{where}",
             f"    resident decode bound: {fmt_bytes(g['device_read'])} a step from device memory at "
             f"{r['hbm'] / 1e9:,.0f} GB/s = {t['hbm'] * 1e3:.2f} ms"]
    if streamed:
        lines.append(f"    streamed layers bound: {fmt_bytes(g['streamed'])} a step over the host link at "
                     f"{r['link'] / 1e9:,.1f} GB/s = {t['link'] * 1e3:.2f} ms"
                     + (f"; NVMe {fmt_bytes(g['from_ssd'])} at {r['ssd'] / 1e9:,.1f} GB/s = {t['ssd'] * 1e3:.2f} ms"
                        if g["from_ssd"] else ""))
    lines.append(f"    decode on the GPU: {g['step_s'] * 1e3:.2f} ms a step ({g['binding']}-bound), "
                 f"{g['decode_tokens_per_s']:,.1f} tokens/s")
    return lines


def does_not_fit(b: DecodeBytes, gpu_mem: int) -> dict:
    """The record where `place` finds no room: what the device must hold first, and the window."""
    return {"gpu_mem": gpu_mem, "why": (
        f"does not fit: embeddings and head {fmt_bytes(b.fixed)}, KV cache {fmt_bytes(b.kv)} and compute "
        f"{fmt_bytes(b.scratch)} leave less than a copy window of {DEVICE_WINDOW_LAYERS} layers "
        f"({fmt_bytes(DEVICE_WINDOW_LAYERS * b.layer)})")}
