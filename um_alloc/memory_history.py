"""PyTorch's memory history and snapshots under um_alloc: a warning, and an error that says what
to use, where PyTorch's pluggable allocator raises "does not yet support".

PyTorch's guide to understanding CUDA memory usage has a script start with
``torch.cuda.memory._record_memory_history()`` and end with ``torch.cuda.memory._dump_snapshot()``.
A script that debugs its out-of-memory errors that way would stop at that first line under
um_alloc: "CUDAPluggableAllocator does not yet support recordHistory". Recording is a debugging
aid the training does not need, so install() makes the call warn once and record nothing. A
snapshot (``torch.cuda.memory_snapshot()``, ``torch.cuda.memory._snapshot()``, ``_dump_snapshot()``)
describes the caching allocator's segments and blocks, which um_alloc's pool does not have:
it raises MemorySnapshotUnsupported, which names what shows um_alloc's memory instead.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["HISTORY_WARNING", "MemorySnapshotUnsupported", "answer_memory_history"]

HISTORY_WARNING = (
    "um_alloc: torch.cuda.memory._record_memory_history() records nothing under um_alloc: PyTorch's "
    "pluggable allocator keeps no history. um_alloc.memory_summary() gives live, peak and reserved bytes "
    "per tag, and bert_example/train.py --timeline draws them over a step.")
SNAPSHOT_MESSAGE = (
    "um_alloc: PyTorch's memory snapshot describes its caching allocator's segments, which um_alloc "
    "replaces; under um_alloc there is none. um_alloc.memory_summary() and um_alloc.memory_stats() give "
    "live, peak and reserved bytes per tag, and torch.cuda.max_memory_allocated() works.")

_HISTORY = ("_cuda_record_memory_history", "_cuda_record_memory_history_legacy")
_SNAPSHOT = "_cuda_memorySnapshot"


class MemorySnapshotUnsupported(RuntimeError):
    """A snapshot of PyTorch's caching allocator was asked for while um_alloc is the allocator."""


def answer_memory_history() -> None:
    """Makes the memory-history calls warn and record nothing, and a snapshot raise
    MemorySnapshotUnsupported (idempotent)."""
    if getattr(getattr(torch._C, _SNAPSHOT, None), "answered_by_um_alloc", False):
        return
    warned = []

    def record_nothing(*args, **kwargs) -> None:
        enabled = args[0] if args else kwargs.get("enabled", True)  # False or None: turned off
        if enabled and not warned:
            warned.append(True)
            warnings.warn(HISTORY_WARNING, UserWarning, stacklevel=4)

    def no_snapshot(*args, **kwargs):
        raise MemorySnapshotUnsupported(SNAPSHOT_MESSAGE)

    for name in _HISTORY:
        setattr(torch._C, name, record_nothing)
    no_snapshot.answered_by_um_alloc = True
    setattr(torch._C, _SNAPSHOT, no_snapshot)
