"""Shared by the benchmarks: run bert_example/train.py in a fresh process, write result JSON.

Each method runs in its own process (PyTorch takes a new allocator only before CUDA starts),
all from one invocation of a benchmark, so ratios compare runs on the same GPU minutes apart.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TRAIN = ROOT / "bert_example" / "train.py"

# The fields DESIGN.md's benchmark protocol asks of every result.
PROTOCOL_FIELDS = ("device", "date", "workload", "method", "policy", "batch", "budget_bytes", "step_s_median",
                   "samples_per_s", "ratio_vs_stock", "highwater_bytes", "gpu_page_faults", "htod_bytes",
                   "dtoh_bytes", "loss_first", "loss_last")


def run_train(args: list[str], env: dict | None = None, timeout: int = 900) -> dict | None:
    """train.py's JSON summary, or None if the run failed (its stderr tail is printed)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(TRAIN), *args, "--json", str(out)]
        print("  $", " ".join(cmd[1:]), flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        if done.returncode != 0 or not out.exists():
            print(f"  failed (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
            return None
        return json.loads(out.read_text())


def highwater(summary: dict) -> int | None:
    """GPU residency high-water mark: NVML used after - before (the driver keeps managed pages)."""
    return summary.get("device_used_delta_bytes")


def protocol_record(summary: dict, *, stock_samples_per_s: float | None, budget_bytes: int | None,
                    **extra) -> dict:
    record = {
        "device": summary["device"], "date": summary["date"], "workload": summary["workload"],
        "method": summary["method"], "policy": summary.get("policy"), "batch": summary["batch"],
        "budget_bytes": budget_bytes, "step_s_median": summary["step_s_median"],
        "samples_per_s": summary["samples_per_s"],
        "ratio_vs_stock": summary["samples_per_s"] / stock_samples_per_s if stock_samples_per_s else None,
        "highwater_bytes": highwater(summary),
        # CUPTI counters come with the profiling work; null means not measured, not zero.
        "gpu_page_faults": summary.get("gpu_page_faults"), "htod_bytes": summary.get("htod_bytes"),
        "dtoh_bytes": summary.get("dtoh_bytes"),
        "loss_first": summary["loss_first"], "loss_last": summary["loss_last"],
    }
    record.update(extra)
    return record


def write_result(name: str, record: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path
