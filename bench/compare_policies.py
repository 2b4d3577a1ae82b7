"""Compare memory-advise policies on the BERT example: one process per policy, same workload and
budget, CUPTI counters on in every run (so every run pays the same profiling overhead).

    python bench/compare_policies.py --memory-limit 16GiB                  # the default set
    python bench/compare_policies.py --batch-size 32 my_policy.yaml other.yaml
    python bench/compare_policies.py --dry-run                             # what would run

Default set: none, worst, best; then ablations of best: advice only (best's hints, no
prefetch) and prefetch only (best's prefetches, no hints), each with best's scheduler. With --budget, also the ablations of
what happens under a budget (best's block planner keeps, recomputes or moves each block under a
hard budget): offload (activations beyond the budget moved by pinned copies, nothing recomputed:
offload.yaml's way), checkpoint (every block recomputed), planner_off (the hard budget alone),
each way data leaves the GPU (evict_reactive: least recently used chunks to the host by prefetch,
faults bring them back; evict_host_mapped: best plus the optimizer state host-mapped, written by
the GPU over the link), and the offload's three schedule windows.

Budgets: --budget writes scheduler.budget into a copy of every policy (OUT/policies/*.yaml);
--memory-limit caps the managed memory of every run (pool.max_reserved: past it, OOM). A budget
is hard unless a policy says otherwise; the reactive runs (none, the baseline of page faults, and
evict_reactive) say `evict_live: true` in their copies.

OUT is bench/results/RUN_ID unless --out says otherwise; every row carries the run_id. Writes
OUT/policies.csv and .md (per-step counters are means over the timed steps), OUT/*.png
(step time, throughput, GPU faults, migrated bytes by direction and cause, high-water mark),
OUT/results.json, and OUT/policies/*.yaml (the generated ablations, to re-run one by hand).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness import (MEMORY_COLUMNS, OFFLOAD_COLUMNS, RUN_COLUMNS, Run, add_ratio, add_workload_args, compare,
                     counter_columns, provenance, raw_policy, row, run_train, validation_error, with_scheduler,
                     workload_args, write_all, write_policy)

from um_alloc.errors import PolicyError
from um_alloc.policy import TagAdvice, load_policy

SHIPPED = [("none", "no advice, no prefetch: pages move on faults only; reactive eviction under a budget"),
           ("worst", "the opposite of best: everything prefers the CPU, nothing is prefetched"),
           ("best", "Choi & Lee's advice plus prefetch; under a budget: hard, the block planner")]
NEEDS_BUDGET = "needs --budget (it changes only what happens under a budget)"
WINDOWS = ("256MiB", "1GiB", "4GiB")
REACTIVE = {"evict_live": True}  # over the budget, evict live chunks and let faults bring them back
# Under --budget, what each shipped policy's copy changes besides the budget.
SHIPPED_SCHEDULER = {"none": REACTIVE}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("policies", nargs="*", help="extra policy files, run after the default set")
    add_workload_args(p)
    p.add_argument("--budget", metavar="SIZE", help="scheduler.budget for every policy (copies under OUT/policies/)")
    p.add_argument("--only", metavar="NAMES", help="comma-separated names to run (others are listed as skipped)")
    p.add_argument("--timeline", action="store_true", help="also draw each run's last step (OUT/timeline_NAME.png)")
    return p.parse_args(argv)


def tag_dict(advice: TagAdvice) -> dict:
    return {"preferred_location": advice.preferred_location, "read_mostly": advice.read_mostly,
            "accessed_by": list(advice.accessed_by), "prefetch": advice.prefetch}


def ablations() -> list[tuple[str, dict, str, bool]]:
    """(name, policy dict, description, needs a budget) for each generated policy."""
    best = load_policy("best")
    tags = {tag: tag_dict(a) for tag, a in best.tags.items() if a != TagAdvice()}
    advice = {t: {**a, "prefetch": False} for t, a in tags.items()}
    prefetch = {t: {"prefetch": True} for t, a in tags.items() if a["prefetch"]}
    hard = {"evict_live": False}
    planner = {**hard, "strategy": best.scheduler.strategy}
    offload = {**hard, "offload_activations": True}
    host_state = {**tags, "optimizer_state": {"preferred_location": "cpu", "accessed_by": ["gpu"]}}
    out = [("advice_only", {"tags": advice, "scheduler": planner}, "best's hints, no prefetch", False),
           ("prefetch_only", {"tags": prefetch, "scheduler": planner}, "best's prefetches, no hints", False),
           ("offload", {"tags": tags, "scheduler": offload},
            "best's hints, activations beyond the budget moved to host memory, none recomputed", True),
           ("checkpoint", {"tags": tags, "scheduler": {**hard, "strategy": "checkpoint"}},
            "best's hints, every block recomputed", True),
           ("planner_off", {"tags": tags, "scheduler": hard}, "best's hard budget alone, activations not planned", True),
           ("evict_reactive", {"tags": tags, "scheduler": REACTIVE},
            "best's hints, reactive budget: LRU chunks to the host, faults back", True),
           ("evict_host_mapped", {"tags": host_state, "scheduler": planner},
            "best, and optimizer state host-mapped (GPU writes it over the link)", True)]
    out += [(f"window_{size}", {"tags": tags, "scheduler": {**offload, "schedule_window": size}},
             f"the offload, schedule_window {size}", True) for size in WINDOWS]
    return out


def plan(args, out: Path) -> list[Run]:
    common = workload_args(args) + ["--allocator", "um", "--profile"]
    common += ["--memory-limit", args.memory_limit] if args.memory_limit else []

    def make(name: str, data: dict | None, source: str, description: str, skip: str | None = None) -> Run:
        """A run of policy `source` as is, or of `data` (plus --budget) written to OUT/policies/NAME.yaml."""
        policy = source
        if data is not None:
            if args.budget and not skip:
                data = with_scheduler(data, budget=args.budget)
            path = out / "policies" / f"{name}.yaml"
            error = validation_error(data, str(path), name)
            skip = skip or (f"policy does not validate: {error}" if error else None)
            if not args.dry_run:
                write_policy(path.parent, name, data, description)
            policy = str(path)
        extra = ["--timeline", str(out / f"timeline_{name}.png")] if args.timeline else []
        return Run(name, description, [*common, "--policy", policy, *extra], skip=skip)

    runs = [make(name, with_scheduler(raw_policy(f"{name}.yaml"), **SHIPPED_SCHEDULER.get(name, {}))
                 if args.budget else None, f"{name}.yaml", text) for name, text in SHIPPED]
    for name, data, text, needs_budget in ablations():
        runs.append(make(name, data, name, text, NEEDS_BUDGET if needs_budget and not args.budget else None))
    for file in args.policies:
        error = _file_error(file)
        data = raw_policy(file) if args.budget and not error else None
        runs.append(make(Path(file).stem, data, str(Path(file).resolve()), f"policy file {file}", error))
    if args.only:
        wanted = set(args.only.split(","))
        for run in runs:
            run.skip = run.skip or (None if run.name in wanted else "not in --only")
    return runs


def _file_error(file: str) -> str | None:
    try:
        load_policy(file)
    except (PolicyError, OSError) as error:
        return f"does not load: {error}"
    return None


def execute(runs: list[Run], timeout: int, runner=run_train, run_id: str | None = None) -> list[dict]:
    rows = []
    for run in runs:
        if run.skip:
            print(f"[{run.name}] skipped: {run.skip}", flush=True)
            rows.append(row(run, None, "skipped", run_id=run_id))
            continue
        summary, status, note = runner(run, timeout)
        rows.append(row(run, summary, status, note, run_id=run_id))
    return rows


def report(rows: list[dict], out: Path, args) -> list[Path]:
    from um_alloc.profile import charts

    add_ratio(rows, "none", "ratio_vs_none")
    columns = [*RUN_COLUMNS, ("ratio_vs_none", "vs none", "ratio"), *MEMORY_COLUMNS, *OFFLOAD_COLUMNS,
               *counter_columns()]
    notes = [f"Workload: BERT-{args.model} MLM, batch {args.batch_size}, seq {args.seq_len}, {args.steps} steps "
             f"({args.warmup_steps} warm-up), memory limit {args.memory_limit or 'none'}, scheduler.budget "
             f"{args.budget or 'none'}; one process per policy, CUPTI counters on in all.", provenance(rows),
             "Counters are means per timed step. HtoD 'fault' is CUPTI's COHERENCE cause (page faults), "
             "'prefetch' its USER cause (cudaMemPrefetchAsync), 'speculative' the driver's own prefetch.",
             "GPU high-water: NVML used at the end minus at the start (the driver keeps pages it has used).",
             "Offloaded: the last step's pinned copies of saved activations (policies with "
             "scheduler.offload_activations under a budget); CUPTI's unified-memory counters do not see them.",
             *[f"{r['name']}: {r['note']}" for r in rows if r["note"]]]
    paths = write_all(rows, out, "policies", md_columns=columns, title="Memory-advise policies", notes=notes)
    drawn = [r for r in rows if r["status"] != "skipped"]
    labels = [r["name"] for r in drawn]
    for key, name, title, ylabel, kind in (
            ("step_s_median", "step_time", "Median step time", "step time", "seconds"),
            ("samples_per_s", "throughput", "Throughput", "samples/s", "rate"),
            ("gpu_page_faults", "gpu_page_faults", "GPU page-fault groups per timed step", "faults", "count"),
            ("highwater_bytes", "highwater", "GPU memory high-water mark (NVML)", "bytes", "bytes")):
        paths.append(charts.bar_chart(labels, [r.get(key) for r in drawn], out / f"{name}.png",
                                      title=title, ylabel=ylabel, kind=kind))
    paths.append(charts.migrated_bytes_chart(labels, drawn, out / "migrated_bytes.png",
                                             title="Migrated bytes per timed step, by direction and cause"))
    return paths


def main(argv=None) -> int:
    args = parse_args(argv)
    return compare("compare_policies", args, plan=plan, report=report, table="policies.md",
                   execute=lambda runs, run_id: execute(runs, args.timeout, run_id=run_id))


if __name__ == "__main__":
    sys.exit(main())
