"""The host's time of one CUDA tensor's allocation and free from Python, under PyTorch's allocator
or um_alloc's pool (none.yaml, no budget; planner.yaml's hard budget with --budget): what a
host-paced model pays per tensor.

    python bench/alloc_cost.py stock
    python bench/alloc_cost.py um
    python bench/alloc_cost.py um --budget 16GiB --held 10GiB

Each size: two tensors made and dropped, --pairs times, twice; the second pass is printed.
--held first allocates that much in 32 MiB tensors and drops every other one, as a training
step's forward leaves memory: held tensors with free runs between them.
"""
from __future__ import annotations

import argparse
import time

import torch

SIZES = (4 << 10, 64 << 10, 1 << 20, 8 << 20, 32 << 20, 128 << 20)
HELD_PIECE = 32 << 20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("allocator", choices=("stock", "um"))
    p.add_argument("--pairs", type=int, default=40_000)
    p.add_argument("--budget", help="um: planner.yaml's hard budget of this size (e.g. 16GiB)")
    p.add_argument("--held", default="0B", help="memory held while timing, with free runs between (e.g. 10GiB)")
    args = p.parse_args(argv)
    from um_alloc.sizes import parse_size
    held = parse_size(args.held, key="--held", source="command line")
    budget = parse_size(args.budget, key="--budget", source="command line") if args.budget else None
    if budget is not None and args.allocator != "um":
        p.error("--budget applies to um_alloc (allocator um)")
    if budget is not None and held >= budget:
        p.error(f"--held ({args.held}) must be below --budget ({args.budget})")
    if not torch.cuda.is_available():
        raise SystemExit("alloc_cost: needs a CUDA device")
    if args.allocator == "um":
        import um_alloc
        um_alloc.install("planner.yaml" if budget else "none.yaml", budget=budget)
    torch.empty(1, device="cuda")
    pieces = [torch.empty(HELD_PIECE, dtype=torch.uint8, device="cuda") for _ in range(held // HELD_PIECE)]
    del pieces[::2]  # free runs between the held tensors
    for size in SIZES:
        for _ in range(2):  # the first pass makes the pool's blocks
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.pairs):
                a = torch.empty(size, dtype=torch.uint8, device="cuda")
                b = torch.empty(size, dtype=torch.uint8, device="cuda")
                del a, b
            seconds = time.perf_counter() - start
        label = args.allocator + (f", budget {args.budget}" if budget else "") + (f", {args.held} held" if held else "")
        print(f"{label}: {size:>9d} B: {seconds / (2 * args.pairs) * 1e6:.2f} us per allocation and free", flush=True)


if __name__ == "__main__":
    main()
