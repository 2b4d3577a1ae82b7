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

**Upcast logits.** Most Hugging Face language models upcast their logits before the loss
(``logits.float().view(-1, vocabulary)``, transformers' ``ForCausalLMLoss``): the cross-entropy then
gets fp32 logits, twice the bytes of the bf16 ones they were made from, and backward makes an fp32
gradient of them before the bf16 one. While the mode is entered it notes such upcasts (a floating
tensor made wider, of at least ``min_bytes``) and the views taken of them; a cross-entropy of one
takes the narrower tensor instead, upcasts a chunk of rows at a time, and returns the gradient in
the narrower dtype. Upcasting is exact, and casting the gradient a chunk at a time rounds each
element as the cast's backward does, so loss and gradient stay bit for bit PyTorch's. Forward and
backward then hold the bf16 logits and one chunk instead of the fp32 logits and their gradient: at
GPT-2's vocabulary (50,257) and 8 x 1024 tokens, by the tensors' sizes, 1.5 GiB at the start of
backward instead of 3.8.
An upcast changed in place after it was made, or not contiguous, is left to the plain path. Where
the same upcast also feeds another term of the loss (a z-loss on the logits, say), the two
gradients meet in the narrow dtype instead of in fp32, and their sum may differ in its last bits.

``LeanLoss`` is a TorchFunctionMode: the planner enters it where a model computes its loss (after
its last unit, inside its forward), so no code changes.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["LeanLoss", "chunked_cross_entropy", "applies"]

MiB = 1 << 20
CHUNK_BYTES = 256 * MiB     # log-softmax rows recomputed at once in backward
ALIGN_BYTES = 512           # a row of an upcast chunk starts where it would in the whole upcast, modulo this
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
                          reduction: str = "mean", chunk_bytes: int = CHUNK_BYTES,
                          dtype: torch.dtype | None = None, phase: int = 0) -> torch.Tensor:
    """``F.cross_entropy(logits.to(dtype), target, ignore_index=..., reduction=...)`` for 2-D logits,
    with the log-softmax recomputed in backward `chunk_bytes` of rows (in `dtype`) at a time.
    `dtype`: a wider floating dtype the logits are upcast to, a chunk at a time (default: their
    own); the gradient comes back in the logits' own dtype, as the upcast's backward gives it.
    `phase`: the address, modulo ALIGN_BYTES, of the upcast the chunks stand for (see _Rows)."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    rows = _Rows(logits, dtype or logits.dtype, phase, chunk_bytes)
    return _ChunkedCrossEntropy.apply(logits, target, ignore_index, reduction, rows)


class _Rows:
    """The logits a chunk of rows at a time, in the dtype the loss computes in. Where that is the
    logits' own, a chunk is a view of them. Where it is wider, a chunk is upcast into a buffer
    placed so that each row has the address, modulo ALIGN_BYTES, it has in the whole upcast:
    the log-softmax kernel reduces a row's misaligned head apart from its vectorized body, so the
    order of its sums, and with it their last bits, depends on where the row starts (GPT-2's
    50,257 fp32 logits a row start 4 bytes further each row)."""

    def __init__(self, logits: torch.Tensor, dtype: torch.dtype, phase: int, chunk_bytes: int):
        self.logits, self.dtype, self.phase = logits, dtype, phase
        self.item_bytes = torch.finfo(dtype).bits // 8
        self.row_bytes = logits.size(1) * self.item_bytes
        self.step = max(1, chunk_bytes // max(self.row_bytes, 1))

    def chunks(self):
        """(start, end, the rows start:end in the loss's dtype) in order."""
        for start in range(0, self.logits.size(0), self.step):
            end = min(start + self.step, self.logits.size(0))
            yield start, end, self._rows(start, end)

    def _rows(self, start: int, end: int) -> torch.Tensor:
        rows = self.logits[start:end]
        if rows.dtype is self.dtype:
            return rows
        buffer = torch.empty((end - start) * rows.size(1) + ALIGN_BYTES // self.item_bytes, dtype=self.dtype,
                             device=rows.device)
        want = (self.phase + start * self.row_bytes) % ALIGN_BYTES
        skip = (want - buffer.data_ptr()) % ALIGN_BYTES // self.item_bytes
        return buffer[skip:skip + rows.numel()].view(rows.shape).copy_(rows)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, rows):
        dtype = rows.dtype
        valid = target != ignore_index
        index = torch.where(valid, target, torch.zeros_like(target)).unsqueeze(1)
        picked = torch.empty(logits.size(0), 1, dtype=dtype, device=logits.device)
        for start, end, chunk in rows.chunks():
            log_probs = F.log_softmax(chunk, 1, dtype=dtype)  # as cross_entropy: autocast keeps it
            torch.gather(log_probs, 1, index[start:end], out=picked[start:end])
        # nll_loss itself reduces the picked values: one column, class 0 where the row counts.
        column_target = torch.where(valid, torch.zeros_like(target), target)
        ctx.save_for_backward(logits, index, valid)
        ctx.rows, ctx.reduction = rows, reduction
        rows.logits = None  # saved above; backward takes it back from there
        return F.nll_loss(picked, column_target, ignore_index=ignore_index, reduction=reduction)

    @staticmethod
    def backward(ctx, grad):
        logits, index, valid = ctx.saved_tensors
        rows = ctx.rows
        rows.logits = logits
        # nll_loss's gradient of each picked log-probability, -grad (sum) or -grad / counted rows
        # (mean), in nll_loss's dtype (fp32 under autocast), then in the log-probabilities' dtype.
        scale = grad / valid.sum().to(grad.dtype) if ctx.reduction == "mean" else grad
        picked_grad = torch.where(valid, -scale, torch.zeros_like(scale)).to(rows.dtype).unsqueeze(1)
        out = torch.empty_like(logits)
        for start, end, chunk in rows.chunks():
            log_probs = F.log_softmax(chunk, 1, dtype=rows.dtype)
            grad_log_probs = torch.zeros_like(log_probs).scatter_(1, index[start:end], picked_grad[start:end])
            # An upcast's backward casts the whole gradient down; element by element, a chunk's cast is the same.
            out[start:end] = torch.ops.aten._log_softmax_backward_data(grad_log_probs, log_probs, 1, rows.dtype)
        rows.logits = None
        return out, None, None, None, None


