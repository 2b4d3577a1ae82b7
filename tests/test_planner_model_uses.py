"""Where a model runs other than as planned: a deep copy (an EMA, a best-so-far copy) and a pickle
run their own weights, unplanned; a shallow copy is planned as the model; nn.DataParallel's
replicas are refused with what to do instead; a loop calling model.forward() is told why nothing
is planned; a user's hooks inside a recomputed block run again in its rerun; a model called with
tensors swapped in for its parameters (torch.func.functional_call) keeps what it would recompute;
a model that skips layers at random each step (LayerDrop) trains as plain autograd."""
import copy
import io

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision, planner_of
from planner_helpers import Residual, fixed_decisions
from test_planner_replay import gradients, tiny_bert

transformers = pytest.importorskip("transformers")

IDS = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def halved(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    return model


def planned_and_trained(dropout: float = 0.0):
    """A model planned and trained for three steps (two measure, one runs the plan)."""
    model = tiny_bert(dropout=dropout)
    planner = BlockPlanner(model, "1GiB")
    for _ in range(3):
        gradients(model, IDS)
    assert planner.plan is not None
    return model, planner


def test_a_deep_copy_runs_its_own_weights_and_is_not_planned():
    model, planner = planned_and_trained()
    try:
        ema = halved(copy.deepcopy(model))
        expected = logits(halved(_unplanned_copy(model)))
        assert torch.equal(logits(ema), expected)  # not the planned model's blocks
        assert not torch.equal(logits(ema), logits(model))
        assert planner_of(ema) is None
        assert all("forward" not in vars(m) or not _installed(vars(m)["forward"]) for m in ema.modules())
        copied_steps = planner.safe_steps
        ema.train()
        loss, _ = gradients(ema, IDS)  # a training step of the copy: no step of the planner's
        assert planner.safe_steps == copied_steps and torch.isfinite(loss)
    finally:
        planner.remove()


def test_an_averaged_model_made_from_a_planned_one_averages_its_own_weights():
    """torch.optim.swa_utils.AveragedModel deep-copies the model it averages."""
    model, planner = planned_and_trained()
    try:
        averaged = torch.optim.swa_utils.AveragedModel(model)
        plain_averaged = torch.optim.swa_utils.AveragedModel(_unplanned_copy(model))
        for _ in range(2):  # the first update copies the weights, the second averages
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.1)
            averaged.update_parameters(model)
            plain_averaged.update_parameters(_unplanned_copy(model))
        assert torch.equal(logits(averaged), logits(plain_averaged))
        assert not torch.equal(logits(averaged), logits(model))
    finally:
        planner.remove()


def test_a_pickled_planned_model_loads_unplanned_with_its_weights():
    model, planner = planned_and_trained()
    try:
        saved = io.BytesIO()
        torch.save(model, saved)  # a whole-model checkpoint
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        assert torch.equal(logits(loaded), logits(model))
        assert planner_of(loaded) is None
        loss, grads = gradients(loaded.train(), IDS)
        assert torch.isfinite(loss) and all(g is not None for g in grads)
    finally:
        planner.remove()


def test_a_shallow_copy_shares_the_blocks_and_is_planned_as_the_model():
    model, planner = planned_and_trained(dropout=0.1)
    plain = _unplanned_copy(model)
    try:
        shallow = copy.copy(model)
        loss, grads = gradients(shallow, IDS)
        plain_loss, plain_grads = gradients(plain, IDS)
        assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    finally:
        planner.remove()


def test_a_data_parallel_replica_is_refused_with_what_to_do():
    model, planner = planned_and_trained()
    try:
        replica = model._replicate_for_data_parallel()  # what nn.DataParallel's replicate() makes of each module
        with pytest.raises(RuntimeError, match="DataParallel replica.*torchrun.*CUDA_VISIBLE_DEVICES"):
            replica(input_ids=IDS, labels=IDS)
        loss, _ = gradients(model, IDS)  # the model itself trains on
        assert torch.isfinite(loss)
    finally:
        planner.remove()


def _unplanned_copy(model):
    """A copy of the model's weights in a model the planner never saw."""
    fresh = tiny_bert(dropout=model.config.hidden_dropout_prob)
    fresh.load_state_dict(model.state_dict())
    return fresh.train(model.training)


def _installed(value) -> bool:
    return type(value).__name__ == "_Installed"


def test_a_loop_that_calls_forward_directly_is_told_why_nothing_is_planned(caplog):
    """model.forward(...) skips the hooks in which the planner begins a step."""
    model = tiny_bert(dropout=0.0)
    planner = BlockPlanner(model, "1GiB")
    try:
        with caplog.at_level("WARNING", logger="um_alloc.planner"):
            for _ in range(2):
                model.forward(input_ids=IDS, labels=IDS).loss.backward()
        warned = [r.getMessage() for r in caplog.records if "model.forward(...) skips" in r.getMessage()]
        assert len(warned) == 1 and "bert.encoder.layer.0" in warned[0]  # once, naming the first block
        assert planner.safe_steps == 0
        caplog.clear()
        with caplog.at_level("WARNING", logger="um_alloc.planner"):
            gradients(model, IDS)  # through its hooks: measured, and nothing more is said
        assert planner.safe_steps == 1 and not caplog.records
    finally:
        planner.remove()


