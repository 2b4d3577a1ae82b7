"""Step arenas: under the planner, the pool keeps what a training step allocates apart from what
outlasts it, and gives the step's GPU memory back where a step begins a new layout.

Under a hard budget the pool counts a chunk as GPU-backed until its whole arena is free: the driver
keeps a range's GPU memory until cudaFree. A step that lays its activations out anew (a safe step
after planned ones, a plan after the safe steps, a retry with less kept) finds the chunks the last
layout backed free but scattered, and a large request that fits none of them backs new memory
beside them: ResNet-50 at batch 352 under 8 GiB ran out with 5.5 GiB live and 8.0 GiB backed.
No arena could be given back, since the optimizer state made at the first step was scattered
through the arenas of the step's activations.

So, while a step's forward and backward run, the pool takes chunk runs from arenas of their own
(``ChunkPool.set_step_arenas``); parameters, optimizer state and whatever else is made between
steps stay in the others. Between steps, the step arenas hold at most the gradients of a loop that
clears them late, and ``release`` returns every wholly free one with its GPU memory (a cudaFree,
which waits for the device: the director calls it only where a layout changes).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..install import is_installed
from ..pool import ChunkPool

__all__ = ["StepArenas"]


class StepArenas:
    """The pool's step arenas for one device; does nothing on the CPU or under stock PyTorch."""

    def __init__(self, device: torch.device):
        self._pool = ChunkPool.for_device(device.index) if device.type == "cuda" and is_installed() else None
        self._overflow = 0
        if self._pool is not None:
            _warm_up_blas(device)

    def open(self) -> None:
        """A step's forward begins: what it allocates comes from the step arenas."""
        if self._pool is not None:
            self._pool.set_step_arenas(True)

    def close(self) -> None:
        """Its backward has ended (or it never came): the optimizer's state is not a step's."""
        if self._pool is not None:
            self._pool.set_step_arenas(False)

    @property
    def can_overflow(self) -> bool:
        """Whether a step's excess can go to host memory: only um_alloc's pool does that."""
        return self._pool is not None

    def allow_overflow(self, nbytes: int) -> None:
        """Up to `nbytes` of the step's large requests that the hard budget refuses go to host
        memory the GPU maps instead of failing (ChunkPool.set_overflow); 0: none."""
        self._overflow = nbytes
        if self._pool is not None:
            self._pool.set_overflow(nbytes)

    @contextlib.contextmanager
    def between_steps(self):
        """Around work of a step's kind done between steps (units run by themselves, alone.py):
        it allocates from the step arenas, as a step does, so that nothing of it is left among
        the arenas that outlast steps, and never overflows to host memory."""
        overflow = self._overflow
        self.allow_overflow(0)
        self.open()
        try:
            yield
        finally:
            self.close()
            self.allow_overflow(overflow)

    def overflow_peak(self) -> int:
        """The most bytes held in host memory that way at once since the last call."""
        return self._pool.take_overflow_peak() if self._pool is not None else 0

    def release(self) -> int:
        """Returns the wholly free arenas, and the GPU memory backing them; the bytes returned."""
        return self._pool.empty_cache() if self._pool is not None else 0


def _warm_up_blas(device: torch.device) -> None:
    """cuBLAS and cuBLASLt allocate workspaces through the pool at the first matmul of each
    thread's handle on a stream, and keep them for the life of the process. Made here, outside any
    step, in this thread and in the autograd engine's thread for the device, they hold no step
    arena: a backward, and in it a recomputed linear layer with a bias (cuBLASLt's path), as a
    recomputed block runs it."""
    dtypes = [torch.float32] + ([torch.bfloat16] if torch.cuda.is_bf16_supported() else [])
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        for dtype in dtypes:
            x = torch.ones(8, 8, device=device, dtype=dtype, requires_grad=True)
            out = checkpoint(F.linear, x, x, x[0], use_reentrant=False)
            (F.linear(out, x, x[0]) @ x).sum().backward()
