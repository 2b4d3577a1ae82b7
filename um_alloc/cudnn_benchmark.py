"""cuDNN's benchmark mode under um_alloc: kept off, with a warning, where it would raise.

With ``torch.backends.cudnn.benchmark = True`` (torchvision's reference scripts and many
training scripts set it), cuDNN's algorithm search asks PyTorch's allocator for its largest free
block (``cacheInfo``) to size the workspaces it tries. PyTorch's pluggable allocator cannot answer
("CUDAPluggableAllocator does not yet support cacheInfo"), so under um_alloc every convolution
would raise. install() keeps the mode off instead: setting it, by the attribute or by
``torch.backends.cudnn.flags(benchmark=True)``, warns once and leaves it off, and cuDNN chooses
its algorithms by its heuristics, as it does by default.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["BENCHMARK_WARNING", "keep_cudnn_benchmark_off"]

BENCHMARK_WARNING = (
    "um_alloc: torch.backends.cudnn.benchmark stays off under um_alloc. cuDNN's benchmark asks the "
    "allocator for its largest free block, which PyTorch's pluggable allocator cannot answer, and "
    "every convolution would raise; cuDNN chooses its algorithms by its heuristics instead, as it does "
    "by default.")


def keep_cudnn_benchmark_off() -> None:
    """Makes every way of turning cuDNN's benchmark mode on leave it off with a warning (idempotent),
    and turns it off where it was on before install()."""
    setter = torch._C._set_cudnn_benchmark
    if getattr(setter, "keeps_benchmark_off", False):
        return
    off = _off_instead_of(setter)
    torch._C._set_cudnn_benchmark = off  # torch.backends.cudnn.flags(...)
    attribute = type(torch.backends.cudnn).__dict__.get("benchmark")  # a ContextProp since PyTorch 1.x
    if hasattr(attribute, "setter"):
        attribute.setter = off           # torch.backends.cudnn.benchmark = ...
    if torch._C._get_cudnn_benchmark():
        off(True)


def _off_instead_of(setter):
    def set_benchmark(on: bool) -> None:
        if on:
            warnings.warn(BENCHMARK_WARNING, UserWarning, stacklevel=3)
        setter(False)

    set_benchmark.keeps_benchmark_off = True
    return set_benchmark
