"""The planner's step arenas (um_alloc/planner/arenas.py): what a step allocates is kept apart
from what outlasts it, and the step arenas are given back where a step lays activations out anew."""
import pytest
import torch

from um_alloc.planner import BlockPlanner
from test_planner_replay import tiny_bert


class RecordedArenas:
    """Stands in for StepArenas (which needs um_alloc's pool on a GPU): what the runtime asked."""

    def __init__(self):
        self.events = []
        self.overflowed = 0  # what the next overflow_peak() reports

    def allow_overflow(self, nbytes: int):
        self.events.append(("overflow", nbytes))

    def overflow_peak(self) -> int:
        peak, self.overflowed = self.overflowed, 0
        return peak

    def open(self):
        self.events.append("open")

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


def test_arenas_are_given_back_before_safe_steps_the_first_plan_and_a_retry():
    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB")
    model._recorded = planner._runtime.arenas = RecordedArenas()
    ids, closed = torch.randint(0, 97, (4, 16)), []
    for _ in range(4):  # two safe steps, the plan's first step, its second
        train_step(model, optimizer, ids, closed)
    assert planner.safe_steps == 2 and planner.plan is not None
    assert closed == [True] * 4  # every backward's end closed the step arenas before optimizer.step

    def out_of_memory(module, args):
        raise torch.OutOfMemoryError("stand-in: the budget is spent")

    hook = model.bert.encoder.layer[1].attention.register_forward_pre_hook(out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        train_step(model, optimizer, ids, closed)
    optimizer.zero_grad(set_to_none=True)
    hook.remove()
    for _ in range(2):  # the retry with less kept, then the next step
        train_step(model, optimizer, ids, closed)
    assert steps(model._recorded.events) == [True, True, True, False, False, True, False]
    assert planner.overflowed_steps == 0
    planner.remove()
    assert model._recorded.events[-1] == "close"


def test_the_blas_warm_up_runs_a_backward_even_where_gradients_are_off():
    """plan() may be called under torch.no_grad(); the warm-up still reaches the autograd thread."""
    from um_alloc.planner.arenas import _warm_up_blas

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _warm_up_blas(torch.device("cpu"))


def test_a_planned_step_that_overflowed_makes_the_next_plan_keep_that_much_less(caplog):
    """Only planned steps may overflow; one that did grows the margin by what it overflowed (and a
    little), plans again, and the next step lays its activations out anew."""
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
    assert allowed == [0, 0, 300 << 20]
    margin, first_plan = planner.margin, planner.plan
    arenas.overflowed = 40 << 20
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        train_step(model, optimizer, ids, closed)  # this one overflowed 40 MiB
    assert planner.margin == margin + (40 << 20) + OVERFLOW_SLACK and planner.overflowed_steps == 1
    assert "needed 40.0 MiB more than the 1.0 GiB budget holds" in caplog.text
    train_step(model, optimizer, ids, closed)
    assert planner.plan is not first_plan
    assert planner.plan.limit_bytes == first_plan.limit_bytes - (40 << 20) - OVERFLOW_SLACK
    assert steps([e for e in arenas.events if not isinstance(e, tuple)]) == [True, True, True, False, True]
    assert planner.to_dict()["overflowed_steps"] == 1 and planner.to_dict()["overflow_bytes"] == 300 << 20


def test_the_default_overflow_is_a_quarter_of_the_budget_and_at_least_a_gibibyte():
    from um_alloc.planner.director import default_margin, default_overflow

    assert default_overflow(16 << 30) == 4 << 30 and default_overflow(2 << 30) == 1 << 30
    assert default_margin(16 << 30) == 512 << 20 and default_margin(64 << 30) == 512 << 20
    assert default_margin(4 << 30) == 128 << 20


def test_where_no_plan_leaves_room_for_what_overflowed_the_plan_that_keeps_least_runs_on(caplog):
    """The margin grows only as far as the safe mode still fits; the plan that keeps least then
    runs, its excess in host memory, and later overflows plan nothing again."""
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
    arenas.overflowed = 64 << 20
    train_step(model, optimizer, ids, closed)  # the plan that keeps least, overflowing again
    least = planner.plan
    assert least.predicted_peak_bytes == measured.smallest_peak()
    train_step(model, optimizer, ids, closed)
    assert planner.margin == most and planner.overflowed_steps == 2 and planner.plan is least


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
