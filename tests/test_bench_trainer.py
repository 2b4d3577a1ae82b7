"""bench/bench_trainer.py and bench_launcher.py on the CPU: which command each method is, that the
example accepts it, the alternation of repeated runs and the records of one invocation. Runs on a
GPU are replaced by a stand-in."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "examples"))
import bench_launcher  # noqa: E402
import bench_trainer  # noqa: E402
import hf_trainer_gpt2  # noqa: E402


def test_the_launcher_bench_runs_the_same_script_plainly_and_under_the_launcher_without_a_budget(tmp_path):
    args = bench_launcher.parse_args([])
    script = bench_launcher.command("script", args, tmp_path / "r.json", tmp_path / "x.json")
    launched = bench_launcher.command("launcher", args, tmp_path / "r.json", tmp_path / "x.json")
    assert script[1:] == [str(bench_trainer.EXAMPLE), *bench_trainer.example_args(args, tmp_path / "r.json")]
    assert launched[1:4] == ["-m", "um_alloc", "run"] and launched[-len(script) + 1:] == script[1:]
    assert "--budget" not in launched and "--policy" not in launched
    example = hf_trainer_gpt2.parse_args(script[2:])  # the example takes every flag
    assert (example.batch_size, example.seq_len, example.steps, example.budget) == (8, 1024, 30, None)


def test_repeated_runs_alternate_and_each_record_holds_their_median(tmp_path, monkeypatch, capsys):
    order = []

    def stand_in(make_command, timeout):
        cmd = make_command(tmp_path / "r.json", tmp_path / "x.json")
        method = "launcher" if "um_alloc" in cmd else "script"
        order.append(method)
        rate = {"script": [50.0, 52.0, 51.0], "launcher": [49.0, 51.0, 50.0]}[method][order.count(method) - 1]
        return {"samples_per_s": rate, "step_s_median": 8 / rate, "nvml_highwater_bytes": 30 << 30,
                "losses": [11.0]}, {"policy": "none"}, "ok"

    monkeypatch.setattr(bench_launcher, "run_example", stand_in)
    assert bench_launcher.main(["--repeats", "3", "--out", str(tmp_path)]) == 0
    assert order == ["script", "launcher"] * 3
    records = json.loads((tmp_path / "launcher_no_budget.json").read_text())
    assert [r["method"] for r in records] == ["script", "launcher"]
    assert len({r["run_id"] for r in records}) == 1 and records[0]["run_id"].startswith("launcher-")
    assert records[0]["samples_per_s"] == 51.0 and records[1]["samples_per_s"] == 50.0
    assert records[1]["ratio_vs_script"] == pytest.approx(50 / 51) and records[0]["ratio_vs_script"] == 1.0
    assert records[1]["samples_per_s_runs"] == [49.0, 51.0, 50.0] and records[1]["highwater_bytes"] == 30 << 30
    assert {"workload", "batch", "budget_bytes", "status"} <= set(records[0]) and records[0]["batch"] == 8


def test_a_failed_run_is_named_and_left_out_of_the_median():
    runs = [({"samples_per_s": 40.0, "step_s_median": 0.2, "plan": {"predicted_step_s": 0.19},
              "calibration": {"step_s": 0.25}, "trials": [{"kept": True}]}, {}, "ok"),
            ({}, {}, "failed: CUDA out of memory"),
            ({"samples_per_s": 44.0, "step_s_median": 0.18}, {}, "ok")]
    figures = bench_trainer.merged(runs)
    assert figures["samples_per_s"] == 42.0 and figures["status"] == "failed: CUDA out of memory"
    assert figures["samples_per_s_runs"] == [40.0, None, 44.0] and figures["predicted_step_s"] == 0.19
    assert figures["calibration"] == {"step_s": 0.25}  # the first good run's, as its plan
    assert figures["trials"] == [{"kept": True}]
    assert bench_trainer.merged([({}, {}, "failed: timed out")])["samples_per_s"] is None


def test_the_trainer_bench_gives_every_method_the_same_workload(tmp_path):
    import argparse

    args = argparse.Namespace(budget="12GiB", batch=8, seq_len=1024, steps=20, warmup=6)
    commands = {m: bench_trainer.command(m, args, tmp_path / "r.json", tmp_path / "x.json")
                for m in bench_trainer.METHODS}
    workload = bench_trainer.example_args(args, tmp_path / "r.json")
    for method, cmd in commands.items():
        assert cmd[-len(workload):] == workload, method
    assert commands["planner"][2:4] == ["--budget", "12GiB"] and commands["launcher"][4:6] == ["--budget", "12GiB"]


def test_the_trainer_bench_runs_a_variant_under_planner_yaml_with_its_keys(tmp_path):
    import argparse

    args = argparse.Namespace(budget="12GiB", batch=8, seq_len=1024, steps=20, warmup=6, out_dir=tmp_path)
    cmd = bench_trainer.command("planner_remade_logits", args, tmp_path / "r.json", tmp_path / "x.json")
    assert cmd[2:4] == ["--budget", "12GiB"] and cmd[4] == "--policy"
    written = Path(cmd[5]).read_text()
    assert "recompute_logits: true" in written and "strategy: auto" in written
    workload = bench_trainer.example_args(args, tmp_path / "r.json")
    assert cmd[-len(workload):] == workload
