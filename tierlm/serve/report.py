"""The generation report: each phase's tokens/s, effective GB/s, and the share of each roofline.

A phase's time is compared with what each resource alone would need for the bytes and FLOPs it
moved: the largest share is the bound it is closest to. The rooflines (this machine's memory, SSD
and matmul rates) come in as data: tierlm.bench.rooflines measures and caches them, the command
(tierlm.serve.run) reads them.
"""
from __future__ import annotations

from ..infer import gemv
from ..units import count


def phase_line(name: str, seconds: float, tokens: int, ram: int, ssd: int, kv: int, flops: float,
               rates: dict, dtype: str) -> tuple[str, dict]:
    """One line: tokens/s, effective GB/s, and the share of each roofline the phase reached."""
    if seconds <= 0 or tokens == 0:
        return f"{name}: nothing ran", {}
    gbps = (ram + kv + ssd) / seconds / 1e9
    shares = {}
    if rates.get("mem_gbps"):
        shares["memory"] = (ram + kv) / (rates["mem_gbps"] * 1e9) / seconds
    if ssd and rates.get("ssd_gbps"):
        shares["ssd"] = ssd / (rates["ssd_gbps"] * 1e9) / seconds
    mm = rates.get(f"matmul_{'bf16' if dtype == 'bf16' else 'fp32'}_gflops")
    if mm:
        shares["compute"] = flops / (mm * 1e9) / seconds
    bound = max(shares, key=shares.get) if shares else "unknown"
    parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in shares.items())
    line = (f"{name}: {count(tokens, 'token')} in {seconds:.3f} s = {tokens / seconds:.1f} tok/s, "
            f"{gbps:.2f} GB/s effective (weights from RAM {ram / seconds / 1e9:.2f}, SSD {ssd / seconds / 1e9:.2f}, "
            f"KV {kv / seconds / 1e9:.2f}); closest bound: {bound} (share of each roofline: {parts})")
    return line, {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "gbps": gbps,
                  "bound": bound, "shares": shares}


def compute_dtype(engine) -> str:
    """The dtype the products compute in: a bf16 model's products run in fp32 where this CPU's bf16
    matmul is slow (gemv.py upcasts many rows; our kernels widen the weights to fp32), so its
    compute roofline is the fp32 matmul rate (against the bf16 one, 0.3 GFLOP/s on an AVX2-only
    EPYC, a decode phase read as 89x its compute roofline)."""
    import torch

    return "bf16" if engine.dtype == torch.bfloat16 and not gemv.bf16_matmul_is_slow() else "fp32"


def report(batcher, engine, requests, rates: dict) -> tuple[list[str], dict]:
    """Lines for `tierlm generate`: TTFT, prefill and decode phases, against `rates`."""
    s = batcher.stats
    lines, out = [], {}
    ttfts = [r.t_first - r.t_submit for r in requests if r.t_first]
    if ttfts:
        out["ttft_s"] = sum(ttfts) / len(ttfts)
        lines.append(f"time to first token: {out['ttft_s']:.3f} s (mean of {len(ttfts)})")
    for ph in ("prefill", "decode"):
        flops = 2 * engine.flop_params * s.tokens[ph]
        line, d = phase_line(ph, s.s[ph], s.tokens[ph], s.ram[ph], s.ssd[ph], s.kv[ph], flops, rates,
                             compute_dtype(engine))
        lines.append(line)
        out[ph] = d
    experts = engine.expert_stats() if hasattr(engine, "expert_stats") else None
    if experts is not None:
        line, out["experts"] = experts_line(experts, s, rates)
        lines.append(line)
    return lines, out


def experts_line(e, s, rates: dict) -> tuple[str, dict]:
    """The expert cache: its hit rate, the decode phase's bytes per token, and the time per token the
    bytes alone need (weights and KV from RAM at the memory roofline, then the SSD reads at the SSD
    one: an expert's read waits for its layer's router, so nothing overlaps it), set against the
    measured time per token."""
    d = {**e.to_dict()}
    tok = s.tokens["decode"]
    text = f"experts: {e.requests} routed, cache hit rate {100 * e.hit_rate:.1f}%"
    if tok and s.s["decode"] > 0:
        ram, ssd = (s.ram["decode"] + s.kv["decode"]) / tok, s.ssd["decode"] / tok
        d.update(active_bytes_per_token=ram, ssd_bytes_per_token=ssd)
        text += f"; decode reads {ram / 1e6:.1f} MB a token from RAM and {ssd / 1e6:.1f} MB from the SSD"
        if rates.get("mem_gbps") and rates.get("ssd_gbps"):
            t_ram, t_ssd = ram / (rates["mem_gbps"] * 1e9), ssd / (rates["ssd_gbps"] * 1e9)
            bound, per = t_ram + t_ssd, s.s["decode"] / tok
            d.update(bound_s=bound, ram_share=t_ram / bound if bound else 0.0, ssd_share=t_ssd / bound if bound else 0.0,
                     of_bound=bound / per)
            text += (f"; RAM+SSD bound {1e3 * bound:.2f} ms a token ({100 * d['ram_share']:.0f}% RAM, "
                     f"{100 * d['ssd_share']:.0f}% SSD), decode at {100 * d['of_bound']:.0f}% of it")
    return text, d


def read_past_the_roofline(out: dict) -> bool:
    """A phase read memory faster than the memory roofline: the roofline was measured low (in a
    busier moment of a shared machine: one cached at 30.8 GB/s, decode then read 31-32)."""
    return any(d.get("shares", {}).get("memory", 0) > 1 for d in out.values() if isinstance(d, dict))
