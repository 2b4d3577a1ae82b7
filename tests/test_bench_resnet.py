"""bench/bench_resnet.py on the CPU: a step that runs out of memory runs again without the failed
attempt's activations still in memory."""
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
