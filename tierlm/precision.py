"""`--precision auto`: bf16 compute where this CPU multiplies bf16 matrices fast, fp32 where not.

bf16 halves the bytes of working weights and activations, but a CPU without bf16 matrix
instructions (AVX512-BF16, AMX) runs bf16 products through a fallback kernel: on a 2-core AMD EPYC
(AVX2 only) a llama layer's forward + backward ran 39x slower in bf16 than in fp32, which makes
every step compute-bound many times over. So `auto` measures the three products a training step
runs (x W^T forward, g W and g^T x in backward) in both dtypes, once per process (~1 s at worst),
and takes bf16 only where its slowest product keeps at least half the fp32 rate.
"""
from __future__ import annotations

import functools
import time

import torch

PRECISIONS = ("auto", "bf16", "fp32")
MIN_BF16_SHARE = 0.5  # bf16 moves half the bytes: worth it down to half the fp32 FLOP rate


def _rate(a: torch.Tensor, b: torch.Tensor) -> float:
    a @ b  # kernel selection and first touch outside the timing
    best = float("inf")
    for _ in range(2):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / best


@functools.lru_cache(maxsize=1)
def probe(tokens: int = 256, width: int = 512) -> dict:
    """FLOP/s of each training-step product layout in bf16 and fp32, and their slowest ratio."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g)
    w = torch.randn(width, width, generator=g)
    shapes = {"forward x@W^T": (x, w.t()), "backward g@W": (x, w), "backward g^T@x": (x.t(), x)}
    out = {}
    for name, (a, b) in shapes.items():
        fp32 = _rate(a, b)
        bf16 = _rate(a.bfloat16(), b.bfloat16())
        out[name] = {"fp32_flops": fp32, "bf16_flops": bf16, "ratio": bf16 / fp32}
    worst = min(out.values(), key=lambda r: r["ratio"])
    return {"layouts": out, "worst_ratio": worst["ratio"], "bf16_gflops": worst["bf16_flops"] / 1e9,
            "fp32_gflops": worst["fp32_flops"] / 1e9, "capability": torch.backends.cpu.get_cpu_capability()}


def resolve(precision: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """(bf16 | fp32, why): `auto` measured on a CPU, from the GPU's capability on a GPU; the
    others as given."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision != "auto":
        return precision, f"--precision {precision}"
    if torch.device(device).type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ("bf16" if ok else "fp32"), (f"--precision auto chose {'bf16' if ok else 'fp32'}: "
                                            f"{torch.cuda.get_device_name(device)} "
                                            f"{'has' if ok else 'lacks'} bf16 matrix units")
    p = probe()
    chosen = "bf16" if p["worst_ratio"] >= MIN_BF16_SHARE else "fp32"
    return chosen, (f"--precision auto chose {chosen}: bf16 matrix products run at {p['worst_ratio']:.2f}x the "
                    f"fp32 rate on this CPU ({p['capability']}; slowest layout {p['bf16_gflops']:.0f} against "
                    f"{p['fp32_gflops']:.0f} GFLOP/s)")


__all__ = ["PRECISIONS", "probe", "resolve"]
