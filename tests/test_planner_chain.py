"""Chains (um_alloc/planner/chain.py): units rerun in backward one from another. On the CPU: the
plan's choice on synthetic calibrations, what calibration learns of a stem, and gradients through a
chain equal to plain autograd's in float64."""
import copy
import weakref

import pytest
import torch
import torch.nn as nn

from um_alloc.planner import BlockPlanner, Decision, find_units
from um_alloc.planner.planning import Calibration, Segment, UnitCost, chains, evaluate, make_plan
from um_alloc.planner.replay import Runtime

from planner_helpers import Fixed

MiB, GiB = 1 << 20, 1 << 30


class Bottleneck(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(x + self.bn(self.conv(x)))


class Stemmed(nn.Module):
    """A ResNet's shape: a stem of gaps (convolution, BatchNorm, in-place ReLU, max-pool, and a
    dropout), repeated blocks, a head. `poke` changes the pool's output in place before the dropout."""

    def __init__(self, poke: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.drop = nn.Dropout(0.3)
        self.layers = nn.Sequential(Bottleneck(), Bottleneck())
        self.fc = nn.Linear(8, 3)
        self.poke = poke

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        if self.poke:
            x.add_(1.0)
        x = self.drop(x)
        return self.fc(self.layers(x).mean((2, 3)))


STEM = {"conv1": Decision.RECOMPUTE, "bn1": Decision.CHAINED, "relu": Decision.CHAINED,
        "maxpool": Decision.CHAINED, "drop": Decision.CHAINED}


def _run(model, decisions, steps=2, watch=None):
    """Losses, gradients and BatchNorm statistics of `steps` steps of SGD-free training, each step's
    dropout drawn from its own seed; `decisions` by unit name (the rest kept), or None for plain
    autograd. `watch`: a module whose output is looked at between forward and backward."""
    units = find_units(model)
    runtime = None
    if decisions is not None:
        chosen = tuple(decisions.get(u.name, Decision.KEEP) for u in units) + (Decision.KEEP,)
        runtime = Runtime(model, units, torch.device("cpu"), Fixed(chosen), window=1 << 20, min_bytes=1)
        runtime.attach()
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    losses, alive = [], []
    try:
        for step in range(steps):
            torch.manual_seed(step)
            seen = []
            handle = watch.register_forward_hook(lambda m, i, o: seen.append(weakref.ref(o))) if watch else None
            loss = model(x).square().sum()
            if handle:
                handle.remove()
                alive.append(seen[0]() is not None)
            loss.backward()
            losses.append(loss.item())
    finally:
        if runtime:
            runtime.detach()
    grads = [p.grad.clone() for p in model.parameters()]
    stats = [b.clone() for b in model.buffers()]
    return losses, grads, stats, alive


def _plain_and_planned(poke=False, decisions=STEM, watch=None):
    torch.manual_seed(0)
    plain = Stemmed(poke).double()
    planned = copy.deepcopy(plain)
    return _run(plain, None, watch=watch and getattr(plain, watch)), \
        _run(planned, decisions, watch=watch and getattr(planned, watch))


def test_a_chained_stem_trains_as_plain_autograd_does_bit_for_bit():
    (losses, grads, stats, _), (c_losses, c_grads, c_stats, _) = _plain_and_planned()
    assert c_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(grads, c_grads))
    assert all(torch.equal(a, b) for a, b in zip(stats, c_stats))  # BatchNorm counts each batch once


def test_a_chain_holds_none_of_what_its_units_save_between_forward_and_backward():
    """The convolution's output is what the BatchNorm after it saves: plain autograd holds it until
    backward; in a chain nothing does."""
    (_, _, _, alive), (_, _, _, chained_alive) = _plain_and_planned(watch="conv1")
    assert alive == [True, True] and chained_alive == [False, False]


def test_a_chain_may_run_on_into_a_block_and_from_moved_inputs():
    decisions = {**STEM, "conv1": Decision.RECOMPUTE_MOVED, "layers.0": Decision.CHAINED}
    (losses, grads, _, _), (c_losses, c_grads, _, _) = _plain_and_planned(decisions=decisions)
    assert c_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(grads, c_grads))


