"""Training beyond a GPU budget: every method in one invocation, ratios to stock in memory.

    python bench/bench_budget.py --budget 16GiB --batch 32
Writes bench/results/budget_<budget>_<method>.json in DESIGN.md's protocol form.

Transfer bound (for the methods driven by ActivationOffload, when stock ran in the same
invocation): copies out overlap forward and copies back overlap backward, so a step takes at least
    max(forward, bytes out / d2h rate) + max(backward, bytes in / h2d rate) + optimizer step
with forward, backward and the optimizer step timed in the stock run (compute only) and the bytes
the method moved in its last step. It is given twice: with the link rates of the stock run
(pinned host <-> cudaMalloc memory: the link) and with those of the method's own run (pinned host
<-> the memory its allocator hands out). Efficiency = bound / measured median step.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import write_result

HERE = Path(__file__).resolve().parent
POLICIES = {"reactive": "none.yaml", "planned": "best.yaml", "offload": "best.yaml, evict_live: false",
            "offload_hostopt": "host_optimizer.yaml", "offload_moveall": "best.yaml, evict_live: false, rebuild off",
            "offload_stock": "stock allocator"}


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
    p.add_argument("--methods", default="stock,save_on_cpu,checkpointing,reactive,planned,offload,offload_hostopt,"
                                        "offload_moveall,offload_stock")
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
        record["transfer_bound"] = transfer_bound(r, stock)
        write_result(f"budget_{args.budget}_b{args.batch}_{method}", record)
        hw = (r["highwater_bytes"] or 0) / 2**30
        ev = (r.get("last_bytes_out") or r.get("evicted_bytes") or 0) / 2**30
        print(f"{method:<15}{r['samples_per_s']:>11.2f}{(ratio or 0):>10.3f}{hw:>9.1f} GiB{ev:>11.1f} GiB")
        if record["transfer_bound"]:
            print(_bound_line(record["transfer_bound"]))


def transfer_bound(run: dict, stock: dict | None) -> dict | None:
    """The step-time bound of the module docstring, with both sets of link rates; None if n/a."""
    if stock is None or run.get("last_bytes_out") is None or run["method"] == "stock":
        return None
    compute = {phase: stock[f"{phase}_s_median"] for phase in ("forward", "backward", "optimizer")}
    out = {"bytes_out": run["last_bytes_out"], "bytes_in": run["last_bytes_in"],
           "bytes_rebuilt": run.get("rebuilt_bytes", 0), "compute_only_s": compute,
           "measured_s": run["step_s_median"]}
    for label, rates in (("link", stock), ("allocator", run)):
        d2h, h2d = rates["link_d2h_GBps"] * 1e9, rates["link_h2d_GBps"] * 1e9
        bound = (max(compute["forward"], run["last_bytes_out"] / d2h)
                 + max(compute["backward"], run["last_bytes_in"] / h2d) + compute["optimizer"])
        out[label] = {"d2h_GBps": d2h / 1e9, "h2d_GBps": h2d / 1e9, "bound_s": bound,
                      "efficiency": bound / run["step_s_median"]}
    return out


def _bound_line(b: dict) -> str:
    return (f"{'':<15}moved {b['bytes_out'] / 2**30:.2f} GiB out, {b['bytes_in'] / 2**30:.2f} GiB in, rebuilt "
            f"{b['bytes_rebuilt'] / 2**30:.2f} GiB; bound "
            f"{b['link']['bound_s']:.3f} s at the link's {b['link']['d2h_GBps']:.1f}/{b['link']['h2d_GBps']:.1f} GB/s "
            f"(efficiency {b['link']['efficiency']:.2f}), {b['allocator']['bound_s']:.3f} s at this run's "
            f"{b['allocator']['d2h_GBps']:.1f}/{b['allocator']['h2d_GBps']:.1f} GB/s "
            f"(efficiency {b['allocator']['efficiency']:.2f}); measured {b['measured_s']:.3f} s")


def _now() -> str:
    from datetime import datetime, timezone

    return datetime.now(timezone.utc).isoformat(timespec="seconds")


if __name__ == "__main__":
    main()
