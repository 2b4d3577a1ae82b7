"""bench/bench_resnet.py on the CPU: a step that runs out of memory runs again without the failed
attempt's activations still in memory; the checkpointing peer's blocks and which batches each
method tries."""
import sys
import weakref
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_resnet  # noqa: E402


class Token:
    """Lives as long as the autograd graph whose node holds it; `fails`: its backward runs out of memory."""

    def __init__(self, fails: bool):
        self.fails = fails


class SavesAToken(torch.autograd.Function):
    """The identity; its node holds a token."""

    @staticmethod
    def forward(ctx, x, token):
        ctx.token = token
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if ctx.token.fails:
            raise torch.OutOfMemoryError("out of memory while the graph still holds activations")
        return grad, None


class Model(torch.nn.Module):
    """A linear layer whose forward notes whether the previous forward's graph is still alive; the
    first backward runs out of memory."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 10)
        self.previous = None
        self.alive_at_start = []

    def forward(self, x):
        self.alive_at_start.append(self.previous is not None and self.previous() is not None)
        token = Token(fails=not self.alive_at_start[:-1])
        self.previous = weakref.ref(token)
        return SavesAToken.apply(self.linear(x), token)


def test_a_retried_step_starts_without_the_failed_attempts_activations():
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = torch.randn(4, 8), torch.randint(0, 10, (4,))
    loss = bench_resnet._step(model, optimizer, images, labels, retry=True)
    assert loss > 0
    assert model.alive_at_start == [False, False]  # the failed attempt's graph went before the retry


class Stage(torch.nn.Sequential):
    pass


class ResNetLike(torch.nn.Module):
    """torchvision's layout (a stem, four stages of blocks, a head) at a size the CPU runs at once."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)

        def block():
            return torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())

        self.layer1, self.layer2, self.layer3, self.layer4 = (Stage(block(), block()) for _ in range(4))
        self.head = torch.nn.Linear(4, 10)

    def forward(self, x):
        x = self.layer4(self.layer3(self.layer2(self.layer1(self.stem(x)))))
        return self.head(x.mean((2, 3)))


def test_the_checkpointing_peer_wraps_every_block_and_trains_as_the_plain_model():
    images, labels = torch.randn(2, 3, 8, 8, dtype=torch.float64), torch.tensor([1, 7])
    grads = []
    for checkpointed in (False, True):
        model = ResNetLike().double()
        if checkpointed:
            assert bench_resnet.checkpoint_every_block(model) == 8
            assert all(type(b).__name__ == "Checkpointed" for b in model.layer3)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_checkpointing_stops_at_its_first_failure_and_the_planner_tries_every_batch():
    trained = {"planner": {176, 352, 704}, "checkpoint": {176, 352, 704}}

    def probe(method, batch, args):
        return {"method": method, "batch": batch, "samples_per_s": 1.0} if batch in trained[method] else None

    batches = [176, 352, 528, 704]
    planner = bench_resnet.runs("planner", batches, 8 << 30, "r", None, probe=probe)
    assert [r.get("status") for r in planner] == [None, None, "failed", None]
    checkpoint = bench_resnet.runs("checkpoint", batches, 8 << 30, "r", None, probe=probe)
    assert [r.get("status") for r in checkpoint] == [None, None, "failed", "skipped: batch 528 failed"]
    assert all(r["run_id"] == "r" for r in planner + checkpoint)
