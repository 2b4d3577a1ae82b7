"""CUDA graphs under um_alloc: refused at once, with what to use instead.

A captured graph replays fixed addresses, so PyTorch gives each graph a private memory pool: the
allocator must route allocations made during capture (and during torch.compile's warm-up of
``mode="reduce-overhead"``) to that pool and keep it for the graph's life. A pluggable allocator
does this only through its graph-pool hooks, which um_alloc does not implement; and the managed
pool's ``cudaMemAdvise`` and prefetch calls are not allowed on a capturing stream. Without the
hooks PyTorch would capture anyway and fail later and elsewhere (reduce-overhead stops with
"pluggable does not yet support checkPoolLiveAllocations"), or replay into memory that has
been handed out again. install() therefore makes both entries into a graph pool raise
CudaGraphsUnsupported:

- ``torch.cuda.CUDAGraph.capture_begin``: ``torch.cuda.graph``, ``make_graphed_callables``, and
  the recording of reduce-overhead's graphs;
- ``torch._C._cuda_beginAllocateCurrentThreadToPool``: reduce-overhead's warm-up, before it records.
"""
from __future__ import annotations

import functools

__all__ = ["CudaGraphsUnsupported", "MESSAGE", "refuse_cuda_graphs", "allow_cuda_graphs"]

MESSAGE = (
    "um_alloc: CUDA graphs cannot be captured under um_alloc ({where}): a graph needs a private memory "
    "pool, which um_alloc's pluggable allocator does not provide (PyTorch's graph-pool hooks are not "
    "implemented), and the managed pool's advice and prefetch calls are not allowed while a stream "
    "captures. Use torch.compile in its default mode (mode=None or \"max-autotune-no-cudagraphs\"), "
    "which trains under um_alloc, or run this process without um_alloc.install() to capture graphs "
    "with PyTorch's own allocator.")

_ENTRIES = (("torch.cuda.CUDAGraph.capture_begin", "torch.cuda.graphs", "CUDAGraph", "capture_begin"),
            ("torch.compile(mode=\"reduce-overhead\")", "torch._C", None, "_cuda_beginAllocateCurrentThreadToPool"))
_originals: dict = {}  # (owner, name) -> what was there, while refused


class CudaGraphsUnsupported(RuntimeError):
    """CUDA-graph capture was asked for while um_alloc is PyTorch's allocator."""


def refuse_cuda_graphs() -> None:
    """Makes every entry into a CUDA-graph pool raise CudaGraphsUnsupported (idempotent)."""
    for where, owner in _owners():
        name = owner[1]
        if (owner[0], name) not in _originals and hasattr(owner[0], name):
            _originals[(owner[0], name)] = getattr(owner[0], name)
            setattr(owner[0], name, _refusing(where, getattr(owner[0], name)))


def allow_cuda_graphs() -> None:
    """Puts PyTorch's entries back (tests; a process keeps its allocator for life)."""
    for (target, name), original in _originals.items():
        setattr(target, name, original)
    _originals.clear()


def _owners():
    import importlib

    for where, module, cls, name in _ENTRIES:
        target = importlib.import_module(module)
        target = getattr(target, cls, None) if cls else target
        if target is not None:
            yield where, (target, name)


def _refusing(where: str, original):
    @functools.wraps(original)
    def refuse(*args, **kwargs):
        raise CudaGraphsUnsupported(MESSAGE.format(where=where))
    return refuse
