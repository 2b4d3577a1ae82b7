"""Run any training script under the unified-memory counters, unchanged:

    python -m um_alloc.profile [--json OUT.json] [--device N] your_train.py ARGS...

A step ends after each optimizer.step() returns (a global hook), so per-step counts need no
change to the script. Those marks are taken on the CPU: a loop that never synchronises with
the GPU lets a step's late faults count in the next one. With several optimizers, each step()
is a mark. The counters start before the script runs, so um_alloc.install() in it still comes
before any CUDA work. Prints the counts at the end; --json (or UM_PROFILE_JSON) writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from . import aggregate
from .tables import counts_line
from .um_counters import UMCounters


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m um_alloc.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=os.environ.get("UM_PROFILE_JSON"), metavar="PATH",
                   help="write totals and per-step counts here (default: $UM_PROFILE_JSON)")
    p.add_argument("--device", type=int, default=0, help="CUDA device whose counters to read (default 0)")
    p.add_argument("--no-step-marks", action="store_true", help="totals only; no optimizer.step() hook")
    p.add_argument("script", help="the Python script to run")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p.parse_args(argv)


def mark_on_optimizer_steps(counters: UMCounters):
    """A step mark after every optimizer.step() of the process (a global hook); returns its handle."""
    return register_optimizer_step_post_hook(lambda optimizer, args, kwargs: counters.mark_step())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    counters = UMCounters(args.device).start()
    hook = None if args.no_step_marks else mark_on_optimizer_steps(counters)
    sys.argv = [args.script, *args.args]
    sys.path.insert(0, str(Path(args.script).resolve().parent))  # as `python script.py` would
    code = 0
    try:
        runpy.run_path(args.script, run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    finally:
        if hook is not None:
            hook.remove()
        counters.stop()
        report(counters, args.json)
    return code


def report(counters: UMCounters, json_path: str | None) -> None:
    """The counts to stderr; with `json_path`, totals and per-step counts there."""
    summary = counters.summary()
    steps = summary["per_step"]
    print(f"\num_alloc.profile: {len(steps)} marked steps", file=sys.stderr)
    if summary["available"]:
        print(f"  total: {counts_line(summary['totals'])}", file=sys.stderr)
        print(f"  mean per step: {counts_line(aggregate.mean(steps))}", file=sys.stderr)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"  wrote {json_path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
