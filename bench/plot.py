"""Latency-over-time PNG for ``llmproxy bench burst --plot`` (matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmproxy.bench.burst.report import TargetResult


def plot_latency(results: list[TargetResult], path: Path) -> None:
    """One series per target: x = time of each burst's last keystroke, y = the user's wait."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'llmproxy[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        points = sorted(
            (b.t_last_key - r.t0, b.latency_s * 1000) for b in r.bursts if b.latency_s is not None
        )
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o",
            label=f"{r.url} ({r.profile})",
        )
        ax.axhline(r.baseline_s * 1000, linestyle=":", linewidth=1, color=ax.lines[-1].get_color())
    ax.set_xlabel("time since the first burst (s)")
    ax.set_ylabel("last completion latency (ms)")
    ax.set_title("Completion the user waited for (dotted: one uncontended generation)")
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
