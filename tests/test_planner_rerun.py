"""A unit recomputed as one node of the graph (planner/rerun.py), on the CPU: it is used only once
checkpoint's recomputation has shown that the unit reaches nothing but its arguments and its own
parameters; what it computes is plain autograd's, also for gradients taken with .grad(), through
a second derivative, twice over a retained graph, with dropout and with BatchNorm."""
import copy
import weakref
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from um_alloc.planner import Decision, find_units
from um_alloc.planner import rerun
from um_alloc.planner.replay import Runtime
from um_alloc.planner.rerun import foreign_edges, graph_clock
from planner_helpers import Fixed, decisions_for


class Block(nn.Module):
    def __init__(self, width: int = 8, dropout: float = 0.0):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, scale=None):
        y = self.dropout(torch.tanh(self.linear(self.norm(x))))
        return x + y if scale is None else x + y * scale


class Stack(nn.Module):
    def __init__(self, block=Block, n: int = 3, **kwargs):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([block(**kwargs) for _ in range(n)])
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h).pow(2).mean()


def batch():
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def attached(model: nn.Module, decision=Decision.RECOMPUTE) -> Runtime:
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1)
    runtime.attach()
    return runtime


def gradients(model: nn.Module, x: torch.Tensor, steps: int = 1):
    for _ in range(steps):
        torch.manual_seed(3)
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def equal(a, b) -> bool:
    return torch.equal(a[0], b[0]) and len(a[1]) == len(b[1]) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a[1], b[1]))


def block_reruns(runtime: Runtime) -> list:
    """Per block, whether it reruns as one node, as the steps so far have shown."""
    return [runtime._shown.get(j, ok) for j, (ok, u) in enumerate(zip(runtime._reruns, runtime.units))
            if u.kind == "block"]


@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED], ids=lambda d: d.value)
def test_the_second_step_reruns_each_block_as_one_node_and_trains_as_plain_autograd(decision):
    model = Stack(dropout=0.3).double()
    plain = gradients(copy.deepcopy(model), batch())
    runtime = attached(model, decision)
    try:
        assert block_reruns(runtime) == [None] * 3  # nothing seen yet
        assert equal(gradients(model, batch()), plain)
        assert block_reruns(runtime) == [True] * 3
        assert equal(gradients(model, batch()), plain)  # the dropout masks drawn again alike
    finally:
        runtime.detach()


def test_gradients_taken_with_grad_and_a_second_derivative_are_plain_autograds():
    """A gradient penalty: .grad() with create_graph, then backward through it."""
    def penalized(model, x):
        torch.manual_seed(3)
        model.zero_grad(set_to_none=True)
        params = list(model.parameters())
        first = torch.autograd.grad(model(x), params, create_graph=True)
        sum(g.pow(2).sum() for g in first).backward()
        return [g.detach() for g in first], [p.grad for p in params]

    model = Stack().double()
    plain = penalized(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        penalized(model, batch())
        assert block_reruns(runtime) == [True] * 3
        planned = penalized(model, batch())
    finally:
        runtime.detach()
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-14)
               for a, b in zip(planned[0] + planned[1], plain[0] + plain[1]))


def test_backward_over_a_retained_graph_twice_accumulates_as_plain_autograd():
    def twice(model, x):
        model.zero_grad(set_to_none=True)
        loss = model(x)
        loss.backward(retain_graph=True)
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    model = Stack().double()
    plain = twice(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        twice(model, batch())
        assert equal(twice(model, batch()), plain)
    finally:
        runtime.detach()


@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED], ids=lambda d: d.value)
def test_a_nodes_inputs_go_once_backward_has_run_it(decision, monkeypatch):
    """As autograd does with what checkpoint saves: a backward that does not retain the graph lets
    each node's call go once it has run the node, with the inputs (or the host copies) the rerun
    read, though the graph (the loss, still held) lives on. Held until the graph went, every
    recomputed block's input would add to backward's peak."""
    model = Stack().double()
    runtime = attached(model, decision)
    calls, inputs = [], []
    made = rerun.RerunCall.__init__

    def noted(call, *args, **kwargs):
        calls.append(weakref.ref(call))
        made(call, *args, **kwargs)

    monkeypatch.setattr(rerun.RerunCall, "__init__", noted)
    hooks = [block.register_forward_pre_hook(lambda module, args: inputs.append(weakref.ref(args[0])))
             for block in model.blocks]
    try:
        gradients(model, batch())
        assert block_reruns(runtime) == [True] * 3 and calls == []
        inputs.clear()
        loss = model(batch())
        assert [call() is not None for call in calls] == [True] * 3
        if decision is Decision.RECOMPUTE:
            assert [ref() is not None for ref in inputs] == [True] * 3
        loss.backward()
        assert [call() is None for call in calls] == [True] * 3
        assert [ref() is None for ref in inputs] == [True] * 3
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
        runtime.detach()


