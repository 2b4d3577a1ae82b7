"""The fields of the core's statistics, once for the whole package.

``um_stats`` in csrc/um_alloc.h is the source of truth; FIELDS lists it field by field, in its
order: _lib.py builds the ctypes mirror from it (and load() checks the two have one size),
pool.py reads the counts by it, and stats.py renames them by it for memory_stats().
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Field", "FIELDS", "PER_TAG", "TOTALS"]


class Field(NamedTuple):
    core: str        # the member of um_stats
    public: str      # its key in um_alloc.memory_stats() (in "tags" when per_tag)
    per_tag: bool    # an array of one count per tag, else one count


def _per_tag(core: str, public: str | None = None) -> Field:
    return Field(core, public or core, True)


def _total(core: str, public: str | None = None) -> Field:
    return Field(core, public or core, False)


FIELDS: tuple[Field, ...] = (
    _per_tag("live_bytes"), _per_tag("peak_live_bytes", "peak_bytes"),
    _per_tag("held_bytes", "reserved_bytes"), _per_tag("allocations"), _per_tag("frees"),
    _total("live_bytes_total", "live_bytes"), _total("peak_live_bytes_total", "peak_live_bytes"),
    _total("reserved_bytes"), _total("peak_reserved_bytes"), _total("max_reserved_bytes", "limit_bytes"),
    _total("arena_count", "arenas"),
    _total("chunk_size"), _total("large_blocks"), _total("small_chunks"), _total("small_blocks"),
    _total("fragmentation_bytes"), _total("internal_waste_bytes"), _total("internal_waste_bound_bytes"),
    _total("free_chunk_bytes"), _total("largest_free_run_bytes"),
    _total("num_ooms"), _total("advise_calls"), _total("prefetch_calls"), _total("prefetch_bytes"),
    _total("stream_waits"), _total("backend_errors"), _total("free_events"),
    _total("arena_reserves"), _total("arena_releases"),
    _per_tag("resident_bytes"), _total("resident_free_bytes"), _total("resident_bytes_total", "resident_bytes"),
    _total("peak_resident_bytes"), _total("budget_bytes"), _total("min_swap_size"), _total("evictions"),
    _total("evicted_bytes"), _total("over_budget_allocations"),
    _total("backed_bytes", "gpu_backed_bytes"), _total("peak_backed_bytes", "peak_gpu_backed_bytes"),
    _total("overflow_allocations"), _total("overflow_bytes"), _total("peak_overflow_bytes"),
)
PER_TAG = tuple(f for f in FIELDS if f.per_tag)
TOTALS = tuple(f for f in FIELDS if not f.per_tag)
