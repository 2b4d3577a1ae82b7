"""What rebuilding GPT-2's GELU saves costs the GPU in backward: the eager tree against one kernel
per saved tensor (um_alloc.planner.fused_tree).

    python bench/fused_trees.py --batch 8 --seq-len 1024

GPT-2's GELU under bf16 autocast, ``0.5 * x * (1 + tanh(c * (x + k * x**3)))``, saves tanh's
output, ``1 + t``, ``0.5 * x`` and the product (as the next linear's bf16 cast). A rebuilt block
makes the first, second and last again in backward from autocast's float32 copy of `x`, which pow
saves. Timed on the GPU's clock as replay runs them: eagerly, each call once (tanh is shared by the
three), or each tree as one kernel; the product cast to bf16 in both. The median of --reps after
warm-up, one JSON record (bench/results/RUN_ID/fused_trees.json unless --out).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path

from harness import RESULTS, new_run_id, write_result

import torch

from um_alloc.planner import fused_tree
from um_alloc.planner.rebuilt import count_reads
from um_alloc.rebuild import Call, Source

T = torch.Tensor
NO_AUTOCAST = (False, torch.bfloat16)
AUTOCAST = (True, torch.bfloat16)


def call(func, *args, autocast=NO_AUTOCAST, **kwargs) -> Call:
    """A recorded call, as um_alloc.rebuild's recorder makes one."""
    return Call(func, args, kwargs, autocast, 0)


def gelu_trees(x: Source, autocast) -> dict:
    """GPT-2's GELU (transformers' NewGELUActivation) as the recorder finds its saved tensors'
    trees: tanh(...), 1 + tanh(...) and the product, over `x`."""
    cube = call(torch.pow, x, 3.0, autocast=autocast)
    inner = call(T.__add__, x, call(T.__rmul__, cube, 0.044715, autocast=autocast), autocast=autocast)
    tanh = call(torch.tanh, call(T.__rmul__, inner, math.sqrt(2.0 / math.pi), autocast=autocast), autocast=autocast)
    one_plus = call(T.__radd__, tanh, 1.0, autocast=autocast)
    product = call(T.__mul__, call(T.__rmul__, x, 0.5, autocast=autocast), one_plus, autocast=autocast)
    return {"tanh": tanh, "one_plus_tanh": one_plus, "product": product}


def timed(roots: list, fetch, reps: int, warmup: int = 5) -> float:
    """Median ms of making every root's output once, as one block's backward does."""
    times = []
    for rep in range(warmup + reps):
        for root in roots:
            root.shared = None
            for nested in root.nested():
                nested.shared = None
        for root in roots:
            count_reads(root)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.no_grad():
            outputs = [root.run(fetch, "cuda") for root in roots]
            outputs[-1] = outputs[-1].to(torch.bfloat16)  # the next linear's cast of the product
        end.record()
        end.synchronize()
        if rep >= warmup:
            times.append(start.elapsed_time(end))
        del outputs
    return statistics.median(times)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--width", type=int, default=4096, help="the GELU's width (GPT-2-medium: 4 x 1024)")
    p.add_argument("--reps", type=int, default=30, help="timed repetitions of each way, after 5 to warm up")
    p.add_argument("--out", metavar="DIR")
    args = p.parse_args(argv)
    for flag in ("batch", "seq_len", "width", "reps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be 1 or more, got {getattr(args, flag)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    run_id = new_run_id("fused_trees")
    torch.manual_seed(0)
    x32 = torch.randn(args.batch, args.seq_len, args.width, device="cuda").to(torch.bfloat16).float()
    fetch = lambda entry: entry  # noqa: E731 - a Source's entry is its tensor here
    trees = gelu_trees(Source(x32, cast=torch.bfloat16), AUTOCAST)
    roots = [trees["tanh"], trees["one_plus_tanh"], trees["product"]]
    eager_ms = timed(roots, fetch, args.reps)
    kernels = {name: fused_tree.fuse(tree, fetch, "cuda") for name, tree in trees.items()}
    for name, tree in trees.items():
        tree.fused = kernels[name]
    fused_ms = timed(roots, fetch, args.reps)
    record = {"run_id": run_id, "device": torch.cuda.get_device_name(),
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "workload": "gpt2-gelu-rebuild",
              "batch": args.batch, "seq_len": args.seq_len, "width": args.width, "reps": args.reps,
              "rebuilt_bytes": x32.numel() * (4 + 4 + 2),
              "fused": {name: kernel is not None for name, kernel in kernels.items()},
              "eager_ms": eager_ms, "fused_ms": fused_ms}
    out = Path(args.out) if args.out else RESULTS / run_id
    path = write_result("fused_trees", record, out)
    print(json.dumps(record, indent=2))
    print(f"fused_trees: eager {eager_ms:.3f} ms, fused {fused_ms:.3f} ms a block -> {path}", flush=True)


if __name__ == "__main__":
    main()