class LiveBytes(TorchDispatchMode):
    """While entered, the most bytes of storage that the tensors ops made held at once."""

    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.refs = [ref for ref in self.refs if ref() is not None]
        storages = {ref().untyped_storage().data_ptr(): ref().untyped_storage().nbytes() for ref in self.refs}
        self.peak = max(self.peak, sum(storages.values()))
        return out


def test_a_step_as_one_node_peaks_no_higher_than_through_checkpoint():
    """Calibration measures recomputation through torch.utils.checkpoint and the plan counts on
    its peak: as one node, the step must hold no more at any moment."""
    peaks = {}
    for one_node in (False, True):
        model = Stack(n=4).double()
        units = find_units(model)
        runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)),
                          1 << 20, min_bytes=1, one_node_recompute=one_node)
        runtime.attach()
        x = torch.randn(4096, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        try:
            gradients(model, x)
            assert block_reruns(runtime) == [True if one_node else False] * 4
            live = LiveBytes()
            with live:
                gradients(model, x)
        finally:
            runtime.detach()
        peaks[one_node] = live.peak
    assert peaks[True] <= peaks[False]


def test_the_installed_policy_can_leave_the_models_loss_to_pytorch(monkeypatch):
    """scheduler.lean_loss: false turns the chunked cross-entropy off with no code changed; an
    argument overrides the policy."""
    from types import SimpleNamespace
    from um_alloc.planner import BlockPlanner, director
    from um_alloc.policy import policy_from_dict

    policy = policy_from_dict({"scheduler": {"strategy": "auto", "lean_loss": False}}, source="p.yaml", name="p")
    monkeypatch.setattr(director, "is_installed", lambda: True)
    monkeypatch.setattr(director, "installation", lambda: SimpleNamespace(policy=policy, budget=1 << 30))
    for options, chunked in (({}, False), ({"lean_loss": True}, True)):
        planner = BlockPlanner(Stack().double(), **options)
        try:
            assert (planner._runtime.lean_loss is not None) is chunked
        finally:
            planner.remove()


def test_the_installed_policy_can_keep_checkpoint_throughout(monkeypatch):
    """Given no argument, the planner does as the installed policy's scheduler.one_node_recompute
    says: under the launcher or a callback, `false` keeps torch.utils.checkpoint with no code
    changed. An argument overrides the policy."""
    from types import SimpleNamespace
    from um_alloc.planner import BlockPlanner, director
    from um_alloc.policy import policy_from_dict

    policy = policy_from_dict({"scheduler": {"strategy": "auto", "one_node_recompute": False}},
                              source="p.yaml", name="p")
    monkeypatch.setattr(director, "is_installed", lambda: True)
    monkeypatch.setattr(director, "installation", lambda: SimpleNamespace(policy=policy, budget=1 << 30))
    for argument, reruns in ((None, [False] * 3), (True, [None] * 3)):  # None: not yet shown either way
        options = {} if argument is None else {"one_node_recompute": argument}
        planner = BlockPlanner(Stack().double(), **options)
        try:
            assert block_reruns(planner._runtime) == reruns
        finally:
            planner.remove()


class NormBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return x + torch.relu(self.norm(self.linear(x)))


def test_batchnorm_counts_each_batch_once_when_rerun_as_one_node():
    model = Stack(block=NormBlock).double()
    reference = copy.deepcopy(model)
    plain = [gradients(reference, batch()) for _ in range(3)][-1]
    runtime = attached(model)
    try:
        planned = [gradients(model, batch()) for _ in range(3)][-1]
        assert block_reruns(runtime) == [True] * 3
    finally:
        runtime.detach()
    assert equal(planned, plain)
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), reference.buffers()))  # running statistics


class Borrows(nn.Module):
    """Reads a parameter of a module that is not its own: its gradient would stop at a rerun as
    one node."""

    def __init__(self, lender: nn.Linear):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.lender = [lender]  # in a plain list: not one of this module's own

    def forward(self, x):
        return x + torch.tanh(self.linear(x) + self.lender[0].weight.sum())


