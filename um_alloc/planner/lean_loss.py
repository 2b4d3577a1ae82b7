"""A cross-entropy over a large vocabulary that holds half as much, computed in row chunks.

PyTorch's ``cross_entropy`` over ``[tokens, vocabulary]`` logits keeps the whole log-softmax for
backward and, in backward, makes the whole gradient of it before the gradient of the logits: at
BERT-Large batch 32, sequence 512 (16,384 rows of 30,522 fp32 logits, 2 GB each) that is 4 GB held
at once in forward and 6 GB in backward, the largest transient of the step. This one keeps the
logits it was given (which exist anyway) and makes the log-probabilities again a chunk of rows at
a time in backward, so forward holds the logits and one chunk, and backward the logits, their
gradient and one chunk: 2 GB less at each peak, for a few more passes over the logits (below).

The result is bit-for-bit PyTorch's: the same log-softmax and nll kernels run on the same rows
(their arithmetic per row does not depend on how many rows there are), the loss is nll_loss's own
reduction over the picked values, and the gradient is log-softmax's backward of nll's gradient, row
by row. Only what the chunks cannot change is taken: mean or sum reduction, no class weights, no
label smoothing, class-index targets, 2-D logits of at least ``min_bytes``. Under autocast the
log-softmax runs in the logits' own dtype, as cross_entropy asks of it (autocast then leaves it
alone), and nll_loss in fp32. Every other call is PyTorch's own.

**Backward without a second log-softmax.** Where the loss computes in fp32 or fp64, log-softmax
writes each value as ``(x - max) - log(sum)`` in that dtype, and at a row's largest logit that is
``-log(sum)`` exactly. So forward keeps each row's largest logit and ``log(sum)`` (8 bytes a row
in fp32), and backward makes the log-probabilities again with two elementwise subtractions instead
of a log-softmax. The first time a process sees a device, dtype and vocabulary, forward compares
the two on its first chunk, bit for bit; where they differ (a kernel that adds ``max + log(sum)``
first), that combination keeps recomputing the log-softmax. So does a backward that builds a graph
of its own (``create_graph=True``, a gradient penalty): to the subtractions, max and ``log(sum)``
are constants, and the gradient's own gradient would come out wrong.

On CUDA, in fp32, the gradient of a chunk is then one elementwise kernel (``_GRADIENT_KERNELS``),
compared with PyTorch's kernels once in the same way and used only where it matched bit for bit.
With GPT-2's vocabulary on an H200 a chunk's gradient took 0.51 ms this way against 0.83 ms.

**Upcast logits.** Most Hugging Face language models upcast their logits before the loss
(``logits.float().view(-1, vocabulary)``, transformers' ``ForCausalLMLoss``): the cross-entropy then
gets fp32 logits, twice the bytes of the bf16 ones they were made from, and backward makes an fp32
gradient of them before the bf16 one. While the mode is entered it notes such upcasts (a floating
tensor made wider, of at least ``min_bytes``) and the views taken of them; a cross-entropy of one
takes the narrower tensor instead: its forward runs on rows of the upcast, which exists then
anyway, backward upcasts a chunk of rows at a time, and the gradient comes back in the narrower
dtype. Upcasting is exact, and casting the gradient a chunk at a time rounds each
element as the cast's backward does, so loss and gradient stay bit for bit PyTorch's. Forward and
backward then hold the bf16 logits and one chunk instead of the fp32 logits and their gradient: at
GPT-2's vocabulary (50,257) and 8 x 1024 tokens, by the tensors' sizes, 1.5 GiB at the start of
backward instead of 3.8.
An upcast changed in place after it was made, or not contiguous, is left to the plain path. Where
the same upcast also feeds another term of the loss (a z-loss on the logits, say), the two
gradients meet in the narrow dtype instead of in fp32, and their sum may differ in its last bits.

**Logits widened by a bias.** BART and the models transformers builds like it (mBART, Pegasus,
Marian, Blenderbot, PLBart, LED, MVP) add a buffer, ``final_logits_bias``, to their head's logits:
under autocast, bf16 logits plus an fp32 bias make fp32 logits by an add instead of a cast. Such a
sum (a narrower tensor that requires a gradient and a wider vector of one value per class that
does not) is noted as an upcast too: the chunks make the sum again from rows of the narrow logits
and the bias, with the same add, element by element; each row's largest value is taken from the
sum (the bias moves it), and the gradient comes back in the narrow dtype, as the add's backward
gives it. These models also return the sum as their output's ``logits``, alive while the output
is, so forward holds it either way; backward no longer makes its fp32 gradient: 1.2 GB at BART's
50,265 classes and 24 x 256 target tokens.

**Logits made again from the head's input** (``recompute_logits``, off by default). Where the logits
are the output of a linear layer (a language model's head, ``F.linear(hidden, weight, bias)``),
backward can skip both the logits and their gradient: a chunk of rows at a time it makes the
chunk's logits again from the head's input, their gradient, and from that the chunk's share of the
head's gradients (input, weight and bias), so the loss hands the head its gradients directly and
the head's own backward never runs. At BERT-Large batch 160 the bf16 logits are 5 GB: spilled to
host memory (um_alloc.spill), the loss's backward wrote their gradient back over the link and the
head's backward read it there, 1.3 s of a 2.6 s step on an H200; made again, a chunk lives on the
GPU for three matrix products, and the loss with the head's gradients took 0.31 s
(bench/results/scale_8GiB/logits_made_again). The forward's loss is the same bit for bit; the
gradient is the same to rounding, not bit for bit (the products run a chunk of rows at a time,
and the weight's gradient is their fp32 sum), so it is off where exactness is promised. The loss
must be taken from the linear's output unchanged (views and an upcast allowed). Another term of
the logits (a z-loss) still reaches the head through the head's own backward, which then runs for
it; the logits' own gradient (``retain_grad``) lacks the loss's share. A backward with
``create_graph`` makes the whole logits again, with a graph.

``LeanLoss`` is a TorchFunctionMode: the planner enters it where a model computes its loss (after
its last unit, inside its forward), so no code changes; with ``recompute_logits`` also in the
forward of the units that are not blocks, where a head's linear layer runs.
"""
from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LeanLoss", "chunked_cross_entropy", "projected_cross_entropy", "applies"]

