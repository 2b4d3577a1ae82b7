"""Blocks the search finds where no ModuleList or Sequential holds repeated modules: the repeated
children of any module (a U-Net's down and up blocks, held as attributes), found only where the
containers hold none, and trained as plain autograd trains them."""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from um_alloc.planner import Decision, find_units
from planner_helpers import BlocksAsAttributes, OneOfEach, Residual, fixed_decisions


class Down(nn.Module):
    def __init__(self, into: int, out: int):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(into, out, 3, padding=1), nn.BatchNorm2d(out)

    def forward(self, x):
        return F.relu(self.norm(self.conv(x)))


class Up(nn.Module):
    """Takes the skip connection as a second argument."""

    def __init__(self, into: int, out: int):
        super().__init__()
        self.conv = nn.Conv2d(into, out, 3, padding=1)

    def forward(self, x, skip):
        return F.relu(self.conv(torch.cat([F.interpolate(x, scale_factor=2.0), skip], dim=1)))


class UNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.down1, self.down2, self.down3 = Down(3, 8), Down(8, 16), Down(16, 32)
        self.up2, self.up1 = Up(32 + 16, 16), Up(16 + 8, 8)
        self.out = nn.Conv2d(8, 1, 1)

    def forward(self, x):
        a = self.down1(x)
        b = self.down2(F.max_pool2d(a, 2))
        c = self.down3(F.max_pool2d(b, 2))
        return self.out(self.up1(self.up2(c, b), a))


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Residual(), Residual()

    def forward(self, x):
        return self.second(self.first(x))


class Stages(nn.Module):
    """Four stages as attributes, two residual units in each: too few stages to plan, so the
    search goes one level in."""

    def __init__(self):
        super().__init__()
        self.s1, self.s2, self.s3, self.s4 = Stage(), Stage(), Stage(), Stage()

    def forward(self, x):
        return self.s4(self.s3(self.s2(self.s1(x))))


class TwoNorms(nn.Module):
    """A layer with two sublayers of one class held as attributes."""

    def __init__(self):
        super().__init__()
        self.before, self.after = Residual(), Residual()

    def forward(self, x):
        return self.after(self.before(x))


class LayersInAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([TwoNorms(), TwoNorms()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def blocks_and_gaps(model) -> tuple[list[str], list[str]]:
    units = find_units(model)
    return [u.name for u in units if u.kind == "block"], [u.name for u in units if u.kind == "gap"]


def test_blocks_held_as_attributes_are_found():
    assert blocks_and_gaps(BlocksAsAttributes()) == (["first", "second", "third"], ["head"])
    assert blocks_and_gaps(UNet()) == (["down1", "down2", "down3", "up2", "up1"], ["out"])


def test_where_few_blocks_hold_repeated_modules_the_search_goes_one_level_in():
    blocks, gaps = blocks_and_gaps(Stages())
    assert blocks == [f"s{i}.{part}" for i in range(1, 5) for part in ("first", "second")] and gaps == []


def test_a_container_of_repeated_blocks_comes_before_sublayers_held_as_attributes():
    assert blocks_and_gaps(LayersInAList()) == (["layers.0", "layers.1"], [])


def test_a_model_without_two_parts_of_one_class_has_no_blocks():
    assert find_units(OneOfEach()) == []
    assert find_units(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))) == []


def _trained(model, decision: Decision | None):
    """The loss, the gradients and the BatchNorm buffers after one step on a fixed batch."""
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]

    if decision is None:
        return step()
    with fixed_decisions(model, decision):
        return step()


@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
def test_a_unet_of_blocks_held_as_attributes_trains_as_plain_autograd_in_float64(decision):
    """Every decision on blocks found as attributes, one of them called with a skip connection
    beside its input, and BatchNorm's running statistics counted once."""
    torch.manual_seed(0)
    model = UNet().double().train()
    plain = _trained(copy.deepcopy(model), None)
    planned = _trained(model, decision)
    assert torch.equal(planned[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(planned[1], plain[1]))
    assert all(torch.equal(a, b) for a, b in zip(planned[2], plain[2]))
