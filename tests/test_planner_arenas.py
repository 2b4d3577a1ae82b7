"""The planner's step arenas (um_alloc/planner/arenas.py): what a step allocates is kept apart
from what outlasts it, and the step arenas are given back where a step lays activations out anew."""
import contextlib

import pytest
import torch

from um_alloc.planner import BlockPlanner
from um_alloc.sizes import format_size

LEAST = "the plan that keeps least"
WITHIN_LEAST = "the model's fastest within the least plan's peak"
from test_planner_replay import tiny_bert


class RecordedArenas:
    """Stands in for StepArenas (which needs um_alloc's pool on a GPU): what the runtime asked."""

    def __init__(self):
        self.events = []
        self.overflowed = 0  # what the next overflow_peak() reports
        self.can_overflow = True

    def allow_overflow(self, nbytes: int):
        self.events.append(("overflow", nbytes))

    def overflow_peak(self) -> int:
        peak, self.overflowed = self.overflowed, 0
        return peak

    def open(self):
        self.events.append("open")

    @contextlib.contextmanager
    def between_steps(self):
        self.events.append("between steps")
        yield

    def close(self):
        self.events.append("close")

    def release(self) -> int:
        self.events.append("release")
        return 0


def steps(events):
    """Per step begun (an "open"), whether a release came before it, since the step before."""
    released, out = False, []
    for event in events:
        if event == "release":
            released = True
        elif event == "open":
            out.append(released)
            released = False
    return out


def trials_of(planner):
    """The trials of the one input shape these tests train (planned again, before its next step)."""
    (shape,) = planner._shapes.values()
    return shape.trials


def train_step(model, optimizer, ids, closed):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    closed.append(closed_now(model))
    optimizer.step()  # optimizer state is made here, outside the step arenas
    optimizer.zero_grad(set_to_none=True)


def closed_now(model):
    """Whether the step arenas were closed after they were last opened."""
    events = model._recorded.events
    return max(i for i, e in enumerate(events) if e == "open") < max(i for i, e in enumerate(events) if e == "close")


def test_arenas_are_given_back_before_the_first_safe_step_the_first_plan_and_a_retry():
    """The clean second safe step repeats the probing step's layout in that step's arenas."""
    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB")
    model._recorded = planner._runtime.arenas = RecordedArenas()
    ids, closed = torch.randint(0, 97, (4, 16)), []
    for _ in range(4):  # two safe steps, the plan's first step, its second
        train_step(model, optimizer, ids, closed)
    assert planner.safe_steps == 2 and planner.plan is not None
    assert closed == [True] * 4  # every backward's end closed the step arenas before optimizer.step
    assert model._recorded.events.count("between steps") == 1  # the probed step's units, run by themselves

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("stand-in: the budget is spent")

    hook = model.bert.encoder.layer[1].attention.register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        train_step(model, optimizer, ids, closed)
    optimizer.zero_grad(set_to_none=True)
    hook.remove()
    for _ in range(2):  # the retry with less kept, then the next step
        train_step(model, optimizer, ids, closed)
    assert steps(model._recorded.events) == [True, False, True, False, False, True, False]
    assert planner.overflowed_steps == 0
    planner.remove()
    assert model._recorded.events[-1] == "close"


def test_the_blas_warm_up_runs_a_backward_even_where_gradients_are_off():
    """plan() may be called under torch.no_grad(); the warm-up still reaches the autograd thread."""
    from um_alloc.planner.arenas import _warm_up_blas

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _warm_up_blas(torch.device("cpu"))


def test_a_planned_step_that_overflowed_makes_the_next_plan_keep_that_much_less(caplog):
    """Every step may overflow. A planned one that did grows the margin by what it overflowed (and
    a little), plans again, and the next step lays its activations out anew."""
    from um_alloc.planner.director import OVERFLOW_SLACK

    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB", overflow="300MiB")
    assert planner.margin == (1 << 30) // 32  # default_margin
    model._recorded = arenas = planner._runtime.arenas = RecordedArenas()
    ids, closed = torch.randint(0, 97, (4, 16)), []
    for _ in range(3):  # two safe steps, the plan's first step
        train_step(model, optimizer, ids, closed)
    allowed = [e[1] for e in arenas.events if isinstance(e, tuple)]
    assert allowed == [300 << 20] * 3
    margin, first_plan = planner.margin, planner.plan
    arenas.overflowed = 40 << 20
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        train_step(model, optimizer, ids, closed)  # this one overflowed 40 MiB
    assert planner.margin == margin + (40 << 20) + OVERFLOW_SLACK and planner.overflowed_steps == 1
    assert "needed 40.0 MiB more than the 1.0 GiB budget holds" in caplog.text
    train_step(model, optimizer, ids, closed)
    assert planner.plan is not first_plan
    assert planner.plan.limit_bytes == first_plan.limit_bytes - (40 << 20) - OVERFLOW_SLACK
    assert steps([e for e in arenas.events if not isinstance(e, tuple)]) == [True, False, True, False, True]
    assert planner.to_dict()["overflowed_steps"] == 1 and planner.to_dict()["overflow_bytes"] == 300 << 20
    assert planner.to_dict()["measuring_step_overflow_bytes"] == 0  # a planned step's overflow is not the calibration's
    assert "measured in a step that overflowed" not in planner.table()


