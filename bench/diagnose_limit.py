"""Why does a configuration fit (or not) under a memory limit? Runs train.py variants and prints,
for each, whether it fit, the micro-batch, every step's time and the pool's churn counters.

    python bench/diagnose_limit.py --limit 16GiB
"""
from __future__ import annotations

import argparse
import json

from harness import Run, new_run_id, run_train, write_result


def variants(limit: str):
    base = ["--memory-limit", limit, "--warmup-steps", "2"]
    yield "um plain b16", ["--allocator", "um", "--batch-size", "16", "--steps", "5", *base]
    yield "um plain b15", ["--allocator", "um", "--batch-size", "15", "--steps", "5", *base]
    yield "stock micro16 b256", ["--allocator", "stock", "--batch-size", "256", "--micro-batch", "16",
                                 "--steps", "4", *base]
    yield "um micro16 b256", ["--allocator", "um", "--batch-size", "256", "--micro-batch", "16", "--steps", "4", *base]
    yield "um micro auto b256", ["--allocator", "um", "--batch-size", "256", "--micro-batch", "auto",
                                 "--steps", "6", *base]


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--limit", default="16GiB")
    args = p.parse_args()
    run_id, rows = new_run_id("diagnose_limit"), []
    for name, argv in variants(args.limit):
        s, status, _ = run_train(Run(name, "", argv), 900)
        row = {"variant": name, "run_id": run_id, "status": status, "fit": s is not None}
        if s:
            m = s.get("memory_stats") or {}
            row.update(micro_batch=s["micro_batch"], samples_per_s=s["samples_per_s"],
                       step_s=[round(t, 3) for t in s.get("step_s", [])],
                       peak_live=m.get("peak_live_bytes"), peak_reserved=s.get("peak_reserved_bytes"),
                       arena_reserves=m.get("arena_reserves"), arena_releases=m.get("arena_releases"),
                       num_ooms=m.get("num_ooms"), device=s["device"], date=s["date"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    write_result("diagnose_limit", rows)


if __name__ == "__main__":
    main()