def test_a_chained_unit_whose_argument_changed_since_keeps_what_it_saves(caplog):
    """The model changes the pool's output in place before the dropout: the dropout's call does not
    take the chain's output as it was, so it keeps what it saves, and the gradients stay plain's."""
    (losses, grads, _, _), (c_losses, c_grads, _, _) = _plain_and_planned(poke=True)
    assert c_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(grads, c_grads))
    assert "drop was planned to be rerun from the unit before it" in caplog.text


def _planned(model) -> BlockPlanner:
    """The planner of `model` after its two measuring steps and its first planned one, on the CPU."""
    torch.manual_seed(0)
    planner = BlockPlanner(model, "1GiB")
    x = torch.randn(4, 3, 8, 8)
    for _ in range(3):
        model(x).sum().backward()
    return planner


def test_calibration_sees_which_calls_follow_the_unit_before_and_times_gaps_rerun_alone():
    planner = _planned(Stemmed())
    units = {u.name: u for u in planner.calibration.units}
    assert [units[n].follows for n in ("conv1", "bn1", "relu", "maxpool", "drop", "layers.0", "layers.1", "fc")] \
        == [False, True, True, True, True, True, True, False]  # fc reads a mean of the blocks' output
    assert all(units[n].recompute_s > 0 and units[n].input_bytes > 0 for n in STEM)
    assert units["relu"].changes_input and not units["bn1"].changes_input
    assert Decision.RECOMPUTE not in units["relu"].allowed() and Decision.CHAINED in units["relu"].allowed()
    assert Decision.CHAINED not in units["conv1"].allowed()
    assert units["fc"].recompute_s == 0 and units["fc"].allowed() == (Decision.KEEP, Decision.MOVE)
    planner.remove()


def test_forcing_a_chained_unit_after_one_that_is_not_rerun_is_refused():
    planner = _planned(Stemmed())
    names = [u.name for u in planner.calibration.units]
    forced = ["keep"] * len(names)
    forced[names.index("bn1")] = "chained"
    with pytest.raises(ValueError, match="bn1 chained after a unit that is not rerun"):
        planner.force(forced)
    forced[names.index("conv1")] = "recompute"
    assert planner.force(forced).decisions[names.index("bn1")] is Decision.CHAINED
    planner.remove()


# -- the plan, on synthetic calibrations --

def stem(follows: bool = True, saved: int = 1 * GiB, rate: float = 50e9, static: int = 2 * GiB) -> Calibration:
    """A stem of four gaps, each saving `saved` and rerun in a millisecond, then a block and a head:
    the forward holds units as they finish, backward lets each go as it passes."""
    units = [UnitCost(f"stem.{j}", "gap", 2e-3, recompute_s=1e-3, saved_bytes=saved, input_bytes=saved // 4,
                      hide_s=0.02, follows=follows and j > 0) for j in range(4)]
    units.append(UnitCost("block", "block", 5e-3, recompute_s=5e-3, saved_bytes=saved, input_bytes=saved // 4,
                          hide_s=0.01, follows=follows))
    units.append(UnitCost("head", "gap", 1e-3, saved_bytes=16 * MiB))
    n = len(units)
    segments = [Segment(f"forward {j}", static + 256 * MiB, tuple(range(j))) for j in range(n + 1)]
    segments += [Segment(f"backward {j}", static + saved, tuple(range(j)), in_backward=True)
                 for j in range(n - 1, -1, -1)]
    return Calibration(tuple(units), tuple(segments), step_s=0.5, link_bytes_per_s=rate)


def test_chains_are_a_rerun_unit_and_the_chained_units_after_it():
    d = Decision
    assert chains((d.RECOMPUTE, d.CHAINED, d.CHAINED, d.KEEP, d.RECOMPUTE_MOVED, d.CHAINED)) == [(0, 2), (4, 5)]
    assert chains((d.RECOMPUTE, d.KEEP, d.CHAINED)) == []  # a chained unit after a kept one is no chain