log = logging.getLogger("um_alloc.planner")

MiB = 1 << 20
CHUNK_BYTES = 256 * MiB     # rows of the loss's dtype taken at once, in forward and in backward
ALIGN_BYTES = 512           # a row of an upcast chunk starts where it would in the whole upcast, modulo this
MIN_BYTES = 512 * MiB       # smaller logits are left to PyTorch: nothing worth saving
# Rows of logits made again at once in backward (recompute_logits), in the loss's dtype: the chunk's
# logits, their upcast, log-probabilities and gradient live together, four tensors this size.
PROJECTED_CHUNK_BYTES = 64 * MiB


def applies(logits, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
            reduction="mean", label_smoothing=0.0, *, min_bytes: int = MIN_BYTES) -> bool:
    """Whether a cross_entropy call with these arguments is one the chunked version computes."""
    return (isinstance(logits, torch.Tensor) and isinstance(target, torch.Tensor)
            and logits.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
            and logits.is_floating_point() and logits.requires_grad
            and weight is None and size_average is None and reduce is None and label_smoothing == 0.0
            and reduction in ("mean", "sum") and logits.numel() * logits.element_size() >= min_bytes)


def chunked_cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                          reduction: str = "mean", chunk_bytes: int = CHUNK_BYTES,
                          dtype: torch.dtype | None = None, phase: int = 0,
                          upcast: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits.to(dtype), target, ignore_index=..., reduction=...)`` for 2-D logits,
    with the log-probabilities made again in backward `chunk_bytes` of rows (in `dtype`) at a time.
    `dtype`: a wider floating dtype the logits are upcast to, a chunk at a time (default: their
    own); the gradient comes back in the logits' own dtype, as the upcast's backward gives it.
    `phase`: the address, modulo ALIGN_BYTES, of the upcast the chunks stand for (see _Rows).
    `upcast`: ``logits.to(dtype)`` where it exists already; forward reads its rows and does not keep it.
    `bias`: a vector of one value per class in `dtype`, not requiring a gradient, that the loss's
    logits are ``logits + bias`` (the widening add of BART's ``final_logits_bias``); `upcast` is then
    that sum."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    dtype = dtype or logits.dtype
    if upcast is not None and (upcast.dtype != dtype or upcast.shape != logits.shape):
        raise ValueError(f"chunked_cross_entropy: upcast must be the logits as {dtype}, of shape "
                         f"{tuple(logits.shape)}; got {upcast.dtype} of shape {tuple(upcast.shape)}")
    if bias is not None and (bias.dtype != dtype or bias.shape != logits.shape[1:] or bias.requires_grad):
        raise ValueError(f"chunked_cross_entropy: bias must be a vector of {logits.size(1)} classes in {dtype} "
                         f"that requires no gradient; got {bias.dtype} of shape {tuple(bias.shape)}"
                         f"{' that requires one' if bias.requires_grad else ''}")
    rows = _Rows(logits, dtype, phase, chunk_bytes, bias)
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, reduction, rows, upcast)


