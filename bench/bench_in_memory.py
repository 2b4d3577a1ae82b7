"""um_alloc vs PyTorch's allocator when everything fits in GPU memory.

BERT-Large MLM, batch 32, seq 512, bf16: stock PyTorch, um_alloc with best.yaml and with
none.yaml. What um_alloc costs where nothing needs to leave the GPU. Runs alternate (stock, um best, um none, stock, ...) for --rounds rounds so slow drift of the
GPU's clocks hits every method alike; each method's figure is the median over its rounds of
the per-run median step time.

    python bench/bench_in_memory.py                 # full: batch 32, 20 steps, 2 rounds
    python bench/bench_in_memory.py --quick         # a smoke run: batch 8, 6 steps, 1 round

Writes bench/results/in_memory_b<batch>_<method>.json, one run_id across them.
"""
from __future__ import annotations

import argparse
import statistics

from harness import Run, new_run_id, protocol_record, run_train, write_result

METHODS = (("stock", None), ("um", "best.yaml"), ("um", "none.yaml"))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.batch_size, args.steps, args.rounds = 8, 6, 1
    return args


def main():
    args = parse_args()
    run_id = new_run_id("bench_in_memory")
    runs: dict[tuple, list[dict]] = {m: [] for m in METHODS}
    for r in range(args.rounds):
        for allocator, policy in METHODS:
            print(f"round {r + 1}/{args.rounds}: {allocator} {policy or ''}", flush=True)
            train_args = ["--allocator", allocator, "--batch-size", str(args.batch_size),
                          "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup-steps", "3"]
            if policy:
                train_args += ["--policy", policy]
            summary, _, _ = run_train(Run(f"{allocator}-{policy or 'stock'}", "", train_args), 900)
            if summary:
                runs[(allocator, policy)].append(summary)
                print(f"  {summary['samples_per_s']:.2f} samples/s, step {summary['step_s_median'] * 1e3:.1f} ms")
    report(runs, args, run_id)


def report(runs, args, run_id: str):
    stock_runs = runs[("stock", None)]
    if not stock_runs:
        raise SystemExit("the stock runs failed: no baseline to compare with")
    stock_sps = args.batch_size / statistics.median(s["step_s_median"] for s in stock_runs)
    print(f"\n{'method':<22}{'samples/s':>12}{'vs stock':>10}{'peak reserved':>16}")
    for (allocator, policy), summaries in runs.items():
        if not summaries:
            print(f"{allocator + ' ' + (policy or ''):<22}{'failed':>12}")
            continue
        step_s = statistics.median(s["step_s_median"] for s in summaries)
        last = summaries[-1]
        record = protocol_record(last, run_id=run_id, stock_samples_per_s=stock_sps, budget_bytes=None,
                                 step_s_median=step_s, samples_per_s=args.batch_size / step_s,
                                 ratio_vs_stock=args.batch_size / step_s / stock_sps,
                                 step_s_rounds=[s["step_s_median"] for s in summaries],
                                 peak_reserved_bytes=last.get("peak_reserved_bytes"))
        name = f"in_memory_b{args.batch_size}_{allocator}" + (f"_{policy.removesuffix('.yaml')}" if policy else "")
        write_result(name, record)
        peak = (last.get("peak_reserved_bytes") or 0) / 2**30
        print(f"{allocator + ' ' + (policy or ''):<22}{record['samples_per_s']:>12.2f}"
              f"{record['ratio_vs_stock']:>10.3f}{peak:>13.1f} GiB")


if __name__ == "__main__":
    main()
