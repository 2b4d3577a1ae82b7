"""The tail of a step in host memory: the part of a model whose temporaries the GPU cannot hold.

    um_alloc.install("large_batch.yaml")   # scheduler.spill_min_size, tags.spill host-mapped
    ...
    um_alloc.spill_from(model.cls)         # BERT's MLM head, and the loss computed after it

A loss over a large vocabulary makes temporaries that grow with batch x sequence x vocabulary. At
BERT-Large batch 80, sequence 512, the bf16 logits, their fp32 copy and the fp32 log-softmax are
12.5 GB together, and backward makes as much again: more than an 8 GiB budget before parameters
and gradients. Offloading saved tensors (um_alloc.offload) cannot lower that, since a single
operation needs them at once.

From `module`'s forward to the end of the step's forward, and in backward until the gradient
reaches `module`'s inputs, allocations of at least `min_size` bytes get the tag "spill". A policy
places that tag in host memory the GPU maps (preferred_location: cpu, accessed_by: [gpu]), so
kernels write it over the link at about the link's rate and read it at 21-34 GB/s (on an H200),
nothing migrates, and it never counts against the budget. Smaller allocations keep their tag:
the head's weight casts and gradients stay on the GPU, where matmuls read them many times.
ActivationOffload leaves saved tensors in spilled memory where they are.

Forward under torch.no_grad(), or with no input that requires grad, spills only inside `module`'s
own forward. A step whose backward never reaches `module` (an error in backward, say) leaves the
scope open until the next forward of `module` or remove().
"""
from __future__ import annotations

import logging

import torch

from .errors import At
from .install import installation, is_installed
from .policy import host_mapped
from .sizes import format_size, positive_size_arg
from .tags import tag
from .tensor_trees import tensors

__all__ = ["SpillFrom", "spill_from"]
log = logging.getLogger(__name__)


class SpillFrom:
    """Tags the large allocations of `module`'s forward tail and backward head "spill"; see the
    module docstring. Works without um_alloc installed (the tag is then never used), for tests;
    spill_from() is the checked entry point."""

    def __init__(self, module: torch.nn.Module, min_size: int | str):
        self.min_size = positive_size_arg(min_size, "min_size", "um_alloc.spill_from")  # refused now, not at forward
        self._scope = None             # the open tag("spill", min_size) scope
        self._until_backward = False   # the open scope ends in backward, not with the forward
        self._handles = [module.register_forward_pre_hook(self._forward_starts),
                         module.register_forward_hook(self._forward_ends)]

    def _forward_starts(self, module, args) -> None:
        self._close()  # left open by a step whose backward did not reach here
        self._open()
        inputs = [t for t in tensors(args) if t.requires_grad]
        self._until_backward = torch.is_grad_enabled() and bool(inputs)
        if self._until_backward:
            # Backward has passed through `module` once a gradient reaches one of its inputs.
            torch.autograd.graph.register_multi_grad_hook(inputs, self._backward_done, mode="any")

    def _forward_ends(self, module, args, output) -> None:
        if not self._until_backward:  # no backward will come through here to end it
            self._close()

    def _backward_done(self, grad) -> None:
        self._close()

    def _open(self) -> None:
        self._scope = tag("spill", self.min_size)
        self._scope.__enter__()

    def _close(self) -> None:
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def remove(self) -> None:
        """Removes the hooks and ends an open scope."""
        self._close()
        for handle in self._handles:
            handle.remove()
        self._handles = []


def spill_from(module: torch.nn.Module, min_size: int | str | None = None) -> SpillFrom:
    """Puts the large temporaries of `module`'s forward tail and backward head in host memory the
    GPU maps; see the module docstring. min_size defaults to the installed policy's
    scheduler.spill_min_size. Raises ValueError (PolicyError for the arguments) when `module` is
    not a module or `min_size` not a size > 0, when um_alloc is not installed, when no size is
    given either way, or when the policy does not place the spill tag in host memory."""
    if not isinstance(module, torch.nn.Module):
        raise At("um_alloc.spill_from", "module").error("not a torch.nn.Module", received=module)
    if min_size is not None:
        positive_size_arg(min_size, "min_size", "um_alloc.spill_from")
    if not is_installed():
        raise ValueError("um_alloc.spill_from: um_alloc is not installed (call um_alloc.install first); "
                         "without it nothing is spilled")
    policy = installation().policy
    if not host_mapped(policy.tags["spill"]):
        raise ValueError(f"um_alloc.spill_from: policy {policy.name!r} does not place tag spill in host memory; "
                         "add under tags: `spill: {preferred_location: cpu, accessed_by: [gpu]}`")
    if min_size is None:
        min_size = policy.scheduler.spill_min_size
        if min_size is None:
            raise ValueError(f"um_alloc.spill_from: no min_size given and policy {policy.name!r} sets no "
                             "scheduler.spill_min_size")
    spill = SpillFrom(module, min_size)
    log.info("spilling allocations of at least %s from %s on to host memory",
             format_size(spill.min_size), type(module).__name__)
    return spill
