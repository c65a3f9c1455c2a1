"""The planner: placement per tier, each resource's time, the binding one, throughput and cost.

tierlm's pipeline runs every resource at once (layer i+1 loads while layer i computes while the
optimizer updates layer i-1), so a step takes as long as its busiest device, plus the pipeline's
fill and drain: one layer's worth of the other devices' work, (sum - max) / layers. Devices are
physical: the GPU (compute), the CPU (optimizer; and compute too when there is no GPU, since they
share the cores), DRAM, the PCIe link (per direction, full duplex) and the SSDs, which serve reads
and writes from the same flash: mixed traffic takes read time + write time.
"""
from __future__ import annotations

from dataclasses import asdict

from . import cost as C
from .catalog import Hardware
from .finetune_plan import finetune
from .records import HOST_RESERVE_BYTES, HOST_RESERVE_FRACTION, Plan, Task, usable_ram
from .serve_plan import serve
from .shapes import ModelShape

# Callers import the task, the plan and the RAM a task may use from here (advise/command.py by the
# RAM's old private name).
_usable_ram = usable_ram
__all__ = ["HOST_RESERVE_BYTES", "HOST_RESERVE_FRACTION", "Plan", "Task", "plan", "usable_ram", "_usable_ram"]


def _cost(hw: Hardware, tokens_per_s: float | None, lifetime_years: float, usd_per_kwh: float) -> dict:
    price = hw.parts_price()
    out = {"hardware_usd": price, "power_w": None if hw.measured else hw.power_w(),
           "lifetime_years": lifetime_years, "usd_per_kwh": usd_per_kwh, "usd_per_hour": None,
           "usd_per_million_tokens": None}
    if price is None:
        out["note"] = "no price for this machine: give one with price_usd under [this] in --catalog"
        return out
    power_kw = (hw.power_w() if hw.measured is None else 0.0) / 1000
    per_hour = price / (lifetime_years * 365 * 24) + power_kw * usd_per_kwh
    out["usd_per_hour"] = per_hour
    if tokens_per_s:
        out["usd_per_million_tokens"] = per_hour / (tokens_per_s * 3600 / 1e6)
    return out


def _assumptions(eff: C.Efficiency, hw: Hardware, lifetime_years: float, usd_per_kwh: float) -> list[str]:
    a = list(hw.notes)
    if hw.measured is None:
        a.append("rates: datasheet peaks x efficiency " + ", ".join(f"{k} {v}" for k, v in eff.to_json().items()))
        a.append(f"CPU optimizer: {C.ADAM_ELEMS_PER_CORE:.0e} AdamW elements/s per core (assumption)")
    else:
        a.append("rates: measured by `tierlm bench` on this machine (" + hw.measured.get("when", "?") + ")")
        if not hw.measured.get("overhead"):
            a.append("no decoder-layer rate or engine fixed costs in the measurements (cached by an older "
                     "`tierlm bench compute`): the large-GEMM rate is used and fixed costs are left out; run "
                     "`tierlm bench compute` again")
    a.append("overlap: step = busiest device + (sum of the others) / layers; SSD reads and writes share the drives")
    ov = (hw.measured or {}).get("overlap")
    if ov is not None and hw.gpu is None:
        a.append(f"CPU compute and SSD I/O share the cores: {ov:.0%} of the shorter is hidden (measured, "
                 f"bench/overlap.py)")
    a.append(f"cost: hardware over {lifetime_years:g} years at 100% use + TDP power at ${usd_per_kwh}/kWh")
    return a


def plan(shape: ModelShape, hw: Hardware, task: Task, eff: C.Efficiency | None = None,
         lifetime_years: float = 3.0, usd_per_kwh: float = 0.15) -> Plan:
    eff = eff or C.Efficiency()
    task.validate()
    if task.precision == "auto":
        # catalog parts all multiply bf16 natively; finetune computes in what `--precision auto` reads
        # from this CPU's ISA flags; generate/serve hold bf16 weights whatever the CPU (their --weights default)
        task.precision = (hw.measured or {}).get("precision", "bf16") if task.kind == "finetune" else "bf16"
    r = C.rates(hw, eff, task.precision)
    p = Plan(model=shape.to_json(), hardware={"spec": hw.spec, "describe": hw.describe(), "rates": r.to_json()},
             task=asdict(task), fits=True, problems=[],
             assumptions=_assumptions(eff, hw, lifetime_years, usd_per_kwh))
    (finetune if task.kind == "finetune" else serve)(p, shape, hw, task, r)
    p.cost = _cost(hw, p.tokens_per_s if p.fits else None, lifetime_years, usd_per_kwh)
    return p
