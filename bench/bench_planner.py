"""The block planner against what a user would do instead, at one budget, in one invocation.

    python bench/bench_planner.py --budget 16GiB --batch 32

Methods (each a train.py run in a process of its own; BERT-Large MLM, bf16, fused AdamW):
  stock          stock PyTorch, everything in memory: the reference of every ratio
  checkpointing  stock limited to the budget (a memory fraction), every layer checkpointed
  frontier       stock limited to the budget, the first k layers checkpointed, k the smallest
                 that fits (searched; fewer checkpointed layers are faster): the strongest peer
  save_on_cpu    stock limited to the budget, saved activations in pinned host memory
  offload        um_alloc, offload.yaml under the budget: the activation offload
  planner        um_alloc, best.yaml (strategy auto) under the budget: the block planner
  planner_plain_loss  the same with the model's loss left to PyTorch (scheduler.lean_loss:
                 false): what the chunked loss costs or gains

All records share one run_id and go to bench/results/RUN_ID/planner_<budget>.json, with the
frontier's k, the planner's plan and its predicted step time. A method that does not fit is
recorded with its status (oom), not left out.

With --repeats N the methods run N times, alternated after the frontier's search (which gives each
peer its first run), and each record holds the median samples/s of its runs, every run's in
samples_per_s_runs, and the first run's plan: the host moves two runs of one method by several
percent, more than the margins this benchmark measures.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from harness import (PLANNER_SETTLING_STEPS, RESULTS, Run, new_run_id, planner_fields, pooled, protocol_record,
                     rate_and_ratio_text, raw_policy, refuse_bad_counts, run_train, smallest_fitting, with_scheduler,
                     write_policy, write_result)

from um_alloc.sizes import format_size, parse_size

LAYERS = 24  # BERT-Large
METHODS = ("stock", "checkpointing", "frontier", "save_on_cpu", "offload", "planner", "planner_plain_loss")


def base_args(args) -> list[str]:
    return ["--model", "large", "--batch-size", str(args.batch), "--steps", str(args.steps),
            "--warmup-steps", str(args.warmup), "--dropout", "0", *(["--deterministic"] if args.deterministic else [])]


def stock_run(args, name: str, *extra: str) -> Run:
    limited = [] if name == "stock" else ["--memory-limit", args.budget]
    return Run(name, f"stock PyTorch {' '.join(extra)}".strip(), [*base_args(args), "--allocator", "stock", *limited, *extra])


def um_run(args, name: str, policy: Path) -> Run:
    return Run(name, f"um_alloc {policy.name}", [*base_args(args), "--allocator", "um", "--policy", str(policy),
                                                  "--budget", args.budget])


def search_frontier(args, fits_all: dict | None, stock: dict | None, timeout: float):
    """The smallest k whose first-k checkpointing fits: a guess from the two ends' peaks (memory
    falls about linearly with k), then steps of one until the boundary is found (k None: not even
    every layer checkpointed fits)."""
    budget = parse_size(args.budget, key="--budget", source="command line")
    if fits_all is None:
        return None, None, []
    guess = LAYERS
    if stock and stock.get("peak_bytes") and fits_all.get("peak_bytes"):
        per_layer = (stock["peak_bytes"] - fits_all["peak_bytes"]) / LAYERS
        guess = min(LAYERS, max(0, math.ceil((stock["peak_bytes"] - 0.92 * budget) / per_layer)))

    def fits(k: int) -> dict | None:
        summary = run_train(stock_run(args, f"frontier_k{k}", "--checkpointing", str(k)), timeout)[0]
        _progress(f"frontier_k{k}", summary)
        return summary

    return smallest_fitting(fits, guess, LAYERS, known={LAYERS: fits_all})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=PLANNER_SETTLING_STEPS + 12)
    p.add_argument("--warmup", type=int, default=PLANNER_SETTLING_STEPS,
                   help="first steps left out of the timing (the planner measures in its first two, then "
                        "tries up to four plans, three steps at a time, in turn and back)")
    p.add_argument("--deterministic", action="store_true", help="train.py --deterministic for every method")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1, help="runs of each method, alternated (see above)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    refuse_bad_counts(p, args)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    budget = parse_size(args.budget, key="--budget", source="command line")
    run_id = new_run_id("planner")
    out = args.out or RESULTS / run_id
    plain_loss = write_policy(out / "policies", "best_plain_loss", with_scheduler(raw_policy("best.yaml"), lean_loss=False),
                              "best.yaml (the block planner) with the model's loss left to PyTorch")
    summaries: dict[str, tuple[dict | None, dict]] = {}
    runs = {"stock": stock_run(args, "stock"), "checkpointing": stock_run(args, "checkpointing", "--checkpointing"),
            "save_on_cpu": stock_run(args, "save_on_cpu", "--offload", "save_on_cpu"),
            "offload": um_run(args, "offload", Path("offload.yaml")), "planner": um_run(args, "planner", Path("best.yaml")),
            "planner_plain_loss": um_run(args, "planner_plain_loss", plain_loss)}
    for name in runs:
        if name in methods or (name in ("stock", "checkpointing") and "frontier" in methods):
            summary, status, note = run_train(runs[name], args.timeout)
            summaries[name] = (summary, {"status": status, "note": note})
            _progress(name, summary)
    if "frontier" in methods:
        k, summary, tried = search_frontier(args, summaries["checkpointing"][0], summaries["stock"][0], args.timeout)
        summaries["frontier"] = (summary, {"status": "ok" if summary else "oom", "checkpointed_layers": k,
                                           "layers_tried": tried})
        if k is not None:
            runs["frontier"] = stock_run(args, f"frontier_k{k}", "--checkpointing", str(k))
    summaries = repeated(summaries, runs, args)
    stock = (summaries.get("stock") or (None,))[0]
    base = stock["samples_per_s"] if stock else None
    records = [_record(name, summary, extra, run_id, base, budget, args) for name, (summary, extra) in summaries.items()]
    write_result(f"planner_{args.budget}", records, out)
    _report(records, budget)
    return 0


def repeated(summaries: dict, runs: dict, args) -> dict:
    """--repeats: every method that ran runs args.repeats - 1 times more, in turn, and its record
    pools its runs (harness.pooled). The frontier runs its k again; its search's runs count once."""
    if args.repeats < 2:
        return summaries
    again = {name: [(summary, extra.get("status", "ok"), extra.get("note", ""))]
             for name, (summary, extra) in summaries.items() if name in runs}
    for _ in range(args.repeats - 1):
        for name in again:
            again[name].append(run_train(runs[name], args.timeout))
            _progress(name, again[name][-1][0])
    out = dict(summaries)
    for name, name_runs in again.items():
        summary, status, note = pooled(name_runs)
        out[name] = (summary, {**summaries[name][1], "status": status, "note": note})
    return out


