"""Copies between the pool's managed memory and pinned host memory through a small buffer of
plain device memory, so that kernels keep running while the copy engine works.

Measured on the H200 (bench/copy_overlap.py): 150 matmuls took 26 ms
alone and 26 ms beside a 1 GiB pinned copy of cudaMalloc memory, but 47 ms beside the same copy
of managed memory, in either direction. The driver does not run kernels while the copy engine
reads or writes managed memory. A staged copy keeps managed memory away from the copy engine:
a kernel moves each slice between the managed tensor and the stage (device memory, hundreds of
GB/s), and the copy engine moves it between the stage and the host.

    stage = DeviceStage(64 << 20, device)
    with torch.cuda.stream(side):
        stage.to_host(gpu_bytes, host_bytes)     # flat uint8 views of equal length
        stage.from_host(host_bytes, gpu_bytes)

Both run on the current stream, slice after slice; the stage is reused only in that stream's order,
so a stage belongs to one stream. Its memory comes from cudaMalloc, outside the pool and its
budget: whoever sizes a budget counts it (ActivationOffload does).
"""
from __future__ import annotations

import weakref

import torch


class DeviceStage:
    """`nbytes` of cudaMalloc memory on `device`, as a flat uint8 tensor the pool does not own."""

    def __init__(self, nbytes: int, device: torch.device):
        from cuda.bindings import runtime as rt

        if nbytes <= 0:
            raise ValueError(f"DeviceStage: nbytes must be > 0, got {nbytes}")
        with torch.cuda.device(device):
            err, ptr = rt.cudaMalloc(nbytes)
        if err != rt.cudaError_t.cudaSuccess:
            raise torch.OutOfMemoryError(f"um_alloc: cudaMalloc of a {nbytes}-byte copy stage on {device} "
                                         f"failed with {err.name}")
        self.nbytes = nbytes
        self._finalizer = weakref.finalize(self, rt.cudaFree, ptr)
        self.buffer = torch.as_tensor(_DeviceArray(int(ptr), nbytes), device=device)

    def to_host(self, gpu_bytes: torch.Tensor, host_bytes: torch.Tensor) -> None:
        for at in range(0, gpu_bytes.numel(), self.nbytes):
            n = min(self.nbytes, gpu_bytes.numel() - at)
            self.buffer[:n].copy_(gpu_bytes[at:at + n])
            host_bytes[at:at + n].copy_(self.buffer[:n], non_blocking=True)

    def from_host(self, host_bytes: torch.Tensor, gpu_bytes: torch.Tensor) -> None:
        for at in range(0, gpu_bytes.numel(), self.nbytes):
            n = min(self.nbytes, gpu_bytes.numel() - at)
            self.buffer[:n].copy_(host_bytes[at:at + n], non_blocking=True)
            gpu_bytes[at:at + n].copy_(self.buffer[:n])

    def close(self) -> None:
        """Frees the memory now (cudaFree waits for the device); otherwise it goes with the stage."""
        self.buffer = None
        self._finalizer()


class _DeviceArray:
    """Device memory described by the CUDA array interface, which torch.as_tensor wraps in place."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "stream": None}


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes a dense tensor spans, as a flat uint8 tensor on the same memory."""
    nbytes = tensor.numel() * tensor.element_size()
    start = tensor.storage_offset() * tensor.element_size()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
        tensor.untyped_storage(), start, (nbytes,), (1,))
