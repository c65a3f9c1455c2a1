"""Streamed decoder layers on a compute device: each copied from host memory while the layer before
it computes.

A step walks the streamed layers in order. Before layer i computes, its copy has been issued (at
the latest now) and the copy of the next streamed layer is issued too, so the next layer's bytes
cross the bus while this one computes; the compute waits for layer i's copy on the device (an
event), not on the host. After layer i computes its device tensors are dropped (the allocator
reuses them once the compute is past them) and its host buffer goes back, only once the copy
has read it. The walk is cyclic: during the last streamed layer the first one's copy starts for
the next step, as decode repeats the same walk. One streamed layer serves every row of the step.

The copies go through a lane: `CudaLane` is a side stream with an event per copy; `SyncLane` has
the same interface on the CPU and copies when asked, so the ordering (which layer is on the device,
when the next copy starts, when a host buffer is released) runs in tests without a GPU.
"""
from __future__ import annotations

import torch


class SyncLane:
    """Copies done when issued (the CPU, or any device for a test): the event is already reached."""

    def __init__(self, device: torch.device):
        self.device = device

    def copy(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
        return {k: torch.empty_like(t, device=self.device).copy_(t) for k, t in host.items()}, None

    def wait(self, event, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def finished(self, event) -> None:
        pass


class CudaLane:
    """Host -> device copies on a side stream; the compute stream waits on each copy's event."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def copy(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], object]:
        # asynchronous from pinned host memory; the device tensors come from the side stream's pool
        with torch.cuda.stream(self.stream):
            out = {k: t.to(self.device, non_blocking=True) for k, t in host.items()}
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return out, ev

    def wait(self, event, tensors: dict[str, torch.Tensor]) -> None:
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(event)
        for t in tensors.values():
            t.record_stream(cur)  # not reused by the side stream until the compute is past its last use

    def finished(self, event) -> None:
        event.synchronize()  # the copy has read the host buffer


def make_lane(device: torch.device):
    return CudaLane(device) if device.type == "cuda" else SyncLane(device)


class HostLayers:
    """Where streamed layers' host tensors come from: layers kept in (pinned) RAM, always there;
    and layers read from the NVMe store through the LayerStream window, whose buffer goes back
    after its copy."""

    def __init__(self, in_ram: dict[int, dict[str, torch.Tensor]], stream=None):
        self.in_ram, self.stream = in_ram, stream

    def take(self, i: int) -> dict[str, torch.Tensor]:
        return self.in_ram[i] if i in self.in_ram else self.stream.take(i)

    def give_back(self, i: int) -> None:
        if i not in self.in_ram:
            self.stream.release(i)


class DeviceLayers:
    """The schedule of the streamed layers' copies (see the module's docstring). `layers`: layer
    index -> its pieces (tierlm.infer.weights.Piece); `host`: a HostLayers; `log`, when a list,
    records ("copy" | "compute" | "release", layer) as they happen (tests)."""

    def __init__(self, lane, layers: dict, host: HostLayers, log: list | None = None):
        self.lane, self.layers, self.host, self.log = lane, layers, host, log
        self.order = sorted(layers)
        self._next = {i: self.order[(k + 1) % len(self.order)] for k, i in enumerate(self.order)}
        self._inflight: dict[int, tuple[dict[str, torch.Tensor], object]] = {}
        self.copied_bytes = 0  # host -> device, counted

    def _note(self, what: str, i: int) -> None:
        if self.log is not None:
            self.log.append((what, i))

    def _issue(self, i: int) -> None:
        if i in self._inflight:
            return
        host = self.host.take(i)
        dev, ev = self.lane.copy(host)
        self._inflight[i] = (dev, ev)
        self.copied_bytes += sum(t.numel() * t.element_size() for t in host.values())
        self._note("copy", i)

    def start_step(self) -> None:
        """The first streamed layer's copy, to overlap what computes before it (the embeddings,
        resident layers); a no-op where the last step's last layer issued it."""
        if self.order:
            self._issue(self.order[0])

    def on_device(self) -> list[int]:
        """The layers whose copies are issued and not yet released."""
        return sorted(self._inflight)

    def before(self, i: int) -> None:
        self._issue(i)
        nxt = self._next[i]
        if nxt != i:
            self._issue(nxt)  # crosses the bus while layer i computes
        dev, ev = self._inflight[i]
        self.lane.wait(ev, dev)
        for p in self.layers[i]:
            p.install(dev[p.key])
        self._note("compute", i)

    def after(self, i: int) -> None:
        for p in self.layers[i]:
            p.install(None)
        _, ev = self._inflight.pop(i)
        self.lane.finished(ev)
        self.host.give_back(i)
        self._note("release", i)

    def hook(self, modules: dict) -> list:
        """Route each streamed layer's forward (layer index -> module) through before/after;
        returns the hook handles."""
        handles = []
        for i, mod in modules.items():
            handles.append(mod.register_forward_pre_hook(lambda m, a, i=i: self.before(i)))
            handles.append(mod.register_forward_hook(lambda m, a, o, i=i: self.after(i)))
        return handles

    def close(self) -> None:
        for i in list(self._inflight):
            _, ev = self._inflight.pop(i)
            self.lane.finished(ev)
            self.host.give_back(i)
