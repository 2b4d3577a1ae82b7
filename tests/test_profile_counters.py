"""Unified-memory counters without a GPU: aggregation of recorded records (a JSON fixture), and
the CUPTI session's logic against a stand-in for cupti-python (no driver here)."""
import enum
import json
import logging
import types
from pathlib import Path

import pytest

from um_alloc.profile import aggregate, um_counters
from um_alloc.profile.um_counters import CountersUnavailable, UMCounters

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "um_records_small.json").read_text())


def subset(got: dict, expected: dict) -> dict:
    """The keys where `got` differs from `expected` (empty when they agree)."""
    return {k: (got.get(k), v) for k, v in expected.items() if got.get(k) != v}


# --- aggregation -------------------------------------------------------------------------------

def test_recorded_records_split_by_step_direction_and_cause():
    counts = aggregate.per_step(FIXTURE["records"], FIXTURE["marks"], FIXTURE["origin_ns"])
    expected = FIXTURE["expected"]
    steps = counts.per_step()
    assert len(steps) == 2
    for got, want in zip(steps, expected["steps"]):
        assert subset(got, want) == {}
    assert subset(counts.setup, expected["setup"]) == {}
    assert subset(counts.after_last_mark(), expected["after_last_mark"]) == {}
    assert subset(counts.totals(), expected["totals"]) == {}


def test_delivery_order_does_not_change_the_counts():
    in_order = aggregate.per_step(FIXTURE["records"], FIXTURE["marks"], FIXTURE["origin_ns"])
    reverse = aggregate.per_step(list(reversed(FIXTURE["records"])), FIXTURE["marks"], FIXTURE["origin_ns"])
    assert in_order.per_step() == reverse.per_step() and in_order.totals() == reverse.totals()


def test_totals_of_records_equal_the_sum_of_steps_setup_and_remainder():
    counts = aggregate.per_step(FIXTURE["records"], FIXTURE["marks"], FIXTURE["origin_ns"])
    parts = [counts.setup, *counts.per_step(), counts.after_last_mark()]
    assert aggregate.merge(parts) == aggregate.totals(FIXTURE["records"])


def test_cpu_faults_count_records_not_their_program_counters():
    record = {"kind": "CPU_PAGE_FAULT_COUNT", "value": 0x401000, "start": 1}
    assert aggregate.totals([record, record])["cpu_page_faults"] == 2


def test_unknown_kind_numbers_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown unified-memory counter kind 42.*4=GPU_PAGE_FAULT"):
        aggregate.totals([{"kind": 42, "value": 1, "start": 0}])


def test_merge_keeps_not_measured_as_none_and_mean_divides():
    measured = {**aggregate.empty_counts(), "gpu_page_faults": 4}
    unknown = dict.fromkeys(aggregate.COUNTER_FIELDS)
    assert aggregate.merge([measured, unknown])["gpu_page_faults"] is None
    assert aggregate.mean([measured, measured | {"gpu_page_faults": 2}])["gpu_page_faults"] == 3
    assert aggregate.mean([]) is None


def test_marks_must_move_forward_and_start_steps_comes_first():
    counts = aggregate.StepCounts(0)
    counts.mark(100)
    with pytest.raises(ValueError, match="mark at 50 ns is before the previous one at 100 ns"):
        counts.mark(50)
    with pytest.raises(RuntimeError, match="after 1 marked steps"):
        counts.start_steps(10)


# --- the CUPTI session, against a stand-in for cupti-python ------------------------------------

class Kind(enum.IntEnum):
    UNKNOWN, BYTES_TRANSFER_HTOD, BYTES_TRANSFER_DTOH, CPU_PAGE_FAULT_COUNT, GPU_PAGE_FAULT = range(5)
    THRASHING, THROTTLING, REMOTE_MAP, BYTES_TRANSFER_DTOD = range(5, 9)


Cause = enum.IntEnum("Cause", [("UNKNOWN", 0), ("USER", 1), ("COHERENCE", 2), ("PREFETCH", 3),
                               ("EVICTION", 4), ("ACCESS_COUNTERS", 5)])
Result = enum.IntEnum("Result", [("SUCCESS", 0), ("ERROR_UM_PROFILING_NOT_SUPPORTED_ON_DEVICE", 28),
                                 ("ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", 39)])


class FakeCuptiError(Exception):
    def __init__(self, status):
        super().__init__(Result(status).name)
        self.status = status


class FakeConfig(list):
    """An array of CUpti_ActivityUnifiedMemoryCounterConfig: setting a field on it sets all."""

    def __init__(self, n):
        super().__init__(types.SimpleNamespace(kind=0, scope=0, device_id=0, enable=0) for _ in range(n))
        self.ptr = id(self)

    def __setattr__(self, name, value):
        for entry in self:
            setattr(entry, name, value)
        object.__setattr__(self, name, value)


