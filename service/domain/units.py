"""Human-readable byte counts, shared by the CLI tables and the dashboard pages."""

from __future__ import annotations

from typing import Any


def human_bytes(n: Any, missing: str = "-") -> str:
    """1536 -> '1.5 KiB'; None -> ``missing``."""
    if n is None:
        return missing
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def gib(n: int | None) -> str:
    """Bytes in GiB with two decimals, as memory messages quote them; None -> '?'."""
    return "?" if n is None else f"{n / 2**30:.2f} GiB"
