"""The controls users of IBM's Large Model Support know, as thin functions over um_alloc's settings.

    set_enabled_lms(True)        # budget enforcement on or off (the policy's scheduler.budget stays)
    set_limit_lms("10GiB")       # the GPU residency budget (scheduler.budget)
    set_size_lms("1MiB")         # allocations smaller than this are never swapped (scheduler.min_swap_size)

They act on the pool of the device um_alloc was installed for, from the next allocation on, and
the limit is what installation().budget reports from then on (um_alloc.offload.from_policy and
the profile's memory timeline size themselves by it). The budget keeps the mode the policy chose:
hard by default (scheduler.evict_live: false), a bound on the GPU memory the driver backs for the
pool; nothing is evicted, wholly free arenas are returned, then allocations fail as out of memory.
With evict_live: true it is kept reactively: least recently used chunks move to host memory when
an allocation would pass it, and page faults bring them back when needed.
"""
from __future__ import annotations

from . import arguments
from .errors import At
from .install import installation, set_budget
from .pool import ChunkPool
from .sizes import format_size, size_text

__all__ = ["set_enabled_lms", "get_enabled_lms", "set_limit_lms", "get_limit_lms", "set_size_lms",
           "get_size_lms"]


def _pool() -> ChunkPool:
    return ChunkPool.for_device(installation().device)


def _settings() -> tuple[int, int, bool]:
    pool = _pool()
    stats = pool.raw_stats()
    return stats["budget_bytes"], stats["min_swap_size"], pool.budget_enabled()


def set_enabled_lms(enable: bool) -> None:
    """Turns budget enforcement on or off without forgetting the limit. `enable`: True or False."""
    enable = arguments.flag(enable, At("set_enabled_lms()", "enable"))
    limit, size, _ = _settings()
    set_budget(limit, size, enable)


def get_enabled_lms() -> bool:
    return _settings()[2]


def set_limit_lms(limit: int | str) -> None:
    """The GPU residency budget in bytes (or '10GiB'), at most the device's memory; 0 removes it."""
    at = At("set_limit_lms()", "limit")
    budget = arguments.size(limit, at)
    total = installation().device_total
    if budget > total:
        raise at.error(f"larger than the device's memory ({format_size(total)}, {total} bytes)",
                       allowed=f"0 (no budget) to {size_text(total)}", received=limit)
    _, size, enabled = _settings()
    set_budget(budget, size, enabled)


def get_limit_lms() -> int:
    return _settings()[0]


def set_size_lms(size: int | str) -> None:
    """Allocations smaller than `size` bytes (or '1MiB') are never swapped out."""
    smallest = arguments.size(size, At("set_size_lms()", "size"))
    limit, _, enabled = _settings()
    set_budget(limit, smallest, enabled)


def get_size_lms() -> int:
    return _settings()[1]
