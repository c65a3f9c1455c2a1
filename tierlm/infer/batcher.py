"""Continuous batching: requests join and leave the running batch between forward steps.

Each step is one engine forward over every active sequence: a new one feeds a chunk of its
prompt (prefill, at most `step_tokens` tokens in the step), a running one its last token. A
finished sequence frees its KV slot at once and a waiting request takes it on the next step, so
the batch stays full while there is work. The same loop serves `tierlm generate` (run until
done, in the caller's thread) and the server (a background thread).
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from ..hf.tokenizer import eos_ids_of
from ..storage import BudgetError
from .sampling import SamplingParams, TextStream, choose, make_generator

_ids = itertools.count(1)


@dataclass
class Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_text: object = None           # callable(delta: str), from the engine thread
    on_done: object = None           # callable(request), from the engine thread
    id: int = field(default_factory=lambda: next(_ids))
    out_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    cancelled: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None
    # engine-thread state
    fed: int = 0                     # positions in the KV slot
    stream: TextStream | None = None
    gen: object = None

    @property
    def text(self) -> str:
        return self.stream.text if self.stream else ""


class PhaseStats:
    """Time and bytes of prefill and decode steps, for TTFT / tokens/s / GB/s reports."""

    def __init__(self):
        self.s = {"prefill": 0.0, "decode": 0.0}
        self.tokens = {"prefill": 0, "decode": 0}
        self.steps = {"prefill": 0, "decode": 0}
        self.ram = {"prefill": 0, "decode": 0}
        self.ssd = {"prefill": 0, "decode": 0}
        self.kv = {"prefill": 0, "decode": 0}

    def add(self, phase, dt, tokens, ram, ssd, kv):
        self.s[phase] += dt
        self.tokens[phase] += tokens
        self.steps[phase] += 1
        self.ram[phase] += ram
        self.ssd[phase] += ssd
        self.kv[phase] += kv


class Batcher:
    def __init__(self, engine, tokenizer, eos_ids: list[int]):
        self.engine, self.tok, self.eos_ids = engine, tokenizer, list(eos_ids)
        self.slots = engine.cfg.max_batch
        self.step_tokens = engine.cfg.step_tokens
        # a model whose recurrent layers cannot continue a prompt from their kept state (Mamba's
        # restart from zero) takes each prompt in one step (engine.whole_prompts)
        self.whole_prompts = getattr(engine, "whole_prompts", False)
        self.waiting: deque[Request] = deque()
        self.active: list[Request] = []   # active[b] is in KV slot b
        self.cv = threading.Condition()
        self.stats = PhaseStats()
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---- submitting -------------------------------------------------------------------
    def submit(self, req: Request) -> Request:
        """Queue a request; refuses (BudgetError) one that cannot fit a KV slot."""
        req.params.check()
        if not req.prompt_ids:
            raise ValueError("the prompt is empty; give at least one token of text")
        if self.whole_prompts and len(req.prompt_ids) > self.step_tokens:
            raise BudgetError(
                f"a prompt of {len(req.prompt_ids)} tokens: {self.engine.config.model_type}'s layers cannot "
                f"continue a prompt fed in chunks (the load-time check found it), so a prompt is one step, and steps were planned for "
                f"{self.step_tokens} tokens (--step-tokens); raise --step-tokens to {len(req.prompt_ids)} "
                f"(more compute memory inside --cpu-mem) or shorten the prompt")
        self.engine.cache.check_fits(len(req.prompt_ids) + req.params.max_tokens,
                                     f"a prompt of {len(req.prompt_ids)} tokens with max_tokens "
                                     f"{req.params.max_tokens}")
        req.stream = TextStream(self.tok, req.params.stop)
        req.gen = make_generator(req.params.seed)
        with self.cv:
            self.waiting.append(req)
            self.cv.notify_all()
        return req

    # ---- the loop ---------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.active or self.waiting)

    def run_until_idle(self) -> None:
        while self.busy():
            self.step()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="tierlm-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self.cv:
            self._stop = True
            self.cv.notify_all()
        if self._thread:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self._stop and not self.busy():
                    self.cv.wait(timeout=1.0)
                if self._stop:
                    return
            self.step()

    def step(self) -> None:
        with self.cv:
            while self.waiting and len(self.active) < self.slots:
                self.active.append(self.waiting.popleft())
        for r in [r for r in self.active if r.cancelled]:
            self._finish(r, "cancelled")
        if not self.active:
            return
        rows = self.active
        prefilling = [r for r in rows if r.fed < len(r.prompt_ids)]
        share = max(1, self.step_tokens // max(len(prefilling), 1))
        tokens, starts = [], []
        for r in rows:
            if r.fed < len(r.prompt_ids):
                tokens.append(r.prompt_ids[r.fed:] if self.whole_prompts else r.prompt_ids[r.fed: r.fed + share])
            else:
                tokens.append([r.out_ids[-1]])
            starts.append(r.fed)
        eng = self.engine
        ssd0, kv0, routed0 = eng.ssd_bytes_read(), eng.cache.bytes_read, eng.routed_expert_bytes()
        t0 = time.perf_counter()
        try:
            logits = eng.step(tokens, starts)
        except Exception as e:  # a failed read or kernel fails these requests, not the server
            for r in list(rows):
                r.error = f"{type(e).__name__}: {e}"
                self._finish(r, "error")
            return
        dt = time.perf_counter() - t0
        phase = "prefill" if prefilling else "decode"
        self.stats.add(phase, dt, sum(map(len, tokens)), eng.ram_weight_bytes() + eng.routed_expert_bytes() - routed0,
                       eng.ssd_bytes_read() - ssd0, eng.cache.bytes_read - kv0)
        now = time.perf_counter()
        done = []
        for b, r in enumerate(rows):
            r.fed += len(tokens[b])
            if r.fed < len(r.prompt_ids):
                continue
            nxt = choose(logits[b], r.params, r.gen)
            r.out_ids.append(nxt)
            if r.t_first is None:
                r.t_first = now
            reason = None
            if nxt in self.eos_ids and not r.params.ignore_eos or nxt in r.params.stop_token_ids:
                r.out_ids.pop()
                reason = "stop"
            elif len(r.out_ids) >= r.params.max_tokens:
                reason = "length"
            delta = r.stream.update(r.out_ids, final=reason is not None)
            if r.stream.stopped:
                reason = "stop"
            if delta and r.on_text:
                r.on_text(delta)
            if reason:
                done.append((r, reason))
        for r, reason in done:
            self._finish(r, reason)

    def _finish(self, r: Request, reason: str) -> None:
        i = self.active.index(r)
        last = len(self.active) - 1
        if i != last:  # keep the slots in use compact: the last sequence moves into the freed one
            moved = self.active[last]
            self.engine.move_slot(last, i, moved.fed)
            self.active[i] = moved
        self.active.pop()
        r.finish_reason = reason
        r.t_done = time.perf_counter()
        if r.on_done:
            r.on_done(r)


__all__ = ["Batcher", "Request", "SamplingParams", "BudgetError", "eos_ids_of"]
