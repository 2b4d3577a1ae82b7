"""bench/bench_scale.py on the CPU, its train.py runs stood in for: which runs it makes, in which
order, and the records it writes (one run_id, ratios to stock, the checkpointing peer, the plan
and its calibration)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_microbatch  # noqa: E402
import bench_scale  # noqa: E402

LARGEST = {"stock": 5, "checkpointing": 15, "um": 160}
RATES = {"stock": 118.0, "checkpointing": 129.0, "um": 62.0}


def method_of(allocator: str, extra) -> str:
    return "checkpointing" if "--checkpointing" in extra else allocator


def summary(method: str, batch: int) -> dict:
    planner = {"plan": {"decisions": {"recompute": 24}, "predicted_step_s": 2.6}, "measured_step_s": 2.5,
               "calibration": {"units": []}, "trials": []} if method == "um" else None
    return {"device": "fake", "date": "2026-11-26T07:52:00+00:00", "workload": "bert-large", "method": "um_alloc"
            if method == "um" else "stock", "policy": None, "batch": batch, "step_s_median": batch / RATES[method],
            "samples_per_s": RATES[method], "device_used_delta_bytes": 8 << 30, "loss_first": 10.6, "loss_last": 7.9,
            "micro_batch": None, "memory_limit_bytes": 8 << 30 if method != "um" else None, "budget_bytes": 8 << 30,
            "peak_reserved_bytes": 1, "memory_stats": None, "steps": 18, "planner": planner,
            "checkpointing": {"layers": 24} if method == "checkpointing" else None}


def test_each_method_is_searched_then_trained_and_written_with_one_run_id(tmp_path, monkeypatch, capsys):
    searched, trained = [], []

    def search(args, allocator, start, limit, probe_steps=2, extra=(), label=None):
        assert label == ("checkpointing" if "--checkpointing" in extra else None)  # how its log names it
        searched.append((method_of(allocator, extra), start, limit, probe_steps))
        return LARGEST[method_of(allocator, extra)]

    def timed_run(args, allocator, batch, extra=(), label=None):
        trained.append((method_of(allocator, extra), batch))
        return summary(method_of(allocator, extra), batch)

    monkeypatch.setattr(bench_microbatch, "search", search)
    monkeypatch.setattr(bench_microbatch, "timed_run", timed_run)
    bench_scale.main(["--budget", "8GiB", "--stock-start", "4", "--um-start", "120", "--um-max-batch", "160",
                      "--out", str(tmp_path)])

    assert searched == [("stock", 4, 512, 2), ("checkpointing", 8, 512, 2), ("um", 120, 160, 4)]
    assert trained == [("stock", 5), ("checkpointing", 15), ("um", 160)]
    records = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert sorted(records) == ["scale-8GiB-checkpointing", "scale-8GiB-stock", "scale-8GiB-um_alloc"]
    assert len({r["run_id"] for r in records.values()}) == 1
    peer, um = records["scale-8GiB-checkpointing"], records["scale-8GiB-um_alloc"]
    assert peer["method"] == "stock+checkpointing" and peer["batch_ratio_vs_stock"] == 3.0
    assert um["batch_ratio_vs_stock"] == 32.0 and um["ratio_vs_stock"] == RATES["um"] / RATES["stock"]
    assert um["plan"]["decisions"] == {"recompute": 24} and um["calibration"] == {"units": []}
    assert um["planner_measured_step_s"] == 2.5 and um["reached_largest_probe"] is True
    assert "32.0x stock's batch, 10.7x checkpointing's" in capsys.readouterr().out