def test_where_keeping_a_stem_does_not_fit_the_plan_reruns_it_as_a_chain_faster_than_without():
    cal = stem()
    plan = make_plan(cal, 6 * GiB)
    unchained = make_plan(cal, 6 * GiB, allowed=frozenset(Decision) - {Decision.CHAINED})
    assert plan.decisions[:3] == (Decision.RECOMPUTE, Decision.CHAINED, Decision.CHAINED)
    assert plan.predicted_peak_bytes <= plan.limit_bytes
    assert plan.predicted_step_s < unchained.predicted_step_s


def test_without_calls_that_follow_one_another_nothing_is_chained():
    plan = make_plan(stem(follows=False), 6 * GiB)
    assert Decision.CHAINED not in plan.decisions


def test_a_chains_rerun_holds_all_its_units_saved_tensors_at_once_in_its_backward():
    """In stem.3's backward the chain holds stem.0-2's saved tensors (rerun together) and, while
    it reruns, the largest of its units' outputs (their inputs, 256 MiB), beside stem.3's own and
    stem.0's input (which recompute keeps)."""
    chained = (Decision.RECOMPUTE,) + (Decision.CHAINED,) * 3 + (Decision.RECOMPUTE, Decision.KEEP, Decision.KEEP)
    plan = evaluate(stem(), chained, 16 * GiB)
    assert plan.predicted_peak_bytes == 2 * GiB + 1 * GiB + 3 * GiB + 256 * MiB + 256 * MiB


def test_a_chain_too_large_for_the_budget_in_its_backward_is_cut_short():
    cal = stem()
    room, tight = make_plan(cal, 6 * GiB), make_plan(cal, 5 * GiB)
    assert chains(room.decisions) == [(0, 2)]
    too_long = evaluate(cal, room.decisions, 5 * GiB)
    assert too_long.predicted_peak_bytes > too_long.limit_bytes  # that chain's rerun has no room at 5 GiB
    assert tight.predicted_peak_bytes <= tight.limit_bytes
    assert tight.decisions.count(Decision.CHAINED) < room.decisions.count(Decision.CHAINED)


@pytest.mark.parametrize("fails", [False, True])
def test_no_chained_step_leaves_its_activations_alive(fails, monkeypatch):
    """After each step nothing a chain's units saved or reran is alive, also while Python's cycle
    collector does not run (a ReLU saves its own output), and also where the chain's rerun fails
    in backward (out of memory): a loop that runs the step again has the room it had."""
    import gc

    torch.manual_seed(0)
    model = Stemmed().double()
    units = find_units(model)
    chosen = tuple(STEM.get(u.name, Decision.KEEP) for u in units) + (Decision.KEEP,)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(chosen), window=1 << 20, min_bytes=1)
    runtime.attach()
    stem_shape = (4, 8, 8, 8)  # the convolution's, BatchNorm's and ReLU's outputs

    relu = torch.nn.functional.relu

    def relu_failing_in_backward(*args, **kwargs):  # the ReLU's rerun, in the chain's
        if relu_failing_in_backward.now:
            raise torch.OutOfMemoryError("no room for the rerun")
        return relu(*args, **kwargs)

    relu_failing_in_backward.now = False
    monkeypatch.setattr(torch.nn.functional, "relu", relu_failing_in_backward)

    gc.collect()
    gc.disable()
    try:
        for step in range(3):
            x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().sum()
            relu_failing_in_backward.now = fails
            try:
                loss.backward()
                assert not fails
            except torch.OutOfMemoryError:
                assert fails
            finally:
                relu_failing_in_backward.now = False
                del loss
            alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == stem_shape]
            assert alive == [], f"step {step}: {len(alive)} of the stem's activations still alive"
    finally:
        gc.enable()
        runtime.detach()


def test_at_the_budgets_edge_the_stem_of_the_plan_that_keeps_least_is_rerun_as_a_chain():
    """gaps_chained: each run of gaps that may rerun one from another, from the first one's kept
    inputs; blocks, and gaps that cannot, keep their decisions."""
    from um_alloc.planner.planning import SAFE, gaps_chained

    cal = stem()
    least = tuple(SAFE[u.kind] for u in cal.units)
    assert gaps_chained(cal, least) == (Decision.RECOMPUTE,) + (Decision.CHAINED,) * 3 + least[4:]
    assert gaps_chained(stem(follows=False), least) == least


