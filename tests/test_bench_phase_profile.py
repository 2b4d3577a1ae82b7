"""bench/phase_profile.py on the CPU: its arguments, and how it splits a profiler trace into phases
by the host range that launched each kernel. The runs themselves need a GPU."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import phase_profile  # noqa: E402


def launch(correlation, ts):
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "args": {"correlation": correlation}}


def on_gpu(correlation, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_kernels_count_for_the_phase_that_launched_them_even_when_they_run_after_it():
    events = [
        {"cat": "user_annotation", "name": "forward", "ts": 0, "dur": 100},
        {"cat": "user_annotation", "name": "backward", "ts": 100, "dur": 400},
        launch(1, 10), launch(2, 20), launch(3, 150), launch(4, 160),
        on_gpu(1, 30, 50), on_gpu(2, 120, 40),           # the second runs after forward's range ends
        on_gpu(3, 200, 100), on_gpu(4, 250, 150), on_gpu(3, 300, 10, "gpu_memcpy"),
    ]
    figures = phase_profile.phase_figures(events)
    forward, backward = figures["forward"], figures["backward"]
    assert forward["kernels"] == 2 and forward["gpu_span_ms"] == pytest.approx(0.130)
    assert forward["kernel_busy_ms"] == pytest.approx(0.090) and forward["idle_ms"] == pytest.approx(0.040)
    assert backward["kernels"] == 2 and backward["kernel_busy_ms"] == pytest.approx(0.200)  # overlap counted once
    assert backward["idle_ms"] == pytest.approx(0.0)
    assert backward["copies"] == 1 and backward["copy_ms"] == pytest.approx(0.010)
    assert "optimizer" not in figures  # no range, no figures


def test_a_negative_step_is_refused_with_the_value_given(capsys):
    with pytest.raises(SystemExit):
        phase_profile.parse_args(["--model", "t5", "--label", "x", "--step", "-1"])
    assert "--step must be at least 0; got -1" in capsys.readouterr().err
