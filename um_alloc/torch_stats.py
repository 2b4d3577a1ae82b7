"""PyTorch's own memory statistics, answered by the pool.

Under a pluggable allocator PyTorch cannot count: torch.cuda.memory_stats(), memory_allocated(),
max_memory_allocated(), memory_reserved(), max_memory_reserved(), memory_summary() and
reset_peak_memory_stats() raise "CUDAPluggableAllocator does not yet support getDeviceStats"
(pytorch/pytorch#133281). Training scripts call them to log memory, so under ``python -m um_alloc
run`` a script would stop at its first such line. install() points the three functions of
torch._C that all of them go through at these, which read the pool of the device asked for.

What the pool counts, in PyTorch's keys ("all" of each; "large_pool" and "small_pool" stay 0):
- allocated_bytes, active_bytes, requested_bytes: bytes asked for and still live, and their peak;
- reserved_bytes: managed memory the pool reserved, and its peak;
- allocation, active: live allocations now; "allocated" and "freed" count calls;
- segment: the pool's arenas; "allocated" and "freed" count the arenas reserved and released;
- num_ooms; num_device_alloc and num_device_free, the arenas reserved and released.
Everything else (cumulative bytes, peaks of counts, splits) is 0: the pool does not count it.
reset_peak_memory_stats() starts the byte peaks over, also those um_alloc.memory_stats() reports;
reset_accumulated_memory_stats() starts the counts of calls, arenas and OOMs over.
"""
from __future__ import annotations

import torch

from .pool import ChunkPool

__all__ = ["answer_torch_memory_stats", "nested_stats"]

_METRICS = ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes", "inactive_split_bytes",
            "allocation", "active", "segment", "inactive_split")
_UNPOOLED = ("oversize_allocations", "oversize_segments")  # one count each, not one per pool
_COUNTS = ("allocations", "frees", "arena_reserves", "arena_releases", "num_ooms")
_baselines: dict[int, dict[str, int]] = {}  # per device: the counts at reset_accumulated_memory_stats()


def answer_torch_memory_stats() -> None:
    """Points torch._C's statistics entry points at the pool (install() calls this once)."""
    torch._C._cuda_memoryStats = _memory_stats
    torch._C._cuda_resetPeakMemoryStats = _reset_peaks
    torch._C._cuda_resetAccumulatedMemoryStats = _reset_accumulated


def nested_stats(raw: dict, baseline: dict[str, int] | None = None) -> dict:
    """torch.cuda.memory_stats_as_nested_dict()'s shape, from ChunkPool.raw_stats(); `baseline`:
    the counts to leave out (those at the last reset_accumulated_memory_stats())."""
    counts = _counts(raw)
    since = {k: counts[k] - (baseline or {}).get(k, 0) for k in _COUNTS}
    stats = {metric: _metric() for metric in _METRICS}
    stats.update({metric: _counted() for metric in _UNPOOLED})
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes"):
        stats[metric]["all"].update(current=raw["live_bytes_total"], peak=raw["peak_live_bytes_total"])
    stats["reserved_bytes"]["all"].update(current=raw["reserved_bytes"], peak=raw["peak_reserved_bytes"])
    live_allocations = raw["large_blocks"] + raw["small_blocks"]
    for metric in ("allocation", "active"):
        stats[metric]["all"].update(current=live_allocations, allocated=since["allocations"], freed=since["frees"])
    stats["segment"]["all"].update(current=raw["arena_count"], allocated=since["arena_reserves"],
                                   freed=since["arena_releases"])
    stats.update(num_alloc_retries=0, num_ooms=since["num_ooms"], num_sync_all_streams=0,
                 num_device_alloc=since["arena_reserves"], num_device_free=since["arena_releases"],
                 max_split_size=-1)
    return stats


def _metric() -> dict:
    return {pool: _counted() for pool in ("all", "large_pool", "small_pool")}


def _counted() -> dict:
    return {"current": 0, "peak": 0, "allocated": 0, "freed": 0}


def _counts(raw: dict) -> dict[str, int]:
    tags = raw["tags"].values()
    return {"allocations": sum(t["allocations"] for t in tags), "frees": sum(t["frees"] for t in tags),
            "arena_reserves": raw["arena_reserves"], "arena_releases": raw["arena_releases"],
            "num_ooms": raw["num_ooms"]}


def _memory_stats(device: int) -> dict:
    return nested_stats(_pool(device).raw_stats(), _baselines.get(device))


def _reset_peaks(device: int) -> None:
    _pool(device).reset_peaks()


def _reset_accumulated(device: int) -> None:
    _baselines[device] = _counts(_pool(device).raw_stats())


def _pool(device: int) -> ChunkPool:
    """The pool of `device` (PyTorch resolves None to the current device's index before calling)."""
    return ChunkPool.for_device(device)
