"""The out-of-core AdamW: consumes each block's gradients as backward produces them.

It runs on its own thread, beside backward. For every (parameter, shard) in backward order it reads
fp32 master weights and Adam moments from the store (looking ahead while the pool has room), waits
for that parameter's gradient, applies torch's own AdamW kernel, and writes the new state to the
other slot plus the new working weights. The result is exactly `torch.optim.AdamW`'s:

- the same functional kernel on the same fp32 values (optim_update: elementwise, so sharding does
  not change a bit; with compressed moments, torch's AdamW with the same encode/decode around it);
- exact global-norm clipping, two ways to the same bits (`clip_path`). speculate: the update runs
  beside backward with clip factor 1 into the new slot, and only when torch would scale the
  gradients (factor < 1) it is redone from the untouched old slot with the saved gradients times
  the factor: free when no step clips, a second pass when one does. hold: backward's gradients are
  only saved (and their norms taken); the one update runs once the norm is known, with the factor:
  no second pass, but nothing beside backward. `auto` predicts the next step clips when the last
  one did (the first step is taken to clip, as fine-tuning's first steps usually do) and holds
  then: a choice from the gradients, never from a timing, and both give torch's bits.

Its parts: the gradients handed over (optim_grads), the read-ahead of the shards' states
(optim_readahead) and their reads (optim_reads), the states kept in RAM (cache_policy), the shard
update (optim_update) and the step's gradient norm (optim_norms). This class runs the pass over them.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..faults import fault
from ..storage.layout import ParamInfo, key
from .cache_policy import StateCache
from .grad_norm import grad_norm
from .optim_grads import GradQueue
from .optim_experts import ExpertsMixin
from .optim_norms import NormsMixin
from .optim_readahead import ArrivalOrder, ReadAhead, shards_of, update_sequence
from .optim_reads import ShardReader
from .optim_types import (EARLY, AdamWConfig, OptimizerDeps, OptimizerError, OutOfCoreOptions, ShardItem,
                          StateFormat, StepResult)
from .optim_update import ShardUpdate, clipped_grad, fp32_grad


class OutOfCoreAdamW(NormsMixin, ExpertsMixin):
    def __init__(self, deps: OptimizerDeps, infos: dict[str, ParamInfo], order: list[str],
                 canonical: list[str], cfg: AdamWConfig, state: dict,
                 opts: OutOfCoreOptions = OutOfCoreOptions()):
        """order: parameter names in the order backward produces them (block by block); with
        deps.dist, only the parameters this rank owns (the clipping norm gathers every owner's);
        canonical: the order of `model.parameters()` (the order torch's clipping stacks norms in);
        state: the persisted optimizer state dict ({'slots', 'steps'}) - mutated on commit."""
        self.store, self.infos, self.cfg, self.canonical = deps.store, infos, cfg, canonical
        self.dist, self.on_event, self.on_new_weights = deps.dist, deps.on_event, deps.on_new_weights
        self.on_unchanged = deps.on_unchanged
        self.state_cache = deps.state_cache
        self.slots: dict[str, int] = state.setdefault("slots", {n: 0 for n in infos})
        self.steps: dict[str, int] = state.setdefault("steps", {n: 0 for n in infos})
        self.lookahead = opts.lookahead
        self.lr = cfg.lr
        fmt = StateFormat(opts.weight_dtype, opts.optim_states, opts.fp32_weights)
        fmt.check_shards(infos)
        self.cache = StateCache(deps.state_cache, fmt)
        self.fmt = fmt
        # Between commits (--commit-every): the slot a step writes is the one the last commit did
        # not name, rewritten in place by every step until the next commit names it; `dirty`: the
        # parameters whose newest state is there. The committed slot stays intact for a resume.
        self.dirty: set[str] = set()
        self.every_step = True  # every step commits (the speculative clip needs its old slot intact)
        self.durable = True     # this step commits: the kept states are written too
        # A held step's update may run while the next forward does (defer_apply): the forward reads
        # each block's new weights once written (the store's reservations); until the step's
        # bookkeeping, `_pending_new` are the parameters whose newest weights are being written.
        self.defer_apply = False
        self.on_apply_failed = None  # the window's: blocks waiting for a failed update's weights raise
        self.on_apply_start = None   # the window's: its entries of these parameters await the new weights
        self._pending_new: set[str] = set()
        self._apply_fut: Future | None = None
        self._slot_lock = threading.Lock()
        self._init_experts(state, cfg)
        self.reader = ShardReader(deps.store, deps.pool, fmt, self.cache, self.read_slot, self.steps)
        self.update = ShardUpdate(deps.store, cfg, fmt)
        self.queue = GradQueue(opts.max_pending_grad_bytes, deps.on_event)
        self.arrivals = ArrivalOrder(order)
        self.clip_path = opts.clip_path
        self.holding = False          # this step's gradients are held until the norm is known
        self.last_clipped: bool | None = None  # did the last finished step clip? (None: no step yet)
        self._held: set[str] = set()
        self._exec = ThreadPoolExecutor(1, thread_name_prefix="tierlm-optim")
        self._run: Future | None = None
        self._norm_at_hand_over = False
        # Shards whose accumulator this step has written, and the parameters a micro-batch has
        # handed over: a parameter some micro-batches give no gradient (a module the data skips)
        # accumulates only what arrives, as autograd's `.grad` does (begin_micro, end_micro)
        self._acc_written: set[tuple[str, int]] = set()
        self._arrived: set[str] = set()
        self._last_of_several = False
        self._pieces: dict[str, dict] = {}  # norms of pieces of a gradient final before the rest
        self._norms: dict[str, torch.Tensor] = {}
        self._sq: dict[str, torch.Tensor] = {}
        self._updated: set[str] = set()
        self._early_shards: dict[str, list[int]] = {}  # parameter -> shards handed over early (grad_ready)
        self._early_done: dict[str, set[int]] = {}    # ... and updated this step
        # The step's last pipeline leaves its writes landing (take_tail): the engine finishes them
        # with the commit while the next forward runs, which writes nothing.
        self.defer_writes = False
        self._tail: list[Future] = []

    @property
    def blocked_s(self) -> float:
        """Time backward waited in grad_ready for the optimizer to catch up."""
        return self.queue.blocked_s

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
            self.holding = self._hold_this_step()
            self._held.clear()
            self._norms.clear()
            self._pieces.clear()
            self._sq.clear()
            self._updated.clear()
            self._early_done.clear()
            self._skip = set()
            self._zero_acc = set()
            self._acc_written = set()
        self._arrived = set()
        self._last_of_several = n_micro > 1 and micro == n_micro - 1
        self.queue.open()
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
        if shards is not None:
            self._early_shards[name] = list(shards)
            name = name + EARLY
            # autograd holds this gradient until the embedding's arrives whatever we do (the
            # budget's `held`): it takes none of the gradients' share, or backward would stand
            # still behind it
            size = 0
        elif self._norm_at_hand_over:
            # recorded before the gradient is visible to the optimizer's thread, which takes the
            # norm itself where there is none
            self._norms[name] = grad_norm(grad, self._pieces.get(name))
        self._arrived.add(name)
        self.queue.put(name, grad, size, self._run)

    def end_micro(self) -> None:
        """Wait until every gradient of this micro-batch is consumed. Parameters that received no
        gradient (unused in the forward) are skipped, as torch skips grad-less parameters."""
        run, self._run = self._run, None
        if run is None:
            return
        if self._last_of_several:
            self._hand_over_accumulated(run)
        self.queue.close()
        try:
            run.result()
        finally:
            self.queue.clear()

    def _hand_over_accumulated(self, run: Future) -> None:
        """The last micro-batch gave no gradient to parameters that earlier ones did: torch's
        `.grad` holds what they accumulated and AdamW applies it, so they arrive now with a zero
        gradient (a broadcast scalar: no memory) that adds nothing to their accumulators."""
        accumulated = {n for n, _ in self._acc_written}
        for name in self.canonical:
            if name in accumulated and name not in self._arrived:
                zero = torch.zeros((), dtype=torch.float32).expand(self.infos[name].numel)
                self.queue.put(name, zero, 0, run)

    def commit(self, durable: bool = True) -> list[Future]:
        """The step's updates become the newest state; durable: the committed one (make_durable).
        Returns the writes in flight that the commit must wait for."""
        with self._slot_lock:
            for n in self._updated:
                self.steps[n] += 1
            self.dirty |= self._updated
            self._pending_new = set()
            self.experts.step_ended(True)
        self._updated.clear()
        self.cache.commit()
        return self.make_durable() if durable else []

    def make_durable(self) -> list[Future]:
        """Write the kept states the disk lacks into their newest slot, and name that slot the
        committed one. Returns the writes (the commit waits for them before its manifest)."""
        futs = []
        for name, k in sorted(self.cache.unwritten):
            bufs, n = self.cache.resident[(name, k)], self.infos[name].shards[k][1] - self.infos[name].shards[k][0]
            for tag in self.fmt.state_tags:
                kind = {"qm": "m", "qv": "v"}.get(tag, tag)
                futs.append(self.store.write(key(kind, name, k, self.write_slot(name, k)), self.fmt.view(bufs, tag, n)))
        self.cache.unwritten.clear()
        with self._slot_lock:
            for n in self.dirty:
                self.slots[n] = 1 - self.slots[n]
            self.dirty.clear()
            self.experts.made_durable(self.slots)
        return futs

    def mark_updated(self, name: str) -> None:
        """Data parallelism: another rank updated `name` and its new weights are in our new slot."""
        self._updated.add(name)

    def updated(self) -> set[str]:
        return set(self._updated)

    def discard(self) -> None:
        """Forget this step's speculative writes (a non-finite step): the old slot stays current,
        and the cached copies that held this step's values are dropped (the disk has the state)."""
        self._updated.clear()
        self.experts.step_ended(False)
        self.cache.discard()

    def drop_cache(self) -> None:
        """Hand the state cache's copies back (with nothing in flight: after settle()). Their
        states are on disk, since the writes never skip a cached shard; a later step reads them."""
        self.cache.drop()

    def close(self) -> None:
        self._exec.shutdown(wait=True)
        for f in self.take_tail():
            f.exception()

    def take_tail(self) -> list[Future]:
        """The writes of the step's last pipeline that may still be landing (the store orders any
        later read or write of the same file after them)."""
        tail, self._tail = self._tail, []
        return tail

    # ---- the worker ------------------------------------------------------------------
    def _hold_this_step(self) -> bool:
        """Hold the gradients until the norm is known (True) or update beside backward (False)."""
        if self.cfg.max_grad_norm is None or self.dist is not None:
            return False  # nothing to learn first; ranks decide the clip together (speculate)
        if not self.every_step:
            return True  # a step between commits rewrites its slot in place: nothing to redo from
        if self.clip_path != "auto":
            return self.clip_path == "hold"
        return self.last_clipped is not False

    def _consume(self, micro: int, n_micro: int) -> None:
        last = micro == n_micro - 1
        if last and self.holding:
            self._pipeline("hold", micro)
            return
        self._pipeline("update" if last else "accumulate", micro, defer=last and self.defer_writes)

    def _apply(self, coef: torch.Tensor | None, names: list[str]) -> None:
        """A held step's one update of `names`. Deferred, a failure fails the reads waiting for
        the weights it would have written."""
        try:
            self._pipeline("apply", 0, clip=coef, names=names, defer=self.defer_writes)
        except BaseException as e:
            self.store.cancel_reserved(e)
            if self.on_apply_failed is not None:
                self.on_apply_failed(e)
            raise

    def start_apply(self, coef: torch.Tensor | None) -> None:
        """A held step's update: now (waited for), or deferred beside the next forward, in the
        order that forward reads the blocks, each block's new weights promised to its reads."""
        if not self.defer_apply:
            names = [n for n in self.arrivals.last if n in self._held]
            self._exec.submit(self._apply, coef, names).result()
            return
        names = [n for n in reversed(self.arrivals.last) if n in self._held]
        kind = "w" if self.fmt.weight_dtype is not None else "master"
        with self._slot_lock:
            self._pending_new = set(names)
        if self.on_apply_start is not None:
            self.on_apply_start(names)  # before the first offer: the window's entries await them
        self.store.reserve([key(kind, n, k, self.write_slot(n, k)) for n in names
                            for k in range(len(self.infos[n].shards)) if (n, k) not in self._skip])
        self._apply_fut = self._exec.submit(self._apply, coef, names)

    @property
    def applying(self) -> bool:
        return self._apply_fut is not None

    def wait_apply(self) -> None:
        """Wait for a deferred update to end (raising what stopped it)."""
        fut, self._apply_fut = self._apply_fut, None
        if fut is not None:
            fut.result()

    def _redo(self, coef: torch.Tensor) -> None:
        self._pipeline("redo", 0, clip=coef, names=[n for n in self.arrivals.last if n in self._updated],
                       defer=self.defer_writes)

    def _shards_of(self, arrival: str) -> tuple[str, list[int]]:
        return shards_of(arrival, self.infos, self._early_shards)

    def _pipeline(self, mode: str, micro: int, clip=None, names: list[str] | None = None,
                  defer: bool = False) -> None:
        """One pass over the arrivals (the gradients as handed over, or `names` in a redo): mode
        update, accumulate (a micro-batch before the last) or redo (the clip's)."""
        order = names if names is not None else self.arrivals.predicted
        ahead = ReadAhead([(real, k) for n in order for real, ks in [self._shards_of(n)] for k in ks
                           if not self._left_alone(mode, real, k)],
                          self.lookahead, lambda n, k, blocking: self._prepared(n, k, mode, micro, blocking),
                          self.reader.abandon)
        writes: list[Future] = []  # in flight; a failure anywhere waits for all of them
        arrival: list[str] = []
        todo = deque(names) if names is not None else None
        ok = False
        try:
            while True:
                ahead.fill()
                name = (todo.popleft() if todo else None) if todo is not None else self.queue.next()
                if name is None:
                    break
                arrival.append(name)
                self._update_arrival(name, mode, micro, clip, ahead, writes)
            ok = True
        finally:
            ahead.close()
            if not (ok and defer):
                for f in writes:
                    f.exception()  # wait for every write before the step can end
        if defer:
            self._tail.extend(writes)
        for f in ([] if defer else writes):
            f.result()  # a failed write raises here, naming its file
        if mode in ("update", "apply") and self.state_cache is not None:
            seq = update_sequence(arrival, self.infos, self._early_shards)
            # a deferred update runs in the forward's order, which waits for its first blocks: keep those
            self.cache.prefer_last(seq[::-1] if mode == "apply" and self.defer_apply else seq, self.infos)
        if mode not in ("redo", "apply"):
            self.arrivals.learn(arrival)

    def _prepared(self, name: str, k: int, mode: str, micro: int, blocking: bool) -> ShardItem | None:
        a, b = self.infos[name].shards[k]
        it = ShardItem(name, k, a, b)
        # no earlier micro-batch of this step gave it a gradient: its accumulator is zero, not the
        # one an earlier step left in the store
        it.acc_zero = micro > 0 and mode in ("update", "accumulate", "hold") and (name, k) not in self._acc_written
        it.fresh = self.experts.is_fresh(name, k)
        if it.fresh and self.skip_ok and mode in ("update", "accumulate", "hold") \
                and (micro == 0 or (name, k) in self._zero_acc):
            it.lazy = True  # nothing read until its gradient shows whether it is left alone
            return it
        return it if self.reader.prepare(it, mode, micro, blocking) else None

    def _update_arrival(self, name: str, mode: str, micro: int, clip, ahead: ReadAhead,
                        writes: list[Future]) -> None:
        """Update (or accumulate) the shards of one arrival; `writes` (in flight) gets theirs."""
        real, ks = self._shards_to_update(name, mode, micro)
        alone = [k for k in ks if self._left_alone(mode, real, k)]
        if alone:
            ks = [k for k in ks if k not in alone]
            self._pass_over(real, alone, mode)
        if not ks:
            self.queue.done_with(name)
        for i, k in enumerate(ks):
            it = ahead.take((real, k))
            it.src, it.last = name, i == len(ks) - 1
            ahead.fill()  # per shard: a many-shard parameter's next states are read during this update
            if it.lazy and self._lazy(it, mode, micro, ahead):
                continue
            for f in it.reads:
                f.result()
            ws, written = self._process(it, mode, micro, clip)
            if it.keep:
                self.cache.stage((it.name, it.shard), {t: it.bufs.pop(t) for t in it.keep})
                it.keep = set()
            it.release_after(ws, written)
            for f in writes:
                if f.done():
                    f.result()  # a failed write raises now, naming its file
            writes[:] = [f for f in writes if not f.done()] + ws

    def _shards_to_update(self, name: str, mode: str, micro: int) -> tuple[str, list[int]]:
        """An arrival's shards still to update: an early arrival's, or the rest of a parameter
        (those handed over early were updated then)."""
        real, ks = self._shards_of(name)
        first_pass = mode in ("update", "hold")  # backward's pass over the gradients
        if real != name:
            self._early_done[real] = set(ks)
            if first_pass and micro == 0:
                self._early_pieces(real, ks)
            return real, ks
        skip = self._early_done.pop(real, set()) if first_pass else set()
        if first_pass and micro == 0 and name not in self._norms:
            # The whole gradient is here: the reduction clip_grad_norm_ runs on it (the same bits
            # as on a float copy, in pieces beyond grad_norm.CHUNK elements)
            self._norms[name] = grad_norm(self.queue.grads[name], self._pieces.get(name))
        return real, [k for k in ks if k not in skip]

    def _process(self, it: ShardItem, mode: str, micro: int, clip) -> tuple[list[Future], set[str]]:
        """The shard's update (or accumulation): its writes, and the buffers they read from."""
        fault("optimizer.write")
        t0 = time.perf_counter()
        g, raw = self._gradient(it, mode, micro, clip)
        if mode == "accumulate":
            writes, written = [self.store.write(key("gacc", it.name, it.shard), g)], {"g"}
            self._acc_written.add((it.name, it.shard))
        elif mode == "hold":
            writes, written = self._save_grad(it, mode, micro, g, raw)
            self._held.add(it.name)
        else:
            writes, written = self._save_grad(it, mode, micro, g, raw) if mode == "update" else ([], set())
            # between commits a shard the cache keeps is written by the commit, not by the step
            write_state = self.durable or not it.keep
            ws, wr, w = self.update.apply(it, g, self.steps[it.name], self.lr, self.write_slot(it.name, it.shard),
                                          write_state)
            self.experts.updated(it.name, it.shard)
            (self.cache.unwritten.discard if write_state else self.cache.unwritten.add)((it.name, it.shard))
            writes += ws
            written |= wr
            if self.on_new_weights is not None:
                self.on_new_weights(it.name, it.shard, w)
            self._updated.add(it.name)
        if self.on_event:
            self.on_event("optimizer", f"{it.name}.{it.shard}", t0, time.perf_counter(), it.b - it.a)
        return writes, written

    def _gradient(self, it: ShardItem, mode: str, micro: int, clip) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The shard's fp32 gradient, and on the first micro-batch its slice as handed over."""
        n = it.b - it.a
        if mode in ("redo", "apply"):
            saved = it.bufs["gl"].view(self.reader.saved_grad_dtype(it), (n,)) if "gl" in it.bufs else None
            return clipped_grad(it.bufs["g"].view(torch.float32, (n,)), saved, clip), None
        handed = self.queue.grads[it.src].reshape(-1)[it.a:it.b]
        if mode == "hold" and micro == 0:  # saved as handed over (a bf16 gradient as bf16)
            if it.last:
                self.queue.done_with(it.src)
            return handed, handed
        g = fp32_grad(handed, it, micro)
        if it.last:
            self.queue.done_with(it.src)
        return g, handed if micro == 0 else None

    def _save_grad(self, it: ShardItem, mode: str, micro: int, g: torch.Tensor,
                   raw: torch.Tensor | None) -> tuple[list[Future], set[str]]:
        """Before an update (or as a held step's first pass): an accumulated gradient's norm, and
        the gradient saved for a clip redo or the held step's update."""
        writes, written = [], set()
        if mode in ("update", "hold"):
            if micro > 0:
                self._record_norm(it, g)
            if self.cfg.max_grad_norm is not None:
                # A bf16 gradient is saved as bf16: its fp32 upcast is exact, so the redo gets the
                # same bits for half the bytes.
                src = raw if raw is not None else g
                writes.append(self.store.write(key("grad", it.name, it.shard), src))
                if raw is None:  # the accumulator buffer is what this write reads
                    written.add("g")
        return writes, written


__all__ = ["AdamWConfig", "OptimizerDeps", "OptimizerError", "OutOfCoreAdamW", "OutOfCoreOptions", "StepResult"]