class Stashed(nn.Module):
    """Reads a tensor the model left on it before the call, which requires a gradient."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.bias = None

    def forward(self, x):
        return x + torch.tanh(self.linear(x) + self.bias)


class Lends(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.embed, self.shared, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList([Borrows(self.shared) if kind == "parameter" else Stashed() for _ in range(3)])

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if self.kind == "tensor":
                block.bias = self.shared.weight.sum() * h.mean()
            h = block(h)
        return self.head(h).pow(2).mean()


@pytest.mark.parametrize("kind", ["parameter", "tensor"])
def test_a_block_that_reaches_beyond_its_arguments_stays_with_checkpoint(kind, caplog):
    model = Lends(kind).double()
    plain = gradients(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        with caplog.at_level("INFO", logger="um_alloc.planner"):
            assert equal(gradients(model, batch()), plain)
        assert block_reruns(runtime) == [False] * 3
        assert "stays recomputed through torch.utils.checkpoint" in caplog.text
        assert equal(gradients(model, batch()), plain)
    finally:
        runtime.detach()


@dataclass
class Carried:
    hidden: torch.Tensor


class CarriesOut(nn.Module):
    """Returns its tensor inside an object torch.utils._pytree does not open."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x = x.hidden if isinstance(x, Carried) else x
        return {"out": Carried(x + torch.tanh(self.linear(x)))}


class Unwraps(Stack):
    def __init__(self):
        super().__init__(block=CarriesOut)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)["out"].hidden
        return self.head(h).pow(2).mean()


