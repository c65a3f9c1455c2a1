"""The allowed range of every numeric option, and the check that refuses the rest (exit 2).

torch.optim refuses an lr, a beta or an eps outside its range when the optimizer is built; a NaN
that passes `lr < 0` (every comparison with NaN is false) trains a model of NaNs. Here every number
a verb takes is checked once, when the options are read, before anything is written: every verb's
options are a typed config whose RANGES are one of the tables below, checked as the config is built
(flags, `--config` files and `tierlm.finetune()` alike, tierlm/config.py).

This module imports no torch: the checks must answer in the time `tierlm --help` does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .units import parse_bytes

# torch.manual_seed and torch.Generator.manual_seed accept exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _fmt(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Num:
    """A finite number (float) or an integer (int) in a range; bounds are optional and inclusive
    (ge, le) or exclusive (gt, lt). `note` says what a special value means ("0 disables")."""
    kind: type = float
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    note: str = ""
    shown: str = ""  # the range as words, where the bounds print badly (seeds)

    def describe(self) -> str:
        what = "an integer" if self.kind is int else "a finite number"
        if self.shown:
            rng = self.shown
        else:
            lo = (f"{'(' if self.gt is not None else '['}{_fmt(self.gt if self.gt is not None else self.ge)}"
                  if self.gt is not None or self.ge is not None else None)
            hi = (f"{_fmt(self.lt if self.lt is not None else self.le)}{')' if self.lt is not None else ']'}"
                  if self.lt is not None or self.le is not None else None)
            if lo and hi:
                rng = f"in {lo}, {hi}"
            elif lo:
                rng = f"{'>' if self.gt is not None else '>='} {lo[1:]}"
            elif hi:
                rng = f"{'<' if self.lt is not None else '<='} {hi[:-1]}"
            else:
                rng = ""
        return f"{what} {rng}".rstrip() + (f" ({self.note})" if self.note else "")

    def ok(self, v) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return False
        if self.kind is int and not isinstance(v, int):
            return False
        if isinstance(v, float) and not math.isfinite(v):
            return False
        return ((self.gt is None or v > self.gt) and (self.ge is None or v >= self.ge)
                and (self.lt is None or v < self.lt) and (self.le is None or v <= self.le))

    def check(self, value, name: str):
        """`value` unchanged where it is in range, else ValueError naming `name`, the range and the value."""
        if value is None or self.ok(value):
            return value
        raise ValueError(f"{name} must be {self.describe()}; got {_fmt(value)}")


@dataclass(frozen=True)
class Size:
    """A memory size like '4GiB' (tierlm.units.parse_bytes), more than `gt` bytes."""
    gt: int = 0

    def describe(self) -> str:
        return f"a size > {self.gt} bytes, like '4GiB' or '512MiB'"

    def check(self, value, name: str):
        if value is None:
            return value
        n = parse_bytes(value, name)  # its own error names `name` and the form
        if n <= self.gt:
            raise ValueError(f"{name} must be {self.describe()}; got {value!r}")
        return value


def int_range(ge=None, le=None, note="", **kw) -> Num:
    return Num(int, ge=ge, le=le, note=note, **kw)


SEED = Num(int, ge=SEED_MIN, le=SEED_MAX, shown="in [-2**63, 2**64 - 1] (torch.manual_seed's range)")
POSITIVE_INT = int_range(ge=1)
COUNT = int_range(ge=0)
MEM = Size()

# finetune's options (FinetuneConfig.RANGES): torch.optim.AdamW's own checks, made strict where its
# range admits a run that cannot train (lr 0 leaves every weight as it was; eps 0 divides 0 by 0 where
# a gradient is 0) and finite everywhere (NaN passes torch's `0.0 <= lr`).
FINETUNE: dict[str, Num | Size] = {
    "cpu_mem": MEM,
    "gpu_mem": MEM,
    "seq_len": POSITIVE_INT,
    "batch_size": POSITIVE_INT,
    "grad_accum": POSITIVE_INT,
    # >= 1 on a new run and a resumed one; a resumed run whose steps are all done re-saves final/
    "steps": POSITIVE_INT,
    "epochs": Num(gt=0),
    "lr": Num(gt=0),
    "warmup_steps": COUNT,
    "weight_decay": Num(ge=0),
    "beta1": Num(ge=0, lt=1),
    "beta2": Num(ge=0, lt=1),
    "eps": Num(gt=0),
    "max_grad_norm": Num(ge=0, note="0 disables clipping"),
    "prefetch": COUNT,
    "seed": SEED,
    "sample_tokens": POSITIVE_INT,
    "sample_temperature": Num(ge=0, le=100, note="0 is greedy"),
    "timeline_step": int_range(ge=0, note="0 disables"),
    "save_every": int_range(ge=0, note="0 disables"),
    "max_restarts": COUNT,
    "max_bad_steps": POSITIVE_INT,
    "nproc": POSITIVE_INT,
    "dist_timeout": Num(gt=0),
    "grad_bucket": MEM,
}

# generate's, chat's and serve's options: their configs' RANGES (tierlm/serve/options.py)
_ENGINE = {
    "cpu_mem": MEM,
    "gpu_mem": MEM,
    "max_seq_len": POSITIVE_INT,
    "step_tokens": POSITIVE_INT,
    "prefetch": COUNT,
    "resident_layers": int_range(ge=0, note="0 streams every layer"),
    "tp": POSITIVE_INT,
    "threads": POSITIVE_INT,
}
_SAMPLING = {  # the ranges SamplingParams.check enforces
    "max_new_tokens": POSITIVE_INT,
    "temperature": Num(ge=0, le=100, note="0 is greedy"),
    "top_p": Num(gt=0, le=1),
    "top_k": int_range(ge=0, note="0 turns it off"),
    "seed": SEED,
}
GENERATE: dict[str, Num | Size] = _ENGINE | _SAMPLING | {"batch": POSITIVE_INT}
CHAT: dict[str, Num | Size] = _ENGINE | _SAMPLING
SERVE: dict[str, Num | Size] = _ENGINE | {"max_batch": POSITIVE_INT, "port": int_range(ge=1, le=65535)}

# init's, demo's, plan's and bench's options: their configs' RANGES (tierlm/hf/init_options.py,
# tierlm/demo.py, tierlm/advise/options.py)
INIT: dict[str, Num | Size] = {name: POSITIVE_INT for name in (
    "layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions")} | {"seed": SEED}
DEMO: dict[str, Num | Size] = {"cpu_mem": MEM, "steps": POSITIVE_INT}
PLAN: dict[str, Num | Size] = {"batch": POSITIVE_INT, "seq_len": POSITIVE_INT, "tokens": POSITIVE_INT, "cpu_mem": MEM,
                               "gpu_mem": MEM}
BENCH: dict[str, Num | Size] = {"steps": POSITIVE_INT, "size": MEM, "cpu_mem": MEM}
