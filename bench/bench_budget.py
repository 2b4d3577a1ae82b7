"""Training beyond a GPU budget: every method in one invocation, ratios to stock in memory.

    python bench/bench_budget.py --budget 16GiB --batch 32
    python bench/bench_budget.py --budget 10GiB --methods stock,offload,save_on_cpu,reactive
    python bench/bench_budget.py --model tiny --budget 2GiB --batch 4 --steps 3 --warmup 1   # a quick check

Each method is one run of bert_example/train.py (BERT-Large MLM, bf16, dropout 0, fused AdamW)
in a process of its own, all with --phase-times and --link-rates:
  stock            stock PyTorch, everything in GPU memory, no budget: the reference
  save_on_cpu      stock limited to the budget (a memory fraction), saved activations in pinned
                   host memory (torch.autograd.graph.save_on_cpu)
  checkpointing    stock limited to the budget, activation checkpointing per layer
  reactive         um_alloc, none.yaml with the budget and evict_live: true: least recently used
                   chunks over the budget go to the host, faults bring them back
  offload          um_alloc, offload.yaml with the budget (hard), saved activations beyond it
                   offloaded by pinned copies (ActivationOffload, from the policy)
  offload_hostopt  the same with host_optimizer.yaml + offload_activations: AdamW's moments in
                   host memory, read and written over the link by the optimizer step
  offload_moveall  offload with --no-rebuild: every saved tensor moves, nothing is rebuilt in
                   backward (what rebuilding saves)
  offload_stock    ActivationOffload over stock PyTorch limited like save_on_cpu (what the pool adds)
Writes OUT/budget_<budget>_b<batch>_<method>.json (OUT: bench/results/RUN_ID unless --out), records
in DESIGN.md's protocol form sharing one run_id, each with its status (ok, oom, failed, timeout)
and train.py's summary under "raw".

Transfer bound (methods with an activation offload, when stock ran in the same invocation): copies
out overlap forward and copies back overlap backward, so a step takes at least
    max(forward, bytes out / d2h rate) + max(backward, bytes in / h2d rate) + optimizer step
with forward, backward and the optimizer step timed in the stock run (compute only) and the bytes
the method moved in its last step. It is given twice: with the link rates of the stock run
(pinned host <-> cudaMalloc memory: the link) and with those of the method's own run (pinned host
<-> the memory its allocator hands out). Efficiency = bound / measured median step.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import (RESULTS, Run, new_run_id, protocol_record, raw_policy, run_train, with_scheduler,
                     write_policy, write_result)

from um_alloc.sizes import parse_size

METHODS = ("stock", "save_on_cpu", "checkpointing", "reactive", "offload", "offload_hostopt", "offload_moveall",
           "offload_stock")
# Policies written for a run (base policy, scheduler settings besides the budget).
GENERATED = {"reactive": ("none.yaml", {"evict_live": True}),
             "offload_hostopt": ("host_optimizer.yaml", {"evict_live": False, "offload_activations": True})}
POLICIES = {"reactive": "none.yaml, evict_live: true", "offload": "offload.yaml",
            "offload_hostopt": "host_optimizer.yaml, offload_activations: true", "offload_moveall": "offload.yaml, no rebuild",
            "offload_stock": "stock allocator"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", choices=("large", "tiny"), default="large", help="tiny: a quick check of the set-up")
    p.add_argument("--timeout", type=int, default=300, help="seconds per method (default 300)")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated, of: " + ", ".join(METHODS))
    p.add_argument("--window", default="1GiB", help="offload methods: bytes copied back ahead of backward")
    p.add_argument("--out", type=Path, help="where the records go (default bench/results/RUN_ID)")
    args = p.parse_args(argv)
    args.methods = args.methods.split(",")
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {', '.join(unknown)}; allowed: {', '.join(METHODS)}")
    return args


def method_args(method: str, args, policy_dir: Path) -> list[str]:
    """train.py's arguments for `method` (see the module docstring), after the common ones."""
    budget, limit, window = ["--budget", args.budget], ["--memory-limit", args.budget], ["--offload-window", args.window]
    policy = "offload.yaml"
    if method in GENERATED:
        base, scheduler = GENERATED[method]
        policy = str(write_policy(policy_dir, method, with_scheduler(raw_policy(base), **scheduler), POLICIES[method]))
    um = ["--allocator", "um", "--policy", policy, *budget]
    return {
        "stock": ["--allocator", "stock"],
        "save_on_cpu": ["--allocator", "stock", *limit, "--offload", "save_on_cpu"],
        "checkpointing": ["--allocator", "stock", *limit, "--checkpointing"],
        "reactive": um,
        "offload": [*um, *window],
        "offload_hostopt": [*um, *window],
        "offload_moveall": [*um, *window, "--no-rebuild"],
        "offload_stock": ["--allocator", "stock", *limit, "--offload", "activations", *window],
    }[method]


