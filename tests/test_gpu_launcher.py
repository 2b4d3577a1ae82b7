"""The launcher on a GPU: a tiny Trainer script, unchanged, under a budget; the plan and the memory
report come back, and the script's own output and status are kept.

    python -m pytest -q -m gpu tests/test_gpu_launcher.py
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[1]


def test_a_tiny_trainer_script_under_a_budget_is_planned(cuda_device, tmp_path):
    pytest.importorskip("accelerate")
    out = tmp_path / "run.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "um_alloc", "run", "--budget", "2GiB", "--json", str(out),
                           str(ROOT / "examples" / "hf_trainer_gpt2.py"), "--tiny", "--steps", "6", "--batch-size", "4",
                           "--seq-len", "128"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    script = json.loads(done.stdout.strip().splitlines()[-1])   # the script's stdout is its own
    report = json.loads(out.read_text())
    assert len(script["losses"]) == 6
    assert report["model"] == "GPT2LMHeadModel" and report["planner"]["plan"]
    assert report["memory_stats"]["peak_gpu_backed_bytes"] <= 2 << 30
    assert "um_alloc memory summary" in done.stderr
