"""Copies between the pool's managed memory and pinned host memory through a small buffer of
plain device memory, so that kernels keep running while the link is busy.

The driver runs no kernel while a copy reads or writes managed memory. Measured on the H200
(bench/copy_overlap.py, bench/results/copy_overlap.json): 150 matmuls took 26 ms alone, 27-28 ms
beside a 1 GiB pinned copy of cudaMalloc memory, but 47 ms beside the same copy of managed memory,
in either direction. Staged, a device-to-device copy moves each slice between the managed tensor
and the stage (tens of microseconds for 16 MiB), and only the slow copy between the stage and the
host uses the link: 28 ms beside the matmuls, at the same 52 GB/s.

    stage = DeviceStage(64 << 20, device)
    with torch.cuda.stream(side):
        stage.to_host(gpu_bytes, host_bytes)     # flat uint8 views of equal length
        stage.from_host(host_bytes, gpu_bytes)

Both run on the current stream, slice after slice; a stage is reused in that stream's order, so
it belongs to one stream. With several slots and a second stream to fill them (to_host's
fill_stream), the device copies run ahead of the copies to the host: the memory they read is
free again soon, and the link always has the next slice waiting. The memory comes from
cudaMalloc, outside the pool and its budget: whoever sizes a budget counts it (ActivationOffload
does).
"""
from __future__ import annotations

import weakref

import torch
from cuda.bindings import runtime as rt

# byte_view is also reached as um_alloc.staging.byte_view; it is defined in byte_views.py.
from .byte_views import byte_view, device_bytes

__all__ = ["DeviceStage", "byte_view"]


class DeviceStage:
    """`slots` buffers of `slot_bytes` of cudaMalloc memory on `device`, which the pool does not own."""

    def __init__(self, slot_bytes: int, device: torch.device, slots: int = 1):
        if slot_bytes <= 0 or slots < 1:
            raise ValueError(f"DeviceStage: slot_bytes must be > 0 and slots >= 1, got {slot_bytes} and {slots}")
        self.nbytes = slot_bytes * slots
        with torch.cuda.device(device):
            err, ptr = rt.cudaMalloc(self.nbytes)
        if err != rt.cudaError_t.cudaSuccess:
            raise torch.OutOfMemoryError(f"um_alloc: CUDA out of memory. cudaMalloc of a {self.nbytes}-byte copy "
                                         f"stage on {device} failed with {err.name}")
        self._finalizer = weakref.finalize(self, rt.cudaFree, ptr)
        buffer = device_bytes(ptr, self.nbytes, device)
        self._slots = list(buffer.split(slot_bytes))
        self._drained: list[torch.cuda.Event | None] = [None] * slots  # the slot's last copy to the host
        self._next = 0

    def to_host(self, gpu_bytes: torch.Tensor, host_bytes: torch.Tensor,
                fill_stream: torch.cuda.Stream | None = None) -> None:
        """Copies to the host on the current stream. With `fill_stream`, the copies into the slots run
        there, up to all the slots ahead of the copies to the host: the memory they read is free
        again when they are done, not when the slower copies to the host are."""
        drain = torch.cuda.current_stream(gpu_bytes.device)
        fill = fill_stream or drain
        for at, n, slot in self._slices(gpu_bytes.numel()):
            buffer = self._slots[slot][:n]
            if fill is not drain and self._drained[slot] is not None:
                fill.wait_event(self._drained[slot])
            with torch.cuda.stream(fill):
                buffer.copy_(gpu_bytes[at:at + n])
            if fill is not drain:
                drain.wait_event(fill.record_event())
            host_bytes[at:at + n].copy_(buffer, non_blocking=True)
            if fill is not drain:
                self._drained[slot] = drain.record_event()

    def from_host(self, host_bytes: torch.Tensor, gpu_bytes: torch.Tensor) -> None:
        """Copies to the GPU on the current stream, slot after slot."""
        for at, n, slot in self._slices(gpu_bytes.numel()):
            buffer = self._slots[slot][:n]
            buffer.copy_(host_bytes[at:at + n], non_blocking=True)
            gpu_bytes[at:at + n].copy_(buffer)

    def _slices(self, total: int):
        size = self._slots[0].numel()
        for at in range(0, total, size):
            slot, self._next = self._next, (self._next + 1) % len(self._slots)
            yield at, min(size, total - at), slot

    def close(self) -> None:
        """Frees the memory now (cudaFree waits for the device); otherwise it goes with the stage."""
        self._slots = []
        self._finalizer()
