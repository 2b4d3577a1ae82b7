"""Logits made again in backward from a linear head's input (recompute_logits): PyTorch's loss
bit for bit, its gradients to rounding, the head's own backward skipped, and PyTorch's own path
wherever the logits are not a linear's unchanged output."""
import functools

import pytest
import torch
import torch.nn.functional as F

from test_lean_loss import tiny_gpt2
from test_planner_replay import Fixed, decisions_for, gradients, tiny_bert
from um_alloc.planner import BlockPlanner, Decision, find_units
from um_alloc.planner.lean_loss import LeanLoss, Projection, projected_cross_entropy
from um_alloc.planner.replay import Runtime
from um_alloc.errors import PolicyError
from um_alloc.policy import policy_from_dict

CLASSES = 211


def head_and_target(dtype=torch.float64, bias=True):
    torch.manual_seed(0)
    hidden = torch.randn(6, 50, 16, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(16, CLASSES, bias=bias).to(dtype)
    target = torch.randint(0, CLASSES, (300,))
    target[::7] = -100
    return hidden, head, target


def loss_and_gradients(hidden, head, target, mode=None, reduction="mean", wide=None, extra=None, change=None):
    """cross_entropy(head(hidden) [upcast to `wide`], flattened), plainly or under `mode`; `extra`
    adds a term of the logits to the loss, `change` changes them in place first."""
    if mode is not None:
        mode.__enter__()
    logits = head(hidden)
    if change is not None:
        change(logits)
    flat = (logits if wide is None else logits.to(wide)).view(-1, CLASSES)
    loss = F.cross_entropy(flat, target, reduction=reduction)
    if mode is not None:
        mode.__exit__(None, None, None)
    if extra is not None:
        loss = loss + extra(logits)
    leaves = [hidden] + [p for p in head.parameters()]
    return loss, torch.autograd.grad(loss, leaves)


def attached(model, decision):
    """A Runtime on `model` running `decision` for every block, the head's logits made again and
    the loss chunked however small, attached."""
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)),
                      window=1 << 20, min_bytes=1, recompute_logits=True)
    runtime.lean_loss.min_bytes = 0
    runtime.attach()
    return runtime


def close(a, b, tolerance):
    return all(torch.allclose(x, y, rtol=tolerance, atol=tolerance) for x, y in zip(a, b))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_loss_is_pytorchs_bit_for_bit_and_gradients_are_within_rounding(reduction, bias):
    hidden, head, target = head_and_target(bias=bias)
    plain, plain_grads = loss_and_gradients(hidden, head, target, reduction=reduction)
    logits = head(hidden).view(-1, CLASSES)
    flat = hidden.reshape(-1, 16)
    projection = Projection(flat, head.weight, head.bias, ("cpu", False, torch.bfloat16))
    chunk = 40 * CLASSES * 8  # 40 rows a chunk, the last one short
    loss = projected_cross_entropy(logits, target, projection, reduction=reduction, chunk_bytes=chunk)
    grads = torch.autograd.grad(loss, [hidden, *head.parameters()])
    assert torch.equal(loss, plain)
    assert close(grads, plain_grads, 1e-12)


def test_the_mode_takes_a_heads_logits_from_its_input_and_skips_the_logits_gradient():
    hidden, head, target = head_and_target()
    plain, plain_grads = loss_and_gradients(hidden, head, target)
    mode = LeanLoss(min_bytes=0, recompute_logits=True)
    made = []
    head.register_full_backward_hook(lambda *_: made.append("head's backward"))
    loss, grads = loss_and_gradients(hidden, head, target, mode)
    assert mode.calls == 1 and mode.projected_calls == 1
    assert made == []  # the loss gave the head its gradients; its own backward never ran
    assert torch.equal(loss, plain) and close(grads, plain_grads, 1e-12)


def test_upcast_logits_of_a_head_are_made_again_narrow_and_upcast_in_chunks():
    """transformers' loss upcasts the head's logits first: the chunks take the narrow ones."""
    hidden, head, target = head_and_target(torch.float32)
    plain, plain_grads = loss_and_gradients(hidden, head, target, wide=torch.float64)
    mode = LeanLoss(min_bytes=0, recompute_logits=True)
    loss, grads = loss_and_gradients(hidden, head, target, mode, wide=torch.float64)
    assert mode.upcast_calls == 1 and mode.projected_calls == 1
    assert loss.dtype == torch.float64 and torch.equal(loss, plain)
    assert all(g.dtype == torch.float32 for g in grads) and close(grads, plain_grads, 1e-5)