class LeanLoss(TorchFunctionMode):
    """While entered, cross_entropy calls the chunked version computes (see `applies`) go to it;
    every other call runs as it is. Of logits that are an upcast made while it is entered, the
    chunked version takes the narrower tensor they were made from (see the module docstring)."""

    def __init__(self, min_bytes: int = MIN_BYTES):
        super().__init__()
        self.min_bytes = min_bytes
        self.calls = 0             # cross-entropies computed in chunks
        self.upcast_calls = 0      # of them, those that took the narrower tensor of upcast logits
        self._upcasts = _Upcasts()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and applies(*args, **kwargs, min_bytes=self.min_bytes):
            self.calls += 1
            logits, target = args[0], args[1]
            source = self._upcasts.source_of(logits)
            self._upcasts.clear()
            if source is not None:
                self.upcast_calls += 1
            return chunked_cross_entropy(logits if source is None else source, target,
                                         kwargs.get("ignore_index", _positional(args, 4, -100)),
                                         kwargs.get("reduction", _positional(args, 6, "mean")),
                                         dtype=logits.dtype, phase=logits.data_ptr() % ALIGN_BYTES)
        out = func(*args, **kwargs)
        if func in _UPCASTS_AND_VIEWS:
            self._upcasts.note(func, args, kwargs, out, self.min_bytes)
        return out

    def __exit__(self, *exc):
        self._upcasts.clear()
        return super().__exit__(*exc)


_CASTS = (torch.Tensor.float, torch.Tensor.double, torch.Tensor.to, torch.Tensor.type)
_VIEWS = (torch.Tensor.view, torch.Tensor.reshape, torch.Tensor.flatten)
_UPCASTS_AND_VIEWS = frozenset(_CASTS + _VIEWS)


class _Upcasts:
    """Tensors made by upcasting a narrower floating tensor (or views of them, taken as they were
    taken), each with that narrower tensor as the same view: the cross-entropy of one can take
    the narrower tensor instead. The upcasts are held weakly, and count only while neither they
    nor their sources have changed since (their version counters)."""

    def __init__(self):
        self._made: dict[int, tuple[weakref.ref, int, torch.Tensor, int]] = {}

    def note(self, func, args, kwargs, out, min_bytes: int) -> None:
        if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
            return
        tensor = args[0]
        if func in _CASTS:
            if _widens(tensor, out) and out.numel() * out.element_size() >= min_bytes:
                self._remember(out, tensor)
            return
        source = self.source_of(tensor)
        if source is None or not out.is_contiguous() or any(isinstance(a, torch.dtype) for a in args[1:]):
            return  # a view as another dtype is a reinterpretation of the bytes, not a shape
        view = func(source, *args[1:], **kwargs)
        if view.shape == out.shape and view.is_contiguous():
            self._remember(out, view)

    def source_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The narrower tensor `tensor` is an unchanged upcast of, or None."""
        made = self._made.get(id(tensor))
        if made is None:
            return None
        upcast, version, source, source_version = made
        if upcast() is not tensor or tensor._version != version or source._version != source_version:
            return None
        return source

    def clear(self) -> None:
        self._made.clear()

    def _remember(self, out: torch.Tensor, source: torch.Tensor) -> None:
        self._made[id(out)] = (weakref.ref(out), out._version, source, source._version)


def _widens(narrow: torch.Tensor, wide: torch.Tensor) -> bool:
    """Whether `wide` is `narrow` cast to a wider floating dtype, which keeps every value exactly:
    the cast can be made again from `narrow` a chunk at a time."""
    return (narrow.is_floating_point() and wide.is_floating_point() and narrow.requires_grad
            and wide.element_size() > narrow.element_size() and wide.shape == narrow.shape
            and wide.device == narrow.device and narrow.is_contiguous() and wide.is_contiguous())


def _positional(args: tuple, i: int, default):
    return args[i] if len(args) > i else default
