"""Soak and faults on a GPU under um_alloc, each in processes of its own:

- 2,000 steps of a small BERT with the block planner (1,000 with the activation offload) under a
  1.5 GiB budget: live, GPU-backed and reserved bytes, host RSS, pinned host memory and NVML's count
  flat after 200 steps of warm-up (bench/bench_soak.py, whose tolerances they are);
- SIGINT in the middle of a step and halfway through a checkpoint write: status 130, the GPU's
  memory given back, and --resume continuing from the last complete checkpoint with an
  uninterrupted run's losses, bit for bit (deterministic kernels);
- an out-of-memory error in the planner's calibration, after which the same process trains a
  smaller batch with a fresh model's losses;
- two processes on one GPU, each under its own cap and budget, training at the same time.

    python -m pytest -q -m gpu tests/test_gpu_soak.py     # about 4 to 5 minutes on an H100
"""
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import checkout_env, interrupt_when_paused, run_gpu_script

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "gpu_scripts"
BENCH = ROOT / "bench" / "bench_soak.py"
TRAIN = ROOT / "bert_example" / "train.py"
GiB, MiB = 1 << 30, 1 << 20
# A tiny BERT under the activation offload at 1 GiB; deterministic kernels, dropout on (its RNG
# state is in the checkpoint). 12 steps, a checkpoint every 4.
TRAIN_ARGS = ["--model", "tiny", "--seq-len", "64", "--batch-size", "8", "--steps", "12", "--checkpoint-every", "4",
              "--deterministic", "--policy", "offload.yaml", "--budget", "1GiB"]


# --- soak -----------------------------------------------------------------------------------------

def assert_flat(record: dict, steps: int) -> None:
    assert record["steps"] == steps and all(math.isfinite(x) for x in record["losses"])
    verdict = record["verdict"]
    assert verdict["missing"] == [], verdict["missing"]  # every series sampled on the GPU
    for name, series in verdict["series"].items():
        assert series["flat"], (f"{name} moved {series['range']} bytes from step {verdict['from_step']} on "
                                f"({series['min']}..{series['max']}; tolerance {series['tolerance']})")
    stats = record["memory_stats"]
    assert stats["num_ooms"] == 0 and stats["peak_gpu_backed_bytes"] <= record["budget_bytes"]
    assert stats["peak_reserved_bytes"] <= record["max_reserved_bytes"]


@pytest.mark.parametrize("mode, steps", [("planner", 2000), ("offload", 1000)])
def test_memory_stays_flat_over_a_soak(cuda_device, mode, steps):
    record = run_gpu_script(BENCH, "--child", mode, "--steps", steps, "--warmup", 200, timeout=600)
    assert_flat(record, steps)
    figures = record["mode_figures"]
    if mode == "planner":
        assert set(figures["plan"]["decisions"]) == {"recompute_moved", "move"}  # the safe mode, every step
    else:
        assert figures["out_bytes"] > 0 and figures["kept_bytes"] == 0  # every eligible tensor moved


# --- SIGINT ---------------------------------------------------------------------------------------

