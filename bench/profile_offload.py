"""Where does an offloading step's time go? One bench_budget.py method, its last step traced.

    python bench/profile_offload.py offload --budget 16GiB --out OUTDIR     (METHOD: one of bench_budget's)

Runs the method as bench_budget.py does (BERT-Large, batch 32, 7 steps) with train.py --trace,
which records the last step with torch.profiler. Prints a JSON summary: per kind of GPU work
(kernels, copies each way) its count, busy time, bytes and rate, and the compute stream's idle
gaps over 1 ms; train.py's phase times, link rates and offload figures beside it. The trace stays
in OUTDIR/trace_METHOD.json.gz for chrome://tracing or Perfetto.
"""
from __future__ import annotations

import argparse
import gzip
import json
import tempfile
from pathlib import Path

from bench_budget import METHODS, common_args, method_args
from harness import Run, run_train

GAP_S = 1e-3  # compute-stream idle gaps shorter than this are not listed


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", choices=METHODS)
    p.add_argument("--budget", default="16GiB")
    p.add_argument("--model", choices=("large", "tiny"), default="large")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=7, help="the last one is traced (default 7)")
    p.add_argument("--window", default="1GiB", help="offload methods: bytes copied back ahead of backward")
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", type=Path, default=Path("."), help="where the trace goes (default .)")
    return p.parse_args(argv)


def gpu_events(trace: dict) -> list[dict]:
    return [e for e in trace["traceEvents"]
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]


def kind_of(event: dict) -> str:
    if event["cat"] == "kernel":
        return "kernel"
    name = event["name"]
    return "DtoH" if "DtoH" in name else "HtoD" if "HtoD" in name else name[:30]


def by_kind(events: list[dict], t0: float) -> dict[str, dict]:
    """Count, busy seconds, bytes, first and last activity (s from t0) and streams per kind."""
    kinds: dict[str, dict] = {}
    for e in events:
        k = kinds.setdefault(kind_of(e), {"n": 0, "dur_s": 0.0, "bytes": 0, "first": float("inf"), "last": 0.0,
                                          "streams": set()})
        k["n"] += 1
        k["dur_s"] += e["dur"] / 1e6
        k["bytes"] += int(e.get("args", {}).get("bytes", 0) or 0)
        k["first"] = min(k["first"], (e["ts"] - t0) / 1e6)
        k["last"] = max(k["last"], (e["ts"] + e["dur"] - t0) / 1e6)
        k["streams"].add(str(e.get("args", {}).get("stream")))
    for k in kinds.values():
        k["streams"] = sorted(k["streams"])
        if k["bytes"] and k["dur_s"]:
            k["rate_GBps"] = k["bytes"] / k["dur_s"] / 1e9
    return kinds


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
    """Of (start, end) spans sorted by start: the length of their union, and (start, length) of
    each gap between its stretches, in time order (the trace's units)."""
    busy, gaps = 0.0, []
    start = end = None
    for s, e in spans:
        if end is None or s > end:
            if end is not None:
                busy += end - start
                gaps.append((end, s - end))
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        busy += end - start
    return busy, gaps


def kernel_gaps(events: list[dict], t0: float) -> list[tuple[float, float]]:
    """(start s from t0, length s) of each stretch over GAP_S with no kernel running."""
    _, gaps = busy_and_gaps(sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["cat"] == "kernel"))
    return [((start - t0) / 1e6, length / 1e6) for start, length in gaps if length / 1e6 > GAP_S]


def analyse(trace: dict) -> dict:
    events = gpu_events(trace)
    t0 = min(e["ts"] for e in events)
    t1 = max(e["ts"] + e["dur"] for e in events)
    gaps = kernel_gaps(events, t0)
    return {"span_s": (t1 - t0) / 1e6, "by_kind": by_kind(events, t0), "kernel_gaps": gaps[:40],
            "kernel_idle_s": sum(length for _, length in gaps)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.warmup = args.steps - 1
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"trace_{args.method}.json.gz"
    with tempfile.TemporaryDirectory() as policy_dir:
        train_args = [*common_args(args), "--trace", str(trace), *method_args(args.method, args, Path(policy_dir))]
        run = Run(args.method, args.method, train_args)
        summary, status, note = run_train(run, args.timeout)
    if summary is None:
        raise SystemExit(f"{args.method}: {status}: {note}")
    with gzip.open(trace, "rt") as file:
        out = analyse(json.load(file))
    out.update(method=args.method, budget=args.budget, trace=str(trace), step_s=summary["step_s"],
               phase_s=summary["phase_s"], link_rates=summary["link_rates"],
               activation_offload=summary.get("activation_offload"))
    print(json.dumps(out, default=str))
    return out


if __name__ == "__main__":
    main()
