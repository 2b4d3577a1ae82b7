"""bench/bench_soak.py on the CPU: the flatness verdict, its arguments, and the soak loop of each
mode for a few steps without um_alloc (tests/test_gpu_soak.py runs 2,000 steps on a GPU)."""
import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_soak  # noqa: E402

MiB = 1 << 20
pytest.importorskip("transformers")


def samples(**series) -> dict:
    steps = len(next(iter(series.values())))
    return {"step": list(range(steps)), **{name: series.get(name, [None] * steps) for name in bench_soak.FLAT_TOLERANCES}}


def test_flat_series_pass_and_the_warm_up_is_left_out():
    verdict = bench_soak.flatness(samples(live_bytes=[0, 5 * MiB, 7 * MiB, 7 * MiB, 7 * MiB + 512]), warmup=2)
    assert verdict["flat"] and verdict["from_step"] == 2
    assert verdict["series"]["live_bytes"] == {"min": 7 * MiB, "max": 7 * MiB + 512, "range": 512, "tolerance": MiB,
                                               "first": 7 * MiB, "last": 7 * MiB + 512, "samples": 3, "flat": True}


def test_a_series_that_grows_past_its_tolerance_is_not_flat():
    growing = [100 * MiB + step * 64 * 1024 for step in range(2000)]  # 64 KiB a step: 125 MiB in all
    verdict = bench_soak.flatness(samples(host_rss_bytes=growing, reserved_bytes=[1 << 30] * 2000), warmup=200)
    assert not verdict["flat"]
    assert not verdict["series"]["host_rss_bytes"]["flat"] and verdict["series"]["reserved_bytes"]["flat"]
    assert verdict["series"]["host_rss_bytes"]["range"] == 1799 * 64 * 1024


def test_a_reserve_that_grows_by_one_arena_is_not_flat_and_missing_series_are_listed():
    reserved = [1 << 30] * 5 + [2 << 30]
    nvml = [None, 3 * MiB, None, 3 * MiB, None, 3 * MiB]  # read every other step
    verdict = bench_soak.flatness(samples(reserved_bytes=reserved, nvml_used_bytes=nvml), warmup=1)
    assert not verdict["flat"] and verdict["series"]["reserved_bytes"]["range"] == 1 << 30
    assert verdict["series"]["nvml_used_bytes"]["samples"] == 3
    assert verdict["missing"] == ["live_bytes", "gpu_backed_bytes", "host_rss_bytes", "pinned_host_bytes"]


@pytest.mark.parametrize("argv, message", [
    (["--modes", "planner,swap"], "--modes: expected some of planner, offload, got planner,swap"),
    (["--steps", "100", "--warmup", "100"], "--warmup must be at least 0 and below --steps (100); got 100"),
    (["--nvml-every", "0"], "--batch-size, --seq-len and --nvml-every must be at least 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_soak.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", bench_soak.MODES)
def test_each_modes_loop_runs_on_the_cpu(mode):
    args = bench_soak.parse_args(["--device", "cpu", "--steps", "4", "--warmup", "2", "--batch-size", "2",
                                  "--seq-len", "16"])
    record = bench_soak.soak(mode, args)
    assert record["steps"] == 4 and all(math.isfinite(x) for x in record["losses"])
    assert record["verdict"]["flat"] and set(record["verdict"]["series"]) == {"host_rss_bytes"}
    assert len(record["samples"]["step"]) == 4
    if mode == "planner":  # the safe mode as the plan: every block recomputed, every gap moved
        assert set(record["mode_figures"]["plan"]["decisions"]) == {"recompute_moved", "move"}
    else:
        assert record["mode_figures"]["out_bytes"] > 0 and record["mode_figures"]["kept_bytes"] == 0
    json.dumps(record)  # the record is JSON as it is
    assert "NOT FLAT" not in bench_soak.report(record)