def fake_cupti(refuse=None):
    """A cupti module stand-in: a settable clock, buffers handed over on flush, chosen failures."""
    state = types.SimpleNamespace(clock=0, pending=[], configured=[], enabled=False, completed=None)

    def configure(ptr, count):
        config = next(c for c in state.configs if c.ptr == ptr)
        kinds = [Kind(e.kind).name for e in config[:count]]
        if refuse == "thrashing" and "THRASHING" in kinds:
            raise FakeCuptiError(int(Result.ERROR_UM_PROFILING_NOT_SUPPORTED_ON_DEVICE))
        state.configured = kinds

    def enable(kind):
        if refuse == "subscriber":
            raise FakeCuptiError(int(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED))
        state.enabled = True

    def config_factory(n):
        config = FakeConfig(n)
        state.configs.append(config)
        return config

    def flush(flag):
        pending, state.pending = state.pending, []
        if pending:
            state.completed(pending)

    state.configs = []
    module = types.SimpleNamespace(
        ActivityKind=enum.IntEnum("ActivityKind", [("CONCURRENT_KERNEL", 10), ("UNIFIED_MEMORY_COUNTER", 25)]),
        ActivityUnifiedMemoryCounterKind=Kind, ActivityUnifiedMemoryMigrationCause=Cause,
        ActivityUnifiedMemoryCounterScope=enum.IntEnum("Scope", [("PROCESS_SINGLE_DEVICE", 1)]),
        ActivityUnifiedMemoryCounterConfig=config_factory, Result=Result,
        get_timestamp=lambda: state.clock, activity_configure_unified_memory_counter=configure,
        activity_register_callbacks=lambda requested, completed: setattr(state, "completed", completed),
        activity_enable=enable, activity_disable=lambda kind: setattr(state, "enabled", False),
        activity_flush_all=flush, activity_get_num_dropped_records=lambda ctx, stream, ptr: None)
    return module, state


def activity(kind: str, value: int, start: int, flags: int = 0, end: int = 0):
    return types.SimpleNamespace(kind=25, counter_kind=int(Kind[kind]), value=value, start=start, end=end,
                                 address=0x7F0000000000, src_id=0, dst_id=0, flags_=flags)


@pytest.fixture
def fake(monkeypatch):
    def install(refuse=None):
        module, state = fake_cupti(refuse)
        monkeypatch.setattr(um_counters, "_import_cupti", lambda: module)
        monkeypatch.setattr(um_counters, "_init_driver", lambda device: None)
        monkeypatch.setattr(um_counters, "_active", None)
        return state
    return install


def test_session_counts_records_per_step_whenever_cupti_delivers_them(fake):
    state = fake()
    state.clock = 100
    with UMCounters(keep_records=True) as counters:
        state.pending.append(activity("BYTES_TRANSFER_HTOD", 4096, 150, flags=1))  # set-up
        state.clock = 200
        counters.start_steps()
        state.clock = 300
        counters.mark_step()
        state.clock = 400
        counters.mark_step()
        # handed over late and out of order: the start timestamps decide the step
        state.pending += [activity("GPU_PAGE_FAULT", 3, 350), activity("GPU_PAGE_FAULT", 2, 250),
                          activity("BYTES_TRANSFER_HTOD", 65536, 260, flags=2),
                          activity("BYTES_TRANSFER_DTOH", 8192, 390, flags=4)]
        assert um_counters.active() is counters and state.enabled
        steps = counters.per_step()
    assert state.configured == list(aggregate.COUNTER_KINDS.values()) and not state.enabled
    assert [s["gpu_page_faults"] for s in steps] == [2, 3]
    assert steps[0]["htod_fault_bytes"] == 65536 and steps[1]["dtoh_eviction_bytes"] == 8192
    assert counters.setup()["htod_prefetch_bytes"] == 4096
    assert counters.totals()["um_records"] == 5 and len(counters.records(250, 300)) == 2
    assert um_counters.active() is None


def test_cupti_in_use_by_another_profiler_is_said_and_the_run_goes_on(fake, caplog):
    fake(refuse="subscriber")
    with caplog.at_level(logging.WARNING, logger="um_alloc.profile"):
        counters = UMCounters().start()
    assert not counters.available
    assert "ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (39)" in counters.reason
    assert "already in use by another profiler" in counters.reason
    assert "CUPTI unavailable:" in caplog.text and "running without counters" in caplog.text
    counters.mark_step()
    assert counters.totals()["gpu_page_faults"] is None
    assert counters.per_step()[0]["htod_bytes"] is None  # marks still work; counts are "not measured"


def test_required_counters_raise_instead(fake):
    fake(refuse="subscriber")
    with pytest.raises(CountersUnavailable, match="CUPTI unavailable: activity_enable failed"):
        UMCounters(required=True).start()


def test_a_device_without_the_rarer_counters_keeps_faults_and_migrations(fake):
    state = fake(refuse="thrashing")
    counters = UMCounters().start()
    assert counters.available and state.configured == list(um_counters._CORE_KINDS)
    totals = counters.totals()
    assert totals["gpu_page_faults"] == 0 and totals["thrashing_events"] is None and totals["dtod_bytes"] is None
    counters.stop()


def test_one_session_per_process(fake):
    fake()
    first = UMCounters().start()
    second = UMCounters().start()
    assert first.available and not second.available and "already running" in second.reason
    first.stop()


def test_without_cupti_or_driver_here_the_counters_say_so(monkeypatch, caplog):
    monkeypatch.setattr(um_counters, "_active", None)
    with caplog.at_level(logging.WARNING, logger="um_alloc.profile"):
        counters = UMCounters().start()  # this machine: no cupti-python (CI) or no CUDA driver
    assert not counters.available and counters.reason
    assert f"CUPTI unavailable: {counters.reason}; running without counters" in caplog.text
    summary = counters.summary()
    assert summary["available"] is False and summary["totals"]["htod_bytes"] is None
    counters.stop()  # a no-op, never an error


def test_missing_cupti_python_names_the_extra(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "cupti", None)  # import cupti -> ImportError
    monkeypatch.setattr(um_counters, "_active", None)
    counters = UMCounters().start()
    assert "cupti-python is not installed" in counters.reason and "um_alloc[profile]" in counters.reason


def test_torch_profiler_holding_cupti_is_named(fake):
    import torch

    fake()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        counters = UMCounters().start()
    assert not counters.available and "torch.profiler is running" in counters.reason
