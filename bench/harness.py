"""The benchmark harness: every benchmark and comparison in bench/ runs through it.

- Runs: each method trains in a process of its own (``run_train``: bert_example/train.py or a
  peer's entry point), because PyTorch takes a new allocator only before CUDA starts and an
  out-of-memory must not poison the next run. A run ends ok, oom (train.py's exit status 3),
  failed (exit N) or timeout; ``largest_batch`` searches the frontier between fits and failures.
- Records: DESIGN.md's benchmark protocol (``PROTOCOL_FIELDS``). Every record of one invocation
  carries that invocation's ``run_id``, and ``ratio_vs_stock`` divides by the stock run of the
  same invocation, so ratios compare runs on one GPU minutes apart.
- Policies: copies of shipped policies with a scheduler setting changed, written where the run
  can read them (and a reader can re-run one).
- Tables: the comparisons' rows, markdown/CSV tables and results.json.

Benchmarks run from anywhere (``python bench/bench_budget.py`` from the repository root): this
module puts the checkout first on sys.path, so um_alloc and bert_example come from it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TRAIN = ROOT / "bert_example" / "train.py"
EXIT_OOM = 3  # train.py's exit status when the GPU runs out of memory
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from um_alloc.errors import PolicyError  # noqa: E402
from um_alloc.planner.director import CALIBRATION_STEPS  # noqa: E402
from um_alloc.planner.trials import MOST_CANDIDATES, STEPS_PER_CANDIDATE  # noqa: E402
from um_alloc.policy import policy_from_dict, resolve_policy_path  # noqa: E402
from um_alloc.profile.aggregate import COUNTER_FIELDS  # noqa: E402
from um_alloc.profile.tables import COUNTER_COLUMNS, write_tables  # noqa: E402

# Steps the block planner takes to measure an input and try its candidate plans: a benchmark
# leaves them out of its timing, which is then of the plan that stayed.
PLANNER_SETTLING_STEPS = CALIBRATION_STEPS + MOST_CANDIDATES * STEPS_PER_CANDIDATE

PROTOCOL_FIELDS = ("device", "date", "run_id", "workload", "method", "policy", "batch", "budget_bytes",
                   "step_s_median", "samples_per_s", "ratio_vs_stock", "highwater_bytes", "gpu_page_faults",
                   "htod_bytes", "dtoh_bytes", "loss_first", "loss_last")


# --- runs --------------------------------------------------------------------------------------

@dataclass
class Run:
    name: str
    description: str
    train_args: list[str]
    script: Path = TRAIN                      # rmm_train.py for the RMM peer
    env: dict = field(default_factory=dict)
    skip: str | None = None                   # why it is not run (listed in the table anyway)
    launch: tuple[str, ...] = ()              # Python flags ahead of the script: torchrun(n) starts n processes


def torchrun(processes: int) -> tuple[str, ...]:
    """Run.launch for `processes` processes on this host under torchrun (python -m torch.distributed.run)."""
    return ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes))


def new_run_id(benchmark: str, now: datetime | None = None) -> str:
    """The id every record of one invocation shares: the benchmark's name and its start (UTC)."""
    return f"{benchmark}-{(now or datetime.now(timezone.utc)).strftime('%Y%m%d-%H%M%S')}"


