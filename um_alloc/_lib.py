"""Loads the C++ core (um_alloc/_core*.so) once and declares its C functions for ctypes.

The library stays loaded for the life of the process: PyTorch holds pointers to its functions
once it is installed as the allocator.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch  # noqa: F401  -- loads libc10, which the core links against, before the core

from .stats_fields import FIELDS
from .tag_names import TAGS

NUM_TAGS = len(TAGS)
_U64xT = ctypes.c_uint64 * NUM_TAGS


class TagPolicyC(ctypes.Structure):
    _fields_ = [("preferred_location", ctypes.c_int8), ("read_mostly", ctypes.c_uint8),
                ("accessed_by_gpu", ctypes.c_uint8), ("accessed_by_cpu", ctypes.c_uint8),
                ("prefetch", ctypes.c_uint8)]


class BlockInfoC(ctypes.Structure):
    _fields_ = [("base", ctypes.c_uint64), ("size", ctypes.c_uint64), ("requested", ctypes.c_uint64),
                ("tag", ctypes.c_int32), ("is_small", ctypes.c_int32), ("residency", ctypes.c_int32)]


class RangeC(ctypes.Structure):
    _fields_ = [("base", ctypes.c_uint64), ("bytes", ctypes.c_uint64)]


class StatsC(ctypes.Structure):
    """um_stats (csrc/um_alloc.h), built from stats_fields.FIELDS; load() checks the size."""
    _fields_ = [(f.core, _U64xT if f.per_tag else ctypes.c_uint64) for f in FIELDS]


ERR_OOM = 1

_P, _SZ, _I = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
_SIGNATURES = {
    "um_pool_create_host": (_P, [_SZ, _SZ, _SZ]),
    "um_pool_create_managed": (_P, [_I, _SZ, _SZ, _SZ]),
    "um_pool_for_device": (_P, [_I]),
    "um_pool_destroy": (None, [_P]),
    "um_pool_malloc": (_P, [_P, _SZ, _P, _I]),
    "um_pool_free": (_I, [_P, _P]),
    "um_pool_record_stream": (_I, [_P, _P, _P]),
    "um_pool_retag": (_I, [_P, _P, _I, _P]),
    "um_pool_retag_many": (_SZ, [_P, ctypes.POINTER(ctypes.c_void_p), _SZ, _I, _P]),
    "um_pool_migrate": (_SZ, [_P, _P, _I, _P]),
    "um_pool_block_at": (_I, [_P, _P, ctypes.POINTER(BlockInfoC)]),
    "um_pool_ranges_for_tag": (_SZ, [_P, _I, ctypes.POINTER(RangeC), _SZ]),
    "um_pool_empty_cache": (_SZ, [_P]),
    "um_pool_stats": (None, [_P, ctypes.POINTER(StatsC)]),
    "um_pool_device_live": (None, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "um_pool_reset_device_peak": (None, [_P]),
    "um_pool_reset_peaks": (None, [_P]),
    "um_pool_device_backed": (None, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "um_pool_device_held": (None, [_P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]),
    "um_pool_set_tag_policy": (_I, [_P, _I, TagPolicyC]),
    "um_pool_set_overflow": (None, [_P, _SZ]),
    "um_pool_take_overflow_peak": (ctypes.c_uint64, [_P]),
    "um_pool_set_step_arenas": (None, [_P, _I]),
    "um_pool_step_arenas": (_I, [_P]),
    "um_pool_backend_error": (ctypes.c_char_p, [_P]),
    "um_pool_set_budget": (_I, [_P, _SZ, _SZ, _I, _I]),
    "um_pool_budget_enabled": (_I, [_P]),
    "um_pool_budget_evicts_live": (_I, [_P]),
    "um_set_default_budget": (_I, [_SZ, _SZ, _I, _I]),
    "um_configure": (_I, [_SZ, _SZ, _SZ]),
    "um_set_default_tag_policy": (_I, [_I, TagPolicyC]),
    "um_set_current_tag": (None, [_I]),
    "um_current_tag": (_I, []),
    "um_set_large_tag": (_I, [_I, _SZ]),
    "um_large_tag": (_I, []),
    "um_large_tag_min": (_SZ, []),
    "um_num_tags": (_I, []),
    "um_tag_name": (ctypes.c_char_p, [_I]),
    "um_stats_size": (_SZ, []),
    "um_last_error": (ctypes.c_char_p, []),
    "um_last_error_kind": (_I, []),
}
TORCH_HOOKS = ("um_torch_malloc", "um_torch_free", "um_torch_empty_cache", "um_torch_record_stream")


def library_path() -> Path:
    here = Path(__file__).parent
    found = sorted(here.glob("_core*.so"))
    if not found:
        raise ImportError(
            f"um_alloc's C++ core is not built: no _core*.so in {here}. Install the package with "
            "`pip install --no-build-isolation .` (or build in place: `python setup.py build_ext --inplace`)."
        )
    return found[0]


@functools.cache
def load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library_path()))
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.um_stats_size() != ctypes.sizeof(StatsC):
        raise ImportError(f"um_alloc core/Python mismatch: um_stats is {lib.um_stats_size()} bytes in C++, "
                          f"{ctypes.sizeof(StatsC)} as stats_fields.py lists it; rebuild the package")
    names = tuple(lib.um_tag_name(i).decode() for i in range(lib.um_num_tags()))
    if names != TAGS:
        raise ImportError(f"um_alloc core/Python tag mismatch: C++ {names}, Python {TAGS}; rebuild the package")
    return lib


def function_address(name: str) -> int:
    """The address of an exported C function, for PyTorch's pluggable-allocator hooks."""
    return ctypes.cast(getattr(load(), name), ctypes.c_void_p).value


def last_error() -> tuple[int, str]:
    lib = load()
    return lib.um_last_error_kind(), (lib.um_last_error() or b"").decode()
