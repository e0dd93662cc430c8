"""Draw the Grafana dashboard's panels with matplotlib, from a real Prometheus.

For where Grafana is not installed (it is not packaged in Debian): every timeseries panel of
deploy/grafana/mooncake-dashboard.json is drawn from its own PromQL targets, queried over
Prometheus' HTTP API (/api/v1/query_range), with the panel's title, unit, legend format,
stacking, min/max and threshold line. The picture in the README was made this way.

    python deploy/grafana/render_panels.py --prometheus http://127.0.0.1:9090 --minutes 15 \\
        --out docs/img/dashboard.png
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the backend

DASHBOARD = Path(__file__).with_name("mooncake-dashboard.json")
# Grafana unit id -> (factor, axis label)
UNITS = {"percentunit": (100.0, "%"), "s": (1.0, "seconds"), "reqps": (1.0, "requests/s"),
         "Bps": (1e-6, "MB/s"), "short": (1.0, "")}
_LEGEND = re.compile(r"\{\{\s*(\w+)\s*\}\}")


def panels(dashboard: dict) -> list[dict]:
    """Timeseries panels in dashboard order (panels inside rows included)."""
    found = []
    for panel in dashboard["panels"]:
        found += [panel] + panel.get("panels", [])
    return [p for p in found if p.get("type") == "timeseries"]


def query_range(client: httpx.Client, prometheus: str, expr: str, start: float, end: float, step: float) -> list:
    resp = client.get(f"{prometheus}/api/v1/query_range",
                      params={"query": expr, "start": start, "end": end, "step": step})
    body = resp.json()
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    """Grafana's legend format ({{label}} replaced); the label set when that leaves nothing."""
    text = _LEGEND.sub(lambda m: labels.get(m.group(1), ""), fmt).strip()
    return text or "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__") + "}"


def draw(ax, panel: dict, series: list[tuple[str, list[float], list[float]]], start: float) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    factor, label = UNITS.get(defaults.get("unit", "short"), (1.0, defaults.get("unit", "")))
    stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
    ax.set_title(panel["title"], fontsize=10, loc="left")
    if not series:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    elif stacked:
        grid = sorted({t for _, ts, _ in series for t in ts})
        rows = []
        for _, ts, vs in series:
            at = dict(zip(ts, vs))
            rows.append([0.0 if math.isnan(at.get(t, math.nan)) else at[t] * factor for t in grid])
        ax.stackplot([(t - start) / 60 for t in grid], rows, labels=[name for name, _, _ in series], alpha=0.7)
    else:
        for name, ts, vs in series:
            ax.plot([(t - start) / 60 for t in ts], [v * factor for v in vs], label=name, linewidth=1.2)
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step.get("value") is not None:
            ax.axhline(step["value"] * factor, color="red", linestyle="--", linewidth=0.8)
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"] * factor)
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"] * factor * 1.05)
    ax.set_ylabel(label, fontsize=8)
    ax.set_xlabel("minutes", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    if series:
        ax.legend(fontsize=6, loc="upper left", ncol=2 if len(series) > 3 else 1)


def render(prometheus: str, dashboard_path: Path, start: float, end: float, rate_interval: str, out: Path,
           columns: int = 4, transport: httpx.BaseTransport | None = None) -> int:
    """Draw every timeseries panel into `out`; returns how many panels had data."""
    dashboard = json.loads(dashboard_path.read_text())
    chosen = panels(dashboard)
    rows = math.ceil(len(chosen) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    step = max(5.0, (end - start) / 240)
    drawn = 0
    with httpx.Client(timeout=30, transport=transport) as client:
        for ax, panel in zip(axes.flat, chosen):
            series = []
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", rate_interval)
                for result in query_range(client, prometheus, expr, start, end, step):
                    ts = [float(t) for t, _ in result["values"]]
                    vs = [float(v) for _, v in result["values"]]
                    series.append((legend(target.get("legendFormat", ""), result["metric"]), ts, vs))
            draw(ax, panel, series, start)
            drawn += bool(series)
    for ax in list(axes.flat)[len(chosen):]:
        ax.axis("off")
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(start))
    fig.suptitle(f"{dashboard['title']}: the Grafana dashboard's panels drawn with matplotlib from Prometheus "
                 f"queries ({stamp}, {(end - start) / 60:.0f} min; Grafana itself not run)", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return drawn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090", help="Prometheus base URL")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD)
    parser.add_argument("--minutes", type=float, default=15, help="how far back from --end to draw")
    parser.add_argument("--end", type=float, default=None, help="Unix time of the right edge (default: now)")
    parser.add_argument("--rate-interval", default="1m", help="what Grafana's $__rate_interval becomes")
    parser.add_argument("--out", type=Path, default=Path("docs/img/dashboard.png"))
    args = parser.parse_args()
    end = args.end or time.time()
    drawn = render(args.prometheus.rstrip("/"), args.dashboard, end - 60 * args.minutes, end, args.rate_interval,
                   args.out)
    print(f"wrote {args.out}: {drawn} panels with data")


if __name__ == "__main__":
    main()
