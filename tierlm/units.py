"""Memory sizes as strings with units ("4GiB", "512MiB", "1.5GB") and back."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: str | int | float, what: str = "size") -> int:
    """'4GiB' -> 4294967296. Plain numbers are bytes. Raises ValueError naming `what`."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size like '4GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{what}: size must be >= 0, got {value!r}")
        return int(value)
    m = _RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"{what}: cannot read {value!r} as a size; write it like '4GiB', '512MiB' or '2GB'")
    return int(float(m.group(1)) * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    """Binary units, three significant digits: 4.00 GiB, 512 MiB."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else (f"{n:.3g} {unit}" if abs(n) >= 100 else f"{n:.2f} {unit}")
        n /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str, nouns: str | None = None) -> str:
    """'1 document', '0 documents', '15,004 documents': a count and its noun, singular for one.
    `nouns` where the plural is not noun + 's'."""
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
