"""Gradients to their owners during backward, and the updated weights back to every rank.

Backward's hooks fire in autograd's order, which may differ between ranks (an uneven last batch
changes the activation policy); collectives must be issued in one order everywhere. So each
gradient waits in `ready` until every parameter before it in the fixed backward order has been
issued, then goes out as an async `reduce` (sum) to its owner. A thread waits for the reductions in
that order and hands the owner's summed gradient to its optimizer, which is already updating the
layers before it: communication overlaps the rest of backward and the optimizer. This is the CPU
path (gloo, host tensors); on GPUs the same contract runs in buckets over NCCL (buckets.py).

A parameter may get a gradient on some ranks and not on others (a module their data skips: a
sparse-attention indexer, a branch). Every rank still issues every parameter's reduction, in the
one order (zeros where it has none), and after backward the ranks sum which parameters each had a
gradient for: as torch's DistributedDataParallel does, a parameter no rank had one for is not handed
to its optimizer (AdamW skips it, as it skips a parameter whose `.grad` is None), and one some rank
had is, with the sum. The owner hands over at once what it had itself; the rest waits for the sum.
"""
from __future__ import annotations

import queue
import threading

import torch
import torch.distributed as td

from ..storage.layout import key


class GradReducer:
    def __init__(self, dist, order: list[str], optimizer, max_inflight_bytes: int,
                 shapes: dict[str, tuple] | None = None):
        self.dist, self.order, self.opt = dist, order, optimizer
        self.shapes = {n: tuple(shapes[n]) for n in order} if shapes is not None else {}
        self._at = {n: i for i, n in enumerate(order)}
        self._local: set[str] = set()  # the parameters this rank had a gradient for, this micro-batch
        self._waiting: list[tuple[str, torch.Tensor]] = []  # owned sums of parameters this rank had none for
        self.max_inflight = max(max_inflight_bytes, 1)
        self.on_device = False  # takes the gradients in host memory (buckets.py: where autograd made them)
        self._ready: dict[str, torch.Tensor] = {}
        self._cursor = 0
        self._q: queue.Queue = queue.Queue()
        self._inflight = 0
        self._cv = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def begin(self) -> None:
        self._ready.clear()
        self._local = set()
        self._waiting = []
        self._cursor = 0
        self._error = None
        self._thread = threading.Thread(target=self._deliver, name="tierlm-grad-reduce", daemon=True)
        self._thread.start()

    def grad(self, name: str, g: torch.Tensor) -> None:
        """From the parameter's hook: sums travel in fp32 (a bf16 sum across ranks would round)."""
        self._ready[name] = g.float().contiguous() if g.dtype != torch.float32 else g.contiguous()
        self._local.add(name)
        self._issue(flush=False)

    def flush(self) -> None:
        """After backward: issue what is left (zeros for the parameters this rank had no gradient
        for), wait until every owner has its sums, then hand over the sums of the parameters some
        other rank had a gradient for."""
        try:
            self._issue(flush=True)
        finally:
            self._q.put(None)
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error
        used = self.dist.all_reduce(torch.tensor([1.0 if n in self._local else 0.0 for n in self.order]))
        for name, g in self._waiting:
            if used[self._at[name]] > 0:
                self.opt.grad_ready(name, g)
        self._waiting = []

    def _zeros(self, name: str) -> torch.Tensor:
        """This rank's part of a parameter it had no gradient for."""
        if name not in self.shapes:
            raise RuntimeError(f"{name}: no gradient on this rank and no shape to send zeros in (a tierlm bug)")
        return torch.zeros(self.shapes[name], dtype=torch.float32)

    def _issue(self, flush: bool) -> None:
        while self._cursor < len(self.order):
            name = self.order[self._cursor]
            g = self._ready.pop(name, None)
            if g is None:
                if not flush:
                    return
                g = self._zeros(name)
            self._cursor += 1
            size = g.numel() * 4
            self._reserve(size)
            owner = self.dist.owners[name]
            work = td.reduce(g, dst=owner, op=td.ReduceOp.SUM, async_op=True) if self.dist.world > 1 else None
            self._q.put(((name, g), work, owner == self.dist.rank, size))

    def _reserve(self, size: int) -> None:
        """Bound the gradient bytes in flight, as the optimizer bounds its own."""
        with self._cv:
            while self._inflight > 0 and self._inflight + size > self.max_inflight and self._error is None:
                self._cv.wait(0.5)
            if self._error is not None:
                raise self._error
            self._inflight += size

    def _complete(self, payload, work, mine: bool) -> None:
        """On the delivery thread: wait for the reduction; the owner's optimizer takes the sum."""
        if work is not None:
            work.wait()
        if mine:
            name, g = payload
            if name in self._local:
                self.opt.grad_ready(name, g)
            else:
                self._waiting.append((name, g))  # handed over once the ranks agree it had a gradient

    def _deliver(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            payload, work, mine, size = item
            try:
                if self._error is None:
                    self._complete(payload, work, mine)
            except BaseException as e:  # noqa: BLE001  (surfaced by flush on the compute thread)
                self._error = e
            finally:
                with self._cv:
                    self._inflight -= size
                    self._cv.notify_all()


def gather_norms(dist, norms: dict[str, torch.Tensor], canonical: list[str]) -> dict[str, torch.Tensor]:
    """Every parameter's gradient norm, each computed by its owner, in canonical order on every
    rank: the total norm, the clip factor and the skip decision come out the same everywhere.
    (Adding the other ranks' zeros is exact, so each norm arrives bit for bit.)"""
    vals = torch.zeros(len(canonical), dtype=torch.float32)
    have = torch.zeros(len(canonical), dtype=torch.float32)
    for i, n in enumerate(canonical):
        if n in norms:
            vals[i] = norms[n].float()
            have[i] = 1
    both = dist.all_reduce(torch.stack([vals, have]))
    return {n: both[0, i] for i, n in enumerate(canonical) if both[1, i] > 0}


def share_weights(engine, updated: list[str]) -> None:
    """The owners' new working weights (the finished step's slot) to every other rank, parameter
    by parameter in canonical order; each rank writes them into its own store for its window."""
    dist, opt, store = engine.dist, engine.optimizer, engine.store
    pending = []
    for name in updated:
        owner = dist.owners[name]
        new = 1 - opt.slots[name]
        for k, (a, b) in enumerate(engine.infos[name].shards):
            buf = engine.opt_pool.acquire((b - a) * engine.wdtype(name).itemsize)
            t = buf.view(engine.wdtype(name), (b - a,))
            if owner == dist.rank:
                store.read_into(key(engine._wkind(name), name, k, new), t, owns_padding=True).result()
            if dist.world > 1:
                td.broadcast(t, src=owner)
            if owner == dist.rank:
                buf.release()
            else:
                engine.window.offer(name, k, t)
                f = store.write(key("w", name, k, new), t)
                f.add_done_callback(lambda _f, b_=buf: b_.release())
                pending.append(f)
        if owner != dist.rank:
            opt.mark_updated(name)
    for f in pending:
        f.result()  # a failed write raises here, naming its file