def test_the_plan_that_keeps_least_with_its_gaps_chained_is_tried_only_within_half_the_overflow_left():
    planner = BlockPlanner(Stemmed(), "6GiB")  # overflow: a quarter of the budget, 1.5 GiB
    cal = stem(saved=128 * MiB)  # the chain holds 3 x 128 MiB more at once, and the last output
    least = planner._least(cal)
    chained = planner._least_chained(cal, least)
    assert chained.decisions[:4] == (Decision.RECOMPUTE,) + (Decision.CHAINED,) * 3
    assert chained.made == "the plan that keeps least, its gaps rerun in chains"
    planner.overflow = 512 * MiB
    assert planner._least_chained(cal, least) is None
    planner.remove()


class WholeBatch(nn.Module):
    """Reads its input as a batch of four: on part of the batch it fails."""

    def forward(self, x):
        return x.view(4, 8, 8, 8).tanh().view_as(x)


def test_a_gap_that_needs_its_whole_batch_is_not_timed_alone_and_does_not_rerun():
    torch.manual_seed(0)
    planner = _planned(nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), WholeBatch(), nn.ReLU(), nn.Flatten(),
                                     nn.Linear(512, 3)))
    units = {u.name: u for u in planner.calibration.units}
    assert units["1"].follows and units["1"].recompute_s == 0
    assert units["1"].allowed() == (Decision.KEEP, Decision.MOVE)
    assert units["0"].recompute_s > 0 and Decision.CHAINED in units["2"].allowed()
    planner.remove()


def test_chains_off_leave_chained_out_of_the_decisions_from_the_argument_or_the_policy():
    planner = BlockPlanner(Stemmed(), "1GiB")
    assert Decision.CHAINED in planner.allowed
    planner.remove()
    planner = BlockPlanner(Stemmed(), "1GiB", chains=False)
    assert Decision.CHAINED not in planner.allowed and Decision.RECOMPUTE in planner.allowed
    planner.remove()
    with pytest.raises(ValueError, match="chains"):
        BlockPlanner(Stemmed(), "1GiB", chains="no")


class Cat(nn.Module):
    def forward(self, parts):
        return torch.cat(parts, dim=1)


class Joined(nn.Module):
    """A gap called with one list of tensors, whose output the next gap takes."""

    def __init__(self):
        super().__init__()
        self.join, self.act, self.head = Cat(), nn.ReLU(), nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.act(self.join([x, x]))).sum()


def test_a_gap_called_with_a_list_is_not_timed_alone_and_the_next_one_is():
    model = Joined()
    planner = BlockPlanner(model, "1GiB")
    for _ in range(3):
        model(torch.randn(4, 4)).backward()
    units = {u.name: u for u in planner.calibration.units}
    assert units["act"].follows and units["act"].recompute_s > 0
    assert not units["join"].follows and units["join"].recompute_s == 0
    planner.remove()


def test_at_the_budgets_edge_the_plan_that_keeps_least_with_its_stem_chained_is_tried_beside_it():
    """Where no plan fits beside what overflowed, the model's own plan (without chains) is tried
    against the plan that keeps least and that plan with its gaps rerun in chains."""
    from test_planner_arenas import RecordedArenas, trials_of

    torch.manual_seed(0)
    model = Stemmed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    planner = BlockPlanner(model, "1GiB")
    arenas = planner._runtime.arenas = RecordedArenas()
    x = torch.randn(4, 3, 8, 8)

    def step():
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    arenas.overflowed = 2 << 30  # more than the whole budget: the margin is cut, plans run past it
    step()
    tried = trials_of(planner).tried
    assert [t.plan.made for t in tried[1:]] == ["the plan that keeps least",
                                                "the plan that keeps least, its gaps rerun in chains"]
    assert Decision.CHAINED not in tried[0].plan.decisions  # the model's own, at the edge
    assert tried[2].plan.decisions[:5] == (Decision.RECOMPUTE,) + (Decision.CHAINED,) * 4
    planner.remove()
