"""A loop that calls the model more than once before its backward (a pair of inputs for one
contrastive or ranking loss, a discriminator's real and generated batches): the forwards are one
step, planned and measured as one, and every decision trains as plain autograd does."""
import copy

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision
from um_alloc.planner.replay import MOST_FORWARDS_A_STEP
from planner_helpers import fixed_decisions
from test_planner_replay import tiny_bert

transformers = pytest.importorskip("transformers")


def pair_of_batches(seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, 97, (4, 16), generator=generator) for _ in range(2))


def pair_step(model, pair, backwards: str = "one"):
    """Both forwards, then backward over the sum of their losses ("one"), or over each loss in
    turn ("each"); the loss and the gradients."""
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    first, second = (model(input_ids=ids, labels=ids).loss for ids in pair)
    if backwards == "one":
        (first + 2 * second).backward()
    else:
        first.backward()
        second.backward()
    return (first + second).detach(), [p.grad.clone() for p in model.parameters()]


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


@pytest.mark.parametrize("backwards", ["one", "each"])
@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
def test_two_forwards_before_backward_are_one_step_and_train_as_plain_autograd(decision, backwards):
    model = tiny_bert(dropout=0.1)
    pair = pair_of_batches()
    plain = pair_step(copy.deepcopy(model), pair, backwards)
    with fixed_decisions(model, decision) as (_, director):
        for _ in range(2):
            assert same(pair_step(model, pair, backwards), plain)  # dropout masks replayed in both forwards
    assert director.ended == [True, True]  # a step a pair, ended by its (first) backward, none left open


def test_a_forward_whose_graph_is_gone_is_a_step_of_its_own_closed_at_the_next():
    """Evaluation with gradients on: each forward's output is dropped, so no backward can come."""
    model = tiny_bert(dropout=0.0)
    with fixed_decisions(model, Decision.RECOMPUTE) as (_, director):
        ids = pair_of_batches()[0]
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.item()
        assert director.ended == [False, False]  # the third is open until the next forward
        pair_step(model, pair_of_batches())
    assert director.ended == [False, False, False, True]


def test_in_evaluation_mode_each_forward_is_a_step_of_its_own_though_its_output_is_held():
    """An evaluation loop with gradients on holds each output until the next forward has run."""
    model = tiny_bert(dropout=0.0).eval()
    with fixed_decisions(model, Decision.RECOMPUTE) as (_, director):
        ids = pair_of_batches()[0]
        out = None
        for _ in range(3):
            out = model(input_ids=ids, labels=ids)
        assert director.ended == [False, False] and out.loss.requires_grad


def test_outputs_held_without_a_backward_are_closed_after_the_most_forwards_a_step_gathers():
    model = tiny_bert(dropout=0.0)
    with fixed_decisions(model, Decision.MOVE) as (_, director):
        ids = pair_of_batches()[0]
        held = [model(input_ids=ids, labels=ids).loss for _ in range(MOST_FORWARDS_A_STEP + 1)]
        assert director.ended == [False]  # the first step took MOST_FORWARDS_A_STEP forwards
        torch.stack(held).sum().backward()  # every graph still trains, moved tensors fetched on demand
    assert director.ended == [False, True]


def test_the_planner_measures_both_forwards_in_one_step_and_trains_as_plain_autograd():
    """Two safe steps measure (each of two forwards), then the plan runs; dropout on throughout."""
    model = tiny_bert(dropout=0.1)
    plain = copy.deepcopy(model)
    planner = BlockPlanner(model, "1GiB")
    try:
        for seed in range(4):
            pair = pair_of_batches(seed)
            assert same(pair_step(model, pair), pair_step(plain, pair)), f"step {seed}"
        assert planner.safe_steps == 2
        assert planner.plan is not None
        recomputed = [u for u in planner.calibration.units if u.kind == "block"]
        assert all(u.recompute_s > 0 for u in recomputed)
    finally:
        planner.remove()


def autocast_pair_step(model, pair, one_region: bool):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = 0.0
    if one_region:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for ids in pair:
                loss = loss + model(input_ids=ids, labels=ids).loss
    else:
        for ids in pair:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss + model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("one_region", [False, True], ids=["a region each", "one region"])
def test_under_autocast_a_pair_recomputed_as_one_node_trains_as_plain_autograd(one_region):
    """In an autocast region of its own each forward trains bit for bit. In one region both
    forwards read each weight's one bf16 cast: plain autograd sums the two calls' gradients in
    bf16 before the cast's backward, a block recomputed as one node after it, in float32, so the
    two agree to bf16's rounding (docs/planner.md)."""
    model = tiny_bert(dropout=0.1).float()
    pair = pair_of_batches()
    plain = autocast_pair_step(copy.deepcopy(model), pair, one_region)
    with fixed_decisions(model, Decision.RECOMPUTE):
        steps = [autocast_pair_step(model, pair, one_region) for _ in range(3)]  # as one node from the second
    assert same(steps[0], plain)  # torch.utils.checkpoint: the forward's own graph, its casts' too
    for loss, grads in steps[1:]:
        if one_region:
            assert torch.allclose(loss, plain[0], rtol=1e-2)
            assert all(torch.allclose(a, b, rtol=2e-2, atol=1e-3) for a, b in zip(grads, plain[1]))
        else:
            assert same((loss, grads), plain)
