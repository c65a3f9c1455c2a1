"""Every automatic choice of a fine-tuning run, with its reason, in one frozen record made before the
engine exists: `resolve_train(config, measured, model, committed) -> TrainSettings`.

The recipe (`tierlm finetune`, `tierlm bench train`) reads what `tierlm bench` measured of this
machine (`tierlm.bench.rates`) and hands it in as data; the engine executes the record and reads no
cache or environment of its own. The run prints the record at its start and keeps it in the run
directory (`settings.json`), so what a run chose, and why, is there to read afterwards.

The choices made here are timings' to tune only where they cannot change bits (the I/O depth, the
read-ahead; the shard size only with one micro-batch a step: `plan.io.shard_size`).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from . import io
from .budget import moment_bytes_per_param
from .activations import Rates


@dataclass(frozen=True)
class Choice:
    value: Any
    why: str


@dataclass(frozen=True)
class Measured:
    """What `tierlm bench` measured of this machine, as data. io: `bench io` of the file system the
    run writes to; compute: `bench compute`; activation_rates: the drive and memory rates the
    activation planner plans with, where they were measured already; probe: measures them when
    the planner first needs them (after step 1), where they were not."""
    io: dict | None = None
    compute: dict | None = None
    activation_rates: Rates | None = None
    probe: Callable[[], Rates] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ModelFacts:
    """What the choices need of the model: its largest decoder layer's parameters and its width."""
    layer_params: int
    hidden: int


@dataclass(frozen=True)
class TrainSettings:
    precision: Choice
    device: Choice
    shard_elems: Choice
    io_threads: Choice
    prefetch: Choice
    activations: Choice
    measured: Measured = field(default_factory=Measured, compare=False, repr=False)

    def to_dict(self) -> dict:
        out = {k: {"value": v.value, "why": v.why} for k, v in self.__dict__.items() if isinstance(v, Choice)}
        rates = self.measured.activation_rates
        out["activation_rates"] = asdict(rates) if rates is not None else (
            "measured after step 1" if self.measured.probe is not None else "defaults")
        return out

    def lines(self) -> list[str]:
        return [f"{k}: {v.value} ({v.why})" for k, v in self.__dict__.items() if isinstance(v, Choice)]


def weight_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def resolve_train(cfg, measured: Measured, model: ModelFacts, committed: int | None = None) -> TrainSettings:
    """cfg: the engine's options (`tierlm.engine.EngineConfig`, already validated: precision and
    device resolved); committed: the shard size of the committed state a resumed run continues
    from, or None."""
    shard = io.shard_size(cfg.shard_elems, measured.io, cfg.cpu_mem, committed, cfg.grad_accum)
    depth = io.io_depth(cfg.io_threads, measured.io)
    w = weight_bytes(cfg.precision)
    state = 4 + moment_bytes_per_param(cfg.optim_states)  # master, m and v
    # a step reads the weights once a micro-batch and the state once; writes the state and the
    # new bf16 weights (fp32 runs compute on the master itself)
    traffic = (w * cfg.grad_accum + state, state + (w if w != 4 else 0))
    ahead = io.read_ahead(cfg.prefetch, measured.io, measured.compute, io.LayerWork(
        model.layer_params, w, traffic, cfg.tokens_per_micro_batch, cfg.grad_accum, cfg.precision, model.hidden,
        cfg.device.startswith("cuda")))
    acts = cfg.activations
    acts_why = ("planned per layer from the profiled step and the measured rates" if acts == "auto" else "set")
    precision_why = getattr(cfg, "precision_why", "") or f"--precision {cfg.precision}"
    device_why = getattr(cfg, "device_why", "") or f"--device {cfg.device}"
    return TrainSettings(precision=Choice(cfg.precision, precision_why), device=Choice(cfg.device, device_why),
                         shard_elems=Choice(*shard), io_threads=Choice(*depth), prefetch=Choice(*ahead),
                         activations=Choice(acts, acts_why), measured=measured)
