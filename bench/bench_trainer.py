"""GPT-2-medium through Hugging Face's Trainer at a GPU budget: the planner against Trainer's own
gradient checkpointing, in one invocation.

    python bench/bench_trainer.py --budget 12GiB --batch 8

Methods (each examples/hf_trainer_gpt2.py in a process of its own, bf16, seq 1024):
  stock                   PyTorch's allocator, everything in memory: the reference of every ratio
  gradient_checkpointing  PyTorch's allocator, TrainingArguments(gradient_checkpointing=True)
  planner                 um_alloc's UMAllocCallback with the budget: the block planner
  launcher                python -m um_alloc run --budget ...: the same, with no um_alloc line in the script

Records share one run_id and go to bench/results/RUN_ID/trainer_gpt2_<budget>.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from harness import RESULTS, child_env, new_run_id, ratio, write_result

from um_alloc.sizes import format_size, parse_size

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer_gpt2.py"
METHODS = ("stock", "gradient_checkpointing", "planner", "launcher")


def command(method: str, args, result: Path, report: Path) -> list[str]:
    common = ["--batch-size", str(args.batch), "--steps", str(args.steps), "--warmup-steps", str(args.warmup),
              "--json", str(result)]
    if method == "stock":
        return [sys.executable, str(EXAMPLE), *common]
    if method == "gradient_checkpointing":
        return [sys.executable, str(EXAMPLE), "--gradient-checkpointing", *common]
    if method == "planner":
        return [sys.executable, str(EXAMPLE), "--budget", args.budget, *common]
    return [sys.executable, "-m", "um_alloc", "run", "--budget", args.budget, "--json", str(report),
            str(EXAMPLE), *common]


def run(method: str, args, run_id: str, budget: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result, report = Path(tmp) / "result.json", Path(tmp) / "report.json"
        try:
            done = subprocess.run(command(method, args, result, report), capture_output=True, text=True,
                                  timeout=args.timeout, env=child_env())
            failed = done.returncode != 0 or not result.exists()
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1] if failed else ""
        except subprocess.TimeoutExpired:
            failed, reason = True, f"timed out after {args.timeout:.0f} s"
        summary = {} if failed else json.loads(result.read_text())
        extra = json.loads(report.read_text()) if report.exists() else {}
    record = {"run_id": run_id, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "workload": f"gpt2-medium-seq{args.seq_len}-bf16-trainer", "method": method, "batch": args.batch,
              "budget_bytes": None if method == "stock" else budget,
              "samples_per_s": summary.get("samples_per_s"), "step_s_median": summary.get("step_s_median"),
              "highwater_bytes": summary.get("nvml_highwater_bytes"), "losses": summary.get("losses"),
              "status": "failed: " + reason[:300] if failed else "ok"}
    plan = (extra.get("planner") or {}).get("plan") or summary.get("plan")
    if plan:
        record.update(plan=plan, predicted_step_s=plan.get("predicted_step_s"))
    print(f"[{method}] {record['samples_per_s'] or 0:.1f} samples/s, high-water "
          f"{format_size(record['highwater_bytes'] or 0)} {'' if not failed else record['status']}", flush=True)
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=6, help="first steps left out of the median (the planner "
                   "calibrates in the first two)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    budget = parse_size(args.budget, key="--budget", source="command line")
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and below --steps ({args.steps}); got {args.warmup}")
    run_id = new_run_id("trainer")
    records = [run(m, args, run_id, budget) for m in methods]
    stock = next((r["samples_per_s"] for r in records if r["method"] == "stock"), None)
    peer = next((r["samples_per_s"] for r in records if r["method"] == "gradient_checkpointing"), None)
    for r in records:
        r["ratio_vs_stock"] = ratio(r["samples_per_s"], stock)
        r["ratio_vs_gradient_checkpointing"] = ratio(r["samples_per_s"], peer)
    write_result(f"trainer_gpt2_{args.budget}", records, args.out or RESULTS / run_id)
    print(f"\nGPT-2-medium b{args.batch} through Trainer, budget {format_size(budget)}, run {run_id}")
    for r in records:
        rate = "failed" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        vs = "" if r["ratio_vs_stock"] is None else f"{r['ratio_vs_stock']:.3f}"
        vp = "" if r["ratio_vs_gradient_checkpointing"] is None else f"{r['ratio_vs_gradient_checkpointing']:.3f}"
        print(f"{r['method']:<24}{rate:>9}{vs:>8}{vp:>8}  {format_size(r['highwater_bytes'] or 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
