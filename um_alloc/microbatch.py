"""Micro-batch streaming (Piao et al., *Micro-Batch Streaming*, Algorithm 1), made exact.

A mini-batch too large for the GPU is split along dim 0 into micro-batches that fit. Each is copied
to the device on a side stream while the previous one computes; forward and backward run per
micro-batch, gradients accumulate, and the optimizer steps once per mini-batch.

Exactness. The paper divides every micro-batch loss by the number of micro-batches, which gives the
mini-batch gradient only when all micro-batches are equally large. We weight by counts instead:
``loss_fn`` returns the mean over the ``c_i`` counted items of micro-batch ``i``; with
``C = sum(c_i)`` we backpropagate ``loss_i * c_i / C``, so the accumulated gradient is the gradient
of the mini-batch mean for any split, including an uneven last micro-batch and losses that average
over a data-dependent number of items (masked tokens in MLM: pass ``count_fn``).

Not exact: anything computing statistics across dim 0. BatchNorm normalises each micro-batch with
its own statistics and updates its running statistics once per micro-batch; LayerNorm (BERT) and
GroupNorm are per sample and unaffected. Dropout draws different masks than one full-batch pass.

Under DistributedDataParallel (pass the DDP module as ``model``) every micro-batch but the last runs
under ``no_sync()``, so gradients are reduced once a mini-batch, not once a micro-batch.

Typical use::

    streamer = MicroBatchStreamer(model, optimizer, lambda m, b: m(**b).loss,
                                  micro_batch_size="auto",
                                  count_fn=lambda b: int((b["labels"] != -100).sum()),
                                  autocast_dtype=torch.bfloat16)
    for batch in loader:             # host tensors; DataLoader(pin_memory=True) saves a copy
        loss = streamer.step(batch)  # the loss the full batch would have reported
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import arguments
from .errors import At
from .install import is_installed
from .tag_names import TAGS
from .tags import retag
from .tensor_trees import map_tensors, tensor_leaves, tensors

__all__ = ["MicroBatchStreamer", "split_batch", "batch_size_of", "shape_signature", "find_micro_batch_size"]

log = logging.getLogger(__name__)

Batch = Any  # a tensor, or a (nested) tuple / list / dict of tensors sharing dim 0
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
CountFn = Callable[[Batch], "int | torch.Tensor"]


# --- batch structure ---------------------------------------------------------------------------

def _check_size(value: object, name: str, where: str = "micro-batch streaming") -> int:
    return arguments.whole_number(value, At(where, name), minimum=1)


def batch_size_of(batch: Batch) -> int:
    """The common dim-0 size of every tensor in the batch.

    Raises TypeError for a non-tensor leaf, ValueError for no tensors, a 0-dim tensor, tensors
    that disagree on dim 0 (naming both and their sizes) or an empty batch.
    """
    leaves = list(tensor_leaves(batch, "batch", strict=True))
    if not leaves:
        raise ValueError("the batch holds no tensors")
    first_path, first = leaves[0]
    for path, tensor in leaves:
        if tensor.dim() == 0:
            raise ValueError(f"{path} is a 0-dim tensor; every tensor needs a batch dimension (dim 0)")
        if tensor.shape[0] != first.shape[0]:
            raise ValueError(f"tensors disagree on the batch size (dim 0): {first_path} has "
                             f"{first.shape[0]}, {path} has {tensor.shape[0]}")
    if first.shape[0] == 0:
        raise ValueError("the batch is empty: dim 0 has size 0")
    return first.shape[0]


def split_batch(batch: Batch, micro_batch_size: int) -> list[Batch]:
    """Splits a batch along dim 0 into views of ``micro_batch_size`` samples (the last may be
    smaller); containers keep their types. Raises as ``batch_size_of`` and ValueError for a size < 1.
    """
    size = _check_size(micro_batch_size, "micro_batch_size")
    total = batch_size_of(batch)
    starts = range(0, total, size)
    return [map_tensors(lambda t, s=start: t.narrow(0, s, min(size, total - s)), batch) for start in starts]


def shape_signature(batch: Batch) -> tuple:
    """What the memory of a micro-batch depends on besides its size: per leaf, shape without dim 0
    and dtype."""
    return tuple((path, tuple(t.shape[1:]), t.dtype) for path, t in tensor_leaves(batch, "batch", strict=True))


# --- finding the micro-batch size -------------------------------------------------------------

@dataclass
class SizeBounds:
    """What probing learnt for one shape signature."""
    fits: int = 0             # largest micro-batch seen to fit; 0: none yet
    fails: int | None = None  # smallest micro-batch seen to run out of memory; None: none yet


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _probe(run_fn: Callable[[Batch], object], micro: Batch, reset_fn: Callable[[], None] | None) -> bool:
    try:
        run_fn(micro)
        fits = True
    except torch.OutOfMemoryError:
        fits = False
    # Out here the exception and its traceback are gone; their frames held the probe's tensors.
    if reset_fn is not None:
        reset_fn()
    if not fits:
        _release_memory()
    return fits


def find_micro_batch_size(run_fn: Callable[[Batch], object], batch: Batch, *, start: int | None = None,
                          cache: dict[tuple, SizeBounds] | None = None,
                          reset_fn: Callable[[], None] | None = None) -> int:
    """The largest micro-batch of ``batch`` for which ``run_fn`` (forward + backward) fits.

    Probes run ``run_fn`` on the first micro-batch of a candidate size; ``torch.OutOfMemoryError``
    means "does not fit", anything else propagates. The search starts at the whole batch (or
    ``start`` if smaller), halves until a size fits, then binary-searches between the largest fit
    and the smallest failure. ``reset_fn`` runs after every probe (zero the gradients). With
    ``cache`` (a dict owned by the caller) bounds are kept per ``shape_signature``, so a batch of
    a known signature costs no probes. Each probe is logged at INFO. Raises torch.OutOfMemoryError
    if even one sample does not fit.
    """
    total = batch_size_of(batch)
    limit = total if start is None else min(_check_size(start, "start"), total)
    key = shape_signature(batch)
    bounds = cache.setdefault(key, SizeBounds()) if cache is not None else SizeBounds()

    def probe(size: int) -> bool:
        fits = _probe(run_fn, split_batch(batch, size)[0], reset_fn)
        log.info("micro-batch probe: %d of %d samples %s", size, total, "fit" if fits else "ran out of memory")
        if fits:
            bounds.fits = max(bounds.fits, size)
        else:
            bounds.fails = size if bounds.fails is None else min(bounds.fails, size)
        return fits

    size = limit if bounds.fails is None else min(limit, bounds.fails - 1)
    while size > bounds.fits and not probe(size):
        size //= 2
    while bounds.fails is not None and bounds.fits < min(limit, bounds.fails - 1):
        probe((bounds.fits + min(limit + 1, bounds.fails)) // 2)
    if bounds.fits == 0:
        raise torch.OutOfMemoryError(f"micro-batch streaming: not even 1 sample of this batch fits "
                                     f"(mini-batch of {total}, per-sample shapes {key})")
    return min(bounds.fits, limit)


@contextlib.contextmanager
def _restoring_state(model: nn.Module, device: torch.device):
    """Yields a snapshot() to call before the first probe; on exit puts back the model's buffers
    (BatchNorm running statistics) and the RNG states, so probing does not change training."""
    saved: dict[str, Any] = {}

    def snapshot() -> None:
        if not saved:
            saved["buffers"] = [(b, b.detach().to("cpu", copy=True)) for b in model.buffers()]
            saved["cpu_rng"] = torch.get_rng_state()
            if device.type == "cuda":
                saved["cuda_rng"] = torch.cuda.get_rng_state(device)

    try:
        yield snapshot
    finally:
        if saved:
            with torch.no_grad():
                for buffer, value in saved["buffers"]:
                    buffer.copy_(value)
            torch.set_rng_state(saved["cpu_rng"])
            if "cuda_rng" in saved:
                torch.cuda.set_rng_state(saved["cuda_rng"], device)


# --- streaming ---------------------------------------------------------------------------------

class _CopyStream:
    """Copies micro-batches to the device on a side CUDA stream, so the copy of the next overlaps
    the compute of the current. On a CPU device there is nothing to copy and no stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def pin(self, batch: Batch) -> Batch:
        """Pins host tensors once per mini-batch (a copy unless already pinned); slices of a pinned
        tensor are pinned, which non_blocking copies need to be asynchronous."""
        if self.stream is None:
            return batch
        return map_tensors(lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t, batch)

    def start(self, micro: Batch) -> tuple[Batch, torch.cuda.Event | None]:
        if self.stream is None:
            return map_tensors(lambda t: t.to(self.device), micro), None
        with torch.cuda.stream(self.stream):
            moved = map_tensors(lambda t: t.to(self.device, non_blocking=True), micro)
        event = torch.cuda.Event()
        event.record(self.stream)
        return moved, event

    def ready(self, pending: tuple[Batch, torch.cuda.Event | None]) -> Batch:
        """Makes the current stream wait for the copy; returns the device micro-batch."""
        moved, event = pending
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            # Allocated on the copy stream, used on the compute stream: without this the allocator
            # could hand the memory to the copy stream again while compute still reads it.
            for tensor in tensors(moved):
                tensor.record_stream(compute)
        return moved


