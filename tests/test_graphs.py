"""CUDA-graph capture under um_alloc fails at once with um_alloc's error (the guard's logic on the
CPU; tests/test_gpu_graphs.py checks it on a GPU)."""
import pytest
import torch

from um_alloc import graphs
from um_alloc.graphs import CudaGraphsUnsupported, allow_cuda_graphs, refuse_cuda_graphs


@pytest.fixture
def refused():
    refuse_cuda_graphs()
    yield
    allow_cuda_graphs()


def test_capture_and_reduce_overheads_pool_entry_raise_um_allocs_error(refused):
    with pytest.raises(CudaGraphsUnsupported, match=r"torch.cuda.CUDAGraph.capture_begin\): a graph needs a "
                                                    r"private memory pool.*Use torch.compile in its default mode"):
        torch.cuda.CUDAGraph.capture_begin(None)
    with pytest.raises(CudaGraphsUnsupported, match=r"torch.compile\(mode=\"reduce-overhead\"\)"):
        torch._C._cuda_beginAllocateCurrentThreadToPool(0, (0, 1))


def test_refusing_twice_then_allowing_restores_pytorchs_own_entries():
    original = torch.cuda.CUDAGraph.capture_begin
    refuse_cuda_graphs()
    refuse_cuda_graphs()  # idempotent: the original is kept once, not the refusal
    assert torch.cuda.CUDAGraph.capture_begin is not original
    allow_cuda_graphs()
    assert torch.cuda.CUDAGraph.capture_begin is original and not graphs._originals


def test_install_refuses_cuda_graphs_once_the_allocator_is_swapped(monkeypatch):
    import importlib

    from um_alloc.device_info import DeviceMemory

    install_module = importlib.import_module("um_alloc.install")
    order = []
    monkeypatch.setattr(install_module, "_installation", None)
    monkeypatch.setattr(install_module, "_require_cuda_untouched", lambda: None)
    monkeypatch.setattr(install_module, "_device_memory_or_raise", lambda d: DeviceMemory(80 << 30, 79 << 30, 0, "fake"))
    monkeypatch.setattr(install_module, "_configure_core", lambda made: order.append("core"))
    monkeypatch.setattr(install_module, "_swap_torch_allocator", lambda: order.append("swap"))
    monkeypatch.setattr(install_module, "refuse_cuda_graphs", lambda: order.append("refuse"))
    install_module.install("none")
    assert order == ["core", "swap", "refuse"]
    assert install_module.install() is install_module.installation()  # no arguments: what is installed
    with pytest.raises(RuntimeError, match=r"already installed by um_alloc.install\(\) with policy 'none'.*"
                                           r"asks for policy 'planner' \(budget 1.0 GiB\)"):
        install_module.install("planner", budget="1GiB")
