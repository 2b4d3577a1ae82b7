"""PYTORCH_CUDA_ALLOC_CONF under um_alloc: a warning where it holds settings of PyTorch's own
device allocator, which no longer runs.

PyTorch's out-of-memory message suggests ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, so
many environments set it, or ``max_split_size_mb``, ``garbage_collection_threshold``,
``roundup_power2_divisions``, ``backend:cudaMallocAsync``. Each configures PyTorch's caching
allocator, which um_alloc replaces: under um_alloc they have no effect, and a user who set them
against fragmentation would not know. The ``pinned_*`` settings configure PyTorch's pinned host
allocator, which still runs, and are left alone. Recent PyTorch versions also read the same
settings from ``PYTORCH_ALLOC_CONF``: both variables are looked at. install() warns, naming the
settings it found and what shapes um_alloc's pool instead.
"""
from __future__ import annotations

import os
import warnings

__all__ = ["ALLOC_CONF_WARNING", "device_allocator_settings", "warn_on_pytorch_alloc_conf"]

ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
HOST_PREFIX = "pinned_"  # the pinned host allocator's settings, which apply under um_alloc too

ALLOC_CONF_WARNING = (
    "um_alloc: {variable} sets {settings} for PyTorch's own CUDA allocator, which um_alloc replaces: "
    "{they} no effect. um_alloc's pool is shaped by its policy (pool.chunk_size, pool.arena_size, "
    "pool.max_reserved; docs/policies.md), and wastes less than one chunk a request.")


def device_allocator_settings(environ=os.environ) -> dict[str, list[str]]:
    """Per variable set, the names of its settings for PyTorch's device allocator (none listed:
    it holds only pinned_* settings, or nothing)."""
    found = {}
    for variable in ENV_VARS:
        names = [item.split(":", 1)[0].strip() for item in _items(environ.get(variable, ""))]
        device = [name for name in names if name and not name.startswith(HOST_PREFIX)]
        if device:
            found[variable] = device
    return found


def _items(value: str) -> list[str]:
    """The comma-separated settings of `value`; a bracketed list (roundup_power2_divisions:[256:1,>:4])
    stays inside its setting."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(value):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(value[start:i])
            start = i + 1
    return items + [value[start:]]


def warn_on_pytorch_alloc_conf(environ=os.environ) -> None:
    """Warns where the environment configures PyTorch's device allocator, which um_alloc replaces."""
    for variable, settings in device_allocator_settings(environ).items():
        warnings.warn(ALLOC_CONF_WARNING.format(variable=variable, settings=", ".join(settings),
                                                they="it has" if len(settings) == 1 else "they have"),
                      UserWarning, stacklevel=3)
