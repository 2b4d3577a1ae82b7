"""bench/fused_trees.py on the CPU: its options are checked before any GPU work, and the trees it
times are GPT-2's GELU as the recorder finds it, giving the module's own GELU."""
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import fused_trees  # noqa: E402

from um_alloc.rebuild import Source  # noqa: E402


@pytest.mark.parametrize("flags, says", [
    (["--batch", "0"], "--batch must be 1 or more, got 0"),
    (["--seq-len", "-3"], "--seq-len must be 1 or more, got -3"),
    (["--reps", "0"], "--reps must be 1 or more, got 0"),
    pytest.param([], "needs a CUDA device",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_bad_options_are_refused_before_any_gpu_work(flags, says, capsys):
    with pytest.raises(SystemExit):
        fused_trees.parse_args(flags)
    assert says in capsys.readouterr().err


def test_the_gelu_trees_make_gpt2s_gelu():
    x = torch.randn(1000, dtype=torch.float64)
    trees = fused_trees.gelu_trees(Source(x), fused_trees.NO_AUTOCAST)
    with torch.no_grad():
        product = trees["product"].run(lambda entry: entry, "cpu")
    expected = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    assert torch.equal(product, expected)
