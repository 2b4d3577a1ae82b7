"""GPT-2-medium through Hugging Face's Trainer at a GPU budget: the planner against Trainer's own
gradient checkpointing, in one invocation.

    python bench/bench_trainer.py --budget 12GiB --batch 8

Methods (each examples/hf_trainer_gpt2.py in a process of its own, bf16, seq 1024):
  stock                   PyTorch's allocator, everything in memory: the reference of every ratio
  gradient_checkpointing  PyTorch's allocator, TrainingArguments(gradient_checkpointing=True)
  planner                 um_alloc's UMAllocCallback with the budget: the block planner
  launcher                python -m um_alloc run --budget ...: the same, with no um_alloc line in the script
  planner_remade_logits   the planner with scheduler.recompute_logits on: backward makes the head's logits
                          again from its input, in chunks (not among the default methods)

With --repeats N the methods run N times, alternated (stock, gradient_checkpointing, planner,
launcher, stock, ...), so that a drift of the GPU's clocks or the host's load falls on all of them;
each record then holds every run's samples/s and, as its own, their median.

Records share one run_id and go to bench/results/RUN_ID/trainer_gpt2_<budget>.json; the um_alloc
methods' hold the first good run's plan, its predicted step time and the calibration it came from.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from harness import (PLANNER_SETTLING_STEPS, REMADE_LOGITS, RESULTS, child_env, new_run_id, planner_fields, ratio,
                     raw_policy, refuse_bad_counts, with_scheduler, write_policy, write_result)

from um_alloc.device_info import device_memory
from um_alloc.sizes import format_size, parse_size

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "hf_trainer_gpt2.py"
METHODS = ("stock", "gradient_checkpointing", "planner", "launcher")
VARIANTS = {"planner_remade_logits": REMADE_LOGITS}  # planner.yaml with other scheduler keys


def command(method: str, args, result: Path, report: Path) -> list[str]:
    common = example_args(args, result)
    if method == "stock":
        return [sys.executable, str(EXAMPLE), *common]
    if method == "gradient_checkpointing":
        return [sys.executable, str(EXAMPLE), "--gradient-checkpointing", *common]
    if method == "planner":
        return [sys.executable, str(EXAMPLE), "--budget", args.budget, *common]
    if method in VARIANTS:
        return [sys.executable, str(EXAMPLE), "--budget", args.budget, "--policy", str(variant_policy(method, args)),
                *common]
    return [sys.executable, "-m", "um_alloc", "run", "--budget", args.budget, "--json", str(report),
            str(EXAMPLE), *common]


def variant_policy(method: str, args) -> Path:
    """planner.yaml with the variant's scheduler keys, written beside the records."""
    keys, what = VARIANTS[method]
    return write_policy(args.out_dir / "policies", method, with_scheduler(raw_policy("planner"), **keys), what)


def example_args(args, result: Path) -> list[str]:
    """The example's workload flags, the same for every method."""
    return ["--batch-size", str(args.batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps),
            "--warmup-steps", str(args.warmup), "--json", str(result)]


def run_example(make_command, timeout: float) -> tuple[dict, dict, str]:
    """One run in a process of its own: (the example's result, the launcher's --json report,
    "ok" or "failed: why"). `make_command(result, report)` gives the command line."""
    with tempfile.TemporaryDirectory() as tmp:
        result, report = Path(tmp) / "result.json", Path(tmp) / "report.json"
        try:
            done = subprocess.run(make_command(result, report), capture_output=True, text=True, timeout=timeout,
                                  env=child_env())
            failed = done.returncode != 0 or not result.exists()
            reason = (done.stderr.strip().splitlines() or ["no output"])[-1] if failed else ""
        except subprocess.TimeoutExpired:
            failed, reason = True, f"timed out after {timeout:.0f} s"
        summary = {} if failed else json.loads(result.read_text())
        extra = json.loads(report.read_text()) if report.exists() else {}
    return summary, extra, "failed: " + reason[:300] if failed else "ok"