def test_blocks_run_under_no_grad_before_training_say_nothing(caplog):
    model = tiny_bert(dropout=0.0)
    planner = BlockPlanner(model, "1GiB")
    try:
        with caplog.at_level("WARNING", logger="um_alloc.planner"):
            logits(model)                                # evaluation first, through the hooks
            with torch.no_grad():
                model.forward(input_ids=IDS)             # and without them, under no_grad
        assert not caplog.records
    finally:
        planner.remove()


def test_a_recomputed_blocks_own_hooks_run_once_and_those_inside_it_again_in_the_rerun():
    """As docs/planner.md says, through torch.utils.checkpoint (the first step) and as one node."""
    model = tiny_bert(dropout=0.0)
    calls = {"block": 0, "inside": 0}
    layer = model.bert.encoder.layer[0]
    layer.register_forward_hook(lambda *_: calls.__setitem__("block", calls["block"] + 1))
    layer.attention.register_forward_hook(lambda *_: calls.__setitem__("inside", calls["inside"] + 1))
    with fixed_decisions(model, Decision.RECOMPUTE):
        for _ in range(2):
            calls.update(block=0, inside=0)
            gradients(model, IDS)
            assert calls == {"block": 1, "inside": 2}


def functional_step(model):
    """The model called through torch.func.functional_call with tensors of its own in place of
    its parameters (as meta-learning and torch.func training do); the loss and their gradients."""
    params = {name: (p * 1.5).detach().requires_grad_(True) for name, p in model.named_parameters()}
    torch.manual_seed(1)
    loss = torch.func.functional_call(model, params, (), {"input_ids": IDS, "labels": IDS}).loss
    return loss.detach(), list(torch.autograd.grad(loss, list(params.values())))


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
def test_a_model_called_with_parameters_swapped_in_trains_as_plain_autograd(decision, caplog):
    """A recomputation in backward would read the module's own parameters, swapped back by then:
    such calls are kept, with a warning, and the gradients are the swapped-in tensors' own."""
    model = tiny_bert(dropout=0.1)
    plain = functional_step(copy.deepcopy(model))
    with fixed_decisions(model, decision), caplog.at_level("WARNING", logger="um_alloc.planner"):
        for _ in range(2):
            loss, grads = functional_step(model)
            assert torch.equal(loss, plain[0]) and all(torch.equal(a, b) for a, b in zip(grads, plain[1]))
    warned = [r for r in caplog.records if "in place of its parameters" in r.getMessage()]
    assert len(warned) == (1 if decision.recomputes else 0)


def test_a_model_moved_after_it_was_planned_is_refused_with_what_to_do():
    """Planned before model.cuda(): its steps would measure and plan on the device it left."""
    model = tiny_bert(dropout=0.0)
    planner = BlockPlanner(model, "1GiB")
    try:
        gradients(model, IDS)
        model.to("meta")  # another device, on a machine without a GPU
        with pytest.raises(RuntimeError, match="planned on cpu, and its blocks are now on meta.*after moving it"):
            model(input_ids=IDS.to("meta"), labels=IDS.to("meta"))
        with torch.no_grad():
            model(input_ids=IDS.to("meta"))  # evaluation is not a training step: nothing refused
    finally:
        planner.remove()


class LayerDrop(torch.nn.Module):
    """Six layers, each skipped in a step when `skip` names it (wav2vec2's and BART's LayerDrop)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Residual() for _ in range(6)])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x, skip=()):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = layer(x)
        return self.head(x)


def test_layers_skipped_at_random_each_step_train_as_plain_autograd():
    """The calibration steps skip some layers and planned steps others: a layer the measured step
    never ran still runs its decision, and every step's parameters are plain training's."""
    import random

    torch.manual_seed(0)
    model = LayerDrop().double()
    plain = copy.deepcopy(model)
    planner = BlockPlanner(model, "1GiB")
    planner._runtime.min_bytes = 1
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (model, plain)]
    draw, x = random.Random(0), torch.randn(8, 16, dtype=torch.float64)
    try:
        for step in range(8):
            if step == 3:
                planner.force(["recompute_moved"] * 3 + ["recompute"] * 3 + ["move", "move"])
            skip = {i for i in range(6) if draw.random() < 0.3}
            for m, optimizer in zip((model, plain), optimizers):
                m(x, skip).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters())), step
        assert planner.safe_steps == 2 and planner.plan.made == "forced"
    finally:
        planner.remove()
