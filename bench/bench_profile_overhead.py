"""What the CUPTI unified-memory counters cost: train.py with and without --profile, same config.

Runs alternate (plain, profiled, plain, profiled, ...) for --rounds rounds per policy, so clock
drift hits both alike; each side's figure is the median over its rounds of the per-run median
step time, and the overhead is profiled / plain - 1. The cost grows with the number of
unified-memory records CUPTI hands over: in memory (best, none) there are few after the first
step; under a reactive budget (--budget: the policies' copies say evict_live: true) live chunks
are evicted and faults bring them back, many records a step. Records per step are reported
beside each ratio.

    python bench/bench_profile_overhead.py                       # best and none in memory, batch 8
    python bench/bench_profile_overhead.py --policies none.yaml --budget 8GiB --name profile_overhead_budget
    python bench/bench_profile_overhead.py --quick               # tiny model, 1 round: a smoke run

Writes bench/results/profile_overhead.json (--name changes the file name), its runs' records
sharing one run_id.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from harness import (Run, new_run_id, protocol_record, raw_policy, run_train, with_scheduler, write_policy,
                     write_result)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", nargs="+", default=["best.yaml", "none.yaml"])
    p.add_argument("--model", choices=("large", "tiny"), default="large")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--memory-limit", metavar="SIZE", help="train.py --memory-limit for every run")
    p.add_argument("--budget", metavar="SIZE",
                   help="scheduler.budget and evict_live: true added to every policy (a fault-heavy case)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--name", default="profile_overhead", help="result file name under bench/results/")
    p.add_argument("--quick", action="store_true", help="tiny model, seq 128, 6 steps, 1 round")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.seq_len, args.steps, args.rounds = "tiny", 128, 6, 1
    return args


def train_args(args, policy: str, profile: bool) -> list[str]:
    out = ["--allocator", "um", "--policy", policy, "--model", args.model, "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    out += ["--memory-limit", args.memory_limit] if args.memory_limit else []
    return out + (["--profile"] if profile else [])


def with_budget(policy: str, budget: str, directory: Path) -> str:
    """A copy of `policy` under a reactive budget, as a file train.py --policy can read."""
    data = with_scheduler(raw_policy(policy), budget=budget, evict_live=True)
    return str(write_policy(directory, f"{Path(policy).stem}_budget", data, f"{policy}, reactive budget {budget}"))


def measure(args) -> dict[str, dict[bool, list[dict]]]:
    runs = {policy: {False: [], True: []} for policy in args.policies}
    tmp = tempfile.TemporaryDirectory()
    files = {p: with_budget(p, args.budget, Path(tmp.name)) if args.budget else p for p in args.policies}
    for r in range(args.rounds):
        for policy in args.policies:
            for profile in (False, True):
                print(f"round {r + 1}/{args.rounds}: {policy} {'--profile' if profile else 'plain'}", flush=True)
                run = Run(f"{policy}{' profiled' if profile else ''}", "", train_args(args, files[policy], profile))
                summary, _, _ = run_train(run, 900)
                if summary:
                    runs[policy][profile].append(summary)
                    print(f"  step {summary['step_s_median'] * 1e3:.1f} ms", flush=True)
    return runs


def summarize_policy(sides: dict[bool, list[dict]]) -> dict:
    plain = [s["step_s_median"] for s in sides[False]]
    profiled = [s["step_s_median"] for s in sides[True]]
    out = {"plain_step_s": plain, "profiled_step_s": profiled, "ratio": None, "overhead_pct": None,
           "um_records_per_step": None, "counters_available": None}
    if plain and profiled:
        out["ratio"] = statistics.median(profiled) / statistics.median(plain)
        out["overhead_pct"] = 100 * (out["ratio"] - 1)
    counters = [s.get("um_counters") or {} for s in sides[True]]
    if counters:
        out["counters_available"] = all(c.get("available") for c in counters)
        means = [(c.get("timed_mean") or {}).get("um_records") for c in counters]
        out["um_records_per_step"] = statistics.median(means) if all(m is not None for m in means) else None
        out["counters_reason"] = next((c.get("reason") for c in counters if c.get("reason")), None)
    return out


def main(argv=None) -> None:
    args = parse_args(argv)
    run_id = new_run_id("bench_profile_overhead")
    runs = measure(args)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "run_id": run_id, "device": None,
              "config": {k: getattr(args, k) for k in ("model", "batch_size", "seq_len", "steps", "warmup_steps",
                                                       "memory_limit", "budget", "rounds")},
              "per_policy": {}, "runs": []}
    budget_bytes = None
    if args.budget:
        from um_alloc.sizes import parse_size

        budget_bytes = parse_size(args.budget, key="--budget", source="command line")
    print(f"\n{'policy':<14}{'plain ms':>10}{'profiled ms':>13}{'ratio':>8}{'records/step':>14}")
    for policy, sides in runs.items():
        figures = summarize_policy(sides)
        result["per_policy"][policy] = figures
        for profile, summaries in sides.items():
            for s in summaries:
                result["device"] = s["device"]
                result["runs"].append(protocol_record(s, run_id=run_id, stock_samples_per_s=None, budget_bytes=budget_bytes,
                                                      profile=profile, step_s=s.get("step_s")))
        plain, prof = figures["plain_step_s"], figures["profiled_step_s"]
        ms = lambda xs: f"{statistics.median(xs) * 1e3:.1f}" if xs else "n/a"  # noqa: E731
        ratio = f"{figures['ratio']:.3f}" if figures["ratio"] else "n/a"
        records = f"{figures['um_records_per_step']:.0f}" if figures["um_records_per_step"] is not None else "n/a"
        print(f"{policy:<14}{ms(plain):>10}{ms(prof):>13}{ratio:>8}{records:>14}")
    print(f"wrote {write_result(args.name, result)}")


if __name__ == "__main__":
    main()
