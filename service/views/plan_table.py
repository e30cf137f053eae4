"""A plan as a rich table, for ``memfit plan``: per-rank device and host bytes by category, the
assumptions, and the changes that would fit. Rendering only; the numbers are the plan's."""

from __future__ import annotations

from service.domain.plan import CATEGORIES, Plan
from service.domain.units import human_bytes


def fmt_bytes(n: int | None) -> str:
    """The plan table's cells: GiB with two decimals from 1 GiB up, else MiB with one."""
    if n is None:
        return "-"
    return human_bytes(n, unit="GiB", digits=2) if abs(n) >= 2**30 else human_bytes(n, unit="MiB")


def render(plan: Plan, console=None) -> None:
    """Print ``plan`` (the planner's, or one served by ``POST /v1/memory/plan``) with rich."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    d, h = plan.per_rank.device, plan.per_rank.host
    where = plan.gpu or "CPU worker"
    verdict = "[green]fits[/green]" if plan.fits else "[red]does not fit[/red]"
    usable = f"of {fmt_bytes(plan.usable_bytes)} usable" if plan.usable_bytes is not None else "nothing to fit into"
    title = (f"{plan.model.name if plan.model else 'model'} on {where} × {plan.world_size}: {verdict} "
             f"(peak {fmt_bytes(plan.peak_bytes)} {usable}, "
             f"{plan.parameter_count:,} params, {plan.trainable_parameter_count:,} trainable)")
    table = Table(title=title)
    table.add_column("per rank")
    table.add_column("device", justify="right")
    table.add_column("host", justify="right")
    for c in (*CATEGORIES, "total"):
        table.add_row(c, fmt_bytes(getattr(d, c)), fmt_bytes(getattr(h, c)))
    console.print(table)
    for a in plan.assumptions:
        console.print(f"  · {a}")
    if plan.data is not None:
        console.print(f"  · data: {plan.data.reason}")
    bound = plan.at_max_seq_length
    if plan.data is not None and plan.data.measured and bound is not None:
        console.print(f"  · at max_seq_length={bound.seq_length} (every row padded to it): peak "
                      f"{fmt_bytes(bound.peak_bytes)}, {'fits' if bound.fits else 'does not fit'}")
    if plan.suggestions:
        st = Table(title="changes that would fit, cheapest first")
        st.add_column("change")
        st.add_column("what")
        st.add_column("predicted peak", justify="right")
        for s in plan.suggestions:
            st.add_row(s.change, s.description, fmt_bytes(s.predicted_peak_bytes))
        console.print(st)
