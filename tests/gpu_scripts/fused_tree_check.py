"""Rebuild trees as one kernel on a GPU: which trees fuse, and whether the kernel gives the eager
tree's bits.

    python tests/gpu_scripts/fused_tree_check.py   # prints a JSON line: per tree, its outcome

Per tree: "fused" (one kernel, the eager bits), "differs" (a kernel was written and its bits
differ: the tree runs eagerly), or "unwritten" (no kernel for it). Leaves are random normal
tensors of 4 Mi elements (GPT-2's GELU input under autocast: a float32 copy of bf16 values).
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from fused_trees import AUTOCAST, NO_AUTOCAST, T, call, gelu_trees  # noqa: E402

from um_alloc.planner import fused_tree  # noqa: E402
from um_alloc.rebuild import Call, Param, Source  # noqa: E402


def trees(x32: torch.Tensor, y32: torch.Tensor, xb: torch.Tensor, weight: torch.Tensor) -> dict:
    x, y, b = Source(x32), Source(y32), Source(xb)
    narrowed = Source(xb.float(), cast=torch.bfloat16)  # autocast's float32 copy, read as bf16
    return {
        **{f"gelu_autocast_{k}": v for k, v in gelu_trees(narrowed, AUTOCAST).items()},
        **{f"gelu_float32_{k}": v for k, v in gelu_trees(x, NO_AUTOCAST).items()},
        **{f"gelu_bf16_{k}": v for k, v in gelu_trees(b, NO_AUTOCAST).items()},
        "silu": call(T.__mul__, x, call(torch.sigmoid, x)),
        "rsub_div_scalar": call(T.__truediv__, call(T.__rsub__, x, 1.0), 3.0),
        "sub_div_tensor": call(torch.div, call(torch.sub, x, y), call(T.__radd__, call(T.__mul__, y, y), 1.0)),
        "rdiv": call(T.__rtruediv__, call(T.__radd__, call(T.__mul__, x, x), 1.0), 2.0),
        "rsqrt_norm": call(T.__mul__, call(torch.rsqrt, call(T.__add__, call(T.__mul__, x, x), 1e-6)), y),
        "exp_neg": call(T.__sub__, call(T.__rmul__, call(torch.exp, call(T.__neg__, x)), 2.0), y),
        "square_plus": call(T.__add__, call(torch.pow, x, 2), y),
        "bf16_arithmetic": call(T.__add__, call(T.__rmul__, b, 0.5), call(torch.pow, b, 2)),
        "bf16_cube": call(T.__sub__, call(torch.pow, b, 3), b),
        "parameter_scale": call(T.__mul__, call(T.__add__, x, 1.0), Param(weight, weight._version)),
    }


def outcome(tree: Call) -> str:
    fetch = lambda entry: entry  # noqa: E731 - a Source's entry is its tensor here
    dtypes = {}
    with torch.no_grad():
        eager = fused_tree._eager(tree, fetch, "cuda", dtypes)
        written = fused_tree._written(tree, dtypes, "cuda")
        if written is None:
            return "unwritten"
        same = fused_tree._same_bits(written, tree, fetch, eager)
    found = fused_tree.fuse(tree, fetch, "cuda")
    assert (found is not None) == same, "fuse's verdict is not the comparison's"
    return "fused" if same else "differs"


def main() -> dict:
    torch.manual_seed(0)
    n = 4 << 20
    x32 = torch.randn(n, device="cuda")
    y32 = torch.randn(n, device="cuda")
    xb = torch.randn(n, device="cuda").to(torch.bfloat16)
    weight = torch.nn.Parameter(torch.randn(n, device="cuda"))
    result = {name: outcome(tree) for name, tree in trees(x32, y32, xb, weight).items()}
    # The replay path: a fused root gives its tree's output and releases the calls it did not run.
    tree = trees(x32, y32, xb, weight)["gelu_autocast_product"]
    tree.fused = fused_tree.fuse(tree, lambda e: e, "cuda")
    with torch.no_grad():
        ran = tree.run(lambda e: e, "cuda")
        tree.fused = None
        eager = tree.run(lambda e: e, "cuda")
    result["replayed_equal"] = bool(torch.equal(ran.view(torch.int32), eager.view(torch.int32)))
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