def merged(runs: list[tuple[dict, dict, str]]) -> dict:
    """One method's runs as one record's figures: the median samples/s and step time of the runs
    that ended well (each run's own is the median of its steps), the highest high-water, the
    first run's losses and plan."""
    good = [(summary, extra) for summary, extra, status in runs if status == "ok"]
    rates = [s["samples_per_s"] for s, _ in good if s.get("samples_per_s")]
    steps = [s["step_s_median"] for s, _ in good if s.get("step_s_median")]
    highwater = [s["nvml_highwater_bytes"] for s, _ in good if s.get("nvml_highwater_bytes") is not None]
    failures = [status for _, _, status in runs if status != "ok"]
    figures = {"samples_per_s": statistics.median(rates) if rates else None,
               "step_s_median": statistics.median(steps) if steps else None,
               "highwater_bytes": max(highwater) if highwater else None,
               "losses": good[0][0].get("losses") if good else None,
               "status": failures[0] if failures else "ok"}
    figures["step_s_each_runs"] = [s.get("step_s_each") if status == "ok" else None for s, _, status in runs]
    if len(runs) > 1:
        figures["samples_per_s_runs"] = [s.get("samples_per_s") if status == "ok" else None for s, _, status in runs]
    summary, extra = good[0] if good else ({}, {})
    planner = extra.get("planner") or summary
    if planner.get("plan"):
        figures.update(planner_fields(planner))
    return figures


def alternated(methods: list[str], repeats: int, run_one) -> dict[str, list]:
    """run_one(method) for each method in turn, `repeats` times over: {method: [its runs]}."""
    runs: dict[str, list] = {m: [] for m in methods}
    for _ in range(repeats):
        for method in methods:
            runs[method].append(run_one(method))
            summary, _, status = runs[method][-1]
            print(f"[{method}] {summary.get('samples_per_s') or 0:.1f} samples/s, high-water "
                  f"{format_size(summary.get('nvml_highwater_bytes') or 0)} {'' if status == 'ok' else status}",
                  flush=True)
    return runs


def device_name() -> str | None:
    """The GPU's name from NVML (this process starts no CUDA), None without one."""
    memory = device_memory(0)
    return None if memory is None else memory.name


def record(method: str, runs: list, args, run_id: str, budget: int | None) -> dict:
    return {"run_id": run_id, "device": device_name(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "workload": f"gpt2-medium-seq{args.seq_len}-bf16-trainer", "method": method, "batch": args.batch,
            "budget_bytes": budget, "runs": len(runs), **merged(runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="12GiB")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=PLANNER_SETTLING_STEPS + 12)
    p.add_argument("--warmup", type=int, default=PLANNER_SETTLING_STEPS,
                   help="first steps left out of the median (the planner calibrates in the first two, then "
                        "tries up to four plans, three steps at a time, in turn and back)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--repeats", type=int, default=1, help="runs of each method, alternated")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    budget = parse_size(args.budget, key="--budget", source="command line")
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS) - set(VARIANTS))
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join((*METHODS, *VARIANTS))}")
    refuse_bad_counts(p, args)
    run_id = new_run_id("trainer")
    args.out_dir = args.out or RESULTS / run_id
    runs = alternated(methods, args.repeats, lambda method: run_example(
        lambda result, report: command(method, args, result, report), args.timeout))
    records = [record(m, runs[m], args, run_id, None if m == "stock" else budget) for m in methods]
    stock = next((r["samples_per_s"] for r in records if r["method"] == "stock"), None)
    peer = next((r["samples_per_s"] for r in records if r["method"] == "gradient_checkpointing"), None)
    for r in records:
        r["ratio_vs_stock"] = ratio(r["samples_per_s"], stock)
        r["ratio_vs_gradient_checkpointing"] = ratio(r["samples_per_s"], peer)
    write_result(f"trainer_gpt2_{args.budget}", records, args.out_dir)
    print(f"\nGPT-2-medium b{args.batch} through Trainer, budget {format_size(budget)}, run {run_id}")
    for r in records:
        rate = "failed" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        vs = "" if r["ratio_vs_stock"] is None else f"{r['ratio_vs_stock']:.3f}"
        vp = "" if r["ratio_vs_gradient_checkpointing"] is None else f"{r['ratio_vs_gradient_checkpointing']:.3f}"
        print(f"{r['method']:<24}{rate:>9}{vs:>8}{vp:>8}  {format_size(r['highwater_bytes'] or 0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
