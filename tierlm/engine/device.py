"""The compute device: where a block's weights go while it runs, and how gradients come back.

Without a GPU the compute memory is host memory: a block computes on its weights in place in the
window. With one (`--device cuda`) the window is pinned host memory, and each block's weights are
copied to the GPU on a side stream: the next layer's while the current one computes, as soon as
its SSD read has landed. The compute stream waits on the copy's event (not the host), and the
host buffer goes back to the window only once the copy has read it. Gradients come back to host
memory as autograd produces them, for the CPU optimizer.
"""
from __future__ import annotations

import torch

# where the device is resolved and buffers moved: below both engines (inference uses them too)
from ..hf.device import move_buffers, resolve_device  # noqa: F401  (re-exported)


class Uploads:
    """Device copies of window entries, one per parameter name, each holding its host pin."""

    def __init__(self, device: torch.device, window):
        self.device, self.window = device, window
        self.stream = torch.cuda.Stream(device)
        self._copies: dict[str, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.bytes = 0  # host -> device, counted

    def upload(self, names, blocking: bool = True) -> bool:
        """Start copying `names` to the device. Not blocking: only when their SSD reads have
        landed (the compute thread must not wait on a read for a layer it does not run yet)."""
        todo = [n for n in names if n not in self._copies]
        if not todo:
            return True
        if not blocking and not self.window.ready(todo):
            return False
        host = self.window.acquire(todo)
        with torch.cuda.stream(self.stream):
            for n, t in host.items():
                d = t.to(self.device, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
                self._copies[n] = (d, ev)
                self.bytes += t.numel() * t.element_size()
        return True

    def get(self, name: str) -> torch.Tensor:
        self.upload([name])
        d, ev = self._copies[name]
        cur = torch.cuda.current_stream(self.device)
        cur.wait_event(ev)
        d.record_stream(cur)  # freed only once the compute stream is past its last use
        return d

    def drop(self, name: str) -> None:
        d, ev = self._copies.pop(name)
        ev.synchronize()  # the copy has read the host buffer: the window may reuse it
        self.window.release([name])

    def drop_all(self) -> None:
        for n in list(self._copies):
            self.drop(n)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A gradient for the CPU optimizer (waits for the GPU to have produced it)."""
    return t if t.device.type == "cpu" else t.to("cpu")


def synchronize(device: torch.device) -> None:
    """Make host timings cover the device's work (the timeline and the planner's profile)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
