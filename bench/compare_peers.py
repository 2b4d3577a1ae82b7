"""um_alloc against the other ways to fit training in less GPU memory: the same workload and budget
for every method, in one invocation, with throughput ratios to stock PyTorch in memory.

    python bench/compare_peers.py --batch-size 32 --memory-limit 16GiB --rounds 2
    python bench/compare_peers.py --profile ...     # CUPTI counters in every run (same overhead for all)

Methods (each in its own process):
- stock: PyTorch's allocator with everything in GPU memory, no budget. The reference (1.00).
- stock_save_on_cpu: torch.autograd.graph.save_on_cpu(pin_memory=True): activations wait in host memory.
- stock_checkpointing: activation checkpointing per layer (recomputed in backward).
- rmm_managed_pool: RMM's pool over managed memory (rmm_torch_allocator), when `import rmm` works.
- um_reactive: um_alloc, none.yaml + scheduler.budget + evict_live: true: the reactive budget
  (evict least recently used chunks over the budget, let faults bring them back).
- um_best: um_alloc, best.yaml + scheduler.budget: a hard budget, under which the block planner
  keeps, recomputes or moves each block's activations (um_alloc.planner).
The budget (--memory-limit) is set_per_process_memory_fraction for stock, maximum_pool_size for
RMM and scheduler.budget for um_alloc (a copy of the policy under OUT/policies/; where the policy
does not accept it, the pool cap --memory-limit instead, and the table says so). A method that
does not fit shows status "oom".
With --rounds N the methods alternate N times; a method's step time is the median of its runs.
OUT is bench/results/RUN_ID unless --out says otherwise; every row carries the run_id.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import (MEMORY_COLUMNS, RUN_COLUMNS, Run, add_ratio, add_workload_args, compare, counter_columns,
                     importable, provenance, raw_policy, row, run_train, validation_error, with_scheduler,
                     workload_args, write_all, write_policy)

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--rounds", type=int, default=1, help="alternate the methods this many times (default 1)")
    p.add_argument("--profile", action="store_true", help="CUPTI unified-memory counters in every run")
    p.add_argument("--reactive-policy", default="none.yaml", help="policy of um_reactive (default none.yaml)")
    return p.parse_args(argv)


def um_budget(args, out: Path, name: str, policy: str, **scheduler) -> tuple[list[str], str]:
    """train.py arguments that hold um_alloc to the budget (with these scheduler settings
    besides), and a note on how."""
    if not args.memory_limit:
        return ["--policy", policy], ""
    data = with_scheduler(raw_policy(policy), budget=args.memory_limit, **scheduler)
    error = validation_error(data, name, name)
    if error:
        return ["--policy", policy, "--memory-limit", args.memory_limit], f"pool cap, not scheduler.budget ({error})"
    path = out / "policies" / f"{name}.yaml"
    if not args.dry_run:
        write_policy(path.parent, name, data, f"{policy} + scheduler.budget {args.memory_limit}")
    return ["--policy", str(path)], ""


def plan(args, out: Path, rmm_status: str | None = "unchecked") -> list[Run]:
    base = workload_args(args) + (["--profile"] if args.profile else [])
    limit = ["--memory-limit", args.memory_limit] if args.memory_limit else []
    rmm_skip = importable("rmm", "rmm.allocators.torch") if rmm_status == "unchecked" else rmm_status
    reactive, reactive_note = um_budget(args, out, "um_reactive", args.reactive_policy, evict_live=True)
    best, best_note = um_budget(args, out, "um_best", "best.yaml")
    return [
        Run("stock", "stock PyTorch, in memory (no budget): the reference", [*base, "--allocator", "stock"]),
        Run("stock_save_on_cpu", "stock + save_on_cpu(pin_memory=True)",
            [*base, "--allocator", "stock", "--offload", "save_on_cpu", *limit]),
        Run("stock_checkpointing", "stock + activation checkpointing",
            [*base, "--allocator", "stock", "--checkpointing", *limit]),
        Run("rmm_managed_pool", "RMM managed-memory pool (rmm_torch_allocator)", [*base, *limit],
            script=HERE / "rmm_train.py", skip=rmm_skip),
        Run("um_reactive", f"um_alloc, {args.reactive_policy} + budget (reactive eviction) {reactive_note}".strip(),
            [*base, "--allocator", "um", *reactive]),
        Run("um_best", f"um_alloc, best.yaml + budget {best_note}".strip(), [*base, "--allocator", "um", *best]),
    ]


def execute(runs: list[Run], rounds: int, timeout: int, runner=run_train, run_id: str | None = None) -> list[dict]:
    """Alternates the runs `rounds` times; one row per method (median step time of its ok runs)."""
    results: dict[str, list[dict]] = {run.name: [] for run in runs}
    for r in range(rounds):
        for run in runs:
            if run.skip:
                continue
            print(f"round {r + 1}/{rounds}", flush=True)
            summary, status, note = runner(run, timeout)
            results[run.name].append(row(run, summary, status, note, run_id=run_id))
    return [combine(run, results[run.name], run_id) for run in runs]


def combine(run: Run, rows: list[dict], run_id: str | None = None) -> dict:
    if run.skip or not rows:
        return row(run, None, "skipped", run_id=run_id)
    ok = [r for r in rows if r["status"] == "ok"]
    out = dict(ok[-1] if ok else rows[-1])
    out["rounds"] = len(rows)
    if ok:
        out["step_s_median"] = statistics.median(r["step_s_median"] for r in ok)
        out["samples_per_s"] = ok[-1]["batch"] / out["step_s_median"]
        out["step_s_rounds"] = [r["step_s_median"] for r in ok]
    return out


def report(rows: list[dict], out: Path, args) -> list[Path]:
    from um_alloc.profile import charts

    stock = add_ratio(rows, "stock", "ratio_vs_stock")
    columns = [*RUN_COLUMNS, ("ratio_vs_stock", "vs stock", "ratio"), *MEMORY_COLUMNS, ("description", "method", "text")]
    columns += counter_columns() if args.profile else []
    notes = [f"Workload: BERT-{args.model} MLM, batch {args.batch_size}, seq {args.seq_len}, {args.steps} steps "
             f"({args.warmup_steps} warm-up), {args.rounds} round(s); budget {args.memory_limit or 'none'} "
             "for every method but stock (the in-memory reference).",
             "stock in memory ran at " + (f"{stock:.2f} samples/s." if stock else "n/a: it did not run or fit."),
             provenance(rows),
             *[f"{r['name']}: {r['note']}" for r in rows if r["note"]]]
    paths = write_all(rows, out, "peers", md_columns=columns, title="um_alloc and its peers", notes=notes)
    drawn = [r for r in rows if r["status"] != "skipped"]
    labels = [r["name"] for r in drawn]
    paths.append(charts.bar_chart(labels, [r.get("ratio_vs_stock") for r in drawn], out / "ratio_vs_stock.png",
                                  title="Throughput relative to stock PyTorch in memory", ylabel="ratio",
                                  kind="ratio", reference=1.0))
    paths.append(charts.bar_chart(labels, [r.get("highwater_bytes") for r in drawn], out / "highwater.png",
                                  title="GPU memory high-water mark (NVML)", ylabel="bytes", kind="bytes"))
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    print(f"compare_peers: every method {args.rounds} time(s), alternating")
    return compare("compare_peers", args, plan=plan, report=report, table="peers.md",
                   execute=lambda runs, run_id: execute(runs, args.rounds, args.timeout, run_id=run_id))


if __name__ == "__main__":
    sys.exit(main())