def child_env(extra: dict | None = None) -> dict:
    """The environment of a run: this checkout first on PYTHONPATH, then `extra`."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def run_train(run: Run, timeout: float) -> tuple[dict | None, str, str]:
    """(summary or None, status, note) of one run: status is ok, oom, failed (exit N) or timeout,
    the note the last lines of its stderr, the summary what the run wrote with --json."""
    with tempfile.TemporaryDirectory() as tmp:
        summary_path = Path(tmp) / "summary.json"
        cmd = [sys.executable, *run.launch, str(run.script), *run.train_args, "--json", str(summary_path)]
        print(f"[{run.name}] $ {' '.join(cmd[1:])}", flush=True)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env(run.env))
        except subprocess.TimeoutExpired:
            return _outcome(run, None, "timeout", f"ran past {timeout} s")
        tail = _why(done.stderr)
        # Under torchrun a rank's exit status is not the launcher's: train.py's message tells.
        if done.returncode == EXIT_OOM or (done.returncode != 0 and "train.py: out of GPU memory" in done.stderr):
            return _outcome(run, None, "oom", tail)
        if done.returncode != 0 or not summary_path.exists():
            print(done.stderr[-3000:], file=sys.stderr)
            return _outcome(run, None, f"failed (exit {done.returncode})", tail)
        return json.loads(summary_path.read_text()), "ok", ""


def _why(stderr: str) -> str:
    """What a run's stderr says about its end: its last lines, and the out-of-memory message if one
    came before them (the launcher prints its summary after the script's error)."""
    lines = stderr.strip().splitlines()
    tail = " ".join(lines[-3:])[-300:]
    oom = next((line for line in reversed(lines[:-3]) if "out of memory" in line.lower()), None)
    return tail if oom is None else f"{oom[:400]} ... {tail}"


def _outcome(run: Run, summary: dict | None, status: str, note: str) -> tuple[dict | None, str, str]:
    print(f"[{run.name}] {status}: {note}", flush=True)
    return summary, status, note


def run_child(args: list[str], timeout: float) -> dict:
    """The JSON object a Python child prints as its last line of output (raises if it fails)."""
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env())
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def importable(*modules: str) -> str | None:
    """Why `modules` cannot be imported here, or None. Tried in a child: this process stays CUDA-free."""
    done = subprocess.run([sys.executable, "-c", "import " + ", ".join(modules)], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    last = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return f"{modules[0].split('.')[0]} is not importable here ({last})"


def largest_batch(probe: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest batch for which probe(batch) is true (it fits), at most `limit`: doubles from
    `start` until a batch fails (halving if `start` already does), then bisects between the
    largest fit and the smallest failure. 0 if not even batch 1 fits."""
    fits, fails, batch = 0, None, max(1, min(start, limit))
    while fails is None or fails - fits > 1:
        if probe(batch):
            fits = batch
        else:
            fails = batch
        if fails is None and fits >= limit:
            break
        batch = min(fits * 2, limit) if fails is None else (fits + fails) // 2
        if batch == 0:  # batch 1 failed
            break
    return fits


def smallest_fitting(fits: Callable[[int], dict | None], start: int, largest: int,
                     known: dict[int, dict | None] | None = None) -> tuple[int | None, dict | None, list[int]]:
    """(k, its summary, every k tried) for the smallest k in 0..largest whose run fits (fits(k)
    returns a summary, None for a run that does not), where more k fits more surely (k layers
    checkpointed): from `start` one step down while runs fit, one up while they do not. `known`
    holds runs made already (k: summary). k None: not even `largest` fits."""
    tried = dict(known or {})

    def fitting() -> list[int]:
        return sorted(k for k, summary in tried.items() if summary is not None)

    def boundary_found() -> bool:  # the smallest fit's neighbour below failed, or nothing fits
        return fitting()[0] == 0 or fitting()[0] - 1 in tried if fitting() else largest in tried

    k = max(0, min(start, largest))
    while not boundary_found():
        if k not in tried:
            tried[k] = fits(k)
        k = k - 1 if tried[k] is not None else k + 1
    if not fitting():
        return None, None, sorted(tried)
    return fitting()[0], tried[fitting()[0]], sorted(tried)


# --- records -----------------------------------------------------------------------------------

def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None where either is missing (a run that failed is no reference)."""
    return value / base if value is not None and base else None


def planner_fields(planner: dict) -> dict:
    """What a record keeps of a run's BlockPlanner.to_dict(): the plan and its prediction; what
    the plan came from (make_plan(calibration_from_dict(...), budget) plans it again); the plans
    tried in the first steps, each predicted and measured, and which stayed; the planner's own
    clock (forward to forward, as it predicts); the room left under the budget as the run ended,
    and the planned steps that needed more (overflowed to host memory)."""
    plan = planner.get("plan")
    return dict(plan=plan, predicted_step_s=(plan or {}).get("predicted_step_s"),
                calibration=planner.get("calibration"), trials=planner.get("trials"),
                planner_measured_step_s=planner.get("measured_step_s"),
                margin_bytes=planner.get("margin_bytes"), overflowed_steps=planner.get("overflowed_steps"))


def pooled(runs: list[tuple]) -> tuple:
    """Several runs of one method as one (run_train's result, plus the launcher's report where
    launched): the first run that ended well, with the median samples/s of those that did, the
    median of their median steps (with --lengths, samples/s is made of the mean step instead) and
    the highest high-water; the first run's result as it is where none did."""
    good = [run for run in runs if run[0] is not None]
    if not good:
        return runs[0]
    rates = [run[0]["samples_per_s"] for run in good]
    summary = {**good[0][0], "samples_per_s": statistics.median(rates),
               "step_s_median": statistics.median(run[0]["step_s_median"] for run in good),
               "samples_per_s_runs": [None if run[0] is None else run[0]["samples_per_s"] for run in runs]}
    highwater = [run[0]["device_used_delta_bytes"] for run in good if run[0].get("device_used_delta_bytes") is not None]
    summary["device_used_delta_bytes"] = max(highwater) if highwater else None
    failed = [run[1] for run in runs if run[0] is None]
    note = f"{len(failed)} of {len(runs)} runs did not end well ({failed[0]})" if failed else good[0][2]
    return (summary, good[0][1], note, *good[0][3:])


def protocol_record(summary: dict | None, *, run_id: str, stock_samples_per_s: float | None,
                    budget_bytes: int | None, **overrides) -> dict:
    """A train.py summary in the protocol's fields (all None but run_id when the run failed);
    `overrides` replace fields (a benchmark's own method name, say) or add to them."""
    if summary is None:
        return {**dict.fromkeys(PROTOCOL_FIELDS), "run_id": run_id, **overrides}
    record = {
        "device": summary["device"], "date": summary["date"], "run_id": run_id, "workload": summary["workload"],
        "method": summary["method"], "policy": summary.get("policy"), "batch": summary["batch"],
        "budget_bytes": budget_bytes, "step_s_median": summary["step_s_median"],
        "samples_per_s": summary["samples_per_s"],
        "ratio_vs_stock": ratio(summary["samples_per_s"], stock_samples_per_s),
        # NVML's device memory in use, end minus start: the driver keeps the managed pages it used.
        "highwater_bytes": summary.get("device_used_delta_bytes"),
        # CUPTI's counters over the training steps, with --profile; null means not measured, not zero.
        "gpu_page_faults": summary.get("gpu_page_faults"), "htod_bytes": summary.get("htod_bytes"),
        "dtoh_bytes": summary.get("dtoh_bytes"),
        "loss_first": summary["loss_first"], "loss_last": summary["loss_last"],
    }
    return {**record, **overrides}


def rate_and_ratio_text(record: dict) -> tuple[str, str]:
    """A record's samples/s ("failed" for a run that did not finish) and its ratio to stock, as a
    comparison's text table shows them."""
    rate = "failed" if record["samples_per_s"] is None else f"{record['samples_per_s']:.1f}"
    ratio = "" if record["ratio_vs_stock"] is None else f"{record['ratio_vs_stock']:.3f}"
    return rate, ratio


def write_result(name: str, record, out: Path = RESULTS) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


# --- policies ----------------------------------------------------------------------------------

# A planner variant both bench_zoo.py and bench_trainer.py run: (scheduler keys, what it is).
REMADE_LOGITS = ({"recompute_logits": True}, "planner.yaml, the head's logits made again in backward")


def raw_policy(name_or_path: str) -> dict:
    """A policy file's YAML as a dict (to copy with a setting changed)."""
    return yaml.safe_load(resolve_policy_path(name_or_path).read_text()) or {}


def with_scheduler(data: dict, **settings) -> dict:
    """A copy of policy `data` with these scheduler settings (budget, evict_live, ...) set."""
    return {**data, "scheduler": {**data.get("scheduler", {}), **settings}}


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


# --- comparison tables -------------------------------------------------------------------------

# Columns every comparison table has, before its own and the counters.
RUN_COLUMNS = [("name", "run", "text"), ("status", "status", "text"), ("step_s_median", "median step", "seconds"),
               ("samples_per_s", "samples/s", "rate")]
MEMORY_COLUMNS = [("highwater_bytes", "GPU high-water", "bytes"), ("peak_bytes", "peak live", "bytes")]
OFFLOAD_COLUMNS = [("offload_out_bytes", "offloaded each way /step", "bytes")]  # pinned copies, not UM


def refuse_bad_counts(p: argparse.ArgumentParser, args) -> None:
    """--warmup below --steps, and --repeats (where the benchmark has it) at least 1: else the
    parser's error, before any GPU work."""
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and below --steps ({args.steps}); got {args.warmup}")
    if getattr(args, "repeats", 1) < 1:
        p.error(f"--repeats must be at least 1; got {args.repeats}")


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload every run of a comparison shares: same model, batch, sequence, steps and budget."""
    p.add_argument("--model", choices=("large", "tiny"), default="large")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup-steps", type=int, default=3)
    p.add_argument("--memory-limit", metavar="SIZE", help="the budget for every run, e.g. 16GiB (train.py --memory-limit)")
    p.add_argument("--out", metavar="DIR", help="where tables, charts and results go (default bench/results/RUN_ID)")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run (default 1800)")
    p.add_argument("--dry-run", action="store_true", help="print the runs and the skipped ones, run nothing")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every train.py run (repeatable), e.g. --train-arg=--dropout=0")


def workload_args(args) -> list[str]:
    out = ["--model", args.model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
           "--steps", str(args.steps), "--warmup-steps", str(args.warmup_steps)]
    return out + list(args.train_arg)


def out_dir(args, run_id: str) -> Path:
    return Path(args.out) if args.out else RESULTS / run_id


def row(run: Run, summary: dict | None, status: str, note: str = "", *, run_id: str | None = None) -> dict:
    """A flat table row: the protocol's fields, memory, and the counters as means over the timed
    steps (the tables' per-step view, where the protocol's record holds the totals)."""
    out = {"name": run.name, "description": run.description, "status": status, "note": note or run.skip or ""}
    out.update(protocol_record(summary, run_id=run_id, stock_samples_per_s=None, budget_bytes=None))
    out.update(dict.fromkeys(COUNTER_FIELDS))
    if summary is None:
        return out
    memory = summary.get("memory_stats") or {}
    out.update(budget_bytes=summary.get("budget_bytes") or summary.get("memory_limit_bytes"),
               memory_limit_bytes=summary.get("memory_limit_bytes"), peak_bytes=summary.get("peak_bytes"),
               peak_reserved_bytes=summary.get("peak_reserved_bytes"),
               peak_resident_bytes=memory.get("peak_resident_bytes"))  # the pool's view
    # Pinned copies of an activation offload: link traffic CUPTI's UM counters do not see.
    out["offload_out_bytes"] = (summary.get("activation_offload") or {}).get("out_bytes")
    counters = summary.get("um_counters") or {}
    out["counters"] = "cupti" if counters.get("available") else (counters.get("reason") or "not requested")
    out.update({k: v for k, v in (counters.get("timed_mean") or {}).items() if k in COUNTER_FIELDS})
    return out


def add_ratio(rows: list[dict], baseline: str, key: str = "ratio") -> float | None:
    """samples/s of each row over the baseline row's (None where either is missing)."""
    base = next((r for r in rows if r["name"] == baseline and r.get("samples_per_s")), None)
    for r in rows:
        r[key] = ratio(r.get("samples_per_s"), base["samples_per_s"] if base else None)
    return base["samples_per_s"] if base else None


def provenance(rows: list[dict]) -> str:
    """The table note that says which invocation, device and date the rows come from."""
    ran = next((r for r in rows if r.get("device")), {})
    run_id = next((r["run_id"] for r in rows if r.get("run_id")), None)
    return f"run_id {run_id or 'n/a'}, on {ran.get('device') or 'n/a'}, {ran.get('date') or 'n/a'}."


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


def compare(name: str, args, *, plan, execute, report, table: str) -> int:
    """A comparison's invocation: plan its runs (into OUT, bench/results/RUN_ID unless --out), list
    them, run them unless --dry-run (execute(runs, run_id) -> rows), report them (report(rows,
    out, args) -> paths written) and print OUT/`table`. Exit status 0 if any run succeeded."""
    run_id = new_run_id(name)
    out = out_dir(args, run_id)
    runs = plan(args, out)
    print(f"{name}: {sum(not r.skip for r in runs)} runs, {sum(bool(r.skip) for r in runs)} skipped -> {out}")
    print_plan(runs)
    if args.dry_run:
        return 0
    rows = execute(runs, run_id)
    paths = report(rows, out, args)
    print((out / table).read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if any(r["status"] == "ok" for r in rows) else 1
