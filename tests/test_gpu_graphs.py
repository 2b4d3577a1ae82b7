"""CUDA graphs under um_alloc on a GPU: capture and reduce-overhead refused at once with um_alloc's
error; torch.compile's default mode trains with stock PyTorch's losses.

    python -m pytest -q -m gpu tests/test_gpu_graphs.py
"""
from pathlib import Path

import pytest
from conftest import run_gpu_script

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).parent / "gpu_scripts" / "graphs_check.py"


@pytest.mark.parametrize("check", ["capture", "reduce_overhead"])
def test_graph_capture_fails_at_once_with_what_to_use_instead(cuda_device, check):
    result = run_gpu_script(SCRIPT, check)
    assert result["refused"], result
    assert "Use torch.compile in its default mode" in result["message"]


def test_torch_compile_default_mode_trains_with_stocks_losses(cuda_device):
    assert run_gpu_script(SCRIPT, "compile_um")["losses"] == run_gpu_script(SCRIPT, "compile_stock")["losses"]
