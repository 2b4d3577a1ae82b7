"""Each distinct block run by itself after the probed step (planner/alone.py), and the base step
it gives (Calibration.base_step_s), on the CPU."""
import logging
import time

import pytest
import torch
from torch import nn

from um_alloc.planner import BlockPlanner
from um_alloc.planner.alone import TIMED_RUNS, AloneCalls, AloneTime
from um_alloc.planner.planning import Calibration, Segment, UnitCost
from um_alloc.planner.replay import _BuffersBefore


class Counted(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(width, width), nn.BatchNorm1d(width), nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x, scale=1.0):
        self.calls += 1
        return self.drop(self.norm(self.linear(x))) * scale


def _calls() -> AloneCalls:
    """On the CPU, timed on the host's clock, as the step recorder times there."""
    return AloneCalls(torch.device("cpu"), time.perf_counter, lambda start, end: end - start)


def _note(calls: AloneCalls, unit: int, block: nn.Module, *args, **kwargs) -> None:
    slots = [(m, name) for m in block.modules() for name in m._buffers]
    calls.note(unit, f"block{unit}", block, block.forward, args, kwargs, lambda: _BuffersBefore(slots))


def test_each_distinct_call_runs_by_itself_and_its_twins_share_its_times():
    twins, other = [Counted(8) for _ in range(3)], Counted(16)
    calls = _calls()
    x = torch.randn(4, 8, requires_grad=True)
    for j, block in enumerate(twins):
        _note(calls, j, block, x, scale=2.0)
    _note(calls, 3, other, torch.randn(4, 16))
    timed = calls.time()
    assert [b.calls for b in twins] == [TIMED_RUNS, 0, 0] and other.calls == TIMED_RUNS
    assert sorted(timed) == [0, 1, 2, 3]
    assert timed[0] == timed[1] == timed[2] and timed[0].forward_s > 0 and timed[0].backward_s > 0
    assert 0 < timed[0].forward_cpu_s <= timed[0].forward_s  # on the CPU the host's clock is the device's
    assert calls.time() == {}  # what was noted is timed once


def test_a_unit_called_twice_sums_its_calls_and_one_failed_call_leaves_it_out(monkeypatch):
    runs = iter([AloneTime(1.0, 2.0, 0.5), None])
    monkeypatch.setattr(AloneCalls, "_timed", lambda self, call: next(runs))
    calls = _calls()
    shared, other = Counted(8), Counted(16)
    _note(calls, 0, shared, torch.randn(4, 8))
    _note(calls, 0, shared, torch.randn(4, 8))     # the same shapes: one run
    _note(calls, 1, shared, torch.randn(4, 8))
    _note(calls, 1, other, torch.randn(4, 16))     # a second distinct call, which fails
    assert calls.time() == {0: AloneTime(2.0, 4.0, 1.0)}


