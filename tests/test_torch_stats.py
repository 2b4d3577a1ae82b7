"""PyTorch's memory statistics under um_alloc: torch.cuda.memory_allocated(), max_memory_allocated(),
reset_peak_memory_stats(), memory_summary() and the rest answered by the pool, where a pluggable
allocator alone makes them raise. Here a host pool stands in for the device's, and PyTorch's own
functions run unchanged on top of it."""
from __future__ import annotations

import pytest
import torch

from um_alloc import torch_stats
from um_alloc.pool import ChunkPool

MiB = 1 << 20
ENTRIES = ("_cuda_memoryStats", "_cuda_resetPeakMemoryStats", "_cuda_resetAccumulatedMemoryStats")


@pytest.fixture
def pool(monkeypatch):
    """PyTorch's statistics routed to a host pool, as install() routes them to the device's."""
    pool = ChunkPool.host(chunk_size=2 * MiB, arena_size=64 * MiB)
    for name in ENTRIES:  # put back (or removed, on a CPU build) after the test
        monkeypatch.setattr(torch._C, name, None, raising=False)
    monkeypatch.setattr(torch.cuda.memory, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_stats, "_pool", lambda device: pool)
    monkeypatch.setattr(torch_stats, "_baselines", {})
    torch_stats.answer_torch_memory_stats()
    yield pool
    pool.close()


def test_allocated_and_its_peak_are_the_pools_live_bytes_and_reset_starts_the_peak_over(pool):
    first, second = pool.malloc(10 * MiB), pool.malloc(6 * MiB)
    assert torch.cuda.memory_allocated(0) == 16 * MiB
    pool.free(first)
    assert torch.cuda.memory_allocated(0) == 6 * MiB
    assert torch.cuda.max_memory_allocated(0) == 16 * MiB
    assert torch.cuda.memory_reserved(0) == 64 * MiB == torch.cuda.max_memory_reserved(0)
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == 6 * MiB   # from the bytes live at the reset
    third = pool.malloc(4 * MiB)
    assert torch.cuda.max_memory_allocated(0) == 10 * MiB
    assert pool.raw_stats()["peak_live_bytes_total"] == 10 * MiB  # um_alloc.memory_stats() agrees
    pool.free(second)
    pool.free(third)


def test_counts_of_calls_and_arenas_and_their_reset(pool):
    blocks = [pool.malloc(3 * MiB) for _ in range(3)]
    pool.free(blocks.pop())
    stats = torch.cuda.memory_stats(0)
    assert (stats["allocation.all.current"], stats["allocation.all.allocated"], stats["allocation.all.freed"]) == (2, 3, 1)
    assert (stats["segment.all.current"], stats["num_device_alloc"], stats["num_ooms"]) == (1, 1, 0)
    torch.cuda.reset_accumulated_memory_stats(0)
    stats = torch.cuda.memory_stats(0)
    assert (stats["allocation.all.current"], stats["allocation.all.allocated"], stats["allocation.all.freed"]) == (2, 0, 0)
    for block in blocks:
        pool.free(block)


def test_memory_summary_prints_the_pools_figures(pool):
    block = pool.malloc(12 * MiB)
    summary = torch.cuda.memory_summary(0)
    assert "PyTorch CUDA memory summary, device ID 0" in summary
    allocated = next(line for line in summary.splitlines() if line.startswith("| Allocated memory"))
    assert "12288 KiB" in allocated or "12 MiB" in allocated  # PyTorch's own formatting of the current bytes
    pool.free(block)