def _progress(name: str, summary: dict | None) -> None:
    if summary is not None:
        print(f"[{name}] {summary['samples_per_s']:.1f} samples/s, peak {format_size(summary.get('peak_bytes') or 0)}, "
              f"high-water {format_size(summary.get('device_used_delta_bytes') or 0)}", flush=True)


def _record(name: str, summary, extra: dict, run_id: str, base, budget: int, args) -> dict:
    record = protocol_record(summary, run_id=run_id, stock_samples_per_s=base,
                             budget_bytes=None if name == "stock" else budget, method=name, **extra)
    record.update(workload=record.get("workload") or f"bert-large-mlm-seq512-bf16-b{args.batch}", batch=args.batch)
    if summary and summary.get("samples_per_s_runs"):
        record["samples_per_s_runs"] = summary["samples_per_s_runs"]
    if summary and summary.get("planner"):
        record.update(planner_fields(summary["planner"]))
    return record


def _report(records: list[dict], budget: int) -> None:
    print(f"\nbudget {format_size(budget)}, run {records[0]['run_id']}")
    print(f"{'method':<15}{'samples/s':>10}{'vs stock':>10}{'high-water':>12}  note")
    for r in records:
        rate, ratio = rate_and_ratio_text(r)
        water = "" if r["highwater_bytes"] is None else format_size(r["highwater_bytes"])
        note = f"k={r['checkpointed_layers']}" if r.get("checkpointed_layers") is not None else \
            (f"predicted {1e3 * r['predicted_step_s']:.0f} ms" if r.get("predicted_step_s") else r.get("status", ""))
        print(f"{r['method']:<15}{rate:>10}{ratio:>10}{water:>12}  {note}")


if __name__ == "__main__":
    raise SystemExit(main())
