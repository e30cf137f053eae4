"""Human-readable byte counts: the one formatter the CLI tables, the dashboard pages, the planner's
table and the pre-flight's messages all use."""

from __future__ import annotations

from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def human_bytes(n: Any, missing: str = "-", *, unit: str | None = None, digits: int = 1) -> str:
    """1536 -> '1.5 KiB'; None -> ``missing``. ``unit`` fixes the unit (``human_bytes(2**29,
    unit="GiB", digits=2)`` -> '0.50 GiB'), else the largest one under 1024 is chosen; ``digits``
    decimals, none for plain bytes."""
    if n is None:
        return missing
    n = float(n)
    if unit is not None:
        return f"{n / 1024 ** _UNITS.index(unit):.{digits}f} {unit}"
    for u in _UNITS:
        if abs(n) < 1024 or u == _UNITS[-1]:
            return f"{n:.0f} {u}" if u == "B" else f"{n:.{digits}f} {u}"
        n /= 1024
    return str(n)


def gib(n: int | None) -> str:
    """Bytes in GiB with two decimals, as memory messages quote them; None -> '?'."""
    return human_bytes(n, "?", unit="GiB", digits=2)
