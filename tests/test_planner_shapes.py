"""Inputs whose shape changes from step to step (dynamic padding, a last smaller batch): which
input runs whose plan, how many steps measure, and that every step trains as plain autograd does."""
import copy

import torch

from um_alloc.planner import BlockPlanner, Decision
from um_alloc.planner import director as director_module
from um_alloc.planner.director import BORROWED_STEPS, PROBED, _holds
from test_planner_replay import gradients as step, tiny_bert

def signature(*shapes, dtype=torch.int64):
    return tuple((shape, dtype) for shape in shapes)


def batches(lengths, batch=4, seed=5):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (batch, length), generator=generator) for length in lengths]


def test_holds_wants_the_same_tensors_dtypes_and_ranks_and_no_smaller_dimension():
    assert _holds(signature((4, 16), (4, 16)), signature((4, 12), (4, 12)))
    assert _holds(signature((4, 16)), signature((3, 16)))
    assert not _holds(signature((4, 16)), signature((4, 16)))                    # the same input
    assert not _holds(signature((4, 16)), signature((8, 12)))                    # a larger batch
    assert not _holds(signature((4, 16)), signature((4, 12), (4, 12)))           # another tensor
    assert not _holds(signature((4, 16)), signature((4, 12), dtype=torch.int32))  # another dtype
    assert not _holds(signature((4, 16, 1)), signature((4, 16)))                 # another rank


def test_a_smaller_input_runs_the_plan_of_the_smallest_planned_input_that_holds_it():
    model = tiny_bert(dropout=0.0)
    planner = BlockPlanner(model, "1GiB")
    for ids in batches([16, 16, 16]):  # two steps measure, the third runs the plan
        step(model, ids)
    assert planner.safe_steps == 2
    assert "first saw" not in planner.table()  # planned from the second step
    for ids in batches([12]):
        step(model, ids)
    assert planner.safe_steps == 2  # no step measured: it ran 4x16's plan
    assert "input 4x12, 4x12 runs the plan of input 4x16, 4x16" in planner.table()
    assert planner.to_dict()["inputs"] == {"planned": 1, "borrowing": 1, "measuring": 0,
                                           "last_step_ran_plan_of": "4x16, 4x16"}
    for ids in batches([20, 20]):  # held by no planned input: one step measures, the next runs its plan
        step(model, ids)
    assert planner.safe_steps == 3
    assert "runs the plan" not in planner.table()
    assert "measured in the step that first saw this input" in planner.table()
    for ids in batches([10, 18]):
        step(model, ids)
        assert "runs the plan of input 4x16, 4x16" in planner.table() if ids.shape[1] == 10 else \
            "runs the plan of input 4x20, 4x20" in planner.table()
    assert planner.safe_steps == 3
    assert planner.to_dict()["inputs"]["planned"] == 2
    planner.remove()


def test_every_step_trains_as_plain_autograd_whichever_plan_it_runs():
    """Lengths as dynamic padding gives them, every block rebuilt where an input has a plan of its
    own: the inputs it holds run its best plan without rebuilds (a recipe is made for one shape),
    here the safe mode's recomputation from moved inputs; all with plain autograd's losses and
    gradients bit for bit in float64, dropout included."""
    model = tiny_bert(dropout=0.1)
    plain = copy.deepcopy(model)
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"])
    lengths = [16, 16, 16, 12, 16, 9, 14, 16, 20, 11, 20, 17]
    for index, ids in enumerate(batches(lengths)):
        loss, grads = step(model, ids)
        plain_loss, plain_grads = step(plain, ids)
        assert torch.equal(loss, plain_loss), f"step {index}, length {ids.shape[1]}"
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)), f"step {index}"
        blocks = {d for d, u in zip(planner.plan.decisions, planner.calibration.units) if u.kind == "block"} \
            if planner.plan else set()
        if ids.shape[1] in (12, 9, 14):  # held by 4x16, which rebuilds
            assert blocks == {Decision.RECOMPUTE_MOVED}
        elif ids.shape[1] == 16 and index >= 2:
            assert blocks == {Decision.REBUILD}
    assert planner.safe_steps == 3  # 4x16 twice, 4x20 once
    planner.remove()


def test_where_the_lenders_plan_without_rebuilds_fits_no_longer_its_borrowers_run_the_plan_that_keeps_least(
        monkeypatch):
    """A lender planned at the budget's edge (the margin cut to what the plan that keeps least
    leaves) may have no plan without rebuilds that the grid fits: the inputs it holds then run
    the plan that keeps least, not an error in their step."""
    from um_alloc.planner import director

    model = tiny_bert(dropout=0.0)
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"])
    for ids in batches([16, 16, 16]):
        step(model, ids)
    assert Decision.REBUILD in planner.plan.decisions

    def none_fits(*args, **kwargs):
        raise director.PlanInfeasible("stand-in: no plan fits", 0)

    monkeypatch.setattr(director, "make_plan", none_fits)
    (short,) = batches([12])
    step(model, short)
    assert planner.plan.made == "the plan that keeps least"
    assert set(planner.plan.decisions) <= {Decision.RECOMPUTE_MOVED, Decision.MOVE}
    planner.remove()


