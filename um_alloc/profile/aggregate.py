"""Unified-memory activity records -> counts, in total and per training step. Pure Python.

A *record* is one CUPTI ``CUpti_ActivityUnifiedMemoryCounter3`` as a plain dict (um_counters.py
makes them; nsys.py makes the same dicts from an Nsight Systems export; tests load them from JSON):

    {"kind": "GPU_PAGE_FAULT", "value": 2, "start": 1000, "end": 1800, "address": 0x7f..., "flags": 1}

``kind`` is the counter kind's CUPTI name, ``start``/``end`` are CUPTI timestamps in ns, and
``value`` and ``flags`` mean what CUPTI documents for each kind:

| kind | value | flags |
|---|---|---|
| BYTES_TRANSFER_HTOD / _DTOH / _DTOD | bytes migrated | migration cause |
| GPU_PAGE_FAULT | page-fault groups for the page | access type |
| CPU_PAGE_FAULT_COUNT | program counter of the faulting instruction (so we count records) | - |
| THRASHING | bytes of the thrashing region | - |
| THROTTLING | - (we sum end - start, the time the driver throttled) | - |
| REMOTE_MAP | bytes mapped remotely instead of migrated | remote-map cause |

Steps: marks are CUPTI timestamps taken after each step; a record belongs to the step whose
interval holds its ``start``. Records before the origin (``start_steps``) are set-up traffic.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable, Mapping

# CUpti_ActivityUnifiedMemoryCounterKind values (cupti_activity.h; um_counters.py checks them
# against the installed cupti-python before trusting them).
COUNTER_KINDS = {1: "BYTES_TRANSFER_HTOD", 2: "BYTES_TRANSFER_DTOH", 3: "CPU_PAGE_FAULT_COUNT",
                 4: "GPU_PAGE_FAULT", 5: "THRASHING", 6: "THROTTLING", 7: "REMOTE_MAP",
                 8: "BYTES_TRANSFER_DTOD"}

# CUpti_ActivityUnifiedMemoryMigrationCause -> our column name. CUPTI's names are not ours:
# USER is an explicit cudaMemPrefetchAsync (what um_alloc issues), COHERENCE is
# a CPU or GPU page fault, and PREFETCH is the driver's own speculative migration around a fault.
MIGRATION_CAUSES = {0: "unknown", 1: "prefetch", 2: "fault", 3: "speculative", 4: "eviction",
                    5: "access_counters"}
CAUSE_ORDER = ("fault", "prefetch", "speculative", "eviction", "access_counters", "unknown")

_DIRECTIONS = {"BYTES_TRANSFER_HTOD": "htod", "BYTES_TRANSFER_DTOH": "dtoh"}

# Every counter, in table order. Each is an int >= 0 when measured; None means "not measured".
COUNTER_FIELDS = (
    "gpu_page_faults", "gpu_fault_pages", "cpu_page_faults",
    "htod_bytes", "dtoh_bytes", "dtod_bytes", "htod_transfers", "dtoh_transfers",
    *(f"htod_{cause}_bytes" for cause in CAUSE_ORDER),
    *(f"dtoh_{cause}_bytes" for cause in CAUSE_ORDER),
    "thrashing_events", "thrashing_bytes", "throttling_events", "throttling_ns",
    "remote_map_events", "remote_map_bytes", "um_records",
)


def kind_name(kind) -> str:
    """A record's kind as a name, whether it was stored as CUPTI's int or as the name."""
    if isinstance(kind, str):
        return kind
    try:
        return COUNTER_KINDS[int(kind)]
    except KeyError:
        raise ValueError(f"unknown unified-memory counter kind {kind!r}; known: "
                         f"{', '.join(f'{k}={n}' for k, n in COUNTER_KINDS.items())}") from None


def empty_counts() -> dict:
    return dict.fromkeys(COUNTER_FIELDS, 0)


def add_record(counts: dict, record: Mapping) -> None:
    """Adds one record to `counts` (a dict from empty_counts())."""
    kind = kind_name(record["kind"])
    value = int(record.get("value", 0))
    counts["um_records"] += 1
    if kind in _DIRECTIONS:
        direction = _DIRECTIONS[kind]
        cause = MIGRATION_CAUSES.get(int(record.get("flags", 0)), "unknown")
        counts[f"{direction}_bytes"] += value
        counts[f"{direction}_transfers"] += 1
        counts[f"{direction}_{cause}_bytes"] += value
    elif kind == "BYTES_TRANSFER_DTOD":
        counts["dtod_bytes"] += value
    elif kind == "GPU_PAGE_FAULT":
        counts["gpu_page_faults"] += value
        counts["gpu_fault_pages"] += 1
    elif kind == "CPU_PAGE_FAULT_COUNT":
        counts["cpu_page_faults"] += 1  # value is a program counter, not a count
    elif kind == "THRASHING":
        counts["thrashing_events"] += 1
        counts["thrashing_bytes"] += value
    elif kind == "THROTTLING":
        counts["throttling_events"] += 1
        counts["throttling_ns"] += max(0, int(record.get("end", 0)) - int(record.get("start", 0)))
    elif kind == "REMOTE_MAP":
        counts["remote_map_events"] += 1
        counts["remote_map_bytes"] += value


def totals(records: Iterable[Mapping]) -> dict:
    counts = empty_counts()
    for record in records:
        add_record(counts, record)
    return counts


def merge(parts: Iterable[Mapping]) -> dict:
    """The sum of several count dicts (None anywhere makes that field None: not measured)."""
    out = empty_counts()
    for part in parts:
        for key in COUNTER_FIELDS:
            out[key] = None if out[key] is None or part.get(key) is None else out[key] + part[key]
    return out


def mean(parts: list[Mapping]) -> dict | None:
    """Per-step mean of each counter (floats), or None for no steps."""
    if not parts:
        return None
    summed = merge(parts)
    return {k: (None if v is None else v / len(parts)) for k, v in summed.items()}


class StepCounts:
    """Counts per step, filled record by record as CUPTI delivers them, in any order.

    Memory is O(steps), not O(records): a BERT-Large step under a bad policy can produce
    hundreds of thousands of records. A record's step is found from its start timestamp, so it
    does not matter how late CUPTI hands it over.
    """

    def __init__(self, origin_ns: int = 0):
        self.origin_ns = origin_ns
        self.marks: list[int] = []      # end of step i (ns); appended in time order
        self.setup = empty_counts()     # records before origin_ns
        self._steps: list[dict] = [empty_counts()]  # the last one is the step still open

    def start_steps(self, origin_ns: int) -> None:
        """Records from now on belong to steps; earlier ones to set-up. Before the first mark only."""
        if self.marks:
            raise RuntimeError(f"start_steps() after {len(self.marks)} marked steps; call it before the first mark_step()")
        self.origin_ns = origin_ns

    def mark(self, now_ns: int) -> None:
        if self.marks and now_ns < self.marks[-1]:
            raise ValueError(f"mark at {now_ns} ns is before the previous one at {self.marks[-1]} ns")
        self.marks.append(now_ns)
        self._steps.append(empty_counts())

    def add(self, record: Mapping) -> None:
        start = int(record.get("start", 0))
        if start < self.origin_ns:
            add_record(self.setup, record)
            return
        # bisect_right: a record starting exactly at a mark goes to the step after it.
        add_record(self._steps[bisect_right(self.marks, start)], record)

    def per_step(self) -> list[dict]:
        """Closed steps, each with "step" (0-based), "start_ns", "end_ns" and every counter."""
        starts = [self.origin_ns, *self.marks[:-1]]
        return [{"step": i, "start_ns": s, "end_ns": e, **counts}
                for i, (s, e, counts) in enumerate(zip(starts, self.marks, self._steps))]

    def after_last_mark(self) -> dict:
        return dict(self._steps[-1])

    def totals(self) -> dict:
        return merge([self.setup, *self._steps])


def per_step(records: Iterable[Mapping], marks: list[int], origin_ns: int = 0) -> StepCounts:
    """StepCounts for recorded records and marks (for JSON fixtures and nsys exports)."""
    counts = StepCounts(origin_ns)
    for mark in marks:
        counts.mark(mark)
    for record in records:
        counts.add(record)
    return counts
