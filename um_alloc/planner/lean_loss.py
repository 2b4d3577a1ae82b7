"""A cross-entropy over a large vocabulary that holds half as much, computed in row chunks.

PyTorch's ``cross_entropy`` over ``[tokens, vocabulary]`` logits keeps the whole log-softmax for
backward and, in backward, makes the whole gradient of it before the gradient of the logits: at
BERT-Large batch 32, sequence 512 (16,384 rows of 30,522 fp32 logits, 2 GB each) that is 4 GB held
at once in forward and 6 GB in backward, the largest transient of the step. This one keeps the
logits it was given (which exist anyway) and recomputes the log-softmax a chunk of rows at a time in
backward, so forward holds the logits and one chunk, and backward the logits, their gradient and
one chunk: 2 GB less at each peak, for one more log-softmax pass (about 1 ms on an H100).

The result is bit-for-bit PyTorch's: the same log-softmax and nll kernels run on the same rows
(their arithmetic per row does not depend on how many rows there are), the loss is nll_loss's own
reduction over the picked values, and the gradient is log-softmax's backward of nll's gradient, row
by row. Only what the chunks cannot change is taken: mean or sum reduction, no class weights, no
label smoothing, class-index targets, 2-D logits of at least ``min_bytes``. Under autocast the
log-softmax runs in the logits' own dtype, as cross_entropy asks of it (autocast then leaves it
alone), and nll_loss in fp32. Every other call is PyTorch's own.

``LeanLoss`` is a TorchFunctionMode: the planner enters it where a model computes its loss (after
its last unit, inside its forward), so no code changes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LeanLoss", "chunked_cross_entropy", "applies"]

MiB = 1 << 20
CHUNK_BYTES = 256 * MiB     # log-softmax rows recomputed at once in backward
MIN_BYTES = 512 * MiB       # smaller logits are left to PyTorch: nothing worth saving


def applies(logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0, *, min_bytes: int = MIN_BYTES) -> bool:
    """Whether a cross_entropy call with these arguments is one the chunked version computes."""
    return (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)
            and logits.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
            and logits.is_floating_point() and logits.requires_grad
            and weight is None and size_average is None and reduce is None and label_smoothing == 0.0
            and reduction in ("mean", "sum") and logits.numel() * logits.element_size() >= min_bytes)


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                          reduction: str = "mean", chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """``F.cross_entropy(logits, target, ignore_index=..., reduction=...)`` for 2-D logits, with
    the log-softmax recomputed in backward `chunk_bytes` of rows at a time."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    rows = max(1, chunk_bytes // max(logits.size(1) * logits.element_size(), 1))
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, reduction, rows)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, rows):
        valid = target != ignore_index
        index = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
        picked = torch.empty(logits.size(0), 1, dtype=logits.dtype, device=logits.device)
        for start in range(0, logits.size(0), rows):
            end = start + rows
            log_probs = F.log_softmax(logits[start:end], 1, dtype=logits.dtype)  # as cross_entropy: autocast keeps it
            torch.gather(log_probs, 1, index[start:end], out=picked[start:end])
        # nll_loss itself reduces the picked values: one column, class 0 where the row counts.
        column_target = torch.where(valid, torch.zeros_like(target), target)
        ctx.save_for_backward(logits, index, valid)
        ctx.rows, ctx.reduction = rows, reduction
        return F.nll_loss(picked, column_target, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    def backward(ctx, grad):
        logits, index, valid = ctx.saved_tensors
        # nll_loss's gradient of each picked log-probability, -grad (sum) or -grad / counted rows
        # (mean), in nll_loss's dtype (fp32 under autocast), then in the log-probabilities' dtype.
        scale = grad / valid.sum().to(grad.dtype) if ctx.reduction == "mean" else grad
        picked_grad = torch.where(valid, -scale, torch.zeros_like(scale)).to(logits.dtype).unsqueeze(1)
        out = torch.empty_like(logits)
        for start in range(0, logits.size(0), ctx.rows):
            end = start + ctx.rows
            log_probs = F.log_softmax(logits[start:end], 1, dtype=logits.dtype)
            grad_log_probs = torch.zeros_like(log_probs).scatter_(1, index[start:end], picked_grad[start:end])
            out[start:end] = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, logits.dtype)
        return out, None, None, None, None


class LeanLoss(TorchFunctionMode):
    """While entered, cross_entropy calls the chunked version computes (see `applies`) go to it;
    every other call runs as it is."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        super().__init__()
        self.min_bytes = min_bytes
        self.calls = 0             # cross-entropies computed in chunks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and applies(*args, **kwargs, min_bytes=self.min_bytes):
            self.calls += 1
            logits, target = args[0], args[1]
            return chunked_cross_entropy(logits, target, kwargs.get("ignore_index", _positional(args, 4, -100)),
                                         kwargs.get("reduction", _positional(args, 6, "mean")))
        return func(*args, **kwargs)


def _positional(args: tuple, i: int, default):
    return args[i] if len(args) > i else default
