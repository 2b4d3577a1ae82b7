"""Unified-memory profiling, in process: page faults, migrated bytes by direction and cause,
thrashing, throttling and remote maps, per training step and in total (CUPTI), a timeline of
GPU-resident bytes per tag for one step, tables and charts, and Nsight Systems exports read
into the same table.

    from um_alloc.profile import UMCounters
    with UMCounters() as counters:
        for batch in loader:
            step(batch)
            counters.mark_step()
    print(counters.totals()["gpu_page_faults"])

Any script, unchanged: ``python -m um_alloc.profile your_script.py ARGS`` (steps are marked
after every ``optimizer.step()``). The BERT example: ``--profile``, or ``UM_PROFILE=1``.
Nothing here imports cupti or matplotlib until it is used.
"""
from __future__ import annotations

from .aggregate import CAUSE_ORDER, COUNTER_FIELDS, StepCounts, per_step, totals
from .um_counters import ENV_FLAG, CountersUnavailable, UMCounters, active, env_enabled, mark_step

__all__ = ["UMCounters", "CountersUnavailable", "active", "mark_step", "env_enabled", "ENV_FLAG",
           "COUNTER_FIELDS", "CAUSE_ORDER", "StepCounts", "per_step", "totals"]
