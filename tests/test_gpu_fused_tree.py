"""Rebuild trees as one kernel on a GPU: the kernel's bits against the eager tree's.

    python -m pytest -q -m gpu tests/test_gpu_fused_tree.py
"""
from pathlib import Path

import pytest
from conftest import run_gpu_script

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).parent / "gpu_scripts" / "fused_tree_check.py"

# Trees of float32 arithmetic alone: ATen rounds each operation once, as the kernel does.
ARITHMETIC = ("rsub_div_scalar", "sub_div_tensor", "rdiv", "square_plus", "parameter_scale")


def test_gpt2s_gelu_and_arithmetic_trees_fuse_with_the_eager_bits(cuda_device):
    result = run_gpu_script(SCRIPT)
    print(result)  # which of the others fused, for the record
    assert {result[f"gelu_autocast_{k}"] for k in ("tanh", "one_plus_tanh", "product")} == {"fused"}
    assert {result[name] for name in ARITHMETIC} == {"fused"}
    assert set(result.values()) <= {"fused", "differs", "unwritten", True}
    assert result["replayed_equal"] is True
