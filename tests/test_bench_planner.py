"""bench/bench_planner.py's repeated runs, with the runs themselves faked: no GPU."""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import bench_planner  # noqa: E402


def test_repeats_alternate_the_methods_and_keep_the_median_of_each_ones_runs(monkeypatch):
    order, rates = [], {"stock": iter([250.0, 240.0]), "frontier": iter([None, 210.0]),
                        "planner": iter([205.0, 230.0])}

    def fake_run(run, timeout):
        order.append(run.name)
        rate = next(rates[run.name.split("_k")[0]])
        if rate is None:
            return None, "oom", "out of memory"
        return {"samples_per_s": rate, "step_s_median": 32 / rate, "device_used_delta_bytes": int(rate)}, "ok", ""

    monkeypatch.setattr(bench_planner, "run_train", fake_run)
    args = argparse.Namespace(repeats=3, timeout=10, batch=32, steps=8, warmup=3, deterministic=False, budget="16GiB")
    first = {"stock": {"samples_per_s": 260.0, "step_s_median": 0.123, "device_used_delta_bytes": 1},
             "frontier": {"samples_per_s": 200.0, "step_s_median": 0.16, "device_used_delta_bytes": 2},
             "planner": {"samples_per_s": 220.0, "step_s_median": 0.145, "device_used_delta_bytes": 3}}
    summaries = {name: (summary, {"status": "ok", "note": ""}) for name, summary in first.items()}
    summaries["frontier"][1]["checkpointed_layers"] = 19
    runs = {"stock": bench_planner.stock_run(args, "stock"),
            "frontier": bench_planner.stock_run(args, "frontier_k19", "--checkpointing", "19"),
            "planner": bench_planner.stock_run(args, "planner")}
    out = bench_planner.repeated(summaries, runs, args)
    assert order == ["stock", "frontier_k19", "planner"] * 2
    assert out["stock"][0]["samples_per_s"] == 250.0 and out["stock"][0]["samples_per_s_runs"] == [260.0, 250.0, 240.0]
    assert out["frontier"][0]["samples_per_s_runs"] == [200.0, None, 210.0]
    assert out["frontier"][0]["samples_per_s"] == 205.0 and out["frontier"][1]["checkpointed_layers"] == 19
    assert "1 of 3 runs did not end well" in out["frontier"][1]["note"]
    assert out["planner"][0]["samples_per_s"] == 220.0
    assert out["planner"][0]["device_used_delta_bytes"] == 230  # the highest high-water of the runs


def test_one_run_a_method_is_left_as_it_is():
    args = argparse.Namespace(repeats=1)
    summaries = {"stock": ({"samples_per_s": 1.0}, {"status": "ok"})}
    assert bench_planner.repeated(summaries, {}, args) is summaries


def test_the_plain_loss_method_runs_the_planner_with_the_chunked_loss_off(monkeypatch, tmp_path):
    ran = []

    def fake_run(run, timeout):
        ran.append(run)
        return {"samples_per_s": 1.0, "step_s_median": 32.0, "device_used_delta_bytes": 1, "device": "test",
                "date": "2026-11-26", "workload": "bert", "method": "um", "batch": 32, "loss_first": 10.0,
                "loss_last": 9.0}, "ok", ""

    monkeypatch.setattr(bench_planner, "run_train", fake_run)
    monkeypatch.setattr(sys, "argv", ["bench_planner.py", "--methods", "planner_plain_loss", "--out", str(tmp_path)])
    assert bench_planner.main() == 0
    (run,) = ran
    policy = Path(run.train_args[run.train_args.index("--policy") + 1]).read_text()
    assert "lean_loss: false" in policy and "strategy: auto" in policy


def test_the_planners_record_holds_its_plan_calibration_and_trials():
    args = argparse.Namespace(batch=32)
    planner = {"plan": {"predicted_step_s": 0.17, "decisions": {"keep": 12, "recompute": 15}},
               "measured_step_s": 0.15, "calibration": {"step_s": 0.25},
               "trials": [{"decisions": {"keep": 12, "recompute": 15}, "measured_step_s": 0.15, "kept": True}]}
    summary = {"device": "GPU", "date": "today", "workload": None, "method": "um", "batch": 32,
               "step_s_median": 0.15, "samples_per_s": 213.3, "loss_first": 9.0, "loss_last": 8.0, "planner": planner}
    record = bench_planner._record("planner", summary, {}, "planner-1", 256.0, 16 << 30, args)
    assert record["predicted_step_s"] == 0.17 and record["planner_measured_step_s"] == 0.15
    assert record["calibration"] == {"step_s": 0.25} and record["trials"] == planner["trials"]
    assert record["workload"] == "bert-large-mlm-seq512-bf16-b32" and record["budget_bytes"] == 16 << 30
