"""What machine a measurement ran on, in one line: the CPU's model name, the ISA flags that decide
how fast a training step's products run, the cores this process may use and the RAM.

A step time means little without it: the same command ran 6.52 s/step on a Xeon with AMX and would
run at another speed on a CPU whose bf16 products go through AVX512_BF16 or a fallback kernel, so
every side-by-side table prints this line above its figures.
"""
from __future__ import annotations

import os
import platform

import psutil

from ..units import fmt_bytes

# The flags that change a training step's speed on a CPU, in /proc/cpuinfo's spelling: the vector
# width (avx2, avx512f), the bf16 and int8 dot products (avx512_bf16, avx512_vnni) and AMX's tiles.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def _cpuinfo(text: str | None = None) -> tuple[str, set[str]]:
    """The CPU's model name and feature flags as Linux lists them; ('', set()) where it does not.
    An x86 name gets its family and model numbers: a VM may name only 'AMD EPYC', which is Zen 3,
    Zen 4 (family 25) or Zen 5 (family 26) and runs a step at very different speeds."""
    name, flags, ids = "", set(), {}
    if text is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            return name, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key in ("cpu family", "model") and key not in ids:
            ids[key] = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    if name and len(ids) == 2:
        name = f"{name} (family {ids['cpu family']} model {ids['model']})"
    return name, flags


def machine_kind() -> dict:
    """The machine as data: cpu (model name), isa (which of ISA_FLAGS it has), cores (usable by this
    process), ram_bytes (total)."""
    name, flags = _cpuinfo()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return {"cpu": name or platform.processor() or platform.machine(),
            "isa": [f for f in ISA_FLAGS if f in flags], "cores": cores,
            "ram_bytes": psutil.virtual_memory().total}


def machine_line(kind: dict | None = None) -> str:
    """`machine_kind()` as one line, e.g. 'AMD EPYC 9R14 (family 25 model 17), 2 cores, 23.5 GiB RAM;
    ISA: avx2 avx512f ...'."""
    k = kind or machine_kind()
    isa = " ".join(k["isa"]) or "none of " + " ".join(ISA_FLAGS)
    return f"{k['cpu']}, {k['cores']} cores, {fmt_bytes(k['ram_bytes'])} RAM; ISA: {isa}"


__all__ = ["ISA_FLAGS", "machine_kind", "machine_line"]
