"""What ``python -m um_alloc run`` costs with no budget: the same Hugging Face Trainer script, in
memory, as a plain script and under the launcher, in one invocation.

    python bench/bench_launcher.py                   # GPT-2-medium b8 seq 1024, two runs of each

Methods (each examples/hf_trainer_gpt2.py in a process of its own, bf16, nothing else changed):
  script    python examples/hf_trainer_gpt2.py ARGS: PyTorch's allocator, the reference of the ratio
  launcher  python -m um_alloc run examples/hf_trainer_gpt2.py ARGS: um_alloc's pool under
            none.yaml, parameters, gradients and optimizer state tagged, no planner

The runs alternate (script, launcher, script, ...), so that a drift of the GPU's clocks or the
host's load falls on both; a method's samples/s is the median of its runs' (each run's own is
the median of its steps after --warmup). The high-water is NVML's device memory in use at the end
beyond the script's start (under the launcher the start comes after um_alloc installed).

Records share one run_id and go to bench/results/RUN_ID/launcher_no_budget.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench_trainer import EXAMPLE, alternated, example_args, record, run_example
from harness import RESULTS, new_run_id, ratio, refuse_bad_counts, write_result

from um_alloc.sizes import format_size

METHODS = ("script", "launcher")


def command(method: str, args, result: Path, report: Path) -> list[str]:
    if method == "script":
        return [sys.executable, str(EXAMPLE), *example_args(args, result)]
    return [sys.executable, "-m", "um_alloc", "run", "--json", str(report), str(EXAMPLE), *example_args(args, result)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of each run's median")
    p.add_argument("--repeats", type=int, default=2, help="runs of each method, alternated")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    refuse_bad_counts(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run_id = new_run_id("launcher")
    runs = alternated(list(METHODS), args.repeats, lambda method: run_example(
        lambda result, report: command(method, args, result, report), args.timeout))
    records = [record(m, runs[m], args, run_id, None) for m in METHODS]
    script = records[0]["samples_per_s"]
    for r in records:
        r["ratio_vs_script"] = ratio(r["samples_per_s"], script)
    path = write_result("launcher_no_budget", records, args.out or RESULTS / run_id)
    print(f"\nGPT-2-medium b{args.batch} seq {args.seq_len} through Trainer, in memory, run {run_id} ({path})")
    for r in records:
        rate = "failed" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        vs = "" if r["ratio_vs_script"] is None else f"{r['ratio_vs_script']:.3f}"
        print(f"{r['method']:<10}{rate:>9}{vs:>8}  {format_size(r['highwater_bytes'] or 0)}  runs "
              f"{r.get('samples_per_s_runs') or [r['samples_per_s']]}  {r['status']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
