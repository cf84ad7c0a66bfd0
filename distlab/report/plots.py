"""Matplotlib figures as embedded PNGs (the report is one self-contained file)."""
from __future__ import annotations

import base64
import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def to_png_b64(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def figure(width=5.5, height=3.4):
    fig, ax = plt.subplots(figsize=(width, height))
    ax.grid(alpha=0.3)
    return fig, ax


def loss_curves(runs: list[dict], title: str) -> str:
    fig, ax = figure()
    for run in runs:
        losses = run["loss"]["per_step"]
        ax.plot(range(len(losses)), losses, label=f"{run['machine']}/{run['experiment']}", linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return to_png_b64(fig)
