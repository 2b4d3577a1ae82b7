"""CUPTI unified-memory counters on a GPU. Each check runs in a process of its own (CUPTI and
the allocator are per process). Skipped where there is no CUDA device or no cupti-python.

    python -m pytest -q -m gpu tests/test_gpu_counters.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "gpu_scripts"


@pytest.fixture
def cupti_python(cuda_device):
    try:
        import cupti  # noqa: F401
    except ImportError as error:
        pytest.skip(f"cupti-python is not installed ({error}): pip install 'um_alloc[profile]'")
    return cuda_device


def run(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_faults_on_host_resident_memory_and_none_after_prefetch(cupti_python, tmp_path):
    found = json.loads(run(SCRIPTS / "counters_check.py", "--records", tmp_path / "records.json")
                       .stdout.strip().splitlines()[-1])
    if "skip" in found:
        pytest.skip(found["skip"])
    faulting, prefetch, prefetched = found["steps"]
    assert found["available"] and found["callback_errors"] == 0 and found["value"] == 4
    assert faulting["gpu_page_faults"] > 0 and faulting["gpu_fault_pages"] > 0, faulting
    assert faulting["htod_bytes"] > 0, faulting
    assert prefetch["htod_bytes"] > 0, prefetch  # the prefetch moved the pages in
    assert prefetched["gpu_page_faults"] == 0 and prefetched["htod_bytes"] == 0, prefetched
    assert (tmp_path / "records.json").stat().st_size > 0


def test_train_profile_reports_counters_per_step_and_a_timeline(cupti_python, tmp_path):
    summary_path, png = tmp_path / "summary.json", tmp_path / "timeline.png"
    done = run(ROOT / "bert_example" / "train.py", "--model", "tiny", "--seq-len", "64", "--batch-size", "4",
               "--steps", "4", "--warmup-steps", "1", "--policy", "worst.yaml", "--profile",
               "--timeline", png, "--json", summary_path)
    summary = json.loads(summary_path.read_text())
    counters = summary["um_counters"]
    assert counters["available"], counters["reason"]
    assert len(counters["per_step"]) == 4 and counters["timed_steps"] == 3
    assert summary["gpu_page_faults"] is not None and summary["htod_bytes"] is not None
    # worst.yaml: first GPU touches fault (the pool grows in steps 0 and 1). This failed with 0 records
    # until the counters flushed before disabling CUPTI's unified-memory kind (um_counters.stop).
    assert counters["totals"]["um_records"] > 0 and counters["totals"]["gpu_page_faults"] > 0
    assert summary["timeline"]["samples"] > 10 and Path(summary["timeline"]["json"]).is_file()
    assert png.is_file() or "matplotlib" in summary["timeline"]["error"]
    assert "UM counters per timed step" in done.stdout
