"""PNG charts with matplotlib's Agg canvas (no display, no pyplot global state).

bar_chart: one value per run. migrated_bytes_chart: per run, HtoD and DtoH bars stacked by
migration cause. timeline_chart: GPU-resident bytes per tag over one step, the budget line and
the GPU page faults. Values that were not measured (None) are drawn as empty bars marked n/a.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .aggregate import CAUSE_ORDER
from .tables import format_value

CAUSE_COLORS = {"fault": "#d62728", "prefetch": "#2ca02c", "speculative": "#ff7f0e",
                "eviction": "#9467bd", "access_counters": "#8c564b", "unknown": "#7f7f7f"}
TAG_COLORS = {"parameter": "#1f77b4", "gradient": "#ff7f0e", "optimizer_state": "#2ca02c",
              "input": "#9467bd", "activation": "#d62728", "other": "#7f7f7f", "spill": "#bcbd22",
              "all": "#17becf"}  # every tag of um_alloc.tag_names.TAGS (tests check), and the total


def _figure(width: float = 8.0, height: float = 4.5):
    try:  # optional (um_alloc[plot]): tables and timelines' data need no matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise RuntimeError(f"charts need matplotlib ({error}): pip install 'um_alloc[plot]'") from None
    figure = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(figure)
    return figure


def _save(figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path)
    return path


def _byte_unit(values: Sequence[float]) -> tuple[float, str]:
    biggest = max((v for v in values if v), default=0)
    return (2**30, "GiB") if biggest >= 2**30 else (2**20, "MiB")


def bar_chart(labels: Sequence[str], values: Sequence, path: str | Path, *, title: str, ylabel: str,
              kind: str = "count", reference: float | None = None) -> Path:
    """One bar per label; `kind` as in tables.format_value; `reference` draws a dashed line."""
    scale, unit = (1.0, "")
    if kind == "bytes":
        scale, unit = _byte_unit([v for v in values if v is not None])
    elif kind == "seconds":
        scale, unit = 1e-3, "ms"
    figure = _figure(max(6.0, 0.9 * len(labels) + 2))
    ax = figure.add_subplot()
    heights = [0.0 if v is None else v / scale for v in values]
    bars = ax.bar(range(len(labels)), heights, color="#4c72b0")
    for bar, value in zip(bars, values):
        ax.annotate(format_value(value, kind), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    if reference is not None:
        ax.axhline(reference, color="black", linestyle="--", linewidth=0.8)
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"{ylabel} ({unit})" if unit else ylabel)
    ax.set_title(title)
    return _save(figure, path)


def migrated_bytes_chart(labels: Sequence[str], rows: Sequence[dict], path: str | Path, *, title: str) -> Path:
    """Two bars per run (HtoD left, DtoH right), each stacked by migration cause."""
    scale, unit = _byte_unit([r.get("htod_bytes") or 0 for r in rows] + [r.get("dtoh_bytes") or 0 for r in rows])
    figure = _figure(max(6.0, 1.1 * len(rows) + 2))
    ax = figure.add_subplot()
    width = 0.38
    for offset, direction in ((-width / 2, "htod"), (width / 2, "dtoh")):
        bottom = [0.0] * len(rows)
        for cause in CAUSE_ORDER:
            heights = [(r.get(f"{direction}_{cause}_bytes") or 0) / scale for r in rows]
            if any(heights):
                xs = [i + offset for i in range(len(rows))]
                ax.bar(xs, heights, width, bottom=bottom, color=CAUSE_COLORS[cause],
                       label=None if _labelled(ax, cause) else cause,
                       edgecolor="white" if direction == "htod" else "black", linewidth=0.4)
                bottom = [b + h for b, h in zip(bottom, heights)]
        for i, row in enumerate(rows):
            text = "n/a" if row.get(f"{direction}_bytes") is None else direction.replace("to", "→").upper()
            ax.annotate(text, (i + offset, bottom[i]), ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(f"migrated ({unit})")
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(title="cause", fontsize=7)
    return _save(figure, path)


def _labelled(ax, label: str) -> bool:
    return label in ax.get_legend_handles_labels()[1]


def timeline_chart(timeline: dict, path: str | Path) -> Path:
    """Top: stacked bytes per tag over one step, the budget line, phase starts. Bottom: GPU faults."""
    samples = timeline["samples"]
    t0 = timeline["t0_ns"]
    xs = [(s["t_ns"] - t0) / 1e6 for s in samples]
    tags = timeline["tags"]
    scale, unit = _byte_unit([sum(s["bytes"].values()) for s in samples] + [timeline.get("budget_bytes") or 0])
    figure = _figure(10, 6)
    ax, faults_ax = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    if tags and samples:
        ys = [[s["bytes"].get(tag, 0) / scale for s in samples] for tag in tags]
        ax.stackplot(xs, ys, labels=tags, colors=[TAG_COLORS.get(t, None) for t in tags], step="post", alpha=0.85)
    else:
        ax.text(0.5, 0.5, "no GPU memory statistics on this device", transform=ax.transAxes, ha="center")
    if timeline.get("budget_bytes"):
        ax.axhline(timeline["budget_bytes"] / scale, color="black", linestyle="--", linewidth=1,
                   label=timeline.get("budget_label") or "budget")
    _phase_lines(ax, faults_ax, samples, xs)
    _fault_marks(faults_ax, timeline, t0, xs)
    faults_ax.set_xlabel("ms since the step began (CPU-side sample times; GPU faults at GPU time)")
    ax.set_ylabel(f"{timeline['source']} ({unit})")
    ax.set_title(f"Memory by tag during step {timeline['step']} ({timeline['source']})", pad=14)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    return _save(figure, path)


def _phase_lines(ax, faults_ax, samples: list[dict], xs: list[float]) -> None:
    seen = set()
    for x, sample in zip(xs, samples):
        phase = sample.get("phase")
        if phase and phase not in seen:
            seen.add(phase)
            for axis in (ax, faults_ax):
                axis.axvline(x, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(f" {phase}", (x, 1.0), xycoords=("data", "axes fraction"), fontsize=7, va="bottom")


def _fault_marks(ax, timeline: dict, t0: int, xs: list[float]) -> None:
    faults = timeline.get("faults_ns")
    ax.set_ylabel("GPU fault\nrecords", fontsize=8)
    if faults is None:
        ax.text(0.5, 0.5, "GPU faults not measured (CUPTI unavailable)", transform=ax.transAxes, ha="center",
                fontsize=8, color="#d62728")
        return
    fault_ms = [(t - t0) / 1e6 for t in faults]
    span = (min(xs + fault_ms, default=0.0), max(xs + fault_ms, default=1.0))
    if not fault_ms:
        ax.text(0.5, 0.5, "no GPU page faults in this step", transform=ax.transAxes, ha="center", fontsize=8)
        return
    ax.hist(fault_ms, bins=min(200, max(10, len(fault_ms) // 20)), range=span, color="#d62728",
            label=f"GPU page faults ({len(fault_ms):,} records)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
