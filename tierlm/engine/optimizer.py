"""The out-of-core AdamW: consumes each block's gradients as backward produces them.

It runs on its own thread, beside backward. For every (parameter, shard) in backward order it reads
fp32 master weights and Adam moments from the store (looking ahead while the pool has room), waits
for that parameter's gradient, applies torch's own AdamW kernel, and writes the new state to the
other slot plus the new working weights. The result is exactly `torch.optim.AdamW`'s:

- the same functional kernel (`torch.optim.adamw.adamw`, fused/foreach/single as configured) on the
  same fp32 values; it is elementwise, so sharding does not change a bit;
- exact global-norm clipping: the update is speculative (clip factor 1) into the new slot; at the end
  of the step the total norm is known, and only when torch would scale the gradients (factor < 1)
  the update is redone from the untouched old slot with the saved gradients times that factor.

With `optim_states` bf16 or int8 the store holds Adam's m and v compressed (see state_quant): a
shard's moments are decoded to fp32 buffers, the same kernel runs, and the new moments are encoded
again before they are written (and before a cached copy is kept: the next step sees exactly what
the disk holds). The master weights stay fp32. The result is then exactly that of torch's AdamW
with the same encode/decode around each step; the fp32 mode does not touch the moments.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.optim.adamw import adamw

from ..faults import fault
from ..storage import HostBufferPool, TensorStore
from ..storage.aligned import round_up
from . import state_quant as SQ
from .cache_policy import last_that_fit
from .grad_norm import grad_norm
from ..storage.layout import ParamInfo, key, nbytes
from .optim_types import EARLY, AdamWConfig, OptimizerError, StepResult
from .optim_types import ShardItem as _Item
from .optim_norms import NormsMixin


class OutOfCoreAdamW(NormsMixin):
    def __init__(self, store: TensorStore, pool: HostBufferPool, infos: dict[str, ParamInfo],
                 order: list[str], canonical: list[str], cfg: AdamWConfig,
                 weight_dtype: torch.dtype | None, state: dict, lookahead: int = 4,
                 max_pending_grad_bytes: int = 1 << 62, on_event=None,
                 state_cache: HostBufferPool | None = None, optim_states: str = "fp32", dist=None,
                 on_new_weights=None):
        """order: parameter names in the order backward produces them (block by block);
        canonical: the order of `model.parameters()` (the order torch's clipping stacks norms in);
        weight_dtype: dtype of the working weights, or None when they are the fp32 master (full fp32);
        state: the persisted optimizer state dict ({'slots', 'steps'}) - mutated on commit;
        state_cache: RAM for master/m/v shards kept resident between steps (their reads are skipped;
        their writes still happen, every step is still durable). From the second step it keeps the
        shards updated last (_last_shards);
        optim_states: how m and v are stored (fp32 | bf16 | int8, state_quant);
        dist: a data-parallel rank (tierlm.dist) or None: `order` then lists only the parameters this
        rank owns, and the clipping norm gathers every owner's norms;
        on_new_weights(name, shard, tensor): the new working weights of a shard, before they are
        written (the weight window keeps them for the next forward)."""
        self.store, self.pool, self.infos, self.cfg = store, pool, infos, cfg
        self.order, self.canonical = order, canonical
        self.weight_dtype = weight_dtype
        self.slots: dict[str, int] = state.setdefault("slots", {n: 0 for n in infos})
        self.steps: dict[str, int] = state.setdefault("steps", {n: 0 for n in infos})
        self.lookahead = lookahead
        self.on_event = on_event
        self.max_pending = max_pending_grad_bytes
        self._grads: dict[str, torch.Tensor] = {}
        self._counted: dict[str, int] = {}  # arrival -> the bytes of it counted as pending
        self._pending_bytes = 0
        self._norm_at_hand_over = False
        self._pieces: dict[str, dict] = {}  # norms of pieces of a gradient final before the rest
        self._cv = threading.Condition()
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tierlm-optim")
        self._run: Future | None = None
        self._error: BaseException | None = None
        self._norms: dict[str, torch.Tensor] = {}
        self._updated: set[str] = set()
        self._sq: dict[str, torch.Tensor] = {}
        self._taken: set[str] = set()
        self._early_shards: dict[str, list[int]] = {}  # parameter -> shards handed over early (grad_ready)
        self._early_done: dict[str, set[int]] = {}    # ... and updated this step
        self._closing = False
        self._predicted: list[str] = list(order)
        self.state_cache = state_cache
        self._resident: dict[tuple, dict] = {}  # (name, shard) -> {tag: Buffer}: the committed state
        self._staged: dict[tuple, dict] = {}    # this step's new state, resident once committed
        self._cache_pref: set | None = None     # the shards the cache keeps (None: the first that fit)
        self.cache_hits = 0
        self._arrival: list[str] = list(order)
        self.lr = cfg.lr
        self.states = SQ.check_mode(optim_states)
        self.quant = optim_states != "fp32"
        # The tags whose buffers hold the state between steps: fp32 m/v, or their stored form.
        self.state_tags = ("master", "qm", "qv") if self.quant else ("master", "m", "v")
        bad = [f"{n}.{k}" for n, i in infos.items() for k, (a, _) in enumerate(i.shards) if a % SQ.BLOCK]
        if self.quant and bad:  # a block straddling two shards would be quantised differently
            raise OptimizerError(f"--optim-states {optim_states} needs shards of a multiple of {SQ.BLOCK} "
                                 f"elements; {bad[0]} starts off a block boundary")
        self.dist = dist
        self.on_new_weights = on_new_weights
        self.blocked_s = 0.0  # time backward waited in grad_ready for the optimizer to catch up
        # The step's last pipeline leaves its writes landing (take_tail): the engine finishes them
        # with the commit while the next forward runs, which writes nothing.
        self.defer_writes = False
        self._tail: list[Future] = []

    # ---- called from the compute thread ----------------------------------------------
    def begin_micro(self, micro: int, n_micro: int, lr: float) -> None:
        """Start consuming the gradients of micro-batch `micro` (0-based) of `n_micro`."""
        if self._run is not None:
            raise OptimizerError("begin_micro called twice without end_micro")
        self.lr = lr
        # One micro-batch a step: each gradient's norm is taken as backward hands it over, on its
        # thread, which waits for the optimizer most of an I/O-bound step anyway; the optimizer's
        # thread then has none to take, and the last ones do not wait until it gets to them.
        self._norm_at_hand_over = n_micro == 1
        if micro == 0:
            self._norms.clear()
            self._pieces.clear()
            self._sq.clear()
            self._updated.clear()
            self._early_done.clear()
        self._taken = set()
        self._error = None
        self._run = self._exec.submit(self._consume, micro, n_micro)

    def grad_ready(self, name: str, grad: torch.Tensor, shards: list[int] | None = None,
                   held: bool = False) -> None:
        """Hand over a parameter's gradient; blocks while too many gradient bytes wait.

        With `shards`: those shards' part of `grad` is already final (a tied weight's rows that the
        batch's tokens do not look up: their gradient is the head's alone, complete at the start of
        backward), so they are updated now; the full gradient, handed over later, updates the rest
        and gives the norm. `held`: the gradient takes the memory of one the budget held through
        backward (a tied head's, summed into it): it takes none of the gradients' share either."""
        size = 0 if held else grad.numel() * grad.element_size()
        norm = grad_norm(grad, self._pieces.get(name)) if self._norm_at_hand_over and shards is None else None
        if shards is not None:
            self._early_shards[name] = list(shards)
            name = name + EARLY
            # autograd holds this gradient until the embedding's arrives whatever we do (the
            # budget's `held`): it takes none of the gradients' share, or backward would stand
            # still behind it
            size = 0
        t0 = time.perf_counter()
        with self._cv:
            while (self._pending_bytes > 0 and self._pending_bytes + size > self.max_pending
                   and self._run is not None and not self._run.done()):
                self._cv.wait(0.5)
            t1 = time.perf_counter()
            if t1 - t0 > 1e-4:
                # backward stood still: the optimizer (or its I/O) is behind, not the compute
                self.blocked_s += t1 - t0
                if self.on_event:
                    self.on_event("wait", "gradients in flight", t0, t1, 0)
            if self._run is not None and self._run.done():
                self._run.result()  # the worker failed: surface its error in backward
            self._grads[name] = grad
            if norm is not None:
                self._norms[name] = norm
            self._counted[name] = size
            self._pending_bytes += size
            self._cv.notify_all()

    def end_micro(self) -> None:
        """Wait until every gradient of this micro-batch is consumed. Parameters that received no
        gradient (unused in the forward) are skipped, as torch skips grad-less parameters."""
        run, self._run = self._run, None
        if run is None:
            return
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        try:
            run.result()
        finally:
            with self._cv:
                self._closing = False
                self._grads.clear()
                self._counted.clear()
                self._pending_bytes = 0

    def commit(self) -> None:
        """The new slot becomes current for every parameter updated this step."""
        for n in self._updated:
            self.slots[n] = 1 - self.slots[n]
            self.steps[n] += 1
        self._updated.clear()
        self._resident.update(self._staged)
        self._staged = {}

    def mark_updated(self, name: str) -> None:
        """Data parallelism: another rank updated `name` and its new weights are in our new slot."""
        self._updated.add(name)

    def updated(self) -> set[str]:
        return set(self._updated)

    def discard(self) -> None:
        """Forget this step's speculative writes (a non-finite step): the old slot stays current,
        and the cached copies that held this step's values are dropped (the disk has the state)."""
        self._updated.clear()
        for bufs in self._staged.values():
            for b in bufs.values():
                b.release()
        self._staged = {}

    def drop_cache(self) -> None:
        """Hand the state cache's copies back (with nothing in flight: after settle()). Their
        states are on disk, since the writes never skip a cached shard; a later step reads them."""
        for bufs in self._resident.values():
            for b in bufs.values():
                b.release()
        self._resident = {}

    def close(self) -> None:
        self._exec.shutdown(wait=True)
        for f in self.take_tail():
            f.exception()

    # ---- the worker ------------------------------------------------------------------
    # Gradients are consumed in the order they arrive (autograd decides the order inside a block);
    # optimizer state is read ahead in the order seen on the previous micro-batch, so the reads of
    # the next parameters overlap the backward that is still producing their gradients.

    def _consume(self, micro: int, n_micro: int) -> None:
        last = micro == n_micro - 1
        self._pipeline("update" if last else "accumulate", micro, defer=last and self.defer_writes)

    def _redo(self, coef: torch.Tensor) -> None:
        self._pipeline("redo", 0, clip=coef, names=[n for n in self._arrival if n in self._updated],
                       defer=self.defer_writes)

    def take_tail(self) -> list[Future]:
        """The writes of the step's last pipeline that may still be landing (the store orders any
        later read or write of the same file after them)."""
        tail, self._tail = self._tail, []
        return tail

    def _pipeline(self, mode: str, micro: int, clip=None, names: list[str] | None = None,
                  defer: bool = False) -> None:
        order = names if names is not None else self._predicted
        predicted = [(real, k) for n in order for real, ks in [self._shards_of(n)] for k in ks]
        cursor = 0
        prepared: dict[tuple, _Item] = {}
        done: set[tuple] = set()
        writes: list[Future] = []
        arrival: list[str] = []
        todo = deque(names) if names is not None else None
        ok = False

        def read_ahead() -> None:
            """Read ahead along the predicted order while the pool has room."""
            nonlocal cursor
            while cursor < len(predicted) and len(prepared) < self.lookahead:
                nk = predicted[cursor]
                if nk in done or nk in prepared:
                    cursor += 1
                    continue
                it = self._new_item(*nk)
                if not self._prepare(it, mode, micro, blocking=False):
                    break
                prepared[nk] = it
                cursor += 1

        try:
            while True:
                read_ahead()
                name = (todo.popleft() if todo else None) if todo is not None else self._next_arrival()
                if name is None:
                    break
                arrival.append(name)
                real, ks = self._shards_of(name)
                if real != name:
                    self._early_done[real] = set(ks)
                    if mode == "update" and micro == 0:
                        self._early_pieces(real, ks)
                else:
                    skip = self._early_done.pop(real, set()) if mode == "update" else set()
                    ks = [k for k in ks if k not in skip]
                    if mode == "update" and micro == 0 and name not in self._norms:
                        # The whole gradient is here: the reduction clip_grad_norm_ runs on it (the
                        # same bits as on a float copy, in pieces beyond grad_norm.CHUNK elements)
                        self._norms[name] = grad_norm(self._grads[name], self._pieces.get(name))
                if not ks:
                    self._done_with_grad(name)
                for i, k in enumerate(ks):
                    it = prepared.pop((real, k), None)
                    while it is None:
                        it = self._new_item(real, k)
                        if not self._prepare(it, mode, micro, blocking=not prepared):
                            it = None
                            self._drop_furthest(prepared)  # make room: this one is needed now
                    it.src, it.last = name, i == len(ks) - 1
                    done.add((real, k))
                    # per shard, not per parameter: an embedding's 30-odd shards arrive as one
                    # parameter, and refilled only per arrival they ran read, update, write in turn
                    read_ahead()
                    for f in it.reads:
                        f.result()
                    ws, written = self._process(it, mode, micro, clip)
                    if it.keep:
                        self._stage(it)
                    it.release_after(ws, written)
                    for f in writes:
                        if f.done():
                            f.result()  # a failed write raises now, naming its file
                    writes = [f for f in writes if not f.done()] + ws
            ok = True
        finally:
            for it in prepared.values():  # read ahead for parameters that got no gradient
                for f in it.reads:
                    f.exception()
                self._abandon(it)
            if not (ok and defer):
                for f in writes:
                    f.exception()  # wait for every write before the step can end
        if defer:
            self._tail.extend(writes)
        for f in ([] if defer else writes):
            f.result()  # a failed write raises here, naming its file
        if mode == "update" and self.state_cache is not None:
            self._cache_pref = self._last_shards(arrival)
        if mode != "redo":
            self._arrival = arrival
            seen = set(arrival)
            self._predicted = arrival + [n for n in self._predicted if n not in seen]

    def _last_shards(self, arrival: list[str]) -> set:
        """The shards updated last in `arrival`'s order whose states fill the cache (cache_policy)."""
        seq, early = [], {}
        for n in arrival:
            real, ks = self._shards_of(n)
            if real != n:
                early[real] = set(ks)
                seq += [(real, k) for k in ks]
            else:
                seq += [(real, k) for k in ks if k not in early.get(real, ())]

        def size_of(nk):
            a, b = self.infos[nk[0]].shards[nk[1]]
            return sum(round_up(self._size(tag, b - a)) for tag in self.state_tags)
        return last_that_fit(seq, size_of, self.state_cache.capacity)

    def _cacheable(self, it: _Item) -> bool:
        return self._cache_pref is None or (it.name, it.shard) in self._cache_pref

    def _stage(self, it: _Item) -> None:
        """This step's new master/m/v of a cached shard stay in RAM (a redo replaces them)."""
        old = self._staged.pop((it.name, it.shard), None)
        for b in (old or {}).values():
            b.release()
        self._staged[(it.name, it.shard)] = {t: it.bufs.pop(t) for t in it.keep}
        it.keep = set()

    def _shards_of(self, arrival: str) -> tuple[str, list[int]]:
        """The parameter an arrival updates and its shards (an early arrival: the final ones)."""
        if arrival.endswith(EARLY):
            real = arrival[:-len(EARLY)]
            return real, self._early_shards.get(real, [])
        return arrival, list(range(len(self.infos[arrival].shards)))

    def _new_item(self, name: str, k: int) -> _Item:
        a, b = self.infos[name].shards[k]
        return _Item(name, k, a, b)

    def _drop_furthest(self, prepared: dict) -> None:
        nk = next(reversed(prepared))
        it = prepared.pop(nk)
        for f in it.reads:
            f.exception()
        self._abandon(it)

    def _abandon(self, it: _Item) -> None:
        """Give up a prepared item: a cache hit's state goes back to the cache (it is still the
        committed state; releasing it would cost a re-read next step), the rest to the pools."""
        if it.cached:
            self._resident[(it.name, it.shard)] = {t: it.bufs.pop(t) for t in it.cached}
            it.cached = set()
            it.keep = set()
            self.cache_hits -= 1
        it.release()

    def _next_arrival(self) -> str | None:
        with self._cv:
            while True:
                for name in self._grads:
                    if name not in self._taken:
                        self._taken.add(name)
                        return name
                if self._closing:
                    return None
                self._cv.wait(0.5)

    def _acquire(self, it: _Item, tag: str, nbytes_: int, blocking: bool) -> bool:
        # read-ahead waits for a place in the pool's arena rather than take fresh pages beside it
        buf = self.pool.acquire(nbytes_) if blocking else self.pool.try_acquire(nbytes_, arena_only=True)
        if buf is None:
            return False
        it.bufs[tag] = buf
        return True

    def _prepare(self, it: _Item, mode: str, micro: int, blocking: bool) -> bool:
        n = it.b - it.a
        need = []
        if mode in ("update", "redo"):
            need += ["master", "m", "v"] + (["qm", "qv"] if self.quant else [])
            if self.weight_dtype is not None:
                need.append("w")
        if mode == "redo" or micro > 0 or self.weight_dtype is not None:
            # the saved gradient (redo), the accumulator (later micro-batches), or the fp32 copy
            # of a low-precision gradient
            need.append("g")
        saved_dtype = None
        if mode == "redo":
            saved_dtype = getattr(torch, self.store.landed_record(key("grad", it.name, it.shard)).dtype)
            if saved_dtype != torch.float32:
                need.append("gl")  # the saved gradient in its own (low) precision
        if mode == "redo":  # the speculative values cached for this shard are not the state
            for b in (self._staged.pop((it.name, it.shard), None) or {}).values():
                b.release()
        cached = self._resident.pop((it.name, it.shard), None) if mode == "update" else None
        if cached:
            it.bufs.update(cached)
            # a shard no longer among the last: used once more, then its buffers go back to the cache
            it.keep = set(cached) if self._cacheable(it) else set()
            it.cached = set(cached)
            self.cache_hits += 1
        elif mode in ("update", "redo") and self.state_cache is not None and self._cacheable(it):
            got = {}
            for tag in self.state_tags:
                buf = self.state_cache.try_acquire(self._size(tag, n))
                if buf is None:
                    break
                got[tag] = buf
            if len(got) == len(self.state_tags):
                it.bufs.update(got)
                it.keep = set(got)
            else:  # a partial set would be taken for the whole state next step
                for buf in got.values():
                    buf.release()
        for tag in need:
            if tag in it.bufs:
                continue
            size = nbytes(saved_dtype, n) if tag == "gl" else self._size(tag, n)
            if not self._acquire(it, tag, size, blocking):
                self._abandon(it)
                return False
        slot = self.slots[it.name]
        view = lambda tag: it.bufs[tag].view(torch.float32, (n,))
        if mode in ("update", "redo") and not cached:
            it.reads.append(self.store.read_into(key("master", it.name, it.shard, slot), view("master"), True))
            if self.steps[it.name] > 0:
                m, v = ("qm", "qv") if self.quant else ("m", "v")
                it.reads.append(self.store.read_into(key("m", it.name, it.shard, slot), self._view(it, m), True))
                it.reads.append(self.store.read_into(key("v", it.name, it.shard, slot), self._view(it, v), True))
            elif not self.quant:  # (compressed modes start m, v at zero in _process)
                view("m").zero_()
                view("v").zero_()
        if mode == "redo":
            dst = view("g") if saved_dtype == torch.float32 else it.bufs["gl"].view(saved_dtype, (n,))
            it.reads.append(self.store.read_into(key("grad", it.name, it.shard), dst, True))
        elif micro > 0:
            it.reads.append(self.store.read_into(key("gacc", it.name, it.shard), view("g"), True))
        return True

    def _size(self, tag: str, n: int) -> int:
        if tag == "w":
            return nbytes(self.weight_dtype, n)
        if tag in ("qm", "qv"):
            return SQ.stored_nbytes(self.states, n)
        return nbytes(torch.float32, n)

    def _view(self, it: _Item, tag: str) -> torch.Tensor:
        """A buffer as the tensor it holds: fp32, or a moment's stored form."""
        n = it.b - it.a
        if tag in ("qm", "qv"):
            dt, numel = SQ.stored_spec(self.states, n)
            return it.bufs[tag].view(dt, (numel,))
        return it.bufs[tag].view(torch.float32, (n,))

    def _grad_dtype(self, it: _Item) -> torch.dtype:
        return getattr(torch, self.store.landed_record(key("grad", it.name, it.shard)).dtype)

    def _grad_shard(self, it: _Item, micro: int) -> torch.Tensor:
        """The fp32 gradient of this shard, accumulated over the micro-batches so far."""
        g = self._grads[it.src].reshape(-1)[it.a:it.b]
        if micro > 0:
            acc = it.bufs["g"].view(torch.float32, (it.b - it.a,))
            acc.add_(g)  # what autograd's accumulation does: grad += new
            return acc
        if g.dtype != torch.float32:
            out = it.bufs["g"].view(torch.float32, (it.b - it.a,))
            out.copy_(g)
            return out
        return g

    def _process(self, it: _Item, mode: str, micro: int, clip) -> tuple[list[Future], set[str]]:
        """The shard's update (or accumulation): its writes, and the buffers they read from."""
        fault("optimizer.write")
        t0 = time.perf_counter()
        n = it.b - it.a
        writes = []
        written = set()
        raw = None
        if mode == "redo":
            g = it.bufs["g"].view(torch.float32, (n,))
            if "gl" in it.bufs:
                g.copy_(it.bufs["gl"].view(self._grad_dtype(it), (n,)))  # exact upcast
            g.mul_(clip)  # what clip_grad_norm_ does to each gradient
        else:
            if micro == 0:
                raw = self._grads[it.src].reshape(-1)[it.a:it.b]
            g = self._grad_shard(it, micro)
            if it.last:
                self._done_with_grad(it.src)
        if mode == "accumulate":
            writes.append(self.store.write(key("gacc", it.name, it.shard), g))
            written.add("g")
        else:
            if mode == "update":
                if micro > 0:
                    self._record_norm(it, g)
                if self.cfg.max_grad_norm is not None:
                    # Saved for a clip redo. A bf16 gradient is saved as bf16: its fp32 upcast is
                    # exact, so the redo gets the same bits for half the bytes.
                    src = raw if raw is not None else g
                    writes.append(self.store.write(key("grad", it.name, it.shard), src))
                    if raw is None:  # the accumulator buffer is what this write reads
                        written.add("g")
            master = it.bufs["master"].view(torch.float32, (n,))
            m = it.bufs["m"].view(torch.float32, (n,))
            v = it.bufs["v"].view(torch.float32, (n,))
            if self.quant:
                if self.steps[it.name] > 0:
                    SQ.decode(self.states, self._view(it, "qm"), m, signed=True)
                    SQ.decode(self.states, self._view(it, "qv"), v, signed=False)
                else:
                    m.zero_()
                    v.zero_()
            step_t = torch.tensor(float(self.steps[it.name]))
            adamw([master], [g], [m], [v], [], [step_t], lr=self.lr, beta1=self.cfg.beta1,
                  beta2=self.cfg.beta2, weight_decay=self.cfg.weight_decay, eps=self.cfg.eps,
                  amsgrad=False, maximize=False, **self.cfg.kernel_flags())
            if self.quant:
                SQ.encode(self.states, m, self._view(it, "qm"), signed=True)
                SQ.encode(self.states, v, self._view(it, "qv"), signed=False)
                m, v = self._view(it, "qm"), self._view(it, "qv")
            new = 1 - self.slots[it.name]
            writes.append(self.store.write(key("master", it.name, it.shard, new), master))
            writes.append(self.store.write(key("m", it.name, it.shard, new), m))
            writes.append(self.store.write(key("v", it.name, it.shard, new), v))
            w = master
            if self.weight_dtype is not None:
                w = it.bufs["w"].view(self.weight_dtype, (n,))
                w.copy_(master)  # the same rounding as `param.data.copy_(master)`
                writes.append(self.store.write(key("w", it.name, it.shard, new), w))
            written |= {"master", "w"} | ({"qm", "qv"} if self.quant else {"m", "v"})
            if self.on_new_weights is not None:
                self.on_new_weights(it.name, it.shard, w)
            self._updated.add(it.name)
        if self.on_event:
            self.on_event("optimizer", f"{it.name}.{it.shard}", t0, time.perf_counter(), n)
        return writes, written

    def _done_with_grad(self, name: str) -> None:
        with self._cv:
            g = self._grads.get(name)
            if g is not None:
                # Keep the tensor until its writes finish (they hold a reference); only the
                # accounting of what backward may produce ahead of us is released here.
                self._pending_bytes -= self._counted.pop(name, 0)
                del self._grads[name]
            self._cv.notify_all()


__all__ = ["AdamWConfig", "OutOfCoreAdamW", "OptimizerError", "StepResult", "math"]