def test_a_probed_step_of_another_input_gives_no_rebuilds(monkeypatch):
    """As under um_alloc run: the first step's keyword arguments are not seen, and it is counted for
    the next step's input, whose length differs here. The probes' figures are not that input's:
    its plan neither rebuilds nor recomputes selectively."""
    allowed_seen = []
    make_plan = director_module.make_plan
    monkeypatch.setattr(director_module, "make_plan", lambda *a, **k: allowed_seen.append(k["allowed"]) or make_plan(*a, **k))
    from torch.nn.modules.module import register_module_forward_pre_hook

    model = tiny_bert(dropout=0.0).float()
    attached = []

    def attach(module, args):  # args: () for model(input_ids=..., labels=...)
        if module is model and not attached:
            attached.append(BlockPlanner(model, "1GiB"))
            attached[0].begin_forward(args)

    handle = register_module_forward_pre_hook(attach)
    short, long = batches([12, 16])
    step(model, short)
    handle.remove()
    for _ in range(3):
        step(model, long)
    planner = attached[0]
    assert planner.safe_steps == 2
    assert "measured in the step that first saw this input" in planner.table()  # 4x16's first step
    assert allowed_seen and all(not PROBED & a for a in allowed_seen)
    assert planner.plan is not None
    planner.remove()


def test_an_input_that_keeps_coming_is_measured_for_a_plan_of_its_own(monkeypatch):
    """After BORROWED_STEPS steps on a larger input's plan, one step measures it, without the
    probes; its plan may then neither rebuild nor recompute selectively (what those probes find)."""
    allowed_seen = []
    make_plan = director_module.make_plan
    monkeypatch.setattr(director_module, "make_plan", lambda *a, **k: allowed_seen.append(k["allowed"]) or make_plan(*a, **k))
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB", decisions=[d.value for d in Decision])
    for ids in batches([16, 16, 16] + [12] * (BORROWED_STEPS + 2)):
        step(model, ids)
    assert planner.safe_steps == 3
    assert planner.to_dict()["inputs"] == {"planned": 2, "borrowing": 0, "measuring": 0}
    assert "runs the plan" not in planner.table()
    assert "first saw" not in planner.table()  # measured after 16 steps of 4x16's plan
    own = [a for a in allowed_seen if not PROBED & a]
    assert own and all(a == frozenset(Decision) - PROBED for a in own)  # 4x12's plan and its runners-up
    assert frozenset(Decision) in allowed_seen                           # 4x16's, probed
    planner.remove()


def test_the_first_inputs_calibration_ends_after_one_step_when_another_input_follows():
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    for ids in batches([16, 12, 12]):
        step(model, ids)
    assert planner.safe_steps == 1
    assert planner.to_dict()["inputs"]["planned"] == 1
    assert "input 4x12, 4x12 runs the plan of input 4x16, 4x16" in planner.table()
    assert "measured in the step that first saw this input" in planner.table()
    planner.remove()


def test_inputs_that_hold_none_of_each_other_are_each_measured_once():
    """A larger batch of shorter sequences and a smaller batch of longer ones, alternating: one
    measuring step each, then each its own plan."""
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    generator = torch.Generator().manual_seed(7)
    for index in range(6):
        shape = (8, 8) if index % 2 else (2, 16)
        step(model, torch.randint(0, 97, shape, generator=generator))
    assert planner.safe_steps == 2
    assert planner.to_dict()["inputs"] == {"planned": 2, "borrowing": 0, "measuring": 0}
    planner.remove()


def test_the_checkpoint_strategy_measures_each_input():
    """The ablation recomputes every block anyway: no input borrows (its own plan is the same)."""
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB", strategy="checkpoint")
    for ids in batches([16, 16, 16, 12, 12]):
        step(model, ids)
    assert planner.to_dict()["inputs"] == {"planned": 2, "borrowing": 0, "measuring": 0}
    assert planner.safe_steps == 3
    planner.remove()


def test_a_measuring_step_whose_kernels_shared_the_link_costs_it_at_the_probes_rate():
    from um_alloc.planner.director import calibration_link
    probed = []

    def probe():
        probed.append(True)
        return 50e9

    assert calibration_link((48e9, 52e9), False, probe) == 48e9 and not probed  # the step's own copies, slower way
    # Kernels reading overflowed or spilled memory shared the link with the copies: the probe says what a plan gets.
    assert calibration_link((3.2e9, 3.5e9), True, probe) == 50e9
    assert calibration_link(None, False, probe) == 50e9  # nothing copied


def test_the_memory_probe_tells_a_step_that_spilled_to_host_memory():
    from um_alloc.planner.record import MemoryProbe

    class Pool:  # the pool's counters as raw_stats() gives them; the rest untouched here
        spills = 3

        def raw_stats(self):
            return {"tags": {"spill": {"allocations": self.spills}}}

        def reset_device_peak(self):
            pass

        def device_backed(self):
            return 0, 0

        def device_held(self):
            return 0, 0

    probe = MemoryProbe(torch.device("cpu"))
    probe._pool = Pool()
    probe.begin_step()
    assert not probe.spilled()
    probe._pool.spills += 2  # the head's logits and their gradient, say
    assert probe.spilled()
    assert not MemoryProbe(torch.device("cpu")).spilled()  # no pool: nothing spills
