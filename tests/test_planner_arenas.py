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
    planner.remove()
    assert model._recorded.events[-1] == "close"


def test_the_blas_warm_up_runs_a_backward_even_where_gradients_are_off():
    """plan() may be called under torch.no_grad(); the warm-up still reaches the autograd thread."""
    from um_alloc.planner.arenas import _warm_up_blas

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        _warm_up_blas(torch.device("cpu"))