def train(*args, timeout: float = 300) -> dict:
    """bert_example/train.py in a process of its own; its --json summary."""
    out = Path(args[args.index("--checkpoint") + 1]).parent / "summary.json"
    done = subprocess.run([sys.executable, str(TRAIN), *TRAIN_ARGS, *map(str, args), "--json", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=checkout_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():  # module-scoped: it runs before cuda_device would skip
        pytest.skip("no CUDA device")
    return train("--checkpoint", tmp_path_factory.mktemp("uninterrupted") / "ckpt")["losses"]


def gpu_used_bytes() -> int:
    from um_alloc.device_info import device_memory

    return device_memory(0).used_bytes


def settled_used_bytes(baseline: int, within: int = 256 * MiB, wait_s: float = 15) -> int:
    """NVML's count once it is back within `within` of `baseline`, or after `wait_s`: the driver
    frees an ended process's memory shortly after its exit."""
    deadline = time.monotonic() + wait_s
    used = gpu_used_bytes()
    while used > baseline + within and time.monotonic() < deadline:
        time.sleep(0.5)
        used = gpu_used_bytes()
    return used


@pytest.mark.parametrize("at, message, kept, resumes_at", [
    ("step:10", "interrupted with 10 of 12 steps done. The last complete checkpoint, at step 8,",
     ["checkpoint.prev.pt", "checkpoint.pt"], 8),
    ("checkpoint:8", "interrupted with 8 of 12 steps done, while writing the checkpoint at step 8 (not kept). "
                     "The last complete checkpoint, at step 4,", ["checkpoint.pt"], 4),
])
def test_sigint_then_resume_gives_an_uninterrupted_runs_losses(cuda_device, uninterrupted, tmp_path, at, message,
                                                               kept, resumes_at):
    checkpoint, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    before = gpu_used_bytes()
    status, stderr = interrupt_when_paused(SCRIPTS / "interrupted_train.py", "--at", at, "--losses", losses, "--",
                                           *TRAIN_ARGS, "--checkpoint", checkpoint, directory=tmp_path, timeout=300)
    assert status == 130, stderr[-3000:]
    assert message in stderr and "Traceback" not in stderr
    assert settled_used_bytes(before) <= before + 256 * MiB  # the GPU's memory came back
    assert sorted(p.name for p in checkpoint.iterdir()) == kept  # no half-written file
    first = [json.loads(line)["loss"] for line in losses.read_text().splitlines()]
    resumed = train("--checkpoint", checkpoint, "--resume")
    assert resumed["first_step"] == resumes_at
    assert first[:resumes_at] + resumed["losses"] == uninterrupted


# --- an out-of-memory error in calibration ---------------------------------------------------------

def test_a_batch_too_large_in_calibration_then_a_smaller_one_trains(cuda_device):
    result = run_gpu_script(SCRIPTS / "soak_check.py", "oom")
    kinds = [error.split(":")[0] for error in result["errors"]]
    assert kinds == ["OutOfMemoryError", "OutOfMemoryError", "PlanInfeasible"], result["errors"]
    assert result["num_ooms"] >= 2
    # The failed steps left nothing behind: what was live before them is live after (1 chunk of slack).
    assert result["live_after_failures"] - result["live_before"] <= 2 * MiB, result
    assert len(result["losses"]) == 7 and all(math.isfinite(x) for x in result["losses"])
    assert result["losses"] == result["fresh_losses"]  # trains as a model that never saw the failure
    assert result["plan"] is not None
    assert result["peak_gpu_backed_bytes"] <= result["budget_bytes"]
    assert result["peak_reserved_bytes"] <= result["limit_bytes"]


# --- two processes, one GPU -----------------------------------------------------------------------

def test_two_processes_on_one_gpu_each_under_its_own_cap(cuda_device, tmp_path):
    workers = {"planner": ("planner.yaml", "3GiB", "1536MiB"), "offload": ("offload.yaml", "4GiB", "1GiB")}
    ready = tmp_path / "ready"
    ready.mkdir()
    children = {}
    for name, (policy, cap, budget) in workers.items():
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            children[name] = subprocess.Popen(
                [sys.executable, str(SCRIPTS / "soak_check.py"), "pair", name, policy, cap, budget, "300", str(ready)],
                stdout=out, stderr=err, env=checkout_env())
    statuses = {name: child.wait(timeout=600) for name, child in children.items()}
    for name, status in statuses.items():
        assert status == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
    results = {name: json.loads((tmp_path / f"{name}.out").read_text().strip().splitlines()[-1]) for name in workers}
    a, b = results["planner"], results["offload"]
    assert a["started"] < b["finished"] and b["started"] < a["finished"]  # they trained at the same time
    assert a["planned"] and b["offloaded"]
    for name, (policy, cap, budget) in workers.items():
        r = results[name]
        assert r["limit_bytes"] == parse(cap) and r["budget_bytes"] == parse(budget)  # each its own
        assert r["peak_reserved_bytes"] <= r["limit_bytes"] and r["peak_gpu_backed_bytes"] <= r["budget_bytes"]
        assert r["num_ooms"] == 0 and len(r["losses"]) == 300 and all(math.isfinite(x) for x in r["losses"])
        if r["nvml_process_bytes"] is not None:  # NVML lists processes by the host's ids
            assert r["nvml_process_bytes"] <= r["limit_bytes"] + GiB  # + the CUDA context and copy stages


def parse(size: str) -> int:
    from um_alloc.sizes import parse_size

    return parse_size(size, key="size", source="test")
