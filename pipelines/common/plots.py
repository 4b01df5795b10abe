"""The PNG line plots the jobs' reports carry (matplotlib, headless)."""

from __future__ import annotations

import io


def plot_lines(labels: list[str], series: dict[str, list[float]], xlabel: str) -> bytes:
    """A PNG of each model's full-catalog NDCG@10 over the buckets ``labels``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for m, values in series.items():
        ax.plot(labels, values, marker="o", label=m)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("full-catalog NDCG@10")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    plt.close(fig)
    return buf.getvalue()