def test_a_measuring_step_that_overflowed_counts_what_it_needed_and_plans_within_the_least_plans_peak(caplog):
    """The safe steps measure the plan that keeps least. One that overflowed needed the whole
    budget backed and its overflow besides (live bytes understate that where backed chunks were
    free but scattered): its calibration says so, and plans no larger than that one run on with
    their excess in host memory. It counts as no planned step that overflowed."""
    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB", overflow="300MiB")
    model._recorded = arenas = planner._runtime.arenas = RecordedArenas()
    ids, closed = torch.randint(0, 97, (4, 16)), []
    train_step(model, optimizer, ids, closed)  # the first safe step
    arenas.overflowed = 40 << 20
    with caplog.at_level("INFO", logger="um_alloc.planner"):
        train_step(model, optimizer, ids, closed)  # the second, which overflowed
        assert "the measuring step overflowed 40.0 MiB to host memory" in caplog.text
        train_step(model, optimizer, ids, closed)  # planned from it
    assert planner.calibration.smallest_budget(0) >= (1 << 30) + (40 << 20)
    assert "needs 40.0 MiB more than the 1.0 GiB budget holds" in caplog.text
    assert planner.plan.made == WITHIN_LEAST and planner.overflowed_steps == 0
    assert [t.plan.made for t in trials_of(planner).tried] == [WITHIN_LEAST, LEAST]
    # The prediction carries the overflowed memory's reads over the link: the table says so.
    assert "measured in a step that overflowed 40.0 MiB to host memory" in planner.table()
    assert planner.to_dict()["measuring_step_overflow_bytes"] == 40 << 20


def test_the_default_overflow_is_a_quarter_of_the_budget_and_at_least_a_gibibyte():
    from um_alloc.planner.director import default_margin, default_overflow

    assert default_overflow(16 << 30) == 4 << 30 and default_overflow(2 << 30) == 1 << 30
    assert default_margin(16 << 30) == 512 << 20 and default_margin(64 << 30) == 512 << 20
    assert default_margin(4 << 30) == 128 << 20


def test_where_no_plan_leaves_room_for_what_overflowed_plans_no_larger_than_the_least_run_and_it_is_tried(caplog):
    """The margin grows only as far as the safe mode still fits; plans no larger than the one
    that keeps least then run, their excess in host memory: the model's fastest and that one,
    tried, the faster measured staying. Later overflows plan nothing again."""
    from um_alloc.planner.trials import STEPS_PER_CANDIDATE

    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB")
    model._recorded = arenas = planner._runtime.arenas = RecordedArenas()
    ids, closed = torch.randint(0, 97, (4, 16)), []
    for _ in range(3):
        train_step(model, optimizer, ids, closed)
    measured = planner.calibration
    most = (1 << 30) - measured.smallest_budget(0)
    arenas.overflowed = 2 << 30  # more than the whole budget
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        train_step(model, optimizer, ids, closed)
    assert planner.margin == most and "no plan leaves that much room" in caplog.text
    trials = trials_of(planner)
    assert [t.plan.made for t in trials.tried] == ["the model's fastest", LEAST]
    assert all(t.plan.predicted_peak_bytes <= measured.smallest_peak() for t in trials.tried)
    arenas.overflowed = 64 << 20
    for _ in range(2 * STEPS_PER_CANDIDATE + 1):  # the first overflowing again, then both tried
        train_step(model, optimizer, ids, closed)
    assert trials.done and planner.plan is trials.chosen
    assert planner.margin == most and planner.overflowed_steps == 2


class InUse:
    """A tiny BERT planned under `budget` on the CPU, where the pool's live bytes, which the CPU
    does not have, are `in_use`: memory that outlasts steps, raised between them by a test."""

    def __init__(self, budget: str, **options):
        self.model = tiny_bert(dropout=0.0).float()
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.planner = BlockPlanner(self.model, budget, **options)
        self.model._recorded = self.planner._runtime.arenas = RecordedArenas()
        self.in_use = 0
        self.planner._probe.live = lambda: self.in_use
        self.ids, self.closed = torch.randint(0, 97, (4, 16)), []

    def steps(self, count: int = 1) -> None:
        for _ in range(count):
            train_step(self.model, self.optimizer, self.ids, self.closed)


