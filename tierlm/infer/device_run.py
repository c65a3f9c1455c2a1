"""An inference engine's weights on a compute device (`--device cuda`): what is resident there, what
is copied each step, and from where.

The placement is `plan.device_placement` under `--gpu-mem` (embeddings, head, KV cache and compute
first, then whole decoder layers) and, for the layers left on the host, `plan.inference`'s under
`--cpu-mem` (kept in pinned RAM while they fit, the rest read from the NVMe store through a
pinned window). Resident blocks are read from the checkpoint a block at a time and copied to the
device, so the host holds one of them at a time. Streamed layers follow `device_layers`' schedule.

On the CPU with `device_schedule` the same placement and schedule run with synchronous copies into
fresh CPU tensors: the same arithmetic on the same bytes, so the tokens are the CPU path's.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..plan.device_placement import plan_device_placement
from ..plan.inference import plan_placement
from .device_layers import DeviceLayers, HostLayers, make_lane
from .quant import int4_layout

GPU_MEM_SHARE = 0.9  # of the device memory free at start, where --gpu-mem is not given


def refusal(device: torch.device, eng) -> str | None:
    """Why this model cannot run with its layers on `device` (yet), or None."""
    if eng.moe:
        return f"--device {device} with mixture-of-experts streaming is not supported yet; use --device cpu"
    if eng.cfg.quant == "int4" and int4_layout() != "tierlm" and device.type == "cuda":
        return (f"--device {device} with --weights int4 needs tierlm's int4 layout, made where its kernels build "
                f"(a C compiler, `cc`); use --weights int8 or bf16")
    if eng.cfg.tp > 1:
        return (f"--device {device} with --tp {eng.cfg.tp}: tensor parallelism runs on the CPU over gloo; "
                f"use --device cpu")
    return None


class DeviceRun:
    def __init__(self, device: torch.device, cfg):
        self.device, self.cfg = device, cfg
        self.lane = make_lane(device)
        self.on_device: set[int] = set()   # decoder layers resident in device memory
        self.in_ram: set[int] = set()      # streamed layers kept in (pinned) host RAM
        self.host_views: dict[int, dict[str, torch.Tensor]] = {}
        # their buffers: a pinned buffer is unregistered when its tensor goes (storage.aligned)
        self.host_buffers: dict[int, torch.Tensor] = {}
        self.layers: DeviceLayers | None = None
        self.placement = None

    @property
    def pin(self) -> bool:
        return self.device.type == "cuda"

    def budget(self) -> int:
        if self.cfg.gpu_mem is not None:
            return self.cfg.gpu_mem
        if self.device.type != "cuda":
            raise ValueError("the device schedule on the CPU needs --gpu-mem (the room it places layers in)")
        free, _ = torch.cuda.mem_get_info(self.device)
        return int(free * GPU_MEM_SHARE)

    def host_config(self):
        """The host side's options: at least one layer read ahead, so that the next layer's buffer is
        there to copy while this one's is still held (two window buffers)."""
        return replace(self.cfg, prefetch=max(self.cfg.prefetch, 1), resident_layers=self.cfg.host_resident_layers)

    def place(self, baseline: int, fixed: int, layer_bytes: int, layer_idx: list[int], kv: int, scratch: int,
              kv_name: str = "KV cache"):
        """(host placement, layers read into RAM at load, layers streamed from the store)."""
        dp = plan_device_placement(self.budget(), fixed, layer_bytes, len(layer_idx), kv, scratch,
                                   self.cfg.resident_layers, kv_name)
        self.placement = dp
        self.on_device = set(layer_idx[: dp.resident])
        host = layer_idx[dp.resident:]
        # the embeddings, head, KV cache and compute are on the device: the host holds the layers
        hp = plan_placement(self.host_config(), baseline, 0, layer_bytes, len(host), 0, 0)
        self.in_ram = set(host[: hp.resident])
        return hp, self.on_device | self.in_ram, host[hp.resident:]

    def placed(self, index: int, pieces: list, is_layer: bool, buf: torch.Tensor) -> None:
        """A block read into host memory (`buf`) at load: to the device now, or kept on the host to
        stream."""
        if is_layer and index in self.in_ram:
            self.host_buffers[index] = buf
            self.host_views[index] = {p.key: p.installed() for p in pieces}
            for p in pieces:
                p.install(None)
            return
        for p in pieces:
            p.install(p.installed().to(self.device))

    def attach(self, modules: dict, pieces: dict, stream) -> None:
        """The schedule over every streamed layer (layer index -> module), from RAM or the store."""
        streamed = sorted(self.in_ram | set(stream.layers if stream else ()))
        if not streamed:
            return
        self.layers = DeviceLayers(self.lane, {i: pieces[i] for i in streamed}, HostLayers(self.host_views, stream))
        self.layers.hook({i: modules[i] for i in streamed})

    def start_step(self) -> None:
        if self.layers:
            self.layers.start_step()

    def describe(self) -> str:
        return f"on {self.device}: {self.placement.describe()}"

    def close(self) -> None:
        if self.layers:
            self.layers.close()