def test_a_block_whose_output_hides_tensors_in_an_object_stays_with_checkpoint():
    model = Unwraps().double()
    plain = gradients(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        assert equal(gradients(model, batch(), steps=2), plain)
        assert block_reruns(runtime) == [False] * 3
    finally:
        runtime.detach()


def test_frozen_blocks_rerun_as_one_node_without_gradients_for_their_parameters():
    model = Stack().double()
    for p in model.blocks.parameters():
        p.requires_grad_(False)
    plain = gradients(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        assert equal(gradients(model, batch(), steps=2), plain)
        assert block_reruns(runtime) == [True] * 3
    finally:
        runtime.detach()
    assert all(p.grad is None for p in model.blocks.parameters())


def test_foreign_edges_names_what_a_computation_reaches_beyond_its_inputs():
    x = torch.randn(3, requires_grad=True)
    own = torch.randn(3, requires_grad=True)
    other = torch.randn(3, requires_grad=True)
    made_before = other * 2
    since = graph_clock()
    out = (x * own).sum() + (x * made_before).sum() + (x * other).sum()
    until = graph_clock()
    found = foreign_edges([out], [x], [own], since, until)
    assert sorted(found) == ["a parameter or leaf of shape (3,)", "the output of MulBackward0 made before the call"]
    since = graph_clock()
    clean = (x * own).sum()
    assert foreign_edges([clean], [x], [own], since, graph_clock()) == []


class Aside(nn.Module):
    """Keeps a tensor it made on an attribute, which the loss reads (a mixture-of-experts'
    balancing loss on its router's output, say)."""

    def __init__(self):
        super().__init__()
        self.linear, self.router = nn.Linear(8, 8), nn.Linear(8, 2)
        self.aside = None

    def forward(self, x):
        self.aside = torch.softmax(self.router(x), dim=-1).pow(2).mean()
        return x + torch.tanh(self.linear(x))


class Balanced(Stack):
    def __init__(self):
        super().__init__(block=Aside)

    def forward(self, x):
        return super().forward(x) + sum(block.aside for block in self.blocks)


def test_a_block_that_keeps_a_tensor_aside_stays_with_checkpoint(caplog):
    model = Balanced().double()
    plain = gradients(copy.deepcopy(model), batch())
    runtime = attached(model)
    try:
        with caplog.at_level("INFO", logger="um_alloc.planner"):
            assert equal(gradients(model, batch(), steps=2), plain)
        assert block_reruns(runtime) == [False] * 3
        assert "kept beyond its outputs" in caplog.text
    finally:
        runtime.detach()


class Later(nn.Module):
    """From the model's second step on, reads what it did not in its first: a parameter of another
    module, or a tensor left on it that requires a gradient."""

    def __init__(self, lender: nn.Linear):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.lender, self.later, self.bias = [lender], False, None

    def forward(self, x):
        y = self.linear(x)
        if self.later:
            y = y + (self.lender[0].weight.sum() if self.bias is None else self.bias)
        return x + torch.tanh(y)


class LaterStack(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        self.kind, self.steps = kind, 0
        self.embed, self.shared, self.head = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 1)
        self.blocks = nn.ModuleList([Later(self.shared) for _ in range(3)])

    def forward(self, x):
        self.steps += 1
        h = self.embed(x)
        for block in self.blocks:
            block.later = self.steps > 1
            block.bias = self.shared.weight.sum() * h.mean() if self.kind == "tensor" and block.later else None
            h = block(h)
        return self.head(h).pow(2).mean()


def test_a_parameter_read_only_after_the_first_step_joins_the_node_and_gets_its_gradient():
    model = LaterStack("parameter").double()
    reference = copy.deepcopy(model)
    runtime = attached(model)
    try:
        for _ in range(2):
            planned, plain = gradients(model, batch()), gradients(reference, batch())
            assert equal(planned, plain)
        assert block_reruns(runtime) == [True] * 3  # the first step read nothing beyond the arguments
        assert model.shared.weight.grad is not None
    finally:
        runtime.detach()


def test_a_tensor_read_only_after_the_first_step_stops_the_step_with_what_to_do():
    model = LaterStack("tensor").double()
    runtime = attached(model)
    try:
        gradients(model, batch())
        with pytest.raises(RuntimeError, match="one_node_recompute=False"):
            gradients(model, batch())
    finally:
        runtime.detach()


def test_what_a_rerun_leaves_live_beside_what_it_saves_is_its_unsaved_outputs():
    """Calibration counts a recomputation's saved bytes from the live bytes it adds; a rerun as one
    node holds its outputs until their gradients are taken, and says which of them backward does
    not keep (a sigmoid's output is kept: its backward reads it)."""
    from um_alloc.planner.rerun import _SavedStorages

    x = torch.randn(256, requires_grad=True)
    saved = _SavedStorages()
    with saved:
        hidden = torch.tanh(x * 2)     # saves x's product's output (tanh keeps its result)
        kept = torch.sigmoid(hidden)   # keeps its result
        unkept = hidden + 1            # an add keeps nothing
    assert saved.bytes_beside([kept, unkept], [x]) == unkept.untyped_storage().nbytes()
    assert saved.bytes_beside([x.view(16, 16)], [x]) == 0  # a view of an input adds nothing


def test_a_recorded_recomputation_counts_its_saves_not_its_outputs():
    from um_alloc.planner.record import StepRecorder

    class Probe:
        def __init__(self, lives):
            self.lives = iter(lives)

        def begin_step(self):
            pass

        def look(self):
            live = next(self.lives)
            return live, live

    recorder = StepRecorder(torch.device("cpu"), Probe([0, 100, 700]), n_units=1)  # a look as it begins
    start, end = recorder.mark("recompute in", 0), recorder.mark("recompute out", 0)
    recorder.pair("recompute", 0, start, end, not_saved=64)
    assert recorder.units[0].rebuilt_bytes == 700 - 100 - 64


def test_gradient_hooks_on_parameters_run_once_a_step():
    """A hook that scales a parameter's gradient (clipping, say) changes it once, as in plain autograd."""
    def hooked(model):
        calls = []
        for p in model.blocks.parameters():
            p.register_hook(lambda g, calls=calls: (calls.append(1), g * 2)[1])
        return calls

    model = Stack().double()
    reference = copy.deepcopy(model)
    plain_calls, plain = hooked(reference), gradients(reference, batch())
    calls = hooked(model)
    runtime = attached(model)
    try:
        assert equal(gradients(model, batch()), plain) and block_reruns(runtime) == [True] * 3
        before = len(calls)
        assert equal(gradients(model, batch()), plain)
    finally:
        runtime.detach()
    assert len(calls) - before == len(plain_calls) == 12  # four parameters in each of three blocks


class Tapped(Stack):
    """Each block's input also read by the head once every block has run, as a detection model's
    feature pyramid reads a backbone layer's output beside the next layer: its gradient has three
    shares, two from inside the block (the residual and the norm) and, first in backward, one
    from outside. As one node the block's two are summed before they meet it (here that differs
    from plain autograd's order by about 2e-16 of the largest gradient)."""

    def forward(self, x):
        h, taps = self.embed(x), []
        for block in self.blocks:
            taps.append(h)
            h = block(h)
        return (self.head(h) + sum(self.head(t) for t in taps)).pow(2).mean()


@pytest.mark.parametrize("one_node", [True, False], ids=["one_node", "checkpoint_only"])
def test_a_block_input_read_outside_it_too_trains_as_plain_autograd_up_to_the_order_of_its_shares(one_node):
    """As one node, the block's two shares are summed before they meet the third, which plain
    autograd adds first: equal up to float64's rounding. Through checkpoint only, the graph is
    plain autograd's and so is every bit."""
    model = Tapped().double()
    plain = gradients(copy.deepcopy(model), batch())
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)), 1 << 20,
                      min_bytes=1, one_node_recompute=one_node)
    runtime.attach()
    try:
        assert equal(gradients(model, batch()), plain)  # the first step runs through checkpoint
        second = gradients(model, batch())
        assert block_reruns(runtime) == [one_node] * 3
        if one_node:
            assert torch.allclose(second[0], plain[0], rtol=1e-12, atol=0)
            assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(second[1], plain[1]))
        else:
            assert equal(second, plain)
    finally:
        runtime.detach()
