"""Matplotlib figures as embedded PNGs (the report is one self-contained file)."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the runs are only read here
    from distlab.report.report_run import ReportRun

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


def label_axes(ax, xlabel: str, ylabel: str, title: str) -> None:
    """Axis names, title and a small legend: how every card's figure is labelled."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)


def loss_curves(runs: list[ReportRun], title: str) -> str:
    """Training loss per step; runs with eval_every also their held-out eval points (markers)."""
    fig, ax = figure()
    for run in runs:
        losses = run.loss.per_step
        line, = ax.plot(range(len(losses)), losses, label=f"{run.machine}/{run.experiment}", linewidth=1.2)
        points = (run.section("eval") or {}).get("during_training") or []
        if points:
            ax.plot([p["step"] for p in points], [p["loss"] for p in points], marker="o", markersize=3,
                    linestyle="--", linewidth=0.8, color=line.get_color(),
                    label=f"{run.experiment} held-out eval")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return to_png_b64(fig)


def ranking(rows: list[dict], title: str) -> str:
    """Horizontal bars: median tokens/s with the spread as error bars, best on top."""
    rows = sorted(rows, key=lambda r: r["median"])
    fig, ax = figure(6.4, 0.9 + 0.32 * len(rows))
    y = range(len(rows))
    med = [r["median"] for r in rows]
    err = [[r["median"] - r["low"] for r in rows], [r["high"] - r["median"] for r in rows]]
    ax.barh(y, med, xerr=err, color="#4c72b0", alpha=0.85, capsize=3)
    ax.set_yticks(list(y), [r["label"] for r in rows], fontsize=7)
    ax.set_xlabel("tokens/s (median; bar = spread)")
    ax.set_title(title)
    return to_png_b64(fig)


def bandwidth_curves(series: list[dict], title: str) -> str:
    """busbw vs message size, one line per (machine, backend, op)."""
    fig, ax = figure(6.4, 3.8)
    for s in series:
        ax.plot(s["sizes"], [b / 1e9 for b in s["busbw"]], marker="o", markersize=3, label=s["label"])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return to_png_b64(fig)


def loss_panels(by_stage: dict[str, list[ReportRun]]) -> str:
    """One small panel per stage, its runs' loss curves overlaid."""
    stages = list(by_stage)
    cols = min(3, len(stages))
    rows = (len(stages) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.3 * cols, 2.6 * rows), squeeze=False)
    for ax in axes.flat[len(stages):]:
        ax.set_visible(False)
    for ax, stage in zip(axes.flat, stages):
        for run in by_stage[stage]:
            losses = [v for v in run.loss.per_step if v is not None]
            ax.plot(range(len(losses)), losses, linewidth=1, label=f"{run.machine}/{run.experiment}")
        ax.set_title(stage, fontsize=9)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=5)
    fig.supxlabel("optimizer step", fontsize=8)
    fig.supylabel("training loss", fontsize=8)
    fig.tight_layout()
    return to_png_b64(fig)