class _Rows:
    """The logits a chunk of rows at a time, in the dtype the loss computes in. Where that is the
    logits' own, a chunk is a view of them. Where it is wider, a chunk is upcast into a buffer
    placed so that each row has the address, modulo ALIGN_BYTES, it has in the whole upcast:
    the log-softmax kernel reduces a row's misaligned head apart from its vectorized body, so the
    order of its sums, and with it their last bits, depends on where the row starts (GPT-2's
    50,257 fp32 logits a row start 4 bytes further each row)."""

    def __init__(self, logits: torch.Tensor, dtype: torch.dtype, phase: int, chunk_bytes: int,
                 bias: torch.Tensor | None = None):
        self.logits, self.dtype, self.phase, self.bias = logits, dtype, phase, bias
        self.item_bytes = torch.finfo(dtype).bits // 8
        self.row_bytes = logits.size(1) * self.item_bytes
        self.step = max(1, chunk_bytes // max(self.row_bytes, 1))
        # What the kernels compared once a process are keyed on: the rows' values are the logits'
        # own where they only widen, and a sum in the loss's dtype where a bias is added.
        values_dtype = logits.dtype if bias is None else dtype
        self.key = (str(logits.device), values_dtype, dtype, logits.size(1))

    def spans(self):
        """(start, end) of each chunk of rows, in order."""
        for start in range(0, self.logits.size(0), self.step):
            yield start, min(start + self.step, self.logits.size(0))

    def rows(self, start: int, end: int) -> torch.Tensor:
        rows = self.logits[start:end]
        if rows.dtype is self.dtype and self.bias is None:
            return rows
        buffer = torch.empty((end - start) * rows.size(1) + ALIGN_BYTES // self.item_bytes, dtype=self.dtype,
                             device=rows.device)
        want = (self.phase + start * self.row_bytes) % ALIGN_BYTES
        skip = (want - buffer.data_ptr()) % ALIGN_BYTES // self.item_bytes
        placed = buffer[skip:skip + rows.numel()].view(rows.shape)
        if self.bias is None:
            return placed.copy_(rows)
        return torch.add(rows, self.bias, out=placed)  # the model's own widening add, element by element

    def values(self, start: int, end: int) -> torch.Tensor:
        """Rows holding the loss's rows' values exactly, in the fewest bytes: the logits' own where
        the loss only widens them (widening keeps every value), else the rows made again."""
        return self.logits[start:end] if self.bias is None else self.rows(start, end)


class _Picked(NamedTuple):
    """What forward takes from the logits for the loss and for backward, a row each."""
    picked: torch.Tensor               # the target's log-probability, in the loss's dtype
    index: torch.Tensor                # the target class, 0 where the row is ignored
    valid: torch.Tensor                # whether the row counts
    row_max: torch.Tensor | None       # the row's largest logit and log(sum of exp) (see the
    log_sum: torch.Tensor | None       # module docstring); None: backward makes log-softmax again


def _pick(rows: _Rows, target: torch.Tensor, ignore_index: int, upcast: torch.Tensor | None) -> _Picked:
    logits, dtype = rows.logits, rows.dtype
    valid = target != ignore_index
    index = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
    picked = torch.empty(logits.size(0), 1, dtype=dtype, device=logits.device)
    row_max = log_sum = None
    if _may_subtract(rows):
        row_max = torch.empty(logits.size(0), 1, dtype=dtype, device=logits.device)
        log_sum = torch.empty_like(row_max)
    for start, end in rows.spans():
        chunk = rows.rows(start, end) if upcast is None else upcast[start:end]
        log_probs = F.log_softmax(chunk, 1, dtype=dtype)  # as cross_entropy: autocast keeps it
        torch.gather(log_probs, 1, index[start:end], out=picked[start:end])
        if row_max is not None:
            # At the row's largest logit, (x - max) - log(sum) is -log(sum), exactly. Where the
            # loss only widens the logits, the narrow ones hold the same largest values, in half
            # the bytes of an upcast; a bias moves them, so those rows are read from the sum.
            values = logits[start:end] if rows.bias is None else chunk
            largest, at = values.max(1, keepdim=True)
            row_max[start:end] = largest
            torch.gather(log_probs, 1, at, out=log_sum[start:end]).neg_()
            if start == 0 and not _subtraction_matches(rows, values, log_probs, row_max[:end], log_sum[:end]):
                row_max = log_sum = None
    return _Picked(picked, index, valid, row_max, log_sum)


def _nll(picked: _Picked, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    # nll_loss itself reduces the picked values: one column, class 0 where the row counts.
    column_target = torch.where(picked.valid, torch.zeros_like(target), target)
    return F.nll_loss(picked.picked, column_target, ignore_index=ignore_index, reduction=reduction)


def _picked_gradient(grad: torch.Tensor, valid: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """nll_loss's gradient of each picked log-probability, -grad (sum) or -grad / counted rows
    (mean), in nll_loss's dtype (fp32 under autocast), then in the log-probabilities' dtype."""
    scale = grad / valid.sum().to(grad.dtype) if reduction == "mean" else grad
    return torch.where(valid, -scale, torch.zeros_like(scale)).to(dtype).unsqueeze(1)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, rows, upcast):
        picked = _pick(rows, target, ignore_index, upcast)
        ctx.save_for_backward(logits, picked.index, picked.valid, picked.row_max, picked.log_sum)
        ctx.rows, ctx.reduction = rows, reduction
        rows.logits = None  # saved above; backward takes it back from there
        return _nll(picked, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad):
        logits, index, valid, row_max, log_sum = ctx.saved_tensors
        rows = ctx.rows
        rows.logits = logits
        picked_grad = _picked_gradient(grad, valid, ctx.reduction, rows.dtype)
        out = torch.empty_like(logits)
        if torch.is_grad_enabled():
            # create_graph: the gradient must itself have one, and max and log(sum) held as
            # constants would give it the wrong one; log-softmax again gives the right one.
            row_max = log_sum = None
        fused = _fused_gradient(rows) if row_max is not None else None
        for start, end in rows.spans():
            if fused is not None:
                # An upcast's backward casts the whole gradient down; element by element, a chunk's cast is the same.
                out[start:end] = fused(rows.values(start, end), row_max[start:end], log_sum[start:end],
                                       picked_grad[start:end], index[start:end])
                continue
            if row_max is None:
                log_probs = F.log_softmax(rows.rows(start, end), 1, dtype=rows.dtype)
            else:  # the narrow logits widen exactly in the first subtraction
                values = rows.values(start, end)
                log_probs = torch.sub(values, row_max[start:end]).sub_(log_sum[start:end])
            grad_log_probs = torch.zeros_like(log_probs).scatter_(1, index[start:end], picked_grad[start:end])
            out[start:end] = grad = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, rows.dtype)
            if start == 0 and row_max is not None:
                fused = _fused_gradient_matching(rows, grad, values, row_max[:end], log_sum[:end],
                                                 picked_grad[:end], index[:end])
        rows.logits = None
        return out, None, None, None, None, None


class Projection(NamedTuple):
    """What logits were made by: ``F.linear(input, weight, bias)`` under `autocast` (device type,
    whether on, dtype), its input as rows of the logits' rows."""
    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    autocast: tuple[str, bool, torch.dtype]


def projected_cross_entropy(logits: torch.Tensor, target: torch.Tensor, projection: Projection,
                            ignore_index: int = -100, reduction: str = "mean", dtype: torch.dtype | None = None,
                            phase: int = 0, upcast: torch.Tensor | None = None,
                            chunk_bytes: int | None = None) -> torch.Tensor:
    """``F.cross_entropy(logits.to(dtype), target, ...)`` where the 2-D `logits` are
    ``F.linear(*projection[:3])``: forward reads the logits (and `upcast`, see
    chunked_cross_entropy), and the loss is the same bit for bit; backward makes them again
    `chunk_bytes` of rows at a time (in `dtype`; default PROJECTED_CHUNK_BYTES) from the
    projection's input and gives the gradients of its input, weight and bias, not of the logits
    (see the module docstring)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"projected_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    x, weight = projection.input, projection.weight
    if x.dim() != 2 or x.size(0) != logits.size(0) or weight.dim() != 2 or weight.size(0) != logits.size(1):
        raise ValueError(f"projected_cross_entropy: logits of shape {tuple(logits.shape)} are not F.linear of an "
                         f"input of shape {tuple(x.shape)} and a weight of shape {tuple(weight.shape)}")
    dtype = dtype or logits.dtype
    rows = _Rows(logits.detach(), dtype, phase, CHUNK_BYTES)
    step = max(1, (chunk_bytes or PROJECTED_CHUNK_BYTES) // max(rows.row_bytes, 1))
    return _ProjectedCrossEntropy.apply(x, weight, projection.bias, target, ignore_index, reduction, rows,
                                        None if upcast is None else upcast.detach(), projection.autocast, step)


class _ProjectedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, reduction, rows, upcast, autocast, step):
        picked = _pick(rows, target, ignore_index, upcast)
        ctx.save_for_backward(x, weight, bias, picked.index, picked.valid, picked.row_max, picked.log_sum, target)
        ctx.dtype, ctx.reduction, ctx.autocast, ctx.step = rows.dtype, reduction, autocast, step
        ctx.ignore_index = ignore_index
        rows.logits = None  # forward's alone: backward makes the logits again
        return _nll(picked, target, ignore_index, reduction)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled():
            return _ProjectedCrossEntropy._differentiable_backward(ctx, grad)
        x, weight, bias, index, valid, row_max, log_sum, _ = ctx.saved_tensors
        picked_grad = _picked_gradient(grad, valid, ctx.reduction, ctx.dtype)
        wants = ctx.needs_input_grad[:3]
        grad_x = torch.empty_like(x) if wants[0] else None
        grad_weight = grad_bias = None
        device_type, enabled, autocast_dtype = ctx.autocast
        # One autocast region for every chunk: it casts the weight once (its cast of a leaf is kept).
        with torch.enable_grad(), torch.autocast(device_type, dtype=autocast_dtype, enabled=enabled):
            w = weight.detach().requires_grad_(wants[1])
            b = None if bias is None else bias.detach().requires_grad_(wants[2])
            for start in range(0, x.size(0), ctx.step):
                end = min(start + ctx.step, x.size(0))
                rows_x = x[start:end].detach().requires_grad_(wants[0])
                logits = F.linear(rows_x, w, b)
                chunk = (slice(start, end), row_max, log_sum, picked_grad, index)
                leaves = [t for t in (rows_x, w, b) if t is not None and t.requires_grad]
                made = iter(torch.autograd.grad(logits, leaves, _gradient_made_again(logits.detach(), ctx.dtype, *chunk)))
                if wants[0]:
                    grad_x[start:end] = next(made)
                if wants[1]:
                    grad_weight = _summed(grad_weight, next(made))
                if wants[2] and b is not None:
                    grad_bias = _summed(grad_bias, next(made))
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None, None, None

    @staticmethod
    def _differentiable_backward(ctx, grad):
        """create_graph (a gradient penalty): the gradient must itself have one. The whole
        logits are made again, with a graph, and PyTorch's cross-entropy differentiated: the
        memory of the plain loss, for a backward few steps take."""
        x, weight, bias, _, _, _, _, target = ctx.saved_tensors
        device_type, enabled, autocast_dtype = ctx.autocast
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=enabled):
            logits = F.linear(x, weight, bias)
        loss = F.cross_entropy(logits.to(ctx.dtype), target, ignore_index=ctx.ignore_index, reduction=ctx.reduction)
        wants = ctx.needs_input_grad[:3]
        leaves = [t for t, want in zip((x, weight, bias), wants) if want]
        made = iter(torch.autograd.grad(loss, leaves, grad, create_graph=True))
        grads = [next(made) if want else None for want in wants]
        return (*grads, None, None, None, None, None, None, None)


def _gradient_made_again(values: torch.Tensor, dtype: torch.dtype, rows: slice, row_max, log_sum,
                         picked_grad, index) -> torch.Tensor:
    """The gradient of a chunk of logits made again (`values`), in their dtype: log-softmax's
    backward of nll's gradient, the log-probabilities made in `dtype` from forward's max and
    log(sum) where it kept them, else by log-softmax."""
    if row_max is None:
        log_probs = F.log_softmax(values, 1, dtype=dtype)
    else:
        log_probs = torch.sub(values.to(dtype), row_max[rows]).sub_(log_sum[rows])
    grad_log_probs = torch.zeros_like(log_probs).scatter_(1, index[rows], picked_grad[rows])
    grad = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, dtype)
    return grad.to(values.dtype)


def _summed(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    """A gradient summed over chunks, in fp32 at least."""
    wide = torch.promote_types(part.dtype, torch.float32)
    return part.to(wide) if total is None else total.add_(part)


# (device, logits' dtype, loss's dtype, vocabulary) -> whether log-softmax's values are the
# subtractions backward makes (_ChunkedCrossEntropy): compared once a process, on real rows.
_SUBTRACTION_MATCHES: dict[tuple, bool] = {}


def _may_subtract(rows: _Rows) -> bool:
    """Log-softmax rounds once, to `dtype`, where it accumulates in `dtype` (fp32, fp64) only."""
    return rows.dtype in (torch.float32, torch.float64) and _SUBTRACTION_MATCHES.get(rows.key, True)


def _subtraction_matches(rows: _Rows, values, log_probs, row_max, log_sum) -> bool:
    """Whether (values - max) - log(sum) gives `log_probs`, the first chunk's, bit for bit; the
    first call for a device, dtypes and vocabulary compares them (and waits for the GPU), the rest
    reuse the answer."""
    if rows.key not in _SUBTRACTION_MATCHES:
        made = torch.sub(values, row_max).sub_(log_sum)
        _SUBTRACTION_MATCHES[rows.key] = torch.equal(made, log_probs)
    return _SUBTRACTION_MATCHES[rows.key]


# The gradient of a chunk of rows in one elementwise kernel (torch.cuda.jiterator), in fp32: the
# log-probability by the subtractions above, then log-softmax's backward of nll's gradient as
# PyTorch's kernel writes it, gradOutput - exp(output) * sum, where a row's gradOutput is `scale`
# at its target and 0 elsewhere, and so is its sum. Whether the compiler fuses the multiply and
# subtract into one rounding is its choice, so both forms are here; the first call compares them
# with PyTorch's kernels and keeps the one that matches bit for bit, if any. It reads the upcast
# rows once and writes their gradient once, where those kernels write and read the
# log-probabilities, nll's gradient and log-softmax's gradient in turn.
_GRADIENT_KERNELS = {
    "contracted": "return picked - ::exp(log_prob) * scale;",
    "rounded_product": "return picked - __fmul_rn(::exp(log_prob), scale);",
}
_GRADIENT_SOURCE = """template <typename T> T lean_loss_gradient(T x, T row_max, T log_sum, T scale, T column, T target) {{
    T log_prob = (x - row_max) - log_sum;
    T picked = column == target ? scale : T(0);
    {body}
}}"""
_FUSED: dict[tuple, object] = {}  # _Rows.key -> the kernel that matched PyTorch's, or None


def _fused_gradient(rows: _Rows):
    """The fused kernel found to match for these rows (a callable of their values, their max and
    log(sum), nll's gradient and the targets), or None: not on CUDA, not fp32, none matched, or
    not compared yet."""
    return _FUSED.get(rows.key) if rows.logits.is_cuda and rows.dtype is torch.float32 else None


def _fused_gradient_matching(rows: _Rows, grad, values, row_max, log_sum, picked_grad, index):
    """Compares the fused kernels with PyTorch's `grad` of the first chunk (of `values`), once for
    a device, dtypes and vocabulary (waits for the GPU); the one that matches, or None."""
    key, dtype = rows.key, rows.dtype
    if key in _FUSED or not values.is_cuda or dtype is not torch.float32:
        return _FUSED.get(key)
    if not bool(picked_grad.ne(0).any()):  # every row ignored: any kernel gives zeros; decide later
        return None
    _FUSED[key] = None
    columns = torch.arange(values.size(1), device=values.device, dtype=dtype)
    for name, body in _GRADIENT_KERNELS.items():
        kernel = torch.cuda.jiterator._create_jit_fn(_GRADIENT_SOURCE.format(body=body))

        def fused(values, row_max, log_sum, picked_grad, index, kernel=kernel):
            # Every input in fp32: given bf16 rows, the kernel converts each element on the fly
            # and ran 1.77 ms a chunk of 1,170 x 50,257 on an H200, against 0.51 ms with the
            # rows upcast first and 0.83 ms for PyTorch's kernels.
            return kernel(values.to(dtype), row_max, log_sum, picked_grad, columns, index.to(dtype))

        try:
            matches = torch.equal(fused(values, row_max, log_sum, picked_grad, index), grad)
        except RuntimeError as error:  # no runtime compiler here: PyTorch's kernels stay
            log.info("lean loss: the fused gradient kernel did not compile (%s); PyTorch's kernels stay", error)
            break
        if matches:
            _FUSED[key] = fused
            break
    log.info("lean loss: the gradient of %s logits%s over %d classes in %s: %s", rows.logits.dtype,
             "" if rows.bias is None else " plus a bias", values.size(1), dtype,
             "one fused kernel (" + name + ")" if _FUSED[key] else "PyTorch's kernels")
    return _FUSED[key]


class LeanLoss(TorchFunctionMode):
    """While entered, cross_entropy calls the chunked version computes (see `applies`) go to it;
    every other call runs as it is. Of logits that are an upcast made while it is entered, the
    chunked version takes the narrower tensor they were made from; with `recompute_logits`, of
    logits a linear layer made while it was entered, the layer's input, weight and bias (see the
    module docstring)."""

    def __init__(self, min_bytes: int = MIN_BYTES, recompute_logits: bool = False):
        super().__init__()
        self.min_bytes = min_bytes
        self.recompute_logits = recompute_logits
        self.calls = 0             # cross-entropies computed in chunks
        self.upcast_calls = 0      # of them, those that took the narrower tensor of upcast logits
        self.projected_calls = 0   # and those whose backward made the logits again from a linear's input
        self._upcasts = _Upcasts()
        self._projections = _Projections()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # Traced by torch.compile, the loss is the compiler's to make. Traced, the upcasts'
            # bookkeeping by id() would guard on each step's logits, and every step would compile
            # the graph again.
            return func(*args, **kwargs)
        if func is F.cross_entropy and applies(*args, **kwargs, min_bytes=self.min_bytes):
            self.calls += 1
            logits, target = args[0], args[1]
            narrow = self._upcasts.source_of(logits)
            projection = self._projection_of(logits if narrow is None else narrow)
            self._upcasts.clear()
            self._projections.clear()
            if narrow is not None:
                self.upcast_calls += 1
            rows = logits if narrow is None else narrow.tensor
            how = dict(ignore_index=kwargs.get("ignore_index", _positional(args, 4, -100)),
                       reduction=kwargs.get("reduction", _positional(args, 6, "mean")),
                       dtype=logits.dtype, phase=logits.data_ptr() % ALIGN_BYTES,
                       upcast=None if narrow is None else logits)
            if projection is not None:
                self.projected_calls += 1
                return projected_cross_entropy(rows, target, projection, **how)
            return chunked_cross_entropy(rows, target, **how, bias=None if narrow is None else narrow.bias)
        out = func(*args, **kwargs)
        if func in _UPCASTS_AND_VIEWS:
            self._upcasts.note(func, args, kwargs, out, self.min_bytes)
        elif func is F.linear and self.recompute_logits:
            self._projections.note(args, kwargs, out, self.min_bytes)
        return out

    def _projection_of(self, logits) -> Projection | None:
        """The linear layer `logits` (a tensor, or the Narrow of an upcast) are the unchanged
        output of, where recompute_logits is on; None for logits widened by a bias."""
        if not self.recompute_logits or (isinstance(logits, Narrow) and logits.bias is not None):
            return None
        return self._projections.of(logits.tensor if isinstance(logits, Narrow) else logits)

    def __exit__(self, *exc):
        # A loss after the last unit takes logits a head noted inside it: those stay until the
        # next loss, which clears them, as does a step's end (Runtime).
        self._upcasts.clear()
        return super().__exit__(*exc)

    def forget(self) -> None:
        """Drops what was noted: a step is over."""
        self._upcasts.clear()
        self._projections.clear()


_CASTS = (torch.Tensor.float, torch.Tensor.double, torch.Tensor.to, torch.Tensor.type)
_ADDS = (torch.Tensor.add, torch.add)
_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten)
_UPCASTS_AND_VIEWS = frozenset(_CASTS + _ADDS + _VIEWS)


class Narrow(NamedTuple):
    """What an upcast was made from: `tensor`, the narrower one, in the upcast's shape, and the
    vector of one value per class added in the wider dtype (None for a plain cast)."""
    tensor: torch.Tensor
    bias: torch.Tensor | None = None


class _Upcasts:
    """Tensors made by upcasting a narrower floating tensor, by a cast or by adding a bias of the
    wider dtype over the last dimension (BART's ``lm_logits + final_logits_bias`` under autocast),
    or views of them taken as they were taken, each with that narrower tensor as the same view:
    the cross-entropy of one can take the narrower tensor instead. The upcasts are held weakly,
    and count only while neither they nor what they were made of have changed since (their
    version counters)."""

    def __init__(self):
        self._made: dict[int, tuple[weakref.ref, int, Narrow, tuple[int, ...]]] = {}

    def note(self, func, args, kwargs, out, min_bytes: int) -> None:
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        if func in _CASTS or func in _ADDS:
            narrow = _cast_of(args[0], out) if func in _CASTS else _biased_sum_of(args, kwargs, out)
            if narrow is not None and out.numel() * out.element_size() >= min_bytes:
                self._remember(out, narrow)
            return
        source = self.source_of(args[0])
        if source is None or not out.is_contiguous() or any(isinstance(a, torch.dtype) for a in args[1:]):
            return  # a view as another dtype is a reinterpretation of the bytes, not a shape
        view = func(source.tensor, *args[1:], **kwargs)
        keeps_classes = source.bias is None or view.size(-1) == source.bias.numel()
        if view.shape == out.shape and view.is_contiguous() and keeps_classes:
            self._remember(out, source._replace(tensor=view))

    def source_of(self, tensor: torch.Tensor) -> Narrow | None:
        """What `tensor` is an unchanged upcast of, or None."""
        made = self._made.get(id(tensor))
        if made is None:
            return None
        upcast, version, narrow, versions = made
        if upcast() is not tensor or tensor._version != version or _versions(narrow) != versions:
            return None
        return narrow

    def clear(self) -> None:
        self._made.clear()

    def _remember(self, out: torch.Tensor, narrow: Narrow) -> None:
        self._made[id(out)] = (weakref.ref(out), out._version, narrow, _versions(narrow))


class _Projections:
    """Outputs of F.linear of at least min_bytes whose input or weight needs a gradient, with the
    call that made them; a flattening view of one (``logits.view(-1, classes)``) stands for the
    call with its input flattened alike. Of an input of more than two dimensions F.linear returns
    a view of its 2-D product, so outputs are found by the tensor they view and the elements they
    cover. The outputs are held weakly, the call's tensors until the next loss or the step's end
    (the layer's backward holds them anyway); a call counts only while neither its output nor its
    tensors have changed since (their version counters)."""

    def __init__(self):
        # id of the output's base -> (the base, held weakly; its version; the call; the call's
        # tensors' versions; the output's first element's address, its size and its classes)
        self._made: dict[int, tuple[weakref.ref, int, Projection, tuple[int, ...], tuple[int, int, int]]] = {}

    def note(self, args: tuple, kwargs: dict, out, min_bytes: int) -> None:
        x = args[0] if args else kwargs.get("input")
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor)
                and out.is_floating_point() and out.is_contiguous() and weight.dim() == 2
                and (x.requires_grad or weight.requires_grad)
                and out.numel() * out.element_size() >= min_bytes):
            return
        state = (out.device.type, torch.is_autocast_enabled(out.device.type), torch.get_autocast_dtype(out.device.type))
        projection = Projection(x, weight, bias, state)
        base = out if out._base is None else out._base
        covers = (out.data_ptr(), out.numel(), out.size(-1))
        self._made[id(base)] = (weakref.ref(base), out._version, projection, _versions(projection[:3]), covers)

    def of(self, logits: torch.Tensor) -> Projection | None:
        """The call 2-D `logits` are the unchanged output of, flattened, or None."""
        base = logits if logits._base is None else logits._base
        made = self._made.get(id(base))
        if made is None or logits.dim() != 2 or not logits.is_contiguous():
            return None
        held, version, projection, versions, covers = made
        if (held() is not base or base._version != version or _versions(projection[:3]) != versions
                or (logits.data_ptr(), logits.numel(), logits.size(1)) != covers):
            return None
        return projection._replace(input=projection.input.reshape(-1, projection.input.size(-1)))

    def clear(self) -> None:
        self._made.clear()


def _versions(tensors) -> tuple[int, ...]:
    return tuple(t._version for t in tensors if t is not None)


def _cast_of(tensor: torch.Tensor, out: torch.Tensor) -> Narrow | None:
    return Narrow(tensor) if _widens(tensor, out) else None


def _biased_sum_of(args: tuple, kwargs: dict, out: torch.Tensor) -> Narrow | None:
    """`out` = a + b as the narrower of the two widened and a bias over the last dimension added,
    or None: the sum of a narrower tensor and a wider vector of one value per class that needs
    no gradient, with no `alpha` (the bias's gradient, and a scaled one, are not made)."""
    if len(args) != 2 or not isinstance(args[1], torch.Tensor) or kwargs.get("alpha", 1) != 1 or "out" in kwargs:
        return None
    for narrow, bias in (args, args[::-1]):
        if (_widens(narrow, out) and bias.dtype == out.dtype and not bias.requires_grad
                and bias.device == out.device and bias.dim() <= out.dim()
                and bias.size(-1) == out.size(-1) == bias.numel()):
            return Narrow(narrow, bias.reshape(-1))
    return None


def _widens(narrow: torch.Tensor, wide: torch.Tensor) -> bool:
    """Whether `wide` is `narrow` cast to a wider floating dtype, which keeps every value exactly:
    the cast can be made again from `narrow` a chunk at a time."""
    return (narrow.is_floating_point() and wide.is_floating_point() and narrow.requires_grad
            and wide.element_size() > narrow.element_size() and wide.shape == narrow.shape
            and wide.device == narrow.device and narrow.is_contiguous() and wide.is_contiguous())


def _positional(args: tuple, i: int, default):
    return args[i] if len(args) > i else default
