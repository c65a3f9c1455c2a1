"""Gradients reduced in buckets on the compute device: NCCL on CUDA, one reduce per bucket.

One reduce per parameter costs a launch and a synchronisation each; on a GPU a layer has a handful
of large and many small parameters. So gradients are copied (as fp32) into flat buckets of about
`bucket_bytes`, and each bucket goes out as one async `reduce` (sum) to its owner rank, whose
optimizer then takes the parameters' slices, copied to host memory only there.

The buckets are planned once, from the fixed backward order, the parameters' sizes and their
owners: every rank plans the same buckets. Each owner has one open bucket at a time; a parameter
joins its owner's open bucket, which is closed first if the parameter would take it past the size
(a parameter larger than the size has a bucket of its own). A bucket is issued once the reducer's
cursor (the fixed backward order, as in grads.py) has passed its last parameter: buckets go out in
one order on every rank whatever order autograd's hooks fire in, each as soon as it is full, while
backward goes on. A parameter without a gradient on this rank leaves zeros in its slot, and its
owner hands its sum over only if some rank had one (grads.py).

Bits: a sum of fp32 gradients is elementwise, so where each element lands in a flat buffer does not
change its sum. With two ranks each element's sum is one addition, a + b == b + a in IEEE arithmetic:
bucketed and per-parameter reductions give the same bits (over gloo, tests/dist/test_buckets.py
checks it). With three or more ranks NCCL may add an element's terms in an order that depends on its
offset and the buffer's size (its ring and tree algorithms), so a bucketed sum may differ from a
per-parameter one in the last bits; the CPU path keeps its per-parameter reductions (grads.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as td

from .grads import GradReducer


@dataclass
class Bucket:
    owner: int
    names: list[str] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0


def plan_buckets(order: list[str], numels: dict[str, int], owners: dict[str, int],
                 bucket_bytes: int) -> list[Bucket]:
    """The buckets in the order they are issued (by the position of their last parameter in `order`).
    bucket_bytes <= 0: one parameter a bucket."""
    open_: dict[int, Bucket] = {}
    last: dict[int, int] = {}  # id(bucket) -> position of its last parameter
    done: list[Bucket] = []
    for pos, name in enumerate(order):
        owner, n = owners[name], numels[name]
        b = open_.get(owner)
        if b is not None and b.names and (b.numel + n) * 4 > bucket_bytes:
            done.append(open_.pop(owner))
            b = None
        if b is None:
            b = open_[owner] = Bucket(owner)
        b.names.append(name)
        b.offsets.append(b.numel)
        b.numel += n
        last[id(b)] = pos
    done += open_.values()
    return sorted(done, key=lambda b: last[id(b)])


class BucketReducer(GradReducer):
    """GradReducer's contract (begin, grad, flush; the owner's optimizer gets each summed fp32
    gradient), with the gradients reduced in buckets where they were computed (`dist.device`)."""

    def __init__(self, dist, order: list[str], optimizer, max_inflight_bytes: int, shapes: dict[str, tuple]):
        super().__init__(dist, order, optimizer, max_inflight_bytes, shapes)
        numels = {n: math.prod(s) for n, s in self.shapes.items()}
        self.buckets = plan_buckets(order, numels, dist.owners, dist.bucket_bytes)
        self._slot: dict[str, tuple[int, int, int]] = {}  # name -> (bucket, offset, numel)
        self._closes: dict[str, int] = {}  # a bucket's last parameter -> the bucket
        for i, b in enumerate(self.buckets):
            for name, off in zip(b.names, b.offsets):
                self._slot[name] = (i, off, numels[name])
            self._closes[b.names[-1]] = i
        self.device = dist.device
        self.on_device = self.device.type != "cpu"  # takes gradients where autograd made them
        self._bufs: dict[int, torch.Tensor] = {}
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if self._side is not None:
            # GPU memory: the open buckets (one an owner) and at most 4 buckets' bytes in flight (a
            # larger parameter goes alone), beside what the engine's GPU budget holds
            self.max_inflight = min(self.max_inflight, 4 * max(dist.bucket_bytes, 1))
        self.issued: list[int] = []  # this micro-batch's buckets in the order they went out

    def begin(self) -> None:
        self._bufs.clear()
        self.issued = []
        super().begin()

    def grad(self, name: str, g: torch.Tensor) -> None:
        """From the parameter's hook: copied (as fp32) into its bucket now, so autograd may free it;
        the bucket goes out when the cursor passes its last parameter."""
        i, off, n = self._slot[name]
        self._buf(i)[off:off + n].copy_(g.reshape(-1))
        self._local.add(name)
        self._ready[name] = True
        self._issue(flush=False)

    def _buf(self, i: int) -> torch.Tensor:
        buf = self._bufs.get(i)
        if buf is None:
            buf = self._bufs[i] = torch.empty(self.buckets[i].numel, dtype=torch.float32, device=self.device)
        return buf

    def _issue(self, flush: bool) -> None:
        while self._cursor < len(self.order):
            name = self.order[self._cursor]
            if not self._ready.pop(name, False):
                if not flush:
                    return
                i, off, n = self._slot[name]
                self._buf(i)[off:off + n].zero_()  # no gradient on this rank: its slot adds zeros
            self._cursor += 1
            i = self._closes.get(name)
            if i is not None:
                self._send(i)

    def _send(self, i: int) -> None:
        b, buf = self.buckets[i], self._bufs.pop(i)
        size = b.numel * 4
        self._reserve(size)
        work = None
        if self.dist.world > 1 or self.dist.grad_group is not None:  # (a 1-rank NCCL group: the GPU smoke test)
            work = td.reduce(buf, dst=b.owner, op=td.ReduceOp.SUM, group=self.dist.grad_group, async_op=True)
        self.issued.append(i)
        # every parameter's sum goes to its owner (those this rank had no gradient for wait for the
        # ranks' agreement: GradReducer.flush)
        names = list(b.names)
        filled = None
        if self._side is not None:  # the copies into the bucket, on this thread's stream, are done
            filled = torch.cuda.Event()
            filled.record(torch.cuda.current_stream(self.device))
        self._q.put(((names, buf, filled), work, b.owner == self.dist.rank, size))

    def _complete(self, payload, work, mine: bool) -> None:
        names, buf, filled = payload
        if self._side is not None:
            # on a stream of its own: waits for the bucket and its reduction, not for the compute
            # stream's later kernels
            with torch.cuda.stream(self._side):
                self._side.wait_event(filled)
                if work is not None:
                    work.wait()
                host = buf.to("cpu") if mine else None  # the owner's copy, for its CPU optimizer
                self._side.synchronize()  # the bucket's memory is free to go back to the allocator
        else:
            if work is not None:
                work.wait()
            host = buf
        if not mine:
            return
        for name in names:
            _, off, n = self._slot[name]
            g = host[off:off + n].view(self.shapes[name])
            if name in self._local:
                self.opt.grad_ready(name, g)
            else:
                self._waiting.append((name, g))


def make_reducer(dist, order: list[str], optimizer, max_inflight_bytes: int, shapes: dict[str, tuple]):
    """The CPU path with bucket_bytes 0 reduces each parameter alone over gloo, as it always has;
    otherwise (every CUDA run, or buckets asked for on the CPU) the gradients go in buckets."""
    if dist.device.type == "cpu" and dist.bucket_bytes <= 0:
        return GradReducer(dist, order, optimizer, max_inflight_bytes, shapes)
    return BucketReducer(dist, order, optimizer, max_inflight_bytes, shapes)
