"""torch.cuda.set_per_process_memory_fraction() under um_alloc: a warning that says what bounds
memory instead.

PyTorch hands the fraction to its allocator. A pluggable allocator without a fraction hook, as
um_alloc's is, drops it, so a script that limits itself to part of a shared GPU would run
without its limit and without a word. Under um_alloc the budget bounds the GPU memory a process
uses (``python -m um_alloc run --budget``, ``install(budget=...)``) and the policy's
``pool.max_reserved`` caps its pool, never past the device's free memory unless
``pool.oversubscribe``. install() makes the call warn with that.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["FRACTION_WARNING", "warn_on_memory_fraction"]

FRACTION_WARNING = (
    "um_alloc: torch.cuda.set_per_process_memory_fraction({fraction}) has no effect under um_alloc. "
    "The budget bounds the GPU memory this process uses (python -m um_alloc run --budget SIZE, or "
    "um_alloc.install(budget=...)), and the policy's pool.max_reserved caps its pool.")


def warn_on_memory_fraction() -> None:
    """Makes torch.cuda.set_per_process_memory_fraction() warn that um_alloc does not apply it
    (idempotent)."""
    if getattr(getattr(torch._C, "_cuda_setMemoryFraction", None), "warns_under_um_alloc", False):
        return

    def set_fraction(fraction: float, device: int) -> None:
        warnings.warn(FRACTION_WARNING.format(fraction=fraction), UserWarning, stacklevel=3)

    set_fraction.warns_under_um_alloc = True
    torch._C._cuda_setMemoryFraction = set_fraction
