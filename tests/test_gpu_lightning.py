"""The Lightning example on a GPU: under a budget that makes the planner recompute, its losses are
stock PyTorch's, step for step, exactly (deterministic kernels, dropout 0). Two processes of
examples/lightning_gpt2.py, one plain and one with UMAllocCallback: um_alloc installs before CUDA
starts, and the plain run keeps PyTorch's own allocator.

    python -m pytest -q -m gpu tests/test_gpu_lightning.py

GPT-2-medium at batch 8, sequence 1024, 10 steps: under 12 GiB (stock holds about 28 GiB) the
plan recomputes most of the 24 blocks, and the first two steps run in the safe mode (every
block recomputed, its inputs in host memory), so both kinds of step are compared.
"""
from pathlib import Path

import pytest
from conftest import run_gpu_script

pytestmark = pytest.mark.gpu
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "lightning_gpt2.py"
WORKLOAD = ("--steps", "10", "--batch-size", "8", "--seq-len", "1024", "--deterministic", "--dropout", "0")
BUDGET = "12GiB"


def test_the_lightning_example_under_a_budget_gives_stocks_losses_exactly(cuda_device):
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    stock = run_gpu_script(EXAMPLE, *WORKLOAD)
    planned = run_gpu_script(EXAMPLE, *WORKLOAD, "--budget", BUDGET)
    assert stock["plan"] is None and len(stock["losses"]) == 10
    recomputed = planned["plan"].get("recompute", 0) + planned["plan"].get("recompute_moved", 0)
    assert recomputed > 0, planned["plan"]  # the budget made the planner recompute
    assert planned["losses"] == stock["losses"]
