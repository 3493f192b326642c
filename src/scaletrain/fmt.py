"""How numbers are written for people: one formatter per kind of quantity, used by the progress
line, the summaries, the planner and the benchmarks alike."""

from __future__ import annotations


def count(x: float) -> str:
    """A count with a decimal prefix: 950, 1.2k, 3.4M, 5.6G."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def flops(x: float) -> str:
    """FLOP/s with a decimal prefix: 231.0 GFLOP/s, 989.4 TFLOP/s."""
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}FLOP/s"
    return f"{x:.0f} FLOP/s"


def size(n: float, *, exact: bool = False) -> str:
    """Bytes in binary units (KiB, MiB, GiB); `exact`: the shortest exact form (64 KiB, 1.5 MiB,
    for message sizes that are round numbers), falling back to bytes."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if exact and n >= div and n % (div // 16) == 0:
            return f"{n / div:g} {unit}"
        if not exact and n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def seconds(s: float) -> str:
    """A duration in s, ms or us with three significant figures or so."""
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.1f} us"


def clock(s: float) -> str:
    """A duration as a clock: m:ss, or h:mm:ss from an hour on."""
    s = int(max(0, s))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"
