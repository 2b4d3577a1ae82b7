"""Tagging allocations: scopes that tag what is allocated inside them, and retagging what exists.

The tags themselves (TAGS, DEFAULT_TAG) are the vocabulary in tag_names.py; they are also
importable from here.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from . import _lib
from .floor import check_budget
from .install import installation, is_installed
from .pool import ChunkPool
from .sizes import positive_size_arg
from .tag_names import DEFAULT_TAG, TAGS, tag_index
from .tensor_trees import local_shard, tensors
from .wrappers import unwrap_model, unwrap_optimizer

__all__ = ["TAGS", "DEFAULT_TAG", "tag", "OpenScopes", "retag", "tag_module", "tag_optimizer", "tag_training",
           "StepTags", "TrainingTags", "optimizer_params"]


@contextlib.contextmanager
def tag(name: str, min_size: int | str | None = None) -> Iterator[None]:
    """Tags every CUDA allocation made inside the block with `name`.

    With `min_size` (bytes, or a size like "256MiB"), only allocations of at least that many bytes
    get `name`; smaller ones keep the tag they would have had. One such scope is open at a time:
    an inner one replaces the outer one until it ends.

    The scope is process-wide, not per thread: autograd runs backward on its own threads and
    its allocations must see the tag too. Nested scopes restore the outer tag on exit.
    """
    lib = _lib.load()
    index = tag_index(name)
    if min_size is None:
        restore, previous = lib.um_set_current_tag, (lib.um_current_tag(),)
        lib.um_set_current_tag(index)
    else:
        smallest = positive_size_arg(min_size, "min_size", "um_alloc.tag")
        restore, previous = lib.um_set_large_tag, (lib.um_large_tag(), lib.um_large_tag_min())
        lib.um_set_large_tag(index, smallest)
    try:
        yield
    finally:
        restore(*previous)


@dataclass(frozen=True)
class OpenScopes:
    """The tag() scopes open at a moment: the tag every allocation gets, and the tag of those of at
    least `large_min` bytes (0: no such scope). Taken with now() and put back for a while with
    restored(), so that work done later allocates as work done then did: the planner runs a unit
    by itself after a step under the scopes its call had (a spilled loss's, spill.py)."""
    current: int
    large: int
    large_min: int

    @classmethod
    def now(cls) -> "OpenScopes":
        lib = _lib.load()
        return cls(lib.um_current_tag(), lib.um_large_tag(), lib.um_large_tag_min())

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        lib, before = _lib.load(), OpenScopes.now()
        lib.um_set_current_tag(self.current)
        lib.um_set_large_tag(self.large, self.large_min)
        try:
            yield
        finally:
            lib.um_set_current_tag(before.current)
            lib.um_set_large_tag(before.large, before.large_min)


def retag(obj: Any, name: str) -> int:
    """Retags the CUDA tensors in `obj` (a tensor, or nested tuples, lists and dicts of them).

    Each allocation is retagged once, whatever views of it `obj` holds, and gets `name`'s hints
    and prefetch. CPU tensors are skipped. One call into the core per device, so retagging all
    of a model's gradients every step costs microseconds, not a call per tensor.
    Returns the number of allocations retagged.
    """
    installation()  # raises a clear error when um_alloc is not installed
    tag_index(name)
    by_device: dict[int, set[int]] = {}
    for t in map(local_shard, tensors(obj)):
        if t.is_cuda and t.untyped_storage().nbytes():
            by_device.setdefault(t.device.index, set()).add(t.untyped_storage().data_ptr())
    for device, bases in by_device.items():
        stream = torch.cuda.current_stream(device).cuda_stream
        found = ChunkPool.for_device(device).retag_many(sorted(bases), name, stream)
        if found != len(bases):
            raise RuntimeError(f"um_alloc.retag: {len(bases) - found} of {len(bases)} tensors on cuda:{device} "
                               "were not allocated by um_alloc (made before install()?)")
    return sum(len(b) for b in by_device.values())


def tag_module(module, params: str = "parameter", grads: str = "gradient") -> int:
    """Retags a module's parameters and buffers, and their existing .grad tensors. `module` may be
    wrapped (DDP, DataParallel, torch.compile: see um_alloc.wrappers)."""
    module = unwrap_model(module)
    n = retag(list(module.parameters()) + list(module.buffers()), params)
    return n + retag([p.grad for p in module.parameters() if p.grad is not None], grads)


def tag_optimizer(optimizer, name: str = "optimizer_state") -> int:
    """Retags the tensors an optimizer keeps in its state (moments, step counts on the GPU).
    `optimizer` may be wrapped (accelerate, Lightning: anything exposing it as .optimizer)."""
    optimizer = unwrap_optimizer(optimizer)
    return retag([v for state in optimizer.state.values() for v in state.values()], name)


class StepTags:
    """Keeps gradients and an optimizer's state tagged as they are created, given the optimizer's
    step hooks: call before(optimizer) ahead of each step and after(optimizer) once it returned.

    Gradients appear during backward and, with zero_grad(set_to_none=True), anew every step;
    optimizer state appears at the first step. Before each step all gradients are retagged in one
    call. A step that may create state (the first, or one after the state grew) runs under the
    optimizer_state tag, so the state is born with its tag and its hints: a host-mapped state is
    then never backed by GPU memory. Later steps run under "other": their temporaries (foreach
    intermediates) are scratch and must not be placed like state. New state tensors are retagged
    once after the step that made them.
    """

    def __init__(self, params):
        self._params = [p for p in params if p.requires_grad]
        self._state_count = -1
        self._step_scope = None

    def before(self, optimizer) -> None:
        self._close_scope()  # a step that raised (out of memory) never reached after()
        retag([p.grad for p in self._params if p.grad is not None], "gradient")
        settled = self._state_count == _state_count(optimizer) > 0
        self._step_scope = tag("other" if settled else "optimizer_state")
        self._step_scope.__enter__()

    def after(self, optimizer) -> None:
        self._close_scope()  # none open: attached after this step's pre-hooks had run
        count = _state_count(optimizer)
        if count != self._state_count:  # new state tensors: retag once, not every step
            self._state_count = count
            tag_optimizer(optimizer)

    def _close_scope(self) -> None:
        if self._step_scope is not None:
            self._step_scope.__exit__(None, None, None)
            self._step_scope = None


def optimizer_params(optimizer) -> list:
    """The parameters an optimizer steps, in its groups' order."""
    return [p for group in unwrap_optimizer(optimizer).param_groups for p in group["params"]]


class TrainingTags:
    """A model's parameters tagged now; its gradients and an optimizer's state as they appear
    (StepTags, driven by the optimizer's own step hooks). Both may be wrapped (um_alloc.wrappers):
    the hooks go on the inner optimizer, whose step() every wrapper's step() calls."""

    def __init__(self, model, optimizer):
        model, optimizer = unwrap_model(model), unwrap_optimizer(optimizer)
        self._tags = StepTags(model.parameters())
        tag_module(model)
        self._handles = [optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._tags.before(opt)),
                         optimizer.register_step_post_hook(lambda opt, args, kwargs: self._tags.after(opt))]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _state_count(optimizer) -> int:
    return sum(len(s) for s in optimizer.state.values())


def tag_training(model, optimizer) -> TrainingTags:
    """The common case: tags parameters, gradients and optimizer state, now and as they appear.
    Wrapped models and optimizers are accepted (DDP, torch.compile, accelerate, Lightning).

    Under a hard budget it first refuses one below what stays on the GPU all step (parameters,
    gradients, optimizer state not in host memory): um_alloc.floor.BudgetBelowFloor, with the
    figures, instead of an out-of-memory error in the first step."""
    model, optimizer = unwrap_model(model), unwrap_optimizer(optimizer)
    if is_installed():
        check_budget(model, optimizer)
    return TrainingTags(model, optimizer)
