"""The host's time of one CUDA tensor's allocation and free from Python, under PyTorch's allocator
or um_alloc's pool (none.yaml, no budget): what a host-paced model pays per tensor.

    python bench/alloc_cost.py stock
    python bench/alloc_cost.py um

Each size: two tensors made and dropped, --pairs times, twice; the second pass is printed.
"""
from __future__ import annotations

import argparse
import time

import torch

SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("allocator", choices=("stock", "um"))
    p.add_argument("--pairs", type=int, default=40_000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("alloc_cost: needs a CUDA device")
    if args.allocator == "um":
        import um_alloc
        um_alloc.install("none.yaml")
    torch.empty(1, device="cuda")
    for size in SIZES:
        for _ in range(2):  # the first pass makes the pool's blocks
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.pairs):
                a = torch.empty(size, dtype=torch.uint8, device="cuda")
                b = torch.empty(size, dtype=torch.uint8, device="cuda")
                del a, b
            seconds = time.perf_counter() - start
        print(f"{args.allocator:5s} {size:>8d} B: {seconds / (2 * args.pairs) * 1e6:.2f} us per allocation and free",
              flush=True)


if __name__ == "__main__":
    main()
