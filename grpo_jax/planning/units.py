"""Short figures for the compile report and its hints: bytes, seconds, FLOPs."""

from __future__ import annotations


def size_text(n: float | None) -> str:
    """Bytes, short: 15.8G, 412M, 36K."""
    if n is None:
        return "-"
    for unit, scale in (("T", 2 ** 40), ("G", 2 ** 30), ("M", 2 ** 20), ("K", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}" if abs(n) < 100 * scale else f"{n / scale:.0f}{unit}"
    return f"{n:.0f}"



def time_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"



def count_text(n: float | None) -> str:
    """FLOPs, short: 1.2P, 35T, 980G."""
    if n is None:
        return "-"
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"
