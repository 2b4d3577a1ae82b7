"""bench/step_anatomy.py on the CPU: its arguments, what it reads from a profiler trace, and the
comparison of two records. The runs themselves need a GPU."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import step_anatomy  # noqa: E402


def kernel(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_time_is_the_union_of_overlapping_kernels_and_copies_and_gaps_come_in_time_order():
    busy, gaps = step_anatomy.busy_and_gaps([(0, 10), (5, 20), (30, 40), (100, 110)])
    assert busy == 20 + 10 + 10
    assert gaps == [(20, 10), (40, 60)]  # (start, length): summarize lists them longest first


def test_a_trace_of_two_steps_is_summarized_per_step():
    events = [kernel("gemm", 0, 400), kernel("copy", 300, 200, "gpu_memcpy"), kernel("gemm", 600, 400),
              kernel("softmax", 1030, 70), kernel("gemm", 1100, 400),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 30},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 40, "dur": 10},
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 5}]  # not a duration event
    summary = step_anatomy.summarize({"traceEvents": events}, steps=2)
    assert summary["span_ms"] == 1500 / 1e3 / 2
    assert summary["busy_ms"] == (500 + 400 + 470) / 1e3 / 2
    assert summary["gaps_ms"] == 100 / 1e3 / 2          # 100 us idle; the 30 us gap is launch latency
    assert summary["longest_gaps_ms"] == [0.1, 0.03]
    assert summary["gpu_top"][0] == ["gemm", 1, 0.6]     # 3 calls, 1200 us over 2 steps
    assert summary["host_top"] == [["aten::mm", 1, 0.02]]


def test_a_trace_without_gpu_activity_is_refused():
    with pytest.raises(ValueError, match="no GPU activity"):
        step_anatomy.summarize({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3}]})


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt2", "--method", "planner"], "needs --budget"),
    (["--model", "gpt2", "--method", "stock_checkpointing", "--checkpoint-layers", "x"], "number of layers"),
    (["--method", "planner", "--budget", "12GiB"], "--model and --method are required"),
    (["--model", "gpt2", "--method", "stock_checkpointing", "--warmup", "30"], "--warmup"),
    (["--model", "gpt2", "--method", "um_budget_checkpointing", "--budget", "12GiB", "--force", "keep"],
     "--force applies to the planner methods"),
    (["--model", "gpt2", "--method", "planner", "--budget", "40GiB", "--force", "move"], "invalid choice"),
    (["--model", "gpt2", "--method", "stock_checkpointing", "--eager-rebuilds"],
     "--eager-rebuilds applies to the planner methods"),
])
def test_bad_arguments_are_refused_before_any_gpu_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        step_anatomy.parse_args(argv)
    assert message in capsys.readouterr().err


def test_compare_lists_what_one_method_takes_beyond_another(tmp_path):
    def record(method, softmax_ms, busy):
        return {"model": "gpt2", "method": method, "step_ms": busy + 5,
                "profile": {"busy_ms": busy, "gpu_top": [["gemm", 10, 100.0], ["softmax", 1, softmax_ms]],
                            "host_top": [["aten::mm", 10, 3.0]]}}
    records = [record("um_budget_checkpointing", 1.5, 150.0), record("planner_recompute", 3.6, 152.1)]
    path = tmp_path / "a.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    text = step_anatomy.compare(records, "gpt2", "um_budget_checkpointing", "planner_recompute")
    assert "+2.100  softmax" in text.splitlines()[3]
    assert step_anatomy.main(["--compare", str(path), "gpt2", "um_budget_checkpointing", "planner_recompute"]) == 0
    with pytest.raises(SystemExit, match="no profiled record of planner"):
        step_anatomy.compare(records, "gpt2", "um_budget_checkpointing", "planner")
