"""bench/resnet_timeline.py on the CPU: its stretches from a trace's events, and its arguments."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import resnet_timeline  # noqa: E402


def event(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_each_stretch_holds_the_share_of_each_kind_that_ran_in_it():
    events = [event("kernel", "conv", 0, 15_000),
              event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 5_000, 10_000),
              event("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 20_000, 5_000),
              {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0}]  # not a span: left out
    found = resnet_timeline.stretches(events)
    assert found["span_ms"] == 25.0
    assert found["busy_ms"] == {"kernel": 15.0, "out": 10.0, "back": 5.0, "other": 0.0}
    assert [(s["kernel"], s["out"], s["back"]) for s in found["stretches"]] == [(1.0, 0.5, 0.0), (0.5, 0.5, 0.0),
                                                                                (0.0, 0.0, 0.5)]


def test_a_batch_or_step_count_below_one_is_refused():
    with pytest.raises(SystemExit):
        resnet_timeline.parse_args(["--batch", "0"])
    assert resnet_timeline.parse_args(["--batch", "704"]).budget == "8GiB"
