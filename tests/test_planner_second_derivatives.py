"""A loop that takes a second derivative through the model (a gradient penalty, as WGAN-GP's
critic or R1 regularisation): three forwards before one backward, one of them differentiated
with create_graph=True. Every decision a second derivative can pass trains as plain autograd; a
recomputation from moved inputs goes through torch.utils.checkpoint once one has been seen, and
the planner plans selective recomputation (which PyTorch refuses to differentiate twice) away."""
import copy

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision, find_units
from planner_helpers import fixed_decisions


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.linear(x)) + x


class Critic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[Layer() for _ in range(3)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.layers(x))


def critic():
    torch.manual_seed(0)
    return Critic().double()


def batches():
    generator = torch.Generator().manual_seed(3)
    return tuple(torch.randn(8, 16, generator=generator, dtype=torch.float64) for _ in range(2))


def critic_step(model, penalty: bool = True):
    """WGAN-GP's critic loss, the gradient penalty on points between real and generated samples
    taken with create_graph=True; the loss and the gradients."""
    real, fake = batches()
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = model(fake).mean() - model(real).mean()
    if penalty:
        alpha = torch.rand(real.shape[0], 1, dtype=real.dtype)
        between = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
        grad, = torch.autograd.grad(model(between).sum(), between, create_graph=True)
        loss = loss + 10 * ((grad.norm(dim=1) - 1) ** 2).mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def same(a, b) -> bool:
    """Plain autograd's loss and gradients, to float64's rounding: a block recomputed as one node
    sums its share of a gradient in another order (docs/planner.md)."""
    return torch.allclose(a[0], b[0], rtol=1e-12, atol=0) and all(
        torch.allclose(x, y, rtol=1e-12, atol=1e-15) for x, y in zip(a[1], b[1]))


TWICE_DIFFERENTIABLE = [d for d in Decision if d not in (Decision.SELECTIVE, Decision.SELECTIVE_MOVED)]


@pytest.mark.parametrize("decision", TWICE_DIFFERENTIABLE, ids=lambda d: d.value)
def test_a_gradient_penalty_trains_as_plain_autograd_under_each_decision(decision):
    model = critic()
    plain = critic_step(copy.deepcopy(model))
    assert [u.name for u in find_units(model) if u.kind == "block"] == ["layers.0", "layers.1", "layers.2"]
    with fixed_decisions(model, decision) as (runtime, _):
        for _ in range(3):  # the first through torch.utils.checkpoint, then as one node where it may
            assert same(critic_step(model), plain)
    assert runtime.second_derivatives


def test_the_planner_trains_a_critic_with_a_gradient_penalty_every_step():
    """Its safe mode recomputes from moved inputs: as one node that could not differentiate twice."""
    model = critic()
    plain = copy.deepcopy(model)
    planner = BlockPlanner(model, "1GiB")
    try:
        for step in range(5):
            assert same(critic_step(model), critic_step(plain)), f"step {step}"
        assert planner.safe_steps == 2 and planner.plan is not None
    finally:
        planner.remove()


def test_a_penalty_first_taken_after_a_selective_plan_is_planned_away_from_the_next_step():
    """A penalty every few steps (lazy regularisation): the plan was made before one was seen.
    The step that first takes it meets PyTorch's refusal; the plan is made again without
    selective recomputation, and from the next step the penalty trains as plain autograd does."""
    model = critic()
    plain = copy.deepcopy(model)
    planner = BlockPlanner(model, "1GiB")
    try:
        for _ in range(3):  # two measure, the third runs the plan
            critic_step(model, penalty=False)
        planner.force("selective")  # every block, as a plan the model chose could
        assert same(critic_step(model, penalty=False), critic_step(plain, penalty=False))
        with pytest.raises(RuntimeError, match="selective activation checkpoint"):
            critic_step(model)
        for step in range(2):
            assert same(critic_step(model), critic_step(plain)), f"step {step}"
        assert not {Decision.SELECTIVE, Decision.SELECTIVE_MOVED} & set(planner.plan.decisions)
    finally:
        planner.remove()


def test_a_penalty_first_taken_through_one_node_from_moved_inputs_says_to_run_the_step_again():
    model = critic()
    plain = copy.deepcopy(model)
    with fixed_decisions(model, Decision.RECOMPUTE_MOVED):
        for _ in range(2):  # the second recomputes as one node
            assert same(critic_step(model, penalty=False), critic_step(plain, penalty=False))
        with pytest.raises(RuntimeError, match="run this step again"):
            critic_step(model)
        for _ in range(2):
            assert same(critic_step(model), critic_step(plain))