def test_where_the_margin_leaves_no_plan_room_it_is_cut_to_what_the_plan_that_keeps_least_leaves(caplog):
    """The margin guards a plan against the pool's layout; where it alone keeps every plan out and
    the pool can overflow, it shrinks rather than refusing a budget the safe steps trained in."""
    run = InUse("2GiB", margin="512MiB")
    planner = run.planner
    run.steps(3)  # two safe steps, the plan's first step
    run.in_use = 7 << 28  # 1.75 GiB: with the 512 MiB margin, more than the 2 GiB budget leaves
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        run.steps()
    room = (2 << 30) - planner.calibration.smallest_budget(0)
    assert 0 < room <= 256 << 20 and planner.margin == room
    assert f"margin cut to {format_size(room)}, what the plan that keeps least leaves" in caplog.text
    assert planner.plan.predicted_peak_bytes <= planner.plan.limit_bytes
    assert planner.plan.made == WITHIN_LEAST
    planner.remove()


def test_a_budget_the_plan_that_keeps_least_passes_within_the_overflow_trains_with_the_excess_in_host_memory(caplog):
    """Where even the safe mode needs more than the budget, by no more than the overflow allowed,
    plans no larger than it run on, the excess in host memory, instead of PlanInfeasible: the
    model's fastest, tried against the plan that keeps least. Past the overflow, PlanInfeasible
    as before."""
    from um_alloc.planner import PlanInfeasible
    from um_alloc.planner.planning import SAFE

    run = InUse("2GiB")
    planner = run.planner
    assert planner.overflow == 1 << 30  # default_overflow: at least 1 GiB
    run.steps(3)
    run.in_use = 9 << 28  # 2.25 GiB
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        run.steps()
    excess = planner.calibration.smallest_budget(0) - (2 << 30)
    assert 256 << 20 <= excess < 512 << 20
    assert f"needs {format_size(excess)} more than the 2.0 GiB budget holds" in caplog.text
    planned, least = (t.plan for t in trials_of(planner).tried)
    assert planned is planner.plan and planned.made == WITHIN_LEAST and planner.margin == 0
    assert planned.budget_bytes == 2 << 30 and planned.limit_bytes == planner.calibration.smallest_peak()
    assert least.made == LEAST and least.decisions == tuple(SAFE[u.kind] for u in planner.calibration.units)
    assert planned.predicted_peak_bytes <= least.predicted_peak_bytes  # it overflows no more
    assert least.predicted_peak_bytes > least.limit_bytes == 2 << 30
    run.in_use = 13 << 28  # 3.25 GiB: 1.25 GiB past the budget, more than the overflow
    with pytest.raises(PlanInfeasible, match=r"ask for 3.25GiB or more; a step may overflow only 1.0 GiB past"):
        run.model(input_ids=run.ids, labels=run.ids)
    planner.remove()


def test_the_copy_stages_count_against_the_budget_and_not_against_the_overflow():
    """The stages beside the pool (512 MiB here) stay on the GPU: a least plan 1.25 GiB past the
    budget with them, 0.75 GiB without, overflows 0.75 GiB of the pool, within the 1 GiB allowed."""
    run = InUse("2GiB")
    planner = run.planner
    planner._reserved = 512 << 20
    run.steps(3)
    run.in_use = 11 << 28  # 2.75 GiB
    run.steps()
    cal = planner.calibration
    excess = cal.smallest_budget(0) - (2 << 30)
    assert cal.reserved_bytes == 512 << 20 and excess - cal.reserved_bytes <= planner.overflow < excess
    assert planner.plan.made == WITHIN_LEAST
    planner.remove()


def test_the_installed_policy_sets_the_overflow_and_an_argument_overrides_it(monkeypatch):
    """Under the launcher or a callback there is no call to pass `overflow` to: the policy's
    scheduler.overflow (0 turns it off) stands in, and auto is a quarter of the budget."""
    from types import SimpleNamespace
    from um_alloc.planner import director
    from um_alloc.policy import policy_from_dict

    for key, expected in ((0, 0), ("auto", 1 << 30), ("3GiB", 3 << 30)):
        policy = policy_from_dict({"scheduler": {"strategy": "auto", "overflow": key}}, source="p.yaml", name="p")
        monkeypatch.setattr(director, "is_installed", lambda: True)
        monkeypatch.setattr(director, "installation", lambda: SimpleNamespace(policy=policy, budget=1 << 30))
        for options, overflow in (({}, expected), ({"overflow": "5MiB"}, 5 << 20)):
            planner = BlockPlanner(tiny_bert(dropout=0.0).float(), "4GiB", **options)
            assert planner.overflow == overflow
            planner.remove()
