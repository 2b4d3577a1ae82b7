"""um_alloc on every GPU of one host, under DistributedDataParallel and FSDP2, against one GPU and
against what a user would do instead, at one budget per GPU, in one invocation.

    python bench/bench_distributed.py --gpus 2 --budget 16GiB --batch 32
    python bench/bench_distributed.py --gpus 2 --losses      # deterministic losses, 20 steps

Methods (each a bert_example/train.py run; several processes start under torchrun; BERT-Large MLM,
bf16, --batch per process, so N processes train N x batch a step):
  stock             one GPU, stock PyTorch, everything in memory: the reference of every ratio
  planner           one GPU, um_alloc's block planner (best.yaml, strategy auto) under the budget
  ddp_stock         DDP, stock, no budget
  ddp_frontier      DDP, stock limited to the budget (a memory fraction per GPU), the first k layers
                    checkpointed, k the smallest that fits: the strongest peer
  ddp_planner       DDP, the block planner on every GPU under the budget
  fsdp_stock        FSDP2 (every encoder layer, then the model, fully_shard), stock, no budget
  fsdp_frontier     FSDP2, stock limited to the budget, the smallest k that fits
  fsdp_cpu_offload  FSDP2's CPUOffloadPolicy (shards in pinned host memory, the optimizer step on
                    the CPU), stock limited to the budget, the first k layers checkpointed with
                    fsdp_frontier's k (without its offload that k fits already)
  fsdp_planner      FSDP2, the block planner on every GPU under the budget

The frontier searches start at --frontier-k (--fsdp-frontier-k) and step by one layer to the
boundary. Scaling:
ddp_planner's samples/s over world x planner's (1.0: every GPU as fast as one alone).

--losses trains 20 steps with deterministic kernels and dropout 0: stock on one GPU with the
global batch (N x batch), ddp_stock and ddp_planner; the record gives each step's losses and the
largest differences between them.

Records share one run_id and go to bench/results/RUN_ID/distributed_<budget>.json (or
distributed_losses.json). A method that does not fit is recorded with its status, not left out.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from harness import (RESULTS, Run, new_run_id, protocol_record, rate_and_ratio_text, run_train, smallest_fitting,
                     torchrun, write_result)

from um_alloc.sizes import format_size, parse_size

LAYERS = 24  # BERT-Large
PLANNED = Path("best.yaml")  # the block planner: strategy auto
METHODS = ("stock", "planner", "ddp_stock", "ddp_frontier", "ddp_planner", "fsdp_stock", "fsdp_frontier",
           "fsdp_cpu_offload", "fsdp_planner")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="processes (one per GPU) of the parallel methods")
    p.add_argument("--budget", default="16GiB", help="per GPU")
    p.add_argument("--batch", type=int, default=32, help="sequences per GPU")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing (the planner "
                                                          "measures in its first two)")
    p.add_argument("--frontier-k", type=int, default=LAYERS, help="where ddp_frontier's search starts")
    p.add_argument("--fsdp-frontier-k", type=int, help="where fsdp_frontier's search starts (default --frontier-k)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--losses", action="store_true", help="the deterministic loss comparison instead")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if args.gpus < 2:
        p.error(f"--gpus must be at least 2, got {args.gpus}")
    args.fsdp_frontier_k = args.frontier_k if args.fsdp_frontier_k is None else args.fsdp_frontier_k
    for flag, k in (("--frontier-k", args.frontier_k), ("--fsdp-frontier-k", args.fsdp_frontier_k)):
        if not 0 <= k <= LAYERS:
            p.error(f"{flag} must be between 0 and {LAYERS}, got {k}")
    parse_size(args.budget, key="--budget", source="command line")
    return args


class Runs:
    """The train.py runs of one invocation: their shared flags, and a Run for each method."""

    def __init__(self, args, planned_policy: Path, *extra: str):
        self.args, self.policy = args, planned_policy
        self.common = ["--model", "large", "--steps", str(args.steps), "--warmup-steps", str(args.warmup),
                       "--dropout", "0", *extra]

    def stock(self, name: str, *, batch: int | None = None, parallel: str | None = None, limited: bool = False,
              checkpointed: int | None = None, cpu_offload: bool = False) -> Run:
        flags = ["--allocator", "stock", *(["--memory-limit", self.args.budget] if limited else []),
                 *(["--checkpointing", str(checkpointed)] if checkpointed is not None else []),
                 *(["--fsdp-cpu-offload"] if cpu_offload else [])]
        return self._run(name, "stock PyTorch", flags, batch, parallel)

    def planner(self, name: str, *, parallel: str | None = None) -> Run:
        flags = ["--allocator", "um", "--policy", str(self.policy), "--budget", self.args.budget]
        return self._run(name, f"um_alloc {self.policy.name}", flags, None, parallel)

    def _run(self, name: str, description: str, flags: list[str], batch: int | None, parallel: str | None) -> Run:
        batch_flags = ["--batch-size", str(batch or self.args.batch)]
        if parallel is None:
            return Run(name, description, [*self.common, *batch_flags, *flags])
        return Run(name, f"{description}, {parallel} on {self.args.gpus} GPUs",
                   [*self.common, *batch_flags, "--parallel", parallel, *flags], launch=torchrun(self.args.gpus))


def measure(args, runs: Runs) -> dict[str, tuple[dict | None, dict]]:
    """Every method asked for: name -> (summary or None, what the record adds)."""
    methods, done = args.methods.split(","), {}
    simple = {"stock": runs.stock("stock"), "planner": runs.planner("planner"),
              "ddp_stock": runs.stock("ddp_stock", parallel="ddp"),
              "ddp_planner": runs.planner("ddp_planner", parallel="ddp"),
              "fsdp_stock": runs.stock("fsdp_stock", parallel="fsdp"),
              "fsdp_planner": runs.planner("fsdp_planner", parallel="fsdp")}
    for name in METHODS:
        if name not in methods:
            continue
        if name in simple:
            summary, status, note = run_train(simple[name], args.timeout)
            done[name] = (summary, {"status": status, "note": note})
        elif name in ("ddp_frontier", "fsdp_frontier"):
            done[name] = frontier(args, runs, name.split("_")[0])
        else:  # fsdp_cpu_offload, at fsdp_frontier's k
            k = (done.get("fsdp_frontier") or (None, {}))[1].get("checkpointed_layers")
            k = LAYERS if k is None else k  # no search made, or nothing fit: every layer
            summary, status, note = run_train(runs.stock(name, parallel="fsdp", limited=True, checkpointed=k,
                                                         cpu_offload=True), args.timeout)
            done[name] = (summary, {"status": status, "note": note, "checkpointed_layers": k})
        _progress(name, done[name][0])
    return done


def frontier(args, runs: Runs, parallel: str) -> tuple[dict | None, dict]:
    def fits(k: int) -> dict | None:
        name = f"{parallel}_frontier_k{k}"
        summary = run_train(runs.stock(name, parallel=parallel, limited=True, checkpointed=k), args.timeout)[0]
        _progress(name, summary)
        return summary

    start = args.frontier_k if parallel == "ddp" else args.fsdp_frontier_k
    k, summary, tried = smallest_fitting(fits, start, LAYERS)
    return summary, {"status": "ok" if summary else "oom", "checkpointed_layers": k, "layers_tried": tried}


def compare_losses(args, runs: Runs) -> dict:
    """Deterministic losses: one GPU on the global batch, DDP stock and DDP with the planner."""
    global_batch = args.batch * args.gpus
    chosen = {"one_gpu_global_batch": runs.stock("one_gpu_global_batch", batch=global_batch),
              "ddp_stock": runs.stock("ddp_stock", parallel="ddp"),
              "ddp_planner": runs.planner("ddp_planner", parallel="ddp")}
    losses = {}
    for name, run in chosen.items():
        summary, status, note = run_train(run, args.timeout)
        losses[name] = summary["losses"] if summary else None
        print(f"[{name}] {status} {note}", flush=True)

    def largest_difference(a: str, b: str) -> float | None:
        if losses[a] is None or losses[b] is None:
            return None
        return max(abs(x - y) for x, y in zip(losses[a], losses[b]))

    return {"losses": losses, "global_batch": global_batch,
            "largest_difference": {"ddp_planner_vs_ddp_stock": largest_difference("ddp_planner", "ddp_stock"),
                                   "ddp_stock_vs_one_gpu": largest_difference("ddp_stock", "one_gpu_global_batch"),
                                   "ddp_planner_vs_one_gpu": largest_difference("ddp_planner", "one_gpu_global_batch")}}


def main() -> int:
    args = parse_args()
    budget = parse_size(args.budget, key="--budget", source="command line")
    run_id = new_run_id("distributed")
    out = args.out or RESULTS / run_id
    if args.losses:
        args.steps, args.warmup = 20, 2
        runs = Runs(args, PLANNED, "--deterministic")
        record = {"run_id": run_id, "gpus": args.gpus, "budget_bytes": budget, "batch_per_gpu": args.batch,
                  "what": "BERT-Large MLM, bf16, deterministic kernels, dropout 0, 20 steps",
                  **compare_losses(args, runs)}
        print("wrote", write_result("distributed_losses", record, out))
        print({k: v for k, v in record["largest_difference"].items()})
        return 0
    done = measure(args, Runs(args, PLANNED))
    records = records_of(done, run_id, budget, args)
    write_result(f"distributed_{args.budget}", records, out)
    report(records, budget, args.gpus)
    return 0


def records_of(done: dict, run_id: str, budget: int, args) -> list[dict]:
    stock = (done.get("stock") or (None,))[0]
    base = stock["samples_per_s"] if stock else None
    single = (done.get("planner") or (None,))[0]
    records = []
    for name, (summary, extra) in done.items():
        record = protocol_record(summary, run_id=run_id, stock_samples_per_s=base,
                                 budget_bytes=None if name.endswith("stock") else budget, method=name, **extra)
        record.update(gpus=1 if name in ("stock", "planner") else args.gpus, batch_per_gpu=args.batch,
                      peak_bytes_per_gpu=summary.get("peak_bytes") if summary else None)
        if summary and summary.get("planner"):
            record["plan"] = summary["planner"].get("plan", {})
        if name.endswith("_planner") and summary and single:
            record["scaling_vs_one_gpu_planner"] = summary["samples_per_s"] / (args.gpus * single["samples_per_s"])
        records.append(record)
    return records


def _progress(name: str, summary: dict | None) -> None:
    if summary is not None:
        print(f"[{name}] {summary['samples_per_s']:.1f} samples/s, peak per GPU "
              f"{format_size(summary.get('peak_bytes') or 0)}", flush=True)


def report(records: list[dict], budget: int, gpus: int) -> None:
    print(f"\nbudget {format_size(budget)} per GPU, {gpus} GPUs, run {records[0]['run_id']}")
    print(f"{'method':<18}{'samples/s':>10}{'vs stock':>10}{'peak/GPU':>11}  note")
    for r in records:
        rate, ratio = rate_and_ratio_text(r)
        peak = "" if r["peak_bytes_per_gpu"] is None else format_size(r["peak_bytes_per_gpu"])
        note = (f"k={r['checkpointed_layers']}" if r.get("checkpointed_layers") is not None else
                f"scaling {r['scaling_vs_one_gpu_planner']:.3f}" if r.get("scaling_vs_one_gpu_planner") else
                r.get("status", ""))
        print(f"{r['method']:<18}{rate:>10}{ratio:>10}{peak:>11}  {note}")


if __name__ == "__main__":
    raise SystemExit(main())
