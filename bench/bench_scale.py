"""The largest BERT-Large batch that trains at a GPU memory budget: stock PyTorch, with and without
checkpointing, against um_alloc.

    python bench/bench_scale.py --budget 8GiB             # searches each, then trains each for --steps steps

(a) stock PyTorch under set_per_process_memory_fraction(budget): the largest batch is searched
    (bench_microbatch's search: doubling, then bisection; each probe a 2-step subprocess).
(b) the same with every layer checkpointed (train.py --checkpointing, Hugging Face's own): the
    strongest peer that fits at these budgets.
(c) um_alloc under a hard budget with policies/large_batch.yaml (the block planner, the optimizer
    state host-mapped, and the MLM head's large temporaries spilled to host memory; see that
    file), --budget the budget: the same search from --um-start, each probe 4 steps (the planner
    measures in the first two), up to --um-max-batch.
Then each method's largest batch trains for --steps steps. One batch is one forward and backward
(no micro-batches). Writes bench/results/scale-<budget>-<method>.json in the protocol's form,
one run_id across them.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import bench_microbatch as mb
from harness import RESULTS, new_run_id, planner_fields, write_result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="8GiB", help="GPU memory budget for both methods (default 8GiB)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="length of the final run of each method (default 20)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--stock-start", type=int, default=2)
    p.add_argument("--um-start", type=int, default=96)
    p.add_argument("--max-batch", type=int, default=512, help="the stock search's largest probe")
    p.add_argument("--checkpointing-start", type=int, default=8)
    # The host's memory bounds um_alloc's batch in the end: the loss spills there (the bf16 logits
    # and their gradient, 62 MB a sample at sequence 512) and the planner's measuring steps move
    # each block's input there (48 MiB a sample). At batch 160 the pool's spill peaked at 9.9 GiB.
    p.add_argument("--um-max-batch", type=int, default=192, help="um_alloc's largest probe (default 192)")
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
    checkpointed_extra = [*stock_extra, "--checkpointing"]
    checkpointed_batch = mb.search(args, "stock", args.checkpointing_start, args.max_batch, 2, checkpointed_extra,
                                   label="checkpointing")
    checkpointed = mb.timed_run(args, "stock", checkpointed_batch, checkpointed_extra, label="checkpointing")
    um_batch = mb.search(args, "um", args.um_start, args.um_max_batch, 4, um_extra)  # 2 measure
    um = mb.timed_run(args, "um", um_batch, um_extra)
    for name, summary in (("stock", stock), ("checkpointing", checkpointed), ("um_alloc", um)):
        record = mb.result(summary, stock["samples_per_s"], run_id)
        record.update(limit_as="hard budget" if summary is um else "memory_fraction",
                      batch_ratio_vs_stock=summary["batch"] / stock["batch"])
        if summary is checkpointed:
            record.update(method="stock+checkpointing", checkpointing=summary.get("checkpointing"))
        if summary is um:  # the search stops at the cap: a larger batch may train too
            record.update(largest_probe=args.um_max_batch, reached_largest_probe=um_batch >= args.um_max_batch,
                          activation_offload=summary.get("activation_offload"),
                          **planner_fields(summary.get("planner") or {}))
        print(f"wrote {write_result(f'scale-{args.budget}-{name}', record, args.out)}")
    print(f"\nlargest batch at {args.budget}: stock {stock['batch']} ({stock['samples_per_s']:.1f} samples/s), "
          f"every layer checkpointed {checkpointed['batch']} ({checkpointed['samples_per_s']:.1f}), "
          f"um_alloc {um['batch']} ({um['samples_per_s']:.1f}): {um['batch'] / stock['batch']:.1f}x stock's batch, "
          f"{um['batch'] / checkpointed['batch']:.1f}x checkpointing's"
          + (f" (um_alloc's search stops at --um-max-batch {args.um_max_batch})" if um_batch >= args.um_max_batch else ""))


if __name__ == "__main__":
    main()
