"""Memory as flat uint8 tensors: raw device memory, a tensor's storage, the bytes a tensor spans.

Copies between managed, device and host memory move bytes, whatever the dtype and the strides;
these views let one ``copy_`` do it. Each view shares the memory it shows: nothing is copied.
"""
from __future__ import annotations

import torch

__all__ = ["device_bytes", "storage_bytes", "byte_view"]


class _CudaArray:
    """A device pointer described by the CUDA array interface, which torch.as_tensor wraps in place."""

    def __init__(self, ptr: int, nbytes: int):
        # stream None: the producer made no stream promises; the caller orders its own work.
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None, "stream": None}


def device_bytes(ptr: int, nbytes: int, device: torch.device | str | int = "cuda") -> torch.Tensor:
    """`nbytes` of device memory at `ptr` (cudaMalloc or managed) as a uint8 tensor; whoever
    allocated the memory keeps it alive and frees it."""
    return torch.as_tensor(_CudaArray(int(ptr), nbytes), device=device)


def storage_bytes(tensor: torch.Tensor, start: int = 0, nbytes: int | None = None) -> torch.Tensor:
    """`nbytes` bytes (default: to the end) of a tensor's storage from byte `start`, as a flat
    uint8 tensor on the same device."""
    storage = tensor.untyped_storage()
    nbytes = storage.nbytes() - start if nbytes is None else nbytes
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, start, (nbytes,), (1,))


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes a dense tensor spans, as a flat uint8 tensor on the same memory."""
    size = tensor.element_size()
    return storage_bytes(tensor, tensor.storage_offset() * size, tensor.numel() * size)
