"""Rows of results -> CSV (raw numbers) and markdown (readable units), and one-line summaries.

A row is a flat dict. A column is (key, header, kind); kind says how markdown shows the value:
bytes (binary units), count, seconds (ms), ratio, rate, text. None is "n/a": not measured.
The CSV keeps the keys as its header and the raw values, for scripts.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Iterable, Sequence

from .aggregate import CAUSE_ORDER, COUNTER_FIELDS

Column = tuple[str, str, str]

# The unified-memory columns every table shares (compare_policies, compare_peers, nsys_faults).
COUNTER_COLUMNS: list[Column] = [
    ("gpu_page_faults", "GPU faults", "count"), ("cpu_page_faults", "CPU faults", "count"),
    ("htod_bytes", "HtoD", "bytes"), ("htod_fault_bytes", "HtoD fault", "bytes"),
    ("htod_prefetch_bytes", "HtoD prefetch", "bytes"), ("htod_speculative_bytes", "HtoD speculative", "bytes"),
    ("dtoh_bytes", "DtoH", "bytes"), ("dtoh_fault_bytes", "DtoH fault", "bytes"),
    ("dtoh_prefetch_bytes", "DtoH prefetch", "bytes"), ("dtoh_eviction_bytes", "DtoH eviction", "bytes"),
    ("thrashing_events", "thrashing", "count"), ("throttling_events", "throttling", "count"),
    ("remote_map_events", "remote maps", "count"),
]
ALL_COUNTER_COLUMNS: list[Column] = [(k, k, "bytes" if k.endswith("_bytes") else "count") for k in COUNTER_FIELDS]


def human_bytes(n) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_value(value, kind: str) -> str:
    if value is None:
        return "n/a"
    if kind == "bytes":
        return human_bytes(value)
    if kind == "count":
        return f"{value:,.0f}" if float(value).is_integer() else f"{value:,.1f}"
    if kind == "seconds":
        return f"{value * 1e3:.1f} ms"
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "rate":
        return f"{value:.1f}"
    return str(value)


def markdown(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(format_value(row.get(key), kind) for key, _, kind in columns) + " |")
    return "\n".join(lines) + "\n"


def write_csv(rows: Iterable[dict], columns: Sequence[Column], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow([key for key, _, _ in columns])
        for row in rows:
            writer.writerow(["" if row.get(key) is None else row.get(key) for key, _, _ in columns])
    return path


def write_tables(rows: Sequence[dict], out_dir: str | Path, stem: str, *, csv_columns: Sequence[Column],
                 md_columns: Sequence[Column], title: str = "", notes: Sequence[str] = ()) -> tuple[Path, Path]:
    """Writes OUT/STEM.csv (every column) and OUT/STEM.md (the readable selection, with notes)."""
    out_dir = Path(out_dir)
    csv_path = write_csv(rows, csv_columns, out_dir / f"{stem}.csv")
    text = (f"## {title}\n\n" if title else "") + markdown(rows, md_columns)
    if notes:
        text += "\n" + "\n".join(f"- {note}" for note in notes) + "\n"
    md_path = out_dir / f"{stem}.md"
    md_path.write_text(text)
    return csv_path, md_path


def counts_line(counts: dict | None) -> str:
    """One line for a log: faults, then bytes each way split by cause, then the rarer events."""
    if not counts or counts.get("gpu_page_faults") is None:
        return "not measured"

    def split(direction: str) -> str:
        parts = [f"{cause} {human_bytes(counts.get(f'{direction}_{cause}_bytes'))}" for cause in CAUSE_ORDER
                 if counts.get(f"{direction}_{cause}_bytes")]
        return human_bytes(counts[f"{direction}_bytes"]) + (f" ({', '.join(parts)})" if parts else "")

    rare = [f"{name} {format_value(counts.get(key), 'count')}" for key, name in
            (("thrashing_events", "thrashing"), ("throttling_events", "throttling"), ("remote_map_events", "remote maps"))]
    return (f"GPU faults {format_value(counts['gpu_page_faults'], 'count')}, CPU faults "
            f"{format_value(counts['cpu_page_faults'], 'count')}, HtoD {split('htod')}, DtoH {split('dtoh')}, "
            + ", ".join(rare))