def common_args(args) -> list[str]:
    """train.py's arguments every method shares."""
    return ["--model", args.model, "--batch-size", str(args.batch), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--warmup-steps", str(args.warmup), "--dropout", "0",
            "--phase-times", "--link-rates"]


def runs(args, policy_dir: Path) -> list[Run]:
    return [Run(m, POLICIES.get(m, m), [*common_args(args), *method_args(m, args, policy_dir)]) for m in args.methods]


def transfer_bound(summary: dict, stock: dict | None) -> dict | None:
    """The step-time bound of the module docstring, with both sets of link rates; None if n/a."""
    moved = summary.get("activation_offload")
    if stock is None or moved is None or not stock.get("phase_s_median") or not summary.get("link_rates"):
        return None
    compute = dict(stock["phase_s_median"])
    out = {"bytes_out": moved["out_bytes"], "bytes_in": moved["in_bytes"], "bytes_rebuilt": moved["rebuilt_bytes"],
           "compute_only_s": compute, "measured_s": summary["step_s_median"]}
    for label, rates in (("link", stock["link_rates"]), ("allocator", summary["link_rates"])):
        d2h, h2d = rates["d2h_GBps"] * 1e9, rates["h2d_GBps"] * 1e9
        bound = (max(compute["forward"], moved["out_bytes"] / d2h)
                 + max(compute["backward"], moved["in_bytes"] / h2d) + compute["optimizer"])
        out[label] = {"d2h_GBps": d2h / 1e9, "h2d_GBps": h2d / 1e9, "bound_s": bound,
                      "efficiency": bound / summary["step_s_median"]}
    return out


def records(args, results: dict[str, tuple[dict | None, str, str]], run_id: str) -> dict[str, dict]:
    """One protocol record per method; ratios and bounds against this invocation's stock run."""
    stock = results.get("stock", (None,))[0]
    base = stock["samples_per_s"] if stock else None
    budget = parse_size(args.budget, key="--budget", source="command line")
    out = {}
    for method, (summary, status, note) in results.items():
        record = protocol_record(summary, run_id=run_id, stock_samples_per_s=base,
                                 budget_bytes=None if method == "stock" else budget, method=method,
                                 policy=POLICIES.get(method), status=status, note=note)
        record["workload"] = record["workload"] or f"bert-{args.model}-mlm-seq{args.seq_len}-bf16-synthetic"
        record["transfer_bound"] = transfer_bound(summary, stock) if summary and method != "stock" else None
        record["raw"] = summary
        out[method] = record
    return out


def print_table(recs: dict[str, dict]) -> None:
    print(f"\n{'method':<17}{'samples/s':>11}{'vs stock':>10}{'high-water':>13}{'moved/step':>13}")
    for method, r in recs.items():
        if r["samples_per_s"] is None:
            print(f"{method:<17}{r['status']:>11}")
            continue
        offload = (r["raw"] or {}).get("activation_offload") or {}
        evicted = ((r["raw"] or {}).get("memory_stats") or {}).get("evicted_bytes")
        moved = (offload.get("out_bytes") or evicted or 0) / 2**30
        print(f"{method:<17}{r['samples_per_s']:>11.2f}{(r['ratio_vs_stock'] or 0):>10.3f}"
              f"{(r['highwater_bytes'] or 0) / 2**30:>9.1f} GiB{moved:>9.1f} GiB")
        if r["transfer_bound"]:
            print(bound_line(r["transfer_bound"]))


def bound_line(b: dict) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    at = lambda r: f"{r['bound_s']:.3f} s at {r['d2h_GBps']:.1f}/{r['h2d_GBps']:.1f} GB/s (efficiency {r['efficiency']:.2f})"  # noqa: E731
    return (f"{'':<17}moved {gib(b['bytes_out'])} out, {gib(b['bytes_in'])} in, rebuilt {gib(b['bytes_rebuilt'])}; "
            f"bound {at(b['link'])} at the link, {at(b['allocator'])} at this run's allocator; "
            f"measured {b['measured_s']:.3f} s")


def main(argv=None, runner=run_train) -> dict[str, dict]:
    args = parse_args(argv)
    run_id = new_run_id("bench_budget")
    with tempfile.TemporaryDirectory() as policy_dir:
        results = {run.name: runner(run, args.timeout) for run in runs(args, Path(policy_dir))}
    recs = records(args, results, run_id)
    out = args.out or RESULTS / run_id
    for method, record in recs.items():
        write_result(f"budget_{args.budget}_b{args.batch}_{method}", record, out)
    print_table(recs)
    print(f"run_id {run_id}; records in {out}")
    return recs


if __name__ == "__main__":
    main()
