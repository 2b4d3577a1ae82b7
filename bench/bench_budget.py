"""Training beyond a GPU budget: every method in one invocation, ratios to stock in memory.

    python bench/bench_budget.py --budget 16GiB --batch 32
Writes bench/results/budget_<budget>_<method>.json in DESIGN.md's protocol form.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import RESULTS, write_result

HERE = Path(__file__).resolve().parent
POLICIES = {"reactive": "none.yaml", "planned": "best.yaml", "offload": "best.yaml, evict_live: false",
            "offload_hostopt": "host_optimizer.yaml"}


def run(method: str, args) -> dict | None:
    cmd = [sys.executable, str(HERE / "budget_run.py"), method, "--budget", args.budget, "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--window", args.window]
    print("$", " ".join(cmd[1:]), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        print(f"  failed (exit {done.returncode}): {done.stderr[-1500:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--methods", default="stock,save_on_cpu,checkpointing,reactive,planned,offload,offload_hostopt")
    p.add_argument("--window", default="1GiB", help="offload methods: bytes copied back ahead of backward")
    args = p.parse_args()
    results = {m: run(m, args) for m in args.methods.split(",")}
    stock = results.get("stock")
    base = stock["samples_per_s"] if stock else None
    print(f"\n{'method':<15}{'samples/s':>11}{'vs stock':>10}{'high-water':>12}{'evicted/step':>14}")
    for method, r in results.items():
        if r is None:
            print(f"{method:<15}{'failed':>11}")
            continue
        ratio = r["samples_per_s"] / base if base else None
        record = {"device": r["device"], "date": _now(), "workload": f"bert-large-mlm-seq512-bf16-b{args.batch}",
                  "method": method, "policy": POLICIES.get(method),
                  "batch": r["batch"], "budget_bytes": r["budget_bytes"], "step_s_median": r["step_s_median"],
                  "samples_per_s": r["samples_per_s"], "ratio_vs_stock": ratio,
                  "highwater_bytes": r["highwater_bytes"], "gpu_page_faults": None, "htod_bytes": None,
                  "dtoh_bytes": None, "loss_first": r["losses"][0], "loss_last": r["losses"][-1], "raw": r}
        write_result(f"budget_{args.budget}_b{args.batch}_{method}", record)
        hw = (r["highwater_bytes"] or 0) / 2**30
        ev = (r.get("last_bytes_out") or r.get("evicted_bytes") or 0) / 2**30
        print(f"{method:<15}{r['samples_per_s']:>11.2f}{(ratio or 0):>10.3f}{hw:>9.1f} GiB{ev:>11.1f} GiB")


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    main()
