"""`--precision auto`: bf16 compute where this CPU has bf16 matrix instructions, fp32 where not.

bf16 halves the bytes of working weights and activations, but a CPU without bf16 matrix
instructions (AVX512_BF16, AMX-BF16; on Arm the `bf16` feature) runs bf16 products through a
fallback kernel: on a 2-core AMD EPYC (AVX2 only) a llama layer's forward + backward ran 39x slower
in bf16 than in fp32, which makes every step compute-bound many times over. With them, bf16
products run faster than fp32 (a Zen 4 EPYC with AVX512_BF16: 1.7-2.2x the fp32 rate).

The choice changes every bit of a run, so it is read from what the CPU is (its ISA flags), never
timed: a speed probe on a busy machine gave bf16 for some runs of one command and fp32 for others.
`cpu_bf16_isa()` is the one predicate: training's `auto` and inference's choices (bf16 weights
converted to fp32 for prefill, our kernel for a few rows) all follow it. `tierlm bench compute`
measures the rates for anyone who wants the numbers; nothing decides from them.
"""
from __future__ import annotations

import functools
import platform

import torch

PRECISIONS = ("auto", "bf16", "fp32")


def _cpuinfo_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (x86 `flags`, Arm `Features`); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def _torch_flag(name: str) -> bool | None:
    """torch's own reading of a CPU feature (CPUID, and for AMX whether the OS enabled its tiles),
    or None where this torch has no such query."""
    fn = getattr(torch.cpu, name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except (RuntimeError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def cpu_bf16_isa() -> str | None:
    """The bf16 matrix instructions this CPU has, by name ("AMX-BF16", "AVX512_BF16", "Arm BF16"),
    or None. x86: torch's own queries where it has them (they are what its kernels dispatch on),
    /proc/cpuinfo's flags where not; aarch64: the `bf16` feature."""
    machine = platform.machine().lower()
    flags = _cpuinfo_flags()
    if machine in ("aarch64", "arm64"):
        return "Arm BF16" if "bf16" in flags else None
    amx = _torch_flag("_is_amx_tile_supported")
    if amx is None:
        amx = "amx_bf16" in flags
    elif amx and flags:
        amx = "amx_bf16" in flags  # tiles without the bf16 instructions (AMX-INT8 only) do not count
    if amx:
        return "AMX-BF16"
    avx = _torch_flag("_is_avx512_bf16_supported")
    if avx is None:
        avx = "avx512_bf16" in flags
    return "AVX512_BF16" if avx else None


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (see cpu_bf16_isa)."""
    return cpu_bf16_isa() is not None


def resolve(precision: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """(bf16 | fp32, why): `auto` from the CPU's ISA flags on a CPU, from the GPU's capability on a
    GPU; the others as given. Nothing is timed: the same command picks the same on the same machine."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}; got {precision!r}")
    if precision != "auto":
        return precision, f"--precision {precision}"
    if torch.device(device).type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ("bf16" if ok else "fp32"), (f"--precision auto chose {'bf16' if ok else 'fp32'}: "
                                            f"{torch.cuda.get_device_name(device)} "
                                            f"{'has' if ok else 'lacks'} bf16 matrix units")
    isa = cpu_bf16_isa()
    if isa:
        return "bf16", f"--precision auto chose bf16: this CPU has {isa} (bf16 matrix instructions)"
    return "fp32", ("--precision auto chose fp32: this CPU has no bf16 matrix instructions (no AVX512_BF16, "
                    "AMX-BF16 or Arm BF16), so bf16 products would run on a slow fallback kernel")


__all__ = ["PRECISIONS", "cpu_bf16_isa", "cpu_has_bf16_matmul", "resolve"]
