"""The picture of benchmarks/handover.py, in the spirit of the Mooncake paper's Figure 5:
(a) one long prompt's layers: when each finished computing on P and when its KV landed on D,
its wire time split at the end of compute into hidden and exposed; (b) the median hidden and
exposed wire time per prompt length; (c) TTFT ours against vLLM per prompt length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.kv_overlap import TransferOverlap, summarize  # noqa: E402

HIDDEN, EXPOSED = "#4c9a2a", "#d1495b"


def _layers_panel(ax, transfer: TransferOverlap) -> None:
    t0 = min(transfer.computed)
    end = (transfer.compute_end - t0) * 1e3
    earlier = float("-inf")
    for i, (c, t) in enumerate(zip(transfer.computed, transfer.landed)):
        start = max(c, earlier)
        earlier = max(earlier, t)
        s, e = (start - t0) * 1e3, (t - t0) * 1e3
        if e > s:
            ax.barh(i, max(0.0, min(e, end) - s), left=s, color=HIDDEN, height=0.7)
            if e > end:
                ax.barh(i, e - max(s, end), left=max(s, end), color=EXPOSED, height=0.7)
        ax.plot((c - t0) * 1e3, i, "k|", markersize=7)
    ax.axvline(end, color="k", linestyle=":", linewidth=1)
    ax.set_xlabel("ms since layer 0 was computed")
    ax.set_ylabel("layer")
    ax.invert_yaxis()
    ax.set_title(f"(a) one {transfer.num_tokens:,}-token prompt: | computed, bar = on the wire\n"
                 f"(green hidden, red exposed after the last layer's compute, dotted)", fontsize=9)


def _bars_panel(ax, groups: dict[int, list[TransferOverlap]]) -> None:
    lengths = [n for n, g in groups.items() if g]
    stats = [summarize(n, groups[n]) for n in lengths]
    x = range(len(lengths))
    exposed = [s.exposed_s * 1e3 for s in stats]
    hidden = [(s.wire_s - s.exposed_s) * 1e3 for s in stats]
    ax.bar(x, hidden, color=HIDDEN, label="hidden behind compute")
    ax.bar(x, exposed, bottom=hidden, color=EXPOSED, label="exposed (adds to TTFT)")
    for i, s in enumerate(stats):
        ax.text(i, s.wire_s * 1e3, f"{s.hidden_fraction:.0%} hidden", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{n:,}" for n in lengths])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("KV wire time, ms (median)")
    ax.legend(fontsize=8)
    ax.set_title("(b) KV transfer: hidden vs exposed", fontsize=9)


def _ttft_panel(ax, rows: list[dict], goal: float) -> None:
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["ours"] for r in rows], width=0.4, label="ours: P + D, one core each")
    ax.bar([i + 0.2 for i in x], [r["vllm"] for r in rows], width=0.4, label="vLLM alone, one core")
    for i, r in enumerate(rows):
        ax.text(i, max(r["ours"], r["vllm"]), f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [f"{r['prompt_tokens']:,}" for r in rows])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT, s (median)")
    ax.legend(fontsize=8)
    ax.set_title(f"(c) TTFT, ratio ours/vLLM (goal <= {goal:g}x)", fontsize=9)


def draw(config, rows: list[dict], groups: dict[int, list[TransferOverlap]] | None, path: Path) -> None:
    """`groups`: transfers per prompt length, or None when the prefill worker has no timeline."""
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2))
    have = {n: g for n, g in (groups or {}).items() if g}
    if have:
        longest = max(have)
        _layers_panel(axes[0], have[longest][-1])
        _bars_panel(axes[1], groups)
    else:
        for ax, title in zip(axes[:2], ("(a) layers of one long prompt", "(b) hidden vs exposed")):
            ax.text(0.5, 0.5, "no layer_timeline from the prefill worker", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_title(title, fontsize=9)
            ax.set_axis_off()
    _ttft_panel(axes[2], rows, config.goal)
    fig.suptitle(f"KV hand-over, SmolLM2-135M {config.dtype}, vLLM-CPU (benchmarks/handover.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
