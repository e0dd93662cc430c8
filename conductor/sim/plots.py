"""PNG plots of replays: TTFT CDF per run, and pool load over time (paper Figures 7 and 8)."""

from __future__ import annotations

import pathlib

import matplotlib

matplotlib.use("Agg")  # files only; never open a window
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from conductor.sim.report import SimResult  # noqa: E402


def plot_ttft_cdf(runs: dict[str, SimResult], path: str | pathlib.Path, title: str = "TTFT CDF",
                  ttft_slo_s: float | None = None) -> None:
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=90)
    for label, res in runs.items():
        t = np.sort([o.ttft_s for o in res.outcomes if o.status == "completed"])
        if t.size:
            ax.plot(t, np.arange(1, t.size + 1) / t.size, label=f"{label} (mean {t.mean():.2f} s)")
    if ttft_slo_s:
        ax.axvline(ttft_slo_s, color="grey", ls=":", lw=1, label="TTFT SLO")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of completed requests")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_load(res: SimResult, path: str | pathlib.Path, title: str, ttft_slo_s: float, tbt_slo_s: float) -> None:
    """Prefill load = mean queued prefill seconds / TTFT SLO; decode load = mean KV
    utilisation and mean step time / TBT SLO. 1.0 is the SLO line for all of them."""
    tl = res.timeline
    t = np.array([p.t_s for p in tl])
    fig, ax = plt.subplots(figsize=(6.5, 3.2), dpi=90)
    ax.plot(t, [p.prefill_queue_s / ttft_slo_s for p in tl], label="prefill: queue / TTFT SLO", lw=1)
    ax.plot(t, [p.decode_kv_util for p in tl], label="decode: KV used / capacity", lw=1)
    ax.plot(t, [p.decode_tbt_s / tbt_slo_s for p in tl], label="decode: step time / TBT SLO", lw=1, alpha=0.7)
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("load (1 = SLO)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