def _check_streamer_arguments(model, optimizer, loss_fn, micro_batch_size, count_fn, autocast_dtype,
                              max_micro_batch, max_grad_norm, input_tag) -> None:
    """MicroBatchStreamer's arguments, each refused with what it allows before any work."""
    at = At("MicroBatchStreamer", "").child
    if not isinstance(model, nn.Module):
        raise at("model").error("not a torch.nn.Module", received=model)
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise at("optimizer").error("not a torch.optim.Optimizer", allowed="an optimizer, or None", received=optimizer)
    arguments.function(loss_fn, at("loss_fn"))
    arguments.function(count_fn, at("count_fn"), optional=True)
    if micro_batch_size != "auto":
        if isinstance(micro_batch_size, str):
            raise at("micro_batch_size").error("invalid value", allowed="auto, or an integer >= 1",
                                               received=micro_batch_size)
        _check_size(micro_batch_size, "micro_batch_size", "MicroBatchStreamer")
    if max_micro_batch is not None:
        _check_size(max_micro_batch, "max_micro_batch", "MicroBatchStreamer")
    if max_grad_norm is not None:
        arguments.number_in(max_grad_norm, at("max_grad_norm"), 0, math.inf)
    if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
        raise at("autocast_dtype").error("not a torch.dtype", allowed="None, torch.bfloat16, torch.float16",
                                         received=autocast_dtype)
    if input_tag is not None:
        arguments.one_of(input_tag, at("input_tag"), TAGS)


