"""What the planner's CPU tests share: a director with fixed decisions (and a runtime attached
with it), a model that changes a block's input in place after the block has run, and one whose
blocks the search cannot find."""
import contextlib

import torch

from um_alloc.planner import Decision, find_units
from um_alloc.planner.replay import Runtime, StepSpec


class Fixed:
    """A director that gives every step the same decisions and counts what ended."""

    def __init__(self, decisions):
        self.decisions, self.ended = decisions, []

    def begin(self, signature, partial=False):
        return StepSpec(self.decisions)

    def end(self, step, completed):
        self.ended.append(completed)


def decisions_for(units, decision):
    gap = decision if decision in (Decision.KEEP, Decision.MOVE) else Decision.MOVE
    return tuple(decision if u.kind == "block" else gap for u in units) + (gap,)


@contextlib.contextmanager
def fixed_decisions(model, decision):
    """The model's units run `decision` (gaps as decisions_for says) in every step, on the CPU,
    until the block ends; yields the runtime and its Fixed director."""
    units = find_units(model)
    director = Fixed(decisions_for(units, decision))
    runtime = Runtime(model, units, torch.device("cpu"), director, window=1 << 20, min_bytes=1)
    runtime.attach()
    try:
        yield runtime, director
    finally:
        runtime.detach()


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x)


class ScaledAfter(torch.nn.Module):
    """Scales each block's input in place once the block has run. Under autocast the blocks'
    linears save bf16 casts of it, not it, so plain autograd trains; a rerun would read it scaled."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        h = x * 1.0
        for block in self.blocks:
            y = block(h)
            h.mul_(2.0)
            h = (y + h).float()
        return self.head(h).sum()


class Residual(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.outer(torch.relu(self.inner(x)))


class BlocksAsAttributes(torch.nn.Module):
    """Blocks held one by one as attributes, in no ModuleList or Sequential: found where no
    container holds repeated modules."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = Residual(), Residual(), Residual()
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.third(self.second(self.first(x))))


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.value, self.gate = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        return x + self.value(x) * torch.sigmoid(self.gate(x))


class OneOfEach(torch.nn.Module):
    """Two parts of different classes and a head: no module holds two of one class, so the search
    finds no blocks (its parts are gaps), and only block_classes names them."""

    def __init__(self):
        super().__init__()
        self.encode, self.decode = Residual(), Gated()
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        return self.head(self.decode(self.encode(x)))


class NoSubmodules(torch.nn.Module):
    """A model whose forward does all its work itself: nothing to plan."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 2))

    def forward(self, x):
        return x @ self.weight
