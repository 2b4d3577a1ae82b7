"""Blocks the search finds where no ModuleList or Sequential holds repeated modules: the repeated
children of any module (a U-Net's down and up blocks, held as attributes), found only where the
containers hold none; and a model with no blocks at all, whose layers are gaps. Both trained as
plain autograd trains them."""
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
    """Two sublayers of one class held as attributes: a stage of residual units, or a layer's two
    norms."""

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


class LayersInAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Stage(), Stage()])

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


class Branches(nn.Module):
    """An Inception module's shape: a branch of one layer and a Sequential of two units."""

    def __init__(self):
        super().__init__()
        self.single = nn.Linear(16, 16)
        self.double = nn.Sequential(Residual(), Residual())

    def forward(self, x):
        return self.single(x) + self.double(x)


class BranchyNet(nn.Module):
    """GoogLeNet's shape: two stem units and eight modules with branches, all attributes."""

    def __init__(self):
        super().__init__()
        self.stem1, self.stem2 = Residual(), Residual()
        for i in range(8):
            setattr(self, f"module{i}", Branches())

    def forward(self, x):
        x = self.stem2(self.stem1(x))
        for i in range(8):
            x = getattr(self, f"module{i}")(x)
        return x


def test_eight_or_more_attributes_holding_every_container_block_are_the_blocks():
    """Not the units of each module's branch (what the search over containers finds)."""
    blocks, gaps = blocks_and_gaps(BranchyNet())
    assert blocks == ["stem1", "stem2"] + [f"module{i}" for i in range(8)] and gaps == []


class Plain(nn.Module):
    """A VGG's shape: layers in Sequentials, no two composite modules of one class."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(16 * 8 * 8, 32), nn.ReLU(), nn.Dropout(0.5),
                                        nn.Linear(32, 1))

    def forward(self, x):
        return self.classifier(self.features(x))


class Holding(nn.Module):
    """A training framework's module, the model an attribute of it."""

    def __init__(self):
        super().__init__()
        self.model = Plain()

    def forward(self, x):
        return self.model(x)


def test_a_model_without_two_parts_of_one_class_is_planned_as_gaps_layer_by_layer():
    layers = [f"features.{i}" for i in range(6)] + [f"classifier.{i}" for i in range(5)]
    assert blocks_and_gaps(Plain()) == ([], layers)
    assert blocks_and_gaps(Holding()) == ([], [f"model.{name}" for name in layers])
    assert blocks_and_gaps(OneOfEach()) == ([], ["encode.inner", "encode.outer", "decode.value", "decode.gate", "head"])
    assert blocks_and_gaps(nn.Linear(4, 4)) == ([], [])


def _trained(model, decision: Decision | None, seed: int | None = None):
    """The loss, the gradients, the BatchNorm buffers and the bytes moved to host memory after one
    step on a fixed batch (with `seed`, torch's generator seeded first: dropout's mask)."""
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))

    def step():
        if seed is not None:
            torch.manual_seed(seed)
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]

    if decision is None:
        return (*step(), 0)
    with fixed_decisions(model, decision) as (runtime, _):
        return (*step(), runtime.transfers.stats.out_bytes)


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


@pytest.mark.parametrize("decision", [Decision.KEEP, Decision.MOVE], ids=lambda d: d.value)
def test_layers_planned_as_gaps_train_as_plain_autograd_in_float64(decision):
    """Every layer kept, or every layer's saved tensors moved (a ReLU in place on a convolution's
    output, dropout's mask, BatchNorm's statistics among them)."""
    torch.manual_seed(0)
    model = Plain().double().train()
    plain = _trained(copy.deepcopy(model), None, seed=4)
    planned = _trained(model, decision, seed=4)
    assert (planned[3] > 0) == (decision is Decision.MOVE)
    assert torch.equal(planned[0], plain[0])
    assert all(torch.equal(a, b) for a, b in zip(planned[1], plain[1]))
    assert all(torch.equal(a, b) for a, b in zip(planned[2], plain[2]))


class RecurrentLM(nn.Module):
    """An embedding, a two-layer LSTM with dropout between its layers, a head: three gaps."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.rnn = nn.LSTM(16, 32, num_layers=2, batch_first=True, dropout=0.2)
        self.head = nn.Linear(32, 50)

    def forward(self, tokens):
        return self.head(self.rnn(self.embed(tokens))[0])


def test_a_recurrent_model_planned_as_gaps_trains_as_plain_autograd_in_float64():
    torch.manual_seed(0)
    model = RecurrentLM().double().train()
    tokens = torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))
    assert blocks_and_gaps(model) == ([], ["embed", "rnn", "head"])

    def step(model):
        torch.manual_seed(5)
        model.zero_grad(set_to_none=True)
        loss = model(tokens).square().mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain = step(copy.deepcopy(model))
    with fixed_decisions(model, Decision.MOVE) as (runtime, _):
        moved = step(model)
    assert runtime.transfers.stats.out_bytes > 0
    assert torch.equal(moved[0], plain[0]) and all(torch.equal(a, b) for a, b in zip(moved[1], plain[1]))