def _streamer_device(device, model: nn.Module) -> torch.device:
    if device is None:
        return next(model.parameters()).device
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise At("MicroBatchStreamer", "device").error("not a device", allowed="cuda, cuda:N, cpu, or None",
                                                       received=device) from None


class MicroBatchStreamer:
    """Trains on mini-batches by streaming micro-batches through the device.

    model, optimizer: the optimizer steps once per mini-batch (None: only ``accumulate``).
    loss_fn(model, micro_batch) -> 0-dim tensor: the mean over the micro-batch's counted items;
        it runs under autocast when ``autocast_dtype`` is set.
    micro_batch_size: int >= 1 (clamped to the mini-batch, as in the paper), or "auto": the
        largest that fits, found by probing the first mini-batch of each shape signature (see
        ``find_micro_batch_size``; buffers and RNG states are restored after probing). In auto mode
        an out-of-memory error during a step (memory grew, e.g. optimizer state appeared after the
        first step) forgets the fit, re-probes and redoes the mini-batch: before the optimizer
        step nothing has changed, so the result stays exact.
    device: where to compute (default: the device of the model's first parameter).
    count_fn(micro_batch) -> int: counted items; default the number of samples. Called on the
        host micro-batch before the copy, so counting does not synchronise the GPU.
    scaler: a torch.amp.GradScaler; scale per micro-batch, unscale/step/update once per mini-batch.
    max_micro_batch: upper bound for the auto search.
    max_grad_norm: clip the mini-batch gradient to this norm before the step (after unscaling).
    input_tag: um_alloc tag given to device micro-batches when um_alloc is installed (None: don't).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: LossFn, *,
                 micro_batch_size: int | str = "auto", device: torch.device | str | None = None,
                 count_fn: CountFn | None = None, scaler: torch.amp.GradScaler | None = None,
                 autocast_dtype: torch.dtype | None = None, max_micro_batch: int | None = None,
                 max_grad_norm: float | None = None, input_tag: str | None = "input"):
        _check_streamer_arguments(model, optimizer, loss_fn, micro_batch_size, count_fn, autocast_dtype,
                                  max_micro_batch, max_grad_norm, input_tag)
        self.model, self.optimizer, self.loss_fn, self.count_fn = model, optimizer, loss_fn, count_fn
        self.micro_batch_size = micro_batch_size
        self.device = _streamer_device(device, model)
        self.scaler, self.autocast_dtype = scaler, autocast_dtype
        self.max_micro_batch, self.max_grad_norm, self.input_tag = max_micro_batch, max_grad_norm, input_tag
        self.last_micro_batch_size: int | None = None  # size used by the latest mini-batch
        self.last_count: int | None = None             # counted items in the latest mini-batch
        self._sizes: dict[tuple, SizeBounds] = {}
        self._copies = _CopyStream(self.device)

    def step(self, batch: Batch) -> float:
        """Zero grads, accumulate the mini-batch gradient, step the optimizer once. Returns the
        mini-batch loss as one full-batch pass would report it. A mini-batch with no counted items
        is skipped (warning, no step) and returns nan."""
        if self.optimizer is None:
            raise RuntimeError("MicroBatchStreamer.step needs an optimizer; use accumulate() without one")
        loss = self.accumulate(batch)
        if self.last_count == 0:
            return loss
        if self.scaler is not None and self.max_grad_norm is not None:
            self.scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss

    def accumulate(self, batch: Batch) -> float:
        """Zero grads, then forward + backward every micro-batch; afterwards ``.grad`` holds the
        gradient of the mini-batch loss (times the scaler's scale, if any). Returns that loss."""
        while True:
            size = self.resolve_micro_batch_size(batch)
            try:
                return self._accumulate(batch, size)
            except torch.OutOfMemoryError as error:
                if self.micro_batch_size != "auto":
                    error.add_note(f"micro-batch streaming: a micro-batch of {size} samples did not fit; "
                                   "use a smaller micro_batch_size or 'auto'")
                    raise
            log.warning("micro-batch of %d samples ran out of memory during a step; searching again", size)
            self._sizes[shape_signature(batch)] = SizeBounds(fits=0, fails=size)
            self._zero_grad()
            _release_memory()

    def resolve_micro_batch_size(self, batch: Batch) -> int:
        """The micro-batch size the next step on this batch will use (probing if auto)."""
        total = batch_size_of(batch)
        if self.micro_batch_size != "auto":
            return min(self.micro_batch_size, total)
        with _restoring_state(self.model, self.device) as snapshot:
            def run(micro: Batch) -> None:
                snapshot()
                with self._reduction(last=False):  # a probe's gradients are thrown away: never reduced
                    self._backward(self._forward(self._copies.ready(self._copies.start(micro))))
            return find_micro_batch_size(run, batch, start=self.max_micro_batch, cache=self._sizes,
                                         reset_fn=self._zero_grad)

    # -- one mini-batch --

    def _accumulate(self, batch: Batch, size: int) -> float:
        self._zero_grad()
        micros = split_batch(self._copies.pin(batch), size)
        counts = [self._count(micro) for micro in micros]
        total = sum(counts)
        self.last_micro_batch_size, self.last_count = size, total
        if total == 0:
            warnings.warn("micro-batch streaming: the mini-batch has no counted items (count_fn gave 0); "
                          "skipped without an optimizer step", RuntimeWarning, stacklevel=3)
            return math.nan
        work = [(micro, count) for micro, count in zip(micros, counts) if count > 0]
        loss_sum = None
        pending = self._copies.start(work[0][0])
        for index, (_, count) in enumerate(work):
            micro = self._copies.ready(pending)
            if index + 1 < len(work):
                pending = self._copies.start(work[index + 1][0])
            with self._reduction(last=index == len(work) - 1):
                weighted = self._forward(micro) * (count / total)
                self._backward(weighted)
            loss_sum = weighted.detach() if loss_sum is None else loss_sum + weighted.detach()
            del micro, weighted
        return loss_sum.item()

    def _forward(self, micro: Batch) -> torch.Tensor:
        self._retag_input(micro)
        autocast = (torch.autocast(self.device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None else contextlib.nullcontext())
        with autocast:
            loss = self.loss_fn(self.model, micro)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a 0-dim tensor (the mean over the micro-batch's "
                             f"counted items), got {shape}")
        # Half-precision losses are weighted in float32; float64 stays float64.
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss

    def _reduction(self, last: bool):
        """Where the model is DistributedDataParallel (it has ``no_sync``), every micro-batch but
        the last runs under ``no_sync()``: gradients accumulate locally and the last backward
        reduces the mini-batch's sum once, as one step of plain DDP does. Every rank then reduces
        once a mini-batch, whatever number of micro-batches its own memory allowed.

        Except on the first step of ``static_graph=True``: PyTorch's reducer fails (an internal
        assert) when a static graph's first backward runs under ``no_sync()``, so until DDP has
        run one reduced backward every micro-batch, and every probe, is reduced."""
        no_sync = getattr(self.model, "no_sync", None)
        if last or not callable(no_sync) or _static_graph_not_yet_recorded(self.model):
            return contextlib.nullcontext()
        return no_sync()

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _count(self, micro: Batch) -> int:
        if self.count_fn is None:
            return batch_size_of(micro)
        value = self.count_fn(micro)
        value = value.item() if isinstance(value, torch.Tensor) else value
        if value < 0 or value != int(value):
            raise ValueError(f"count_fn must return a whole number >= 0, got {value!r}")
        return int(value)

    def _zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)

    def _retag_input(self, micro: Batch) -> None:
        if self.input_tag is None or self.device.type != "cuda":
            return
        if is_installed():
            retag(micro, self.input_tag)


def _static_graph_not_yet_recorded(model: nn.Module) -> bool:
    """DDP(static_graph=True) before its first reduced backward (DDP's own flag for it; a wrapper
    without the flag counts as recorded)."""
    return bool(getattr(model, "static_graph", False)) and not getattr(
        model, "_static_graph_delay_allreduce_enqueued", True)
