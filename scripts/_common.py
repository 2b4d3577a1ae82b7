"""Shared by compare_policies.py and compare_peers.py: run the BERT example in a process of its
own (PyTorch takes a new allocator only before CUDA starts), turn its JSON summary into a table
row, and write the tables, charts and raw results.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "bert_example" / "train.py"
EXIT_OOM = 3  # train.py's exit status when the GPU runs out of memory
sys.path.insert(0, str(ROOT))  # um_alloc from this checkout, also when run as a script

import yaml  # noqa: E402

from um_alloc.policy import PolicyError, policy_from_dict, resolve_policy_path  # noqa: E402
from um_alloc.profile.aggregate import COUNTER_FIELDS  # noqa: E402
from um_alloc.profile.tables import COUNTER_COLUMNS, write_tables  # noqa: E402

# Columns every comparison table has, before its own and the counters.
RUN_COLUMNS = [("name", "run", "text"), ("status", "status", "text"), ("step_s_median", "median step", "seconds"),
               ("samples_per_s", "samples/s", "rate")]
MEMORY_COLUMNS = [("highwater_bytes", "GPU high-water", "bytes"), ("peak_bytes", "peak live", "bytes")]
OFFLOAD_COLUMNS = [("offload_out_bytes", "offloaded each way /step", "bytes")]  # pinned copies, not UM


@dataclass
class Run:
    name: str
    description: str
    train_args: list[str]
    script: Path = TRAIN                      # rmm_train.py for the RMM peer
    env: dict = field(default_factory=dict)
    skip: str | None = None                   # why it is not run (listed in the table anyway)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload every run shares: same model, batch, sequence, steps and budget."""
    p.add_argument("--model", choices=("large", "tiny"), default="large")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--memory-limit", metavar="SIZE", help="the budget for every run, e.g. 16GiB (train.py --memory-limit)")
    p.add_argument("--out", metavar="DIR", help="where tables, charts and results go (default bench/results/<script>-<date>)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run (default 1800)")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the skipped ones, run nothing")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every train.py run (repeatable), e.g. --train-arg=--dropout=0")


def workload_args(args) -> list[str]:
    out = ["--model", args.model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    return out + list(args.train_arg)


def out_dir(args, script: str) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path(args.out) if args.out else ROOT / "bench" / "results" / f"{script}-{stamp}"


def run_train(run: Run, timeout: int) -> tuple[dict | None, str, str]:
    """(summary or None, status, note): status is ok, oom, failed (exit N) or timeout."""
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "summary.json"
        cmd = [sys.executable, str(run.script), *run.train_args, "--json", str(summary_path)]
        print(f"[{run.name}] $ {' '.join(cmd[1:])}", flush=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **run.env}
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return None, "timeout", f"ran past {timeout} s"
        tail = done.stderr.strip().splitlines()[-3:]
        if done.returncode == EXIT_OOM:
            return None, "oom", " ".join(tail)[-300:]
        if done.returncode != 0 or not summary_path.exists():
            print(done.stderr[-3000:], file=sys.stderr)
            return None, f"failed (exit {done.returncode})", " ".join(tail)[-300:]
        return json.loads(summary_path.read_text()), "ok", ""


def row(run: Run, summary: dict | None, status: str, note: str = "") -> dict:
    """A flat table row: timing, memory, and the counters as means over the timed steps."""
    out = {"name": run.name, "description": run.description, "status": status, "note": note or run.skip or ""}
    out.update(dict.fromkeys(COUNTER_FIELDS))
    if summary is None:
        return out
    for key in ("method", "policy", "batch", "memory_limit_bytes", "step_s_median", "samples_per_s",
                "peak_bytes", "peak_reserved_bytes", "loss_first", "loss_last", "device", "date", "workload"):
        out[key] = summary.get(key)
    out["highwater_bytes"] = summary.get("device_used_delta_bytes")
    out["peak_resident_bytes"] = (summary.get("memory_stats") or {}).get("peak_resident_bytes")  # the pool's view
    # Pinned copies of the policy's activation offload: link traffic CUPTI's UM counters do not see.
    out["offload_out_bytes"] = (summary.get("activation_offload") or {}).get("out_bytes")
    counters = summary.get("um_counters") or {}
    out["counters"] = "cupti" if counters.get("available") else (counters.get("reason") or "not requested")
    out.update({k: v for k, v in (counters.get("timed_mean") or {}).items() if k in COUNTER_FIELDS})
    return out


def finish(rows: list[dict], table: Path, paths: list[Path]) -> int:
    """Prints the markdown table and what was written; exit status 0 if any run succeeded."""
    print(table.read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in rows) else 1


def add_ratio(rows: list[dict], baseline: str, key: str = "ratio") -> float | None:
    """samples/s of each row over the baseline row's (None where either is missing)."""
    base = next((r for r in rows if r["name"] == baseline and r.get("samples_per_s")), None)
    for r in rows:
        r[key] = r["samples_per_s"] / base["samples_per_s"] if base and r.get("samples_per_s") else None
    return base["samples_per_s"] if base else None


def counter_columns(per_step: bool = True) -> list[tuple[str, str, str]]:
    suffix = " /step" if per_step else ""
    return [(k, f"{header}{suffix}", kind) for k, header, kind in COUNTER_COLUMNS]


def write_all(rows: list[dict], out: Path, stem: str, *, md_columns, title: str, notes: list[str]) -> list[Path]:
    """STEM.csv (every field), STEM.md (the readable columns) and results.json."""
    out.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    csv_path, md_path = write_tables(rows, out, stem, csv_columns=[(k, k, "") for k in keys],
                                     md_columns=md_columns, title=title, notes=notes)
    results = out / "results.json"
    results.write_text(json.dumps(rows, indent=1, default=str) + "\n")
    return [csv_path, md_path, results]


def print_plan(runs: list[Run]) -> None:
    for run in runs:
        state = f"skip: {run.skip}" if run.skip else "run"
        print(f"  {run.name:<24} {state}\n  {'':<24} {run.description}")


def validation_error(data: dict, source: str, name: str) -> str | None:
    try:
        policy_from_dict(data, source=source, name=name)
    except PolicyError as error:
        return str(error)
    return None


def write_policy(directory: Path, name: str, data: dict, description: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.yaml"
    path.write_text(f"# {name}: {description} (generated by {Path(sys.argv[0]).name})\n"
                    + yaml.safe_dump(data, sort_keys=False))
    return path


def raw_policy(name_or_path: str) -> dict:
    """A policy file's YAML as a dict (to copy with a budget added)."""
    return yaml.safe_load(resolve_policy_path(name_or_path).read_text()) or {}
