"""Turning the measurements of one run into a table, the issue's goal ratios and a bar chart.

A row is one measured (case, op, slice size): `case` names system and transport ("ours tcp"),
`wire` says what it moves over ("memory", "tcp", "shm"). Ratios compare medians of the same op
and slice size, measured in the same run.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.transfer.common import MiB


@dataclass(frozen=True)
class Case:
    system: str  # "limit", "ours", "Mooncake TE", "NIXL"
    transport: str  # "memcpy", "tcp x1", "tcp", "shm", "nixl/tcp", ...
    wire: str  # "memory", "tcp", "shm": what the goal ratios compare on
    env: tuple[tuple[str, str], ...] = ()  # extra environment of its workers

    @property
    def name(self) -> str:
        return f"{self.system} {self.transport}"


@dataclass(frozen=True)
class Goal:
    """numerator / denominator >= minimum, per (op, size). A side given as several cases takes
    the best of them ("our best path", NIXL in its best configuration). `wire`: where
    minimum x denominator is above the fastest round that any case on that wire made in the same
    run (raw sockets and every system), the goal asks more than anything moved over it, and the
    line says so."""

    title: str
    numerators: tuple[str, ...]
    denominators: tuple[str, ...]
    minimum: float
    wire: str | None = None


def summarize(case: Case, result: dict) -> dict:
    samples = result["gbps"]
    return {"system": case.system, "transport": case.transport, "wire": case.wire, "case": case.name,
            "op": result["op"], "slice_bytes": result["slice_bytes"], "gbps": samples,
            "median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "verified": result["verified"]}


def _columns(rows: list[dict]) -> list[tuple[str, int]]:
    ops = [op for op in ("write", "read") if any(r["op"] == op for r in rows)]
    sizes = sorted({r["slice_bytes"] for r in rows})
    return [(op, size) for op in ops for size in sizes]


def _cell(row: dict | None) -> str:
    if row is None:
        return "-"
    flag = "" if row["verified"] else " (bytes WRONG)" if row["verified"] is False else ""
    return f"{row['median']:.2f} ({row['min']:.2f}-{row['max']:.2f}){flag}"


def table(cases: list[Case], rows: list[dict], unavailable: dict[str, str]) -> str:
    """Markdown: one line per case, one column per (op, slice size): median GB/s (min-max)."""
    columns = _columns(rows)
    head = ["system", "transport"] + [f"{op} {size // MiB} MiB" for op, size in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        if case.name in unavailable:
            cells = [f"not available: {unavailable[case.name]}"] + [""] * (len(columns) - 1)
        else:
            found = {(r["op"], r["slice_bytes"]): r for r in rows if r["case"] == case.name}
            cells = [_cell(found.get(col)) for col in columns]
        lines.append("| " + " | ".join([case.system, case.transport, *cells]) + " |")
    return "\n".join(lines)


def ratios(goals: list[Goal], rows: list[dict]) -> list[dict]:
    medians = {(r["case"], r["op"], r["slice_bytes"]): r["median"] for r in rows}
    out = []
    for goal in goals:
        for op, size in _columns(rows):
            tops = [(medians[(n, op, size)], n) for n in goal.numerators if (n, op, size) in medians]
            bottoms = [(medians[(n, op, size)], n) for n in goal.denominators if (n, op, size) in medians]
            entry = {"goal": goal.title, "op": op, "slice_bytes": size, "minimum": goal.minimum,
                     "ratio": None, "numerator": None, "denominator": None, "met": None}
            if tops and bottoms:
                (best, name), (bottom, bottom_name) = max(tops), max(bottoms)
                # Name the cases only where the goal picked the best of several.
                picked = [n for n, several in ((name, len(goal.numerators) > 1),
                                                (bottom_name, len(goal.denominators) > 1)) if several]
                entry.update(ratio=best / bottom, numerator=name, denominator=bottom_name, picked=picked,
                             met=best / bottom >= goal.minimum)
                ceilings = [r["max"] for r in rows
                            if goal.wire and r["wire"] == goal.wire and (r["op"], r["slice_bytes"]) == (op, size)]
                if ceilings:
                    entry.update(needed_gbps=goal.minimum * bottom, limit_gbps=max(ceilings),
                                 beyond_limit=goal.minimum * bottom > max(ceilings))
            out.append(entry)
    return out


def ratio_lines(entries: list[dict]) -> str:
    """Markdown: one line per goal, one column per (op, slice size)."""
    columns = list(dict.fromkeys((e["op"], e["slice_bytes"]) for e in entries))
    head = ["goal", "minimum"] + [f"{op} {size // MiB} MiB" for op, size in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title in dict.fromkeys(e["goal"] for e in entries):
        found = {(e["op"], e["slice_bytes"]): e for e in entries if e["goal"] == title}
        cells = []
        for col in columns:
            e = found[col]
            if e["ratio"] is None:
                cells.append("n/a")
            else:
                picked = f" ({' / '.join(e['picked'])})" if e["picked"] else ""
                beyond = (f"; needs {e['needed_gbps']:.2f} GB/s, above any round on this wire, "
                          f"{e['limit_gbps']:.2f}" if e.get("beyond_limit") else "")
                cells.append(f"{e['ratio']:.2f}x {'met' if e['met'] else 'MISSED'}{picked}{beyond}")
        lines.append(f"| {title} | >= {found[columns[0]]['minimum']:g}x | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bar_chart(cases: list[Case], rows: list[dict], path: str, title: str) -> str | None:
    """A PNG of median GB/s with min-max whiskers, one panel per (op, size); None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    columns = _columns(rows)
    measured = [c for c in cases if any(r["case"] == c.name for r in rows)]
    fig, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 4.5), sharey=True, squeeze=False)
    for ax, (op, size) in zip(axes[0], columns):
        found = {r["case"]: r for r in rows if r["op"] == op and r["slice_bytes"] == size}
        names = [c.name for c in measured]
        med = [found[n]["median"] if n in found else 0 for n in names]
        low = [found[n]["median"] - found[n]["min"] if n in found else 0 for n in names]
        high = [found[n]["max"] - found[n]["median"] if n in found else 0 for n in names]
        colors = ["tab:green" if n.startswith("ours") else "tab:gray" if n.startswith("limit") else "tab:blue"
                  for n in names]
        ax.barh(names, med, xerr=[low, high], color=colors)
        ax.set_title(f"{op}, {size // MiB} MiB slices")
        ax.set_xlabel("GB/s (median, min-max)")
    axes[0][0].invert_yaxis()  # shared: once for all panels, so the first case is on top
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
