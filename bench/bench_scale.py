"""The largest BERT-Large batch that trains at a GPU memory budget: stock PyTorch against um_alloc.

    python bench/bench_scale.py --budget 8GiB             # searches both, then trains each for 20 steps

(a) stock PyTorch under set_per_process_memory_fraction(budget): the largest batch is searched
    (bench_microbatch's search: doubling, then bisection; each probe a 2-step subprocess).
(b) um_alloc with a policy that offloads activations under a hard budget (default: best.yaml with
    the optimizer state host-mapped, so the GPU's room goes to the batch), --budget the budget:
    the same search, each probe 4 steps (ActivationOffload calibrates over the first two).
Then each method's largest batch trains for --steps steps. One batch is one forward and backward
(no micro-batches). Writes bench/results/scale-<budget>-<method>.json in the protocol's form.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml

import bench_microbatch as mb

HOST_STATE = {"preferred_location": "cpu", "accessed_by": ["gpu"]}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--budget", default="8GiB", help="GPU memory budget for both methods (default 8GiB)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20, help="length of the final run of each method (default 20)")
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--stock-start", type=int, default=2)
    p.add_argument("--um-start", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=512)
    p.add_argument("--policy", help="um_alloc policy (default: best.yaml with host-mapped optimizer state)")
    p.add_argument("--window", default="256MiB", help="schedule_window written into the default policy")
    p.add_argument("--out", type=Path, default=mb.REPO / "bench" / "results")
    return p.parse_args(argv)


def default_policy(directory: Path, window: str) -> str:
    data = yaml.safe_load((mb.REPO / "policies" / "best.yaml").read_text())
    data["tags"]["optimizer_state"] = dict(HOST_STATE)
    data["scheduler"]["schedule_window"] = window
    path = directory / "best_host_optimizer.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def final(args, allocator: str, batch: int, extra=()) -> dict:
    while batch > 0:  # a longer run can still fail at the edge: step down
        summary = mb.train(args, allocator, batch, args.steps, args.warmup_steps, extra)
        print(mb._line(f"[{allocator}] batch {batch}, {args.steps} steps", summary), flush=True)
        if summary is not None:
            return summary
        batch -= 1
    raise RuntimeError(f"{allocator}: a probe fitted but no {args.steps}-step run did")


def main(argv=None) -> None:
    args = parse_args(argv)
    args.memory_limit = args.budget  # bench_microbatch.train gives stock runs --memory-limit
    with tempfile.TemporaryDirectory() as scratch:
        policy = args.policy or default_policy(Path(scratch), args.window)
        um_extra = ["--policy", policy, "--budget", args.budget, "--dropout", "0"]
        stock_extra = ["--dropout", "0"]
        stock_batch = mb.largest_batch(args, "stock", args.stock_start, args.max_batch, 2, stock_extra)
        stock = final(args, "stock", stock_batch, stock_extra)
        um_batch = mb.largest_batch(args, "um", args.um_start, args.max_batch, 4, um_extra)  # 2 calibrate
        um = final(args, "um", um_batch, um_extra)
    args.out.mkdir(parents=True, exist_ok=True)
    for summary in (stock, um):
        record = mb.result(summary, stock["samples_per_s"])
        record.update(limit_as="memory_fraction" if summary is stock else "hard budget + activation offload",
                      batch_ratio_vs_stock=summary["batch"] / stock["batch"],
                      activation_offload=summary.get("activation_offload"))
        path = args.out / f"scale-{args.budget}-{'stock' if summary is stock else 'um_alloc'}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")
    print(f"\nlargest batch at {args.budget}: stock {stock['batch']} ({stock['samples_per_s']:.1f} samples/s), "
          f"um_alloc {um['batch']} ({um['samples_per_s']:.1f} samples/s): {um['batch'] / stock['batch']:.1f}x the batch")


if __name__ == "__main__":
    main()
