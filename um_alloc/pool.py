"""A Python handle on one chunk pool of the C++ core.

`ChunkPool.for_device(d)` is the pool PyTorch allocates from once um_alloc is installed;
`ChunkPool.host(...)` runs the same placement, reuse and stream logic over host memory, so it
can be tested (and studied) on a machine without a GPU.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import _lib
from .stats_fields import PER_TAG, TOTALS
from .tag_names import TAGS, tag_index

RESIDENCY = ("untouched", "gpu", "host")
_LOCATIONS = {"none": 0, "gpu": 1, "cpu": 2}


@dataclass(frozen=True)
class BlockInfo:
    """What the pool holds at an address: the allocation containing it."""

    base: int
    size: int        # bytes the block occupies (whole chunks for large blocks)
    requested: int   # bytes that were asked for
    tag: str
    is_small: bool   # sub-allocated inside a chunk shared with other small blocks of its tag
    residency: str   # where the pool believes the chunk holding the address asked about lives


def tag_policy_struct(advice) -> _lib.TagPolicyC:
    """A policy.TagAdvice as the C struct the core takes."""
    return _lib.TagPolicyC(
        preferred_location=_LOCATIONS[advice.preferred_location],
        read_mostly=int(advice.read_mostly),
        accessed_by_gpu=int("gpu" in advice.accessed_by),
        accessed_by_cpu=int("cpu" in advice.accessed_by),
        prefetch=int(advice.prefetch),
    )


def _raise_last_error(what: str):
    kind, message = _lib.last_error()
    if kind == _lib.ERR_OOM:
        raise torch.OutOfMemoryError(message)
    raise RuntimeError(f"um_alloc: {what}: {message}")


class ChunkPool:
    def __init__(self, handle: int, owned: bool):
        self._lib = _lib.load()
        self._handle = handle
        self._owned = owned

    @classmethod
    def host(cls, chunk_size: int = 2 << 20, arena_size: int = 1 << 30,
             max_reserved: int = 2**64 - 1) -> "ChunkPool":
        """A pool over host mappings: the same logic with device operations only counted."""
        handle = _lib.load().um_pool_create_host(chunk_size, arena_size, max_reserved)
        if not handle:
            _raise_last_error("cannot create a host pool")
        return cls(handle, owned=True)

    @classmethod
    def managed(cls, device: int = 0, chunk_size: int = 2 << 20, arena_size: int = 1 << 30,
                max_reserved: int = 2**64 - 1) -> "ChunkPool":
        """A pool of its own on managed memory, beside the one PyTorch uses (for tests and tools)."""
        handle = _lib.load().um_pool_create_managed(device, chunk_size, arena_size, max_reserved)
        if not handle:
            _raise_last_error("cannot create a managed pool")
        return cls(handle, owned=True)

    @classmethod
    def for_device(cls, device: int) -> "ChunkPool":
        handle = _lib.load().um_pool_for_device(device)
        if not handle:
            _raise_last_error(f"no pool for device {device}")
        return cls(handle, owned=False)

    def close(self) -> None:
        if self._owned and self._handle:
            self._lib.um_pool_destroy(self._handle)
        self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def malloc(self, nbytes: int, stream: int = 0, tag: str = "activation") -> int:
        """Raises torch.OutOfMemoryError when the pool's cap is reached."""
        ptr = self._lib.um_pool_malloc(self._handle, nbytes, stream, tag_index(tag))
        if not ptr:
            _raise_last_error(f"allocation of {nbytes} bytes failed")
        return ptr

    def free(self, ptr: int) -> None:
        if self._lib.um_pool_free(self._handle, ptr) != 0:
            _raise_last_error(f"free({ptr:#x})")

    def record_stream(self, ptr: int, stream: int) -> None:
        if self._lib.um_pool_record_stream(self._handle, ptr, stream) != 0:
            _raise_last_error(f"record_stream({ptr:#x})")

    def retag(self, ptr: int, tag: str, stream: int = 0) -> None:
        if self._lib.um_pool_retag(self._handle, ptr, tag_index(tag), stream) != 0:
            _raise_last_error(f"retag({ptr:#x}, {tag!r})")

    def retag_many(self, ptrs: list[int], tag: str, stream: int = 0) -> int:
        """retag() for many allocations in one call; returns how many the pool holds."""
        array = (ctypes.c_void_p * len(ptrs))(*ptrs)
        return self._lib.um_pool_retag_many(self._handle, array, len(ptrs), tag_index(tag), stream)

    def migrate(self, ptr: int, to_gpu: bool, stream: int = 0) -> int:
        """Moves the large allocation containing ptr to the GPU or the host on `stream`; bytes moved."""
        return self._lib.um_pool_migrate(self._handle, ptr, int(to_gpu), stream)

    def block_at(self, ptr: int) -> BlockInfo | None:
        info = _lib.BlockInfoC()
        if self._lib.um_pool_block_at(self._handle, ptr, ctypes.byref(info)) != 0:
            return None
        return BlockInfo(info.base, info.size, info.requested, TAGS[info.tag], bool(info.is_small),
                         RESIDENCY[info.residency])

    def ranges_for_tag(self, tag: str) -> list[tuple[int, int]]:
        """(base, bytes) of every live allocation carrying `tag`, in address order."""
        capacity = 256
        while True:
            buf = (_lib.RangeC * capacity)()
            n = self._lib.um_pool_ranges_for_tag(self._handle, tag_index(tag), buf, capacity)
            if n <= capacity:
                return [(buf[i].base, buf[i].bytes) for i in range(n)]
            capacity = n  # it grew between calls at most by what other threads allocated

    def empty_cache(self) -> int:
        """Returns wholly free arenas to the driver; the bytes released."""
        return self._lib.um_pool_empty_cache(self._handle)

    def set_tag_policy(self, tag: str, advice) -> None:
        self._lib.um_pool_set_tag_policy(self._handle, tag_index(tag), tag_policy_struct(advice))

    def raw_stats(self) -> dict:
        s = _lib.StatsC()
        self._lib.um_pool_stats(self._handle, ctypes.byref(s))
        out = {f.core: getattr(s, f.core) for f in TOTALS}
        out["tags"] = {tag: {f.core: getattr(s, f.core)[i] for f in PER_TAG} for i, tag in enumerate(TAGS)}
        return out

    def device_live(self) -> tuple[int, int]:
        """(live, peak): bytes of live allocations whose tag is not host-mapped, which kernels keep
        in GPU memory, and their peak since reset_device_peak(). One lock, no stats copy."""
        live, peak = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.um_pool_device_live(self._handle, ctypes.byref(live), ctypes.byref(peak))
        return live.value, peak.value

    def device_backed(self) -> tuple[int, int]:
        """(backed, peak): bytes of chunks backed by GPU memory, live or free (what a hard budget
        counts), and their peak since reset_device_peak()."""
        backed, peak = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.um_pool_device_backed(self._handle, ctypes.byref(backed), ctypes.byref(peak))
        return backed.value, peak.value

    def device_held(self) -> tuple[int, int]:
        """(held, peak): of the GPU-backed bytes, those in arenas holding a live allocation, which
        a hard budget cannot get back by returning wholly free arenas, and their peak since
        reset_device_peak(). Beyond live bytes, the fragmentation the present layout costs."""
        held, peak = ctypes.c_uint64(), ctypes.c_uint64()
        self._lib.um_pool_device_held(self._handle, ctypes.byref(held), ctypes.byref(peak))
        return held.value, peak.value

    def reset_peaks(self) -> None:
        """Starts raw_stats()'s peaks of live bytes (per tag and in all) and of reserved bytes over
        from the bytes now, as torch.cuda.reset_peak_memory_stats() does PyTorch's."""
        self._lib.um_pool_reset_peaks(self._handle)

    def reset_device_peak(self) -> None:
        """Starts device_live()'s, device_backed()'s and device_held()'s peaks over from the bytes now."""
        self._lib.um_pool_reset_device_peak(self._handle)

    def set_overflow(self, nbytes: int) -> None:
        """Under a hard budget, up to `nbytes` of large requests made while step arenas are on,
        which the budget would refuse, go to host memory the GPU maps instead of failing (0, the
        default: none). The step runs slower, its kernels reaching those bytes over the link, and
        the budget holds. raw_stats() counts them (overflow_allocations, overflow_bytes)."""
        self._lib.um_pool_set_overflow(self._handle, nbytes)

    def take_overflow_peak(self) -> int:
        """The most overflowed bytes live at once since the last call (whole chunks)."""
        return self._lib.um_pool_take_overflow_peak(self._handle)

    def set_step_arenas(self, on: bool) -> None:
        """On: what is allocated from now on comes from the pool's step arenas, apart from data
        that outlasts a training step (parameters, optimizer state: allocated while it is off).
        Between steps the step arenas are then wholly free, and empty_cache() returns them with
        the GPU memory the driver backs them with, which a hard budget counts until then."""
        self._lib.um_pool_set_step_arenas(self._handle, int(on))

    def step_arenas(self) -> bool:
        return bool(self._lib.um_pool_step_arenas(self._handle))

    def set_budget(self, budget: int, min_swap_size: int = 1 << 20, enabled: bool = True,
                   evict_live: bool = False) -> None:
        """GPU residency budget in bytes (0: none); allocations smaller than min_swap_size stay put.
        Hard by default: a bound on GPU-backed chunks; nothing is evicted, wholly free arenas are
        returned, then allocations fail (OOM). evict_live=True keeps it reactively instead: least
        recently used chunks move to host memory, and page faults bring them back."""
        self._lib.um_pool_set_budget(self._handle, budget, min_swap_size, int(enabled), int(evict_live))

    def budget_enabled(self) -> bool:
        return bool(self._lib.um_pool_budget_enabled(self._handle))

    def budget_evicts_live(self) -> bool:
        return bool(self._lib.um_pool_budget_evicts_live(self._handle))

    def backend_error(self) -> str:
        return (self._lib.um_pool_backend_error(self._handle) or b"").decode()
