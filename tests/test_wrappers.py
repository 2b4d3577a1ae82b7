"""Every helper that takes a model or an optimizer takes the wrappers people train with. The
optimizer wrappers are stand-ins built as accelerate's and Lightning's are (neither is a dependency);
DataParallel and torch.compile's OptimizedModule are PyTorch's own."""
import pytest
import torch

import um_alloc.tags as tags_module
from um_alloc.planner import BlockPlanner, planner_of
from um_alloc.tags import tag_training
from um_alloc.wrappers import unwrap_model, unwrap_optimizer


class AcceleratedOptimizer(torch.optim.Optimizer):
    """As accelerate's: an Optimizer subclass that never calls Optimizer.__init__, so it has no
    _optimizer_step_pre_hooks; its step() calls the inner optimizer's."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)


class LightningOptimizer:
    """As Lightning's: not an Optimizer; the optimizer is `_optimizer`, exposed as `.optimizer`."""

    def __init__(self, optimizer):
        self._optimizer = optimizer

    @property
    def optimizer(self):
        return self._optimizer

    def step(self, closure=None):
        return self._optimizer.step(closure)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.linear(x))


def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block(), Block())


def test_optimizer_wrappers_unwrap_to_the_optimizer_inside_however_deep():
    inner = torch.optim.SGD(net().parameters(), lr=0.1)
    assert unwrap_optimizer(inner) is inner
    assert unwrap_optimizer(AcceleratedOptimizer(inner)) is inner
    assert unwrap_optimizer(LightningOptimizer(AcceleratedOptimizer(inner))) is inner
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer or a wrapper .* got str"):
        unwrap_optimizer("adamw")
    with pytest.raises(TypeError, match="got LightningOptimizer holding int"):
        unwrap_optimizer(LightningOptimizer(3))


def test_model_wrappers_unwrap_to_the_module_that_does_the_work():
    model = net()
    assert unwrap_model(model) is model
    assert unwrap_model(torch.nn.DataParallel(model)) is model
    assert unwrap_model(torch.compile(model)) is model                     # OptimizedModule._orig_mod
    assert unwrap_model(torch.compile(torch.nn.DataParallel(model))) is model


def test_a_model_with_a_child_named_module_beside_other_layers_is_not_a_wrapper():
    class Mine(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.module, self.head = net(), torch.nn.Linear(4, 2)

    mine = Mine()
    assert unwrap_model(mine) is mine
    with pytest.raises(TypeError, match="expected an nn.Module .* got AcceleratedOptimizer"):
        unwrap_model(AcceleratedOptimizer(None))


@pytest.mark.parametrize("wrap", [AcceleratedOptimizer, LightningOptimizer, lambda o: LightningOptimizer(AcceleratedOptimizer(o))],
                         ids=["accelerate", "lightning", "both"])
def test_tag_training_takes_wrapped_optimizers_and_models_and_tags_every_step(monkeypatch, wrap):
    """AcceleratedOptimizer has no _optimizer_step_pre_hooks: tag_training must hook the inner one."""
    seen = []
    monkeypatch.setattr(tags_module, "retag", lambda obj, name: seen.append(name) or 0)
    monkeypatch.setattr(tags_module, "tag", lambda name: _Scope(seen, name))
    model = net()
    inner = torch.optim.AdamW(model.parameters())
    handle = tag_training(torch.compile(model), wrap(inner))
    assert seen == ["parameter", "gradient"]                                # tag_module now
    model(torch.ones(2, 4)).sum().backward()
    wrap(inner).step()                                                      # the wrapper's step
    assert seen[2:] == ["gradient", "scope optimizer_state", "optimizer_state"]
    handle.remove()


class _Scope:
    def __init__(self, seen, name):
        self.seen, self.name = seen, name

    def __enter__(self):
        self.seen.append(f"scope {self.name}")

    def __exit__(self, *exc):
        return False


def test_the_planner_attaches_to_the_module_inside_a_wrapper():
    model = net()
    wrapped = torch.nn.DataParallel(model)  # on the CPU it calls the module itself
    planner = BlockPlanner(wrapped, "1GiB")
    assert planner_of(wrapped) is planner and planner_of(model) is planner
    assert [u.name for u in planner.units if u.kind == "block"] == ["0", "1", "2"]  # not "module.0"
    for step in range(3):
        wrapped(torch.ones(2, 4)).sum().backward()
    assert planner.plan is not None          # the inner module's hooks saw every step
    planner.remove()
    assert planner_of(model) is None
