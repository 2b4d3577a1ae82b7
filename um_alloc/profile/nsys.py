"""An Nsight Systems SQLite export -> the counters and table of the in-process CUPTI counters.

    nsys profile --cuda-um-gpu-page-faults=true --cuda-um-cpu-page-faults=true -o run python train.py
    nsys export --type sqlite -o run.sqlite run.nsys-rep
    python -m um_alloc.profile.nsys run.sqlite --out DIR --name none   # DIR/nsys_faults.{csv,md}

Tables read (Nsight Systems' SQLite schema reference):
- CUDA_UM_GPU_PAGE_FAULT_EVENTS(start, end, globalPid, deviceId, address, numberOfPageFaults,
  faultAccessType): one row per faulting page, as CUPTI's GPU_PAGE_FAULT record.
- CUDA_UM_CPU_PAGE_FAULT_EVENTS(start, globalPid, address, originalFaultPc, ...): one CPU fault.
- CUPTI_ACTIVITY_KIND_MEMCPY(start, end, bytes, copyKind, migrationCause, virtualAddress, ...):
  the unified-memory migrations are the rows whose copyKind is a unified-memory kind (11 HtoD,
  12 DtoH, 13 DtoD, or whatever ENUM_CUDA_MEMCPY_OPER labels "unified" in the export), and
  migrationCause holds CUPTI's migration cause (ENUM_CUDA_UNIF_MEM_MIGRATION).
nsys creates tables lazily, so a missing table means no such events. It exports no thrashing,
throttling or remote-map events: those columns read None (not measured), never 0.
"""
from __future__ import annotations

import argparse
import sqlite3
import sys
from contextlib import closing
from pathlib import Path

from . import aggregate
from .tables import COUNTER_COLUMNS, write_tables

UM_COPY_KINDS = {11: "BYTES_TRANSFER_HTOD", 12: "BYTES_TRANSFER_DTOH", 13: "BYTES_TRANSFER_DTOD"}
NOT_EXPORTED = ("thrashing_events", "thrashing_bytes", "throttling_events", "throttling_ns",
                "remote_map_events", "remote_map_bytes")
_DIRECTION_WORDS = {"BYTES_TRANSFER_HTOD": ("htod", "host to device", "host-to-device"),
                    "BYTES_TRANSFER_DTOH": ("dtoh", "device to host", "device-to-host"),
                    "BYTES_TRANSFER_DTOD": ("dtod", "device to device", "device-to-device")}


def read_records(path: str | Path) -> list[dict]:
    """The export's unified-memory events as aggregate.py records, sorted by start."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no nsys SQLite export at {path} (make one with: nsys export --type sqlite REPORT.nsys-rep)")
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        records = _gpu_faults(conn, tables) + _cpu_faults(conn, tables) + _migrations(conn, tables)
    return sorted(records, key=lambda r: r["start"])


def counts(path: str | Path) -> dict:
    """Every counter of the table; the ones nsys does not export are None."""
    out = aggregate.totals(read_records(path))
    out.update(dict.fromkeys(NOT_EXPORTED, None))
    return out


def _gpu_faults(conn, tables: set) -> list[dict]:
    if "CUDA_UM_GPU_PAGE_FAULT_EVENTS" not in tables:
        return []
    rows = conn.execute("SELECT start, end, address, numberOfPageFaults, faultAccessType "
                        "FROM CUDA_UM_GPU_PAGE_FAULT_EVENTS")
    return [{"kind": "GPU_PAGE_FAULT", "start": s, "end": e, "address": a, "value": n, "flags": t or 0}
            for s, e, a, n, t in rows]


def _cpu_faults(conn, tables: set) -> list[dict]:
    if "CUDA_UM_CPU_PAGE_FAULT_EVENTS" not in tables:
        return []
    rows = conn.execute("SELECT start, address, originalFaultPc FROM CUDA_UM_CPU_PAGE_FAULT_EVENTS")
    return [{"kind": "CPU_PAGE_FAULT_COUNT", "start": s, "end": s, "address": a, "value": pc or 0, "flags": 0}
            for s, a, pc in rows]


def _migrations(conn, tables: set) -> list[dict]:
    if "CUPTI_ACTIVITY_KIND_MEMCPY" not in tables:
        return []
    kinds = unified_copy_kinds(conn, tables)
    columns = {row[1] for row in conn.execute("PRAGMA table_info(CUPTI_ACTIVITY_KIND_MEMCPY)")}
    cause = "migrationCause" if "migrationCause" in columns else "0"
    address = "virtualAddress" if "virtualAddress" in columns else "0"
    marks = ",".join("?" * len(kinds))
    rows = conn.execute(f"SELECT start, end, bytes, copyKind, {cause}, {address} FROM CUPTI_ACTIVITY_KIND_MEMCPY "
                        f"WHERE copyKind IN ({marks})", list(kinds))
    return [{"kind": kinds[k], "start": s, "end": e, "value": n, "flags": c or 0, "address": a or 0}
            for s, e, n, k, c, a in rows]


def unified_copy_kinds(conn, tables: set) -> dict[int, str]:
    """copyKind id -> record kind: from the export's own enum table where it names unified
    copies, else nsys's ids (11, 12, 13)."""
    if "ENUM_CUDA_MEMCPY_OPER" not in tables:
        return dict(UM_COPY_KINDS)
    found = {}
    for ident, name, label in conn.execute("SELECT id, name, label FROM ENUM_CUDA_MEMCPY_OPER"):
        text = f"{name or ''} {label or ''}".lower()
        if "unified" not in text:
            continue
        for kind, words in _DIRECTION_WORDS.items():
            if any(word in text for word in words):
                found[int(ident)] = kind
    return found or dict(UM_COPY_KINDS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m um_alloc.profile.nsys", description=__doc__.split("\n\n")[0])
    p.add_argument("sqlite", nargs="+", help="nsys SQLite exports (one table row each)")
    p.add_argument("--out", default=".", help="directory for nsys_faults.csv and nsys_faults.md")
    p.add_argument("--name", action="append", help="row name per export (default: the file stem)")
    args = p.parse_args(argv)
    names = args.name or [Path(s).stem for s in args.sqlite]
    if len(names) != len(args.sqlite):
        p.error(f"{len(names)} --name for {len(args.sqlite)} exports; give one per export or none")
    rows = [{"name": name, "source": "nsys", **counts(path)} for name, path in zip(names, args.sqlite)]
    columns = [("name", "run", "text"), *COUNTER_COLUMNS]
    csv_path, md_path = write_tables(
        rows, args.out, "nsys_faults", csv_columns=[("name", "name", "text"), ("source", "source", "text"),
                                                    *[(k, k, "") for k in aggregate.COUNTER_FIELDS]],
        md_columns=columns, title="Unified-memory counters from Nsight Systems (whole run)",
        notes=["nsys exports no thrashing, throttling or remote-map events: n/a there means not measured."])
    print(md_path.read_text())
    print(f"wrote {csv_path} and {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
