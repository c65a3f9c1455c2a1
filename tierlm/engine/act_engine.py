"""The engine's side of activation policies: which layer keeps, swaps or recomputes, the profile
that the planner is fed with, and plan.json with the predicted and measured times side by side.

With `--activations auto` the first step runs a plan made from estimates (activation bytes from
the layer's shapes, FLOPs at the measured matmul rate); every step is profiled (per layer: forward
and backward time, saved bytes; per phase: SSD bytes of weights and optimizer; time outside the
layers), and the planner re-plans from the measurements after step 1, then after every step until
two consecutive steps agree (step 1 pays for first-touch page faults and kernel set-up and is left
out; one step slowed by another process must not fix the plan: `plan.activations.settle`).
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
import time
from pathlib import Path

from ..hf.fields import head_dim as head_dim_of, widest
from ..storage import BudgetError, HostBufferPool, TensorStore
from ..units import fmt_bytes
from ..plan import activations as P
from ..plan import budget as B
from .activations import ActivationSwapper
from .copy_stream import make_copy_stream
from .link_probe import measure_link

def _say(msg: str) -> None:
    print(f"tierlm: {msg}", file=sys.stderr, flush=True)


class ActivationPlanner:
    def __init__(self, engine, on_event):
        self.eng = engine
        cfg = engine.cfg
        self.layers = [b for b in engine.blocks if b.kind == "layer"]
        n = len(self.layers)
        pols = cfg.activations.split(",")
        self.auto = pols == ["auto"]
        if not self.auto and len(pols) not in (1, n):
            raise ValueError(f"--activations lists {len(pols)} policies for the {n} decoder layers of this model; "
                             f"give one policy, or exactly {n} separated by commas")
        fixed = pols * n if len(pols) == 1 else pols
        self.policies = {b.index: ("keep" if self.auto else p) for b, p in zip(self.layers, fixed)}
        self.est = B.layer_activation_bytes(engine.config, cfg.tokens_per_micro_batch, engine.dtype)
        # kept activations live in the compute memory: host RAM, or the GPU's when one computes
        self.allowance = engine.act_allowance
        self.host_allowance = engine.split.activations  # the swap pool is host RAM either way
        self.on_gpu = engine.on_gpu
        # pinned with a GPU: the swap copies cross its host link at the pinned rate the planner prices
        self.pool = HostBufferPool(0, pin=self.on_gpu, name="activation swap buffers")
        lane = {"ssd_read": "act_read", "ssd_write": "act_write"}
        self.store = TensorStore(engine.root / "act", self.pool, io_threads=2, direct_io=cfg.direct_io,
                                 on_event=lambda ln, *a: on_event(lane.get(ln, ln), *a))
        # a GPU's copy out of its memory is the device-to-host lane of the timeline
        copy_lane = "d2h" if self.on_gpu else "act_copy"
        # with a GPU the swap copies run on a side stream, overlapped with the layers' compute
        self.swapper = ActivationSwapper(self.pool, self.store,
                                         lambda ln, *a: on_event(copy_lane if ln == "act_copy" else ln, *a),
                                         stream=make_copy_stream(engine.device))
        self.plan: P.Plan | None = None
        self.plan_step = 0
        self.rates: P.Rates | None = None
        # seconds of one-off measurement (the drive probe) inside commits: no step's time (finetune)
        self.measure_s = 0.0
        self.profile: list[P.LayerProfile] = []
        self.profiled: list[list[P.LayerProfile]] = []  # steps 2, 3, ... until the profile settles
        self.settled = False
        self.history: list[dict] = []
        self.steps_done = 0
        if self.auto:
            self._apply(self._initial_plan())
        else:
            # The user chose the policies; the pool still comes out of the activation allowance
            # (what does not fit in the host tier goes down to NVMe).
            n_host = sum(p == "swap-host" for p in fixed)
            want = n_host * self.est + (self._swap_pool() if "swap" in fixed else 0)
            self.pool.capacity = min(want, self.host_allowance)
        self._reset_step()

    # ---- sizes -------------------------------------------------------------------------

    def _measure_rates(self) -> P.Rates:
        """The drive and memory rates to plan with: what the recipe handed in, else its probe's
        measurement (run now, once: the first step that plans), else printed defaults."""
        m = self.eng.settings.measured
        if m.activation_rates is not None:
            return self._with_link(m.activation_rates)
        if m.probe is not None:
            return self._with_link(m.probe())
        rates = self._with_link(P.default_rates("nothing measured them"))
        _say(f"activation planner: planning with default rates ({P.describe(rates)}); "
             f"`tierlm bench io --nvme DIR` measures them")
        return rates

    def _with_link(self, rates: P.Rates) -> P.Rates:
        """With a GPU: the rates and its host link, measured now with pinned copies of one layer's
        activation size (at most 64 MiB: past that the rate no longer grows)."""
        if not self.on_gpu or (rates.d2h and rates.h2d):
            return rates
        d2h, h2d = measure_link(self.eng.device, min(max(self.est, 1 << 20), 64 << 20))
        return replace(rates, d2h=d2h, h2d=h2d)

    def _give_back(self, used: int) -> None:
        """With a GPU, the host room for swapping (budget_plan._swap_room, taken from the optimizer
        state cache) that the plan leaves unused goes back to the cache: a run that keeps and
        recomputes only lends it for the steps before its plan."""
        cache = self.eng.cache_pool
        spare = self.host_allowance - used
        if cache is None or spare <= 0:
            return
        cache.capacity += spare
        self.host_allowance = used

    def _swap_pool(self) -> int:
        """Staging for one layer's storages in flight plus one layer read ahead."""
        return 2 * self.est

    def _auto_pool(self) -> int:
        """The pool the planner may reserve from the allowance; 0 (no swapping) when it cannot
        hold one layer: storages that do not fit are written straight from their tensors, which
        then outlive the layer beyond the budget. With a GPU the pool is host RAM, beside the GPU
        memory that kept activations hold."""
        pool = min(self._swap_pool(), self.host_allowance if self.on_gpu else self.allowance)
        return pool if pool >= self.est else 0

    def layer_flops(self) -> float:
        """Forward FLOPs of one decoder layer for a micro-batch: its matmuls (2 per weight per
        token) and causal attention (QK^T and AV over half the square, per sequence)."""
        cfgm = self.eng.config
        tokens = self.eng.cfg.tokens_per_micro_batch
        seq = tokens // max(self.eng.cfg.micro_batch_size, 1)
        per_layer = sum(self.eng.infos[n].numel for n in self.layers[0].owns)
        heads = widest(cfgm, "heads", 0)  # the layer with the most (none: Mamba, which attends not)
        attention = 2 * tokens * seq * heads * head_dim_of(cfgm) if heads else 0  # (the widest layer's head)
        return 2 * per_layer * tokens + attention

    def _initial_plan(self) -> P.Plan:
        flops = self.layer_flops()
        rate = 0.5e12  # replaced by the measured profile after the first step
        layers = [P.LayerProfile(b.index, flops / rate, 2 * flops / rate, self.est) for b in self.layers]
        rates = P.Rates(*P.DEFAULT_RATES, "an estimate until the first step is profiled")
        # with a GPU, the first step keeps or recomputes: its host link is measured after it
        pool = 0 if self.on_gpu else self._auto_pool()
        plan = P.choose(layers, self.allowance, pool, rates, P.Base(), can_swap=pool > 0)
        plan.reason = "from estimates: " + plan.reason
        return plan

    def _apply(self, plan: P.Plan) -> None:
        self.plan = plan
        self.policies = dict(plan.policies)
        self.pool.capacity = plan.pool

    # ---- per step ----------------------------------------------------------------------
    def _reset_step(self) -> None:
        self.cur: dict[int, dict] = {b.index: {"fwd": 0.0, "bwd": 0.0, "act": 0} for b in self.layers}
        self.wait_s = 0.0
        self.kept = 0
        self.phase_bytes = {"read_fwd": 0, "write_fwd": 0, "read_bwd": 0, "write_bwd": 0}
        self._mark = self.eng.store.stats.snapshot()
        self._phase = "fwd"
        self.t_step = None
        self.fwd_s = self.bwd_s = 0.0
        self.swapper.reset_stats()

    def _account_io(self) -> None:
        snap = self.eng.store.stats.snapshot()
        self.phase_bytes[f"read_{self._phase}"] += snap["bytes_read"] - self._mark["bytes_read"]
        self.phase_bytes[f"write_{self._phase}"] += snap["bytes_written"] - self._mark["bytes_written"]
        self._mark = snap

    def micro_begin(self) -> None:
        self.kept = 0
        now = time.perf_counter()
        if self.t_step is None:
            self.t_step = now
        self._account_io()
        self._phase = "fwd"
        self._t_phase = now

    def backward_phase(self) -> None:
        now = time.perf_counter()
        self.fwd_s += now - self._t_phase
        self._account_io()
        self._phase = "bwd"
        self._t_phase = now

    def backward_done(self) -> None:
        self.bwd_s += time.perf_counter() - self._t_phase

    def waited(self, s: float) -> None:
        self.wait_s += s

    def policy_for(self, blk) -> str:
        pol = self.policies[blk.index]
        if self.auto and pol == "keep":
            # The plan's bytes were measured (or estimated); the allowance is a promise: a layer
            # that would overrun it swaps (or recomputes) instead.
            size = self.cur[blk.index]["act"] or max((p.act_bytes for p in self.profile), default=self.est)
            # the pool is host RAM with a GPU, the same memory as kept activations without one
            if self.kept + size > self.allowance - (0 if self.on_gpu else self.pool.capacity):
                pol = "swap" if self.pool.capacity > 0 else "recompute"
            else:
                self.kept += size
        self.cur[blk.index]["pol"] = pol
        self._calling = blk.index
        return pol

    def forward_begin(self, blk) -> None:
        # Only the training forward that policy_for just routed (an inference forward through the
        # same layer keeps nothing for backward).
        calling, self._calling = getattr(self, "_calling", None), None
        pol = self.cur[blk.index].get("pol") if calling == blk.index else None
        if pol in ("swap", "swap-host"):
            self.swapper.begin_forward(blk.index, "nvme" if pol == "swap" else "host")

    def forward_end(self, blk, dt: float, saved: int) -> None:
        if self.swapper.active:
            self.swapper.end_forward()
        rec = self.cur.get(blk.index)
        if rec is None or "pol" not in rec:
            return  # inference, not a training forward
        rec["fwd"] += dt - self.swapper.take_spent(blk.index)
        if rec["pol"] != "recompute":
            rec["act"] = max(rec["act"], saved)

    def backward_begin(self, blk) -> None:
        self.swapper.prefetch(blk.index)
        for j in range(blk.index - 1, blk.index - 1 - self.eng.prefetch, -1):
            if j in self.cur:
                self.swapper.prefetch(j)
        # back to the GPU on the side stream: this layer's (if not already) and, one layer ahead,
        # the next one's, which then crosses the link while this one computes
        self.swapper.upload(blk.index)
        self.swapper.upload(blk.index - 1)

    def backward_end(self, blk, dt: float, saved: int) -> None:
        rec = self.cur[blk.index]
        dt -= self.swapper.take_spent(blk.index)
        self.swapper.end_backward(blk.index)
        if rec.get("pol") == "recompute":
            rec["act"] = max(rec["act"], saved)
            rec["rec"] = rec.get("rec", 0.0) + dt
        else:
            rec["bwd"] += dt

    def step_done(self) -> None:
        """After commit: profile the step, re-plan when it is time, log measured beside predicted."""
        now = time.perf_counter()
        self._account_io()
        self.steps_done += 1
        layers = []
        for b in self.layers:
            r = self.cur[b.index]
            bwd = r["bwd"] + max(r.get("rec", 0.0) - r["fwd"], 0.0) if r.get("pol") == "recompute" else r["bwd"]
            layers.append(P.LayerProfile(b.index, r["fwd"], bwd, r["act"]))
        compute = sum(r["fwd"] + r["bwd"] + r.get("rec", 0.0) for r in self.cur.values())
        step_s = now - (self.t_step or now)
        spent = self.swapper.spent_total()
        fixed = max(step_s - compute - self.wait_s - spent, 0.0)
        base = P.Base(self.phase_bytes["read_fwd"], self.phase_bytes["write_fwd"],
                      self.phase_bytes["read_bwd"], self.phase_bytes["write_bwd"], fixed)
        measured = {"step": self.eng.state["step"], "step_s": step_s, "forward_s": self.fwd_s,
                    "backward_s": self.bwd_s, "layer_compute_s": compute, "waits_s": self.wait_s,
                    "swap_io_wait_s": spent, "fixed_s": fixed,
                    "policies": {b.name: self.cur[b.index].get("pol") for b in self.layers},
                    "swapped_bytes": dict(self.swapper.bytes_out), **self.phase_bytes}
        self.history.append(measured)
        if not self.settled and all(p.fwd_s > 0 for p in layers):
            if self.steps_done > 1:
                self.profiled.append(layers)
                layers, self.settled = P.settle(self.profiled)
            self.profile, self.base = layers, base
            if self.rates is None:
                t = time.perf_counter()
                self.rates = self._measure_rates()
                took = time.perf_counter() - t
                self.measure_s += took
                if getattr(self.eng, "commits", None) is not None:
                    self.eng.commits.measured_rates(self.rates, took)  # before the interval is picked
            if self.auto:
                pool = self._auto_pool()
                if self.on_gpu:
                    plan = P.choose_gpu(layers, self.allowance, self.host_allowance, pool, self.rates, base)
                    self._give_back(plan.pool)
                else:
                    plan = P.choose(layers, self.allowance, pool, self.rates, base, can_swap=pool > 0)
                self._apply(plan)
            else:
                used = {b.index: self.cur[b.index].get("pol") for b in self.layers}
                self.plan = P.Plan(used, P.predict(layers, used, self.rates, base), self.allowance,
                                   self.pool.capacity, f"--activations {self.eng.cfg.activations}")
            self.plan_step = self.eng.state["step"]
        self._write()
        self._reset_step()

    # ---- plan.json ---------------------------------------------------------------------
    def _write(self) -> None:
        path = Path(self.eng.cfg.plan_path) if self.eng.cfg.plan_path else self.eng.root / "plan.json"
        after = [h for h in self.history if h["step"] > self.plan_step] if self.plan else []
        names = {b.index: b.name for b in self.layers}
        doc = {
            "activations": self.eng.cfg.activations,
            "budget": {"allowance_bytes": self.allowance, "allowance": fmt_bytes(self.allowance),
                       "swap_pool_bytes": self.pool.capacity},
            "plan": None if self.plan is None else {
                "made_after_step": self.plan_step, "reason": self.plan.reason,
                "layers": {names[i]: p for i, p in self.plan.policies.items()},
                "predicted": self.plan.predicted},
            "rates": None if self.rates is None else vars(self.rates),
            # steps after the first that the profile was taken from, and whether it is final
            "profiled_steps": len(self.profiled), "profile_settled": self.settled,
            "profile": [dict(vars(p), name=names[p.index], fwd_flops=self.layer_flops(),
                             fwd_tflops=self.layer_flops() / p.fwd_s / 1e12 if p.fwd_s else None,
                             bwd_tflops=2 * self.layer_flops() / p.bwd_s / 1e12 if p.bwd_s else None)
                        for p in self.profile],
            "base": None if not self.profile else vars(self.base),
            "measured_since_plan": _mean(after),
            "steps": self.history[-50:],
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
        tmp.replace(path)

    def describe(self) -> str:
        if self.plan is None:
            return f"activations: {self.eng.cfg.activations}"
        return f"activations: {self.plan.reason}"

    def close(self) -> None:
        self.swapper.close()
        self.store.close()


def _mean(rows: list[dict]) -> dict | None:
    if not rows:
        return None
    keys = ("step_s", "forward_s", "backward_s", "layer_compute_s", "waits_s", "swap_io_wait_s", "fixed_s")
    return {k: sum(r[k] for r in rows) / len(rows) for k in keys} | {"steps": len(rows)}


__all__ = ["ActivationPlanner", "BudgetError"]