def test_running_by_itself_leaves_buffers_gradients_and_the_rng_as_they_were():
    torch.manual_seed(0)
    block = Counted(8)
    block(torch.randn(4, 8))  # running statistics that are not the initial ones
    before = {k: v.clone() for k, v in block.state_dict().items()}
    rng = torch.get_rng_state()
    calls = _calls()
    _note(calls, 0, block, torch.randn(4, 8, requires_grad=True))
    torch.set_rng_state(rng)
    assert 0 in calls.time()
    assert all(torch.equal(before[k], v) for k, v in block.state_dict().items())
    assert all(p.grad is None for p in block.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


class NeedsItsInput(nn.Module):
    """A block that refuses inputs other than the ones it was built for."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        if bool((x < 0).any()):
            raise ValueError("negative input")
        return self.linear(x)


def test_a_unit_runs_by_itself_under_the_tag_scopes_its_call_had():
    """A spilled loss's scope (spill.py) was open when the head was called: run by itself after the
    step, the head allocates under it again, and the scopes are as they were afterwards."""
    from um_alloc import _lib
    from um_alloc.tag_names import tag_index
    from um_alloc.tags import OpenScopes, tag

    lib, seen = _lib.load(), []

    class Head(Counted):
        def forward(self, x, scale=1.0):
            seen.append((lib.um_large_tag(), lib.um_large_tag_min()))
            return super().forward(x, scale)

    head, calls = Head(8), _calls()
    with tag("spill", "1MiB"):
        _note(calls, 0, head, torch.randn(4, 8))
    after_the_step = OpenScopes.now()
    assert after_the_step.large_min == 0
    assert 0 in calls.time()
    assert seen == [(tag_index("spill"), 1 << 20)] * TIMED_RUNS
    assert OpenScopes.now() == after_the_step


def test_a_block_that_fails_by_itself_is_left_out_and_said_so(caplog):
    calls = _calls()
    _note(calls, 0, NeedsItsInput(), torch.rand(64, 8))
    _note(calls, 1, Counted(8), torch.randn(4, 8))
    with caplog.at_level(logging.INFO, logger="um_alloc.planner"):
        timed = calls.time()
    assert sorted(timed) == [1]
    assert "block0 did not run by itself (negative input); the base prices it from the safe step" in caplog.text


class OutOfMemoryOnNegatives(nn.Module):
    """Runs on the ReLU's output in training; by itself, on random values, it runs out of memory."""

    def forward(self, x):
        if bool((x < 0).any()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 TiB")
        return x * 2


class Hidden(nn.Module):
    """Returns its result inside an object no pytree walks into."""

    class Box:
        def __init__(self, value):
            self.value = value

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.Box(self.linear(x))


def test_a_unit_whose_outputs_needing_gradients_are_not_seen_is_left_out(caplog):
    calls = _calls()
    _note(calls, 0, Hidden(), torch.randn(4, 8, requires_grad=True))
    with caplog.at_level(logging.INFO, logger="um_alloc.planner"):
        assert calls.time() == {}  # its backward never ran: pricing it as free would be wrong
    assert "none of its outputs seen needs a gradient" in caplog.text


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.picky = OutOfMemoryOnNegatives()
        self.layers = nn.ModuleList([Counted(16) for _ in range(3)])
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.picky(self.act(self.embed(x)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _losses(model, steps: int, planned: bool):
    torch.manual_seed(1)
    planner = BlockPlanner(model, "1GiB") if planned else None
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, planner


def test_the_planner_times_its_units_by_themselves_and_trains_as_plain_autograd_does(caplog):
    torch.manual_seed(0)
    plain = Stack()
    planned = Stack()
    planned.load_state_dict(plain.state_dict())
    losses, _ = _losses(plain, 4, planned=False)
    with caplog.at_level(logging.INFO, logger="um_alloc.planner"):
        planned_losses, planner = _losses(planned, 4, planned=True)
    assert planned_losses == losses
    units = {u.name: u for u in planner.calibration.units}
    timed = ("embed", "act", "layers.0", "layers.1", "layers.2", "head")
    assert all(units[name].alone_forward_s > 0 and units[name].alone_backward_s > 0 for name in timed)
    assert all(units[name].alone_forward_cpu_s > 0 for name in timed)
    assert units["picky"].alone_forward_s == units["picky"].alone_backward_s == units["picky"].alone_forward_cpu_s == 0
    assert "picky did not run by itself (CUDA out of memory. Tried to allocate 1 TiB)" in caplog.text
    assert units["(outside the units)"].alone_forward_s == 0  # no module's call: not run by itself
    planner.remove()


def _calibration(alone_forward_s: float, alone_backward_s: float) -> Calibration:
    block = UnitCost("block", "block", forward_s=4e-3, recompute_s=2e-3, backward_s=5e-3,
                     alone_forward_s=alone_forward_s, alone_backward_s=alone_backward_s)
    gap = UnitCost("head", "gap", forward_s=1e-3, backward_s=1e-3, alone_forward_s=1.0)
    segments = (Segment("step", 0, (), 12e-3, 12e-3),)
    return Calibration((block, gap), segments, step_s=12e-3, link_bytes_per_s=50e9)


def test_the_base_gives_up_what_a_block_took_beyond_itself_run_alone_and_nothing_more():
    unmeasured = _calibration(0.0, 0.0).base_step_s()
    assert unmeasured == pytest.approx(12e-3 - 4e-3)  # the rerun's forward: the slower of the two runs
    assert _calibration(1.5e-3, 3e-3).base_step_s() == pytest.approx(unmeasured - (2e-3 + 5e-3 - 4.5e-3))
    assert _calibration(3e-3, 6e-3).base_step_s() == pytest.approx(unmeasured)  # slower alone: the safe step's
    faster = [_calibration(f, 2 * f).base_step_s() for f in (3e-3, 2e-3, 1e-3, 0.5e-3)]
    assert faster == sorted(faster, reverse=True)
