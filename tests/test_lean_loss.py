"""The chunked cross-entropy: PyTorch's result bit for bit where it applies, PyTorch's own call
everywhere else, and inside a planned model's forward without changes to the model."""
import pytest
import torch
import torch.nn.functional as F

from test_planner_replay import Fixed, decisions_for, gradients, tiny_bert
from um_alloc.planner import Decision, find_units
from um_alloc.planner.lean_loss import LeanLoss, applies, chunked_cross_entropy
from um_alloc.planner.replay import Runtime


def logits_and_target(dtype, rows=300, classes=211):
    torch.manual_seed(0)
    logits = (3 * torch.randn(rows, classes, dtype=dtype)).requires_grad_()
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_and_gradient_equal_pytorchs_bit_for_bit(dtype, reduction):
    logits, target = logits_and_target(dtype)
    plain = F.cross_entropy(logits, target, reduction=reduction)
    plain_grad, = torch.autograd.grad(plain, logits)
    chunk = 40 * logits.size(1) * logits.element_size()  # 40 rows a chunk, the last one short
    chunked = chunked_cross_entropy(logits, target, reduction=reduction, chunk_bytes=chunk)
    chunked_grad, = torch.autograd.grad(chunked, logits)
    assert torch.equal(plain, chunked)
    assert torch.equal(plain_grad, chunked_grad)


def test_every_row_ignored_gives_pytorchs_nan_and_zero_gradient():
    logits, target = logits_and_target(torch.float64, rows=10)
    target[:] = -100
    chunked = chunked_cross_entropy(logits, target)
    assert torch.isnan(chunked) and torch.isnan(F.cross_entropy(logits, target))
    assert torch.equal(torch.autograd.grad(chunked, logits)[0], torch.zeros_like(logits))


@pytest.mark.parametrize("extra", [{"weight": torch.ones(211)}, {"label_smoothing": 0.1}, {"reduction": "none"}],
                         ids=["weight", "label_smoothing", "reduction_none"])
def test_calls_it_does_not_compute_stay_pytorchs(extra):
    logits, target = logits_and_target(torch.float32)
    assert not applies(logits, target, min_bytes=0, **extra)
    with LeanLoss(min_bytes=0) as mode:
        F.cross_entropy(logits, target, **extra)
    assert mode.calls == 0


def test_small_logits_probabilities_and_no_grad_stay_pytorchs():
    logits, target = logits_and_target(torch.float32)
    assert not applies(logits, target)  # under min_bytes (512 MiB)
    assert not applies(logits, torch.softmax(logits.detach(), 1), min_bytes=0)
    assert not applies(logits.detach(), target, min_bytes=0)
    assert applies(logits, target, None, None, -100, None, "sum", min_bytes=0)  # positional, as PyTorch's signature


def test_mode_routes_positional_and_keyword_arguments():
    logits, target = logits_and_target(torch.float32)
    with LeanLoss(min_bytes=0) as mode:
        a = F.cross_entropy(logits, target, None, None, -100, None, "sum")
        b = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    assert mode.calls == 2 and torch.equal(a, b) and torch.equal(a, F.cross_entropy(logits, target, reduction="sum"))


def test_a_planned_models_loss_is_chunked_with_plain_gradients():
    model = tiny_bert()
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    plain_loss, plain = gradients(model, ids)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)),
                      window=1 << 20, min_bytes=1)
    runtime.lean_loss.min_bytes = 0
    runtime.attach()
    loss, planned = gradients(model, ids)
    runtime.detach()
    assert runtime.lean_loss.calls == 1
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(planned, plain))
    assert torch._C._len_torch_function_stack() == 0  # the mode left with the forward
