"""Plans as text, JSON and a throughput-vs-cost chart."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..plan import gpu_serve
from ..plan.planner import Plan
from ..units import fmt_bytes


def _t(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.1f} ms"


def _usd(x: float | None) -> str:
    return "n/a" if x is None else (f"${x:,.0f}" if x >= 100 else f"${x:.3g}")


def text(p: Plan) -> str:
    m, t = p.model, p.task
    moe = m.get("moe")
    size = (f"{m['params'] / 1e9:,.2f}B parameters, {moe['active_params'] / 1e9:,.2f}B active a token" if moe
            else f"{m['params'] / 1e9:,.2f}B parameters")
    lines = [f"{m['name']} ({size}, {m['layers']} layers) — {t['kind']} on "
             f"{p.hardware['spec']}: {p.hardware['describe']}"]
    if moe:
        lines.append(f"  mixture of experts: {moe['top_k']} of {moe['experts']} experts a token in {moe['moe_layers']} "
                     f"layers, an expert {moe['expert_params'] / 1e6:,.1f}M parameters; dense part "
                     f"{moe['dense_params'] / 1e9:,.2f}B, routed experts {moe['routed_params'] / 1e9:,.2f}B")
    if t["kind"] == "finetune":
        lines.append(f"  batch {t['batch']} x seq {t['seq_len']} = {p.extra.get('tokens_per_step', 0):,} tokens/step, "
                     f"precision {t['precision']}, activations {t['activations']}")
    else:
        lines.append(f"  {t['batch']} requests x (prompt {t['seq_len']} + {t['new_tokens']} new tokens), "
                     f"{t.get('weights', 'bf16')} weights")
    lines.append("  fits: " + ("yes" if p.fits else "NO"))
    for problem in p.problems:
        lines.append(f"    - {problem}")
    lines.append("  placement:")
    for tier, items in p.placement.items():
        if isinstance(items, dict):
            shown = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in items.items() if v)
            lines.append(f"    {tier:<18} {shown or '-'}")
        else:
            lines.append(f"    {tier:<18} {items}")
    if p.activations:
        a = p.activations
        lines.append(f"    activations        {fmt_bytes(a['per_layer_bytes'])}/layer: {a['on_device']} on device, "
                     f"{a['in_ram']} in RAM, {a['on_nvme']} swapped to NVMe, {a['recomputed']} recomputed")
    if p.settings:  # this machine: what `tierlm finetune` will choose, as it will print it
        lines.append("  the run's settings: " + "; ".join(
            f"{k} {v['value']} ({v['why']})" for k, v in p.settings.items() if k in ("prefetch", "shard_elems", "io_threads")))
    if p.step_s is None:
        return "\n".join(lines)
    if "moe" in p.extra and t["kind"] == "serve":
        lines += _moe_decode_lines(p.extra["moe"])
    label = "per step" if t["kind"] == "finetune" else "per decode step"
    lines.append(f"  time {label} by resource (overlapped; the busiest binds):")
    for k, v in p.resources_s.items():
        if v:
            lines.append(f"    {k:<12} {_t(v):>10}")
    busy = ", ".join(f"{k} {_t(v)}" for k, v in p.devices_s.items() if v)
    lines.append(f"    devices: {busy}; binding: {p.binding}")
    if t["kind"] == "finetune":
        lines.append(f"  predicted: {_t(p.step_s)}/step, {p.tokens_per_s:,.1f} tokens/s, "
                     f"{p.tflops:,.1f} TFLOPS (model FLOPs)")
    else:
        e = p.extra
        lines.append(f"  predicted: decode {e['decode_tokens_per_s']:,.1f} tokens/s, time to first token "
                     f"{_t(e['ttft_s'])}, {p.tokens_per_s:,.1f} generated tokens/s over whole requests")
        if e.get("gpu_decode"):
            lines += gpu_serve.describe(e["gpu_decode"])
    c = p.cost
    lines.append(f"  cost: hardware {_usd(c['hardware_usd'])}, {_usd(c['usd_per_hour'])} per hour, "
                 f"{_usd(c['usd_per_million_tokens'])} per million {'trained' if t['kind'] == 'finetune' else 'generated'} tokens"
                 + (f" ({c['note']})" if c.get("note") else ""))
    lines.append("  assumptions: " + "; ".join(p.assumptions))
    return "\n".join(lines)


def _moe_decode_lines(e: dict) -> list[str]:
    """A mixture of experts' decode: bytes a token reads, the expert cache, the bound by source."""
    held = ", ".join(f"{k} {v:,}" for k, v in e["experts_held"].items() if v)
    out = [f"  experts: a token reads {fmt_bytes(e['active_bytes_per_token'])} (the dense part and "
           f"{e['top_k']} experts a layer; a step of all rows reads {fmt_bytes(e['routed_bytes_per_step'])} of "
           f"experts), an expert {fmt_bytes(e['expert_bytes'])}; experts held: {held}; hit rate "
           f"{e['hit_rate']:.0%} (uniform routing assumed)"]
    b = e.get("bound")
    if b:
        sh = b["shares"]
        out.append(f"  decode bound (reads and compute added, no overlap): {_t(b['total_s'])}/step = RAM (dense "
                   f"part, cache hits) {_t(b['ram_s'])} ({sh['ram']:.0%}) + SSD (misses) {_t(b['ssd_s'])} "
                   f"({sh['ssd']:.0%}) + compute {_t(b['compute_s'])} ({sh['compute']:.0%})")
    return out


def write_json(obj, path: str | Path) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def rank(plans: list[Plan]) -> list[Plan]:
    """Feasible plans first, by cost per million tokens (then throughput); infeasible ones last."""
    def key(p: Plan):
        cost = p.cost.get("usd_per_million_tokens")
        return (not p.fits, math.inf if cost is None else cost, -(p.tokens_per_s or 0))
    return sorted(plans, key=key)


def compare_text(plans: list[Plan]) -> str:
    rows = [f"{'#':>2}  {'hardware':<34} {'fits':<4} {'tokens/s':>10} {'$/M tokens':>11} {'hardware $':>11}  binding"]
    for i, p in enumerate(rank(plans), 1):
        c = p.cost
        rows.append(f"{i:>2}  {p.hardware['spec'][:34]:<34} {'yes' if p.fits else 'no':<4} "
                    f"{(p.tokens_per_s or 0):>10,.1f} {_usd(c.get('usd_per_million_tokens')):>11} "
                    f"{_usd(c.get('hardware_usd')):>11}  {p.binding if p.fits else p.problems[0][:60]}")
    return "\n".join(rows)


def chart(plans: list[Plan], path: str | Path, title: str) -> Path:
    """Throughput against cost per million tokens, one point per feasible option (log-log)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    ok = [p for p in plans if p.fits and p.tokens_per_s and p.cost.get("usd_per_million_tokens")]
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for p in ok:
        x, y = p.cost["usd_per_million_tokens"], p.tokens_per_s
        ax.scatter([x], [y], s=30)
        ax.annotate(p.hardware["spec"], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("USD per million tokens (lower is better)")
    ax.set_ylabel("tokens/s (higher is better)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    skipped = len(plans) - len(ok)
    if skipped:
        ax.text(0.01, 0.01, f"{skipped} option(s) do not fit or have no price", transform=ax.transAxes, fontsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
