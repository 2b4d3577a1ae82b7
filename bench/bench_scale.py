"""The largest BERT-Large batch that trains at a GPU memory budget: stock PyTorch against um_alloc.

    python bench/bench_scale.py --budget 8GiB             # searches both, then trains each for 20 steps

(a) stock PyTorch under set_per_process_memory_fraction(budget): the largest batch is searched
    (bench_microbatch's search: doubling, then bisection; each probe a 2-step subprocess).
(b) um_alloc under a hard budget with policies/large_batch.yaml (saved activations offloaded, the
    optimizer state host-mapped, and the MLM head's large temporaries spilled to host memory; see
    that file), --budget the budget: the same search, each probe 4 steps (ActivationOffload
    calibrates over the first two), up to --um-max-batch.
Then each method's largest batch trains for --steps steps. One batch is one forward and backward
(no micro-batches). Writes bench/results/scale-<budget>-<method>.json in the protocol's form,
one run_id across them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import bench_microbatch as mb
from harness import RESULTS, new_run_id, write_result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="8GiB", help="GPU memory budget for both methods (default 8GiB)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="length of the final run of each method (default 20)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--stock-start", type=int, default=2)
    p.add_argument("--um-start", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=512, help="the stock search's largest probe")
    # Host memory, not the GPU, bounds um_alloc here: the calibration steps copy every saved tensor
    # to pinned memory (in power-of-two blocks) and the loss spills to host memory. At batch 80 the
    # host held 91 GiB at its peak (H200 host, 125 GiB), about 1.1 GiB a sample.
    p.add_argument("--um-max-batch", type=int, default=88, help="um_alloc's largest probe (default 88)")
    p.add_argument("--policy", default="large_batch.yaml", help="um_alloc policy (default large_batch.yaml)")
    p.add_argument("--out", type=Path, default=RESULTS)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    run_id = new_run_id("bench_scale")
    args.memory_limit = args.budget  # bench_microbatch.train gives stock runs --memory-limit
    um_extra = ["--policy", args.policy, "--budget", args.budget, "--dropout", "0"]
    stock_extra = ["--dropout", "0"]
    stock_batch = mb.search(args, "stock", args.stock_start, args.max_batch, 2, stock_extra)
    stock = mb.timed_run(args, "stock", stock_batch, stock_extra)
    um_batch = mb.search(args, "um", args.um_start, args.um_max_batch, 4, um_extra)  # 2 calibrate
    um = mb.timed_run(args, "um", um_batch, um_extra)
    for summary in (stock, um):
        record = mb.result(summary, stock["samples_per_s"], run_id)
        record.update(limit_as="memory_fraction" if summary is stock else "hard budget",
                      batch_ratio_vs_stock=summary["batch"] / stock["batch"],
                      activation_offload=summary.get("activation_offload"))
        if summary is um:  # the search stops at the cap: a larger batch may train too
            record.update(largest_probe=args.um_max_batch, reached_largest_probe=um_batch >= args.um_max_batch)
        print(f"wrote {write_result(f'scale-{args.budget}-' + ('stock' if summary is stock else 'um_alloc'), record, args.out)}")
    print(f"\nlargest batch at {args.budget}: stock {stock['batch']} ({stock['samples_per_s']:.1f} samples/s), "
          f"um_alloc {um['batch']} ({um['samples_per_s']:.1f} samples/s): {um['batch'] / stock['batch']:.1f}x the batch"
          + (f" (um_alloc's search stops at --um-max-batch {args.um_max_batch})" if um_batch >= args.um_max_batch else ""))


if __name__ == "__main__":
    main()