def test_off_by_default_the_logits_gradient_is_pytorchs_bit_for_bit():
    hidden, head, target = head_and_target()
    plain, plain_grads = loss_and_gradients(hidden, head, target)
    mode = LeanLoss(min_bytes=0)
    loss, grads = loss_and_gradients(hidden, head, target, mode)
    assert mode.calls == 1 and mode.projected_calls == 0
    assert torch.equal(loss, plain) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_logits_changed_in_place_after_the_head_are_not_made_again():
    """Made again from the head's input, they would lose the change: the plain chunks take them."""
    hidden, head, target = head_and_target()
    halve = lambda logits: logits.mul_(0.5)  # noqa: E731
    plain, plain_grads = loss_and_gradients(hidden, head, target, change=halve)
    mode = LeanLoss(min_bytes=0, recompute_logits=True)
    loss, grads = loss_and_gradients(hidden, head, target, mode, change=halve)
    assert mode.calls == 1 and mode.projected_calls == 0
    assert torch.equal(loss, plain) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))


def test_a_second_term_of_the_logits_still_reaches_the_head_through_its_own_backward():
    hidden, head, target = head_and_target()
    square = lambda logits: 1e-3 * logits.square().mean()  # noqa: E731
    plain, plain_grads = loss_and_gradients(hidden, head, target, extra=square)
    mode = LeanLoss(min_bytes=0, recompute_logits=True)
    loss, grads = loss_and_gradients(hidden, head, target, mode, extra=square)
    assert mode.projected_calls == 1
    assert torch.equal(loss, plain) and close(grads, plain_grads, 1e-12)


def test_a_gradient_of_the_gradient_is_pytorchs():
    """A gradient penalty: backward with create_graph makes the whole logits again, with a graph."""
    hidden, head, target = head_and_target()
    out = []
    for mode in (None, LeanLoss(min_bytes=0, recompute_logits=True)):
        if mode is not None:
            mode.__enter__()
        loss = F.cross_entropy(head(hidden).view(-1, CLASSES), target)
        if mode is not None:
            mode.__exit__(None, None, None)
        grad, = torch.autograd.grad(loss, hidden, create_graph=True)
        out.append(torch.autograd.grad(grad.square().sum(), [hidden, *head.parameters()]))
    assert close(out[1], out[0], 1e-12)


@pytest.mark.parametrize("make,autocast,tolerance", [(functools.partial(tiny_bert, dropout=0.0), False, 1e-12),
                                                      (tiny_gpt2, True, 2e-2)],
                         ids=["bert_fp64", "gpt2_bf16_autocast"])
def test_a_planned_models_head_is_made_again_with_pytorchs_loss(make, autocast, tolerance):
    """BERT's MLM head (a gap) makes its logits from its transform's output; GPT-2's lm_head, in
    bf16 under autocast, has its logits upcast by transformers' loss. The planner notes the head's
    linear layer inside the gap's forward and the loss takes its input."""
    model = make()
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain_loss, plain = gradients(model, ids)
    runtime = attached(model, Decision.RECOMPUTE)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, planned = gradients(model, ids)
    runtime.detach()
    assert runtime.lean_loss.calls == 1 and runtime.lean_loss.projected_calls == 1
    assert torch.equal(loss, plain_loss)
    assert all(torch.allclose(a.float(), b.float(), rtol=tolerance, atol=tolerance) for a, b in zip(planned, plain))
    assert torch._C._len_torch_function_stack() == 0  # the mode left with each gap and the forward


def test_under_fsdp2_the_heads_logits_are_not_made_again(monkeypatch, caplog):
    """FSDP2 gathers a head's weight for the head's own backward, which made-again logits skip:
    the loss takes the logits as they are, with PyTorch's gradients bit for bit."""
    from um_alloc.planner import replay

    monkeypatch.setattr(replay, "_sharded", lambda model, params: True)
    model = tiny_bert(dropout=0.0)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    plain_loss, plain = gradients(model, ids)
    runtime = attached(model, Decision.KEEP)
    with caplog.at_level("WARNING", logger="um_alloc.planner"):
        loss, planned = gradients(model, ids)
    runtime.detach()
    assert runtime.lean_loss.calls == 1 and runtime.lean_loss.projected_calls == 0
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(planned, plain))
    assert sum("FSDP2" in r.getMessage() for r in caplog.records) == 1  # said once


def test_a_forward_without_a_loss_leaves_no_head_noted():
    """A head's output no loss took (an evaluation with gradients on) is dropped at the forward's
    end, with the input the note held."""
    model = tiny_bert(dropout=0.0)
    runtime = attached(model, Decision.KEEP)
    logits = model(input_ids=torch.randint(0, 97, (4, 16))).logits
    runtime.detach()
    assert logits.requires_grad and runtime.lean_loss._projections._made == {}


def test_recompute_logits_needs_the_lean_loss():
    with pytest.raises(ValueError, match="recompute_logits: needs lean_loss"):
        BlockPlanner(tiny_bert(), "1GiB", lean_loss=False, recompute_logits=True)


def parsed(data):
    return policy_from_dict(data, source="<dict>", name="test")


def test_the_policy_key_is_a_boolean_off_by_default():
    assert parsed({"scheduler": {"recompute_logits": True}}).scheduler.recompute_logits is True
    assert parsed({}).scheduler.recompute_logits is False
    with pytest.raises(PolicyError, match="recompute_logits"):
        parsed({"scheduler": {"recompute_logits": "sometimes"}})
