"""The selective decision: PyTorch's selective checkpointing, keeping the outputs of the ops worth
their bytes (matmuls, convolutions, attention) and recomputing the rest.

Only the kept ops go through the checkpoint's bookkeeping. It pairs each op of the recomputation
with the forward's by counting calls per op, and the forward need not call the cheap ops as often
as the rerun does: under autocast, a block called twice in a step finds its weights' casts in
autocast's cache in its second call, while its rerun (without that cache, see
replay._autocast_uncached) casts them again. Counted, those casts would make the rerun fail
("_to_copy ... not found in storage"); run as they come, they are recomputed as the policy says.
Under tracing (torch.compile's AOT autograd) every op still goes through, as the tracer tags each.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torch.utils.checkpoint import _CachedTorchDispatchMode, _CachingTorchDispatchMode

try:
    from torch.utils.checkpoint import _is_compiling
except ImportError:  # older PyTorch: its own test, without the arguments
    def _is_compiling(func, args, kwargs) -> bool:
        return torch.compiler.is_compiling()

from ..tensor_trees import tensors as _tensors

__all__ = ["SAVED_OPS", "selective_contexts", "KeptOpTimer"]


def _aten_ops(*names: str) -> frozenset:
    aten = torch.ops.aten
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


# What a selective recomputation keeps: the expensive ops, whose outputs are worth their bytes.
SAVED_OPS = _aten_ops("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "_convolution",
                      "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                      "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
                      "_efficient_attention_forward")


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in SAVED_OPS and not _draws_random(func, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _draws_random(func, args, kwargs) -> bool:
    """Attention with dropout draws random numbers. Kept instead of rerun, it would leave the
    recomputation's random stream behind the forward's, and every later dropout mask would differ."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = kwargs.get("dropout_p", args[i] if i < len(args) else argument.default_value)
            return bool(value)
    return False


def _bypasses(func, args, kwargs) -> bool:
    return func not in SAVED_OPS and not _is_compiling(func, args, kwargs or {})


class _Saving(_CachingTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _bypasses(func, args, kwargs):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Replaying(_CachedTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _bypasses(func, args, kwargs):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts():
    """The forward's and the recomputation's dispatch modes for one checkpointed call: PyTorch's,
    with the bookkeeping kept to SAVED_OPS (the module docstring says why)."""
    saving, replaying = create_selective_checkpoint_contexts(_policy)
    # PyTorch's own modes, sharing their storage; only their dispatch changes.
    saving.__class__, replaying.__class__ = _Saving, _Replaying
    return saving, replaying


class KeptOpTimer(torch.utils._python_dispatch.TorchDispatchMode):
    """Calibration: the bytes and time of the ops a selective recomputation would keep."""

    def __init__(self, recorder, unit: int):
        super().__init__()
        self._recorder, self._unit = recorder, unit

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in SAVED_OPS:
            return func(*args, **(kwargs or {}))
        done = self._recorder.kept_op(self._unit)
        out = func(*args, **(kwargs or {}))
        done(sum(t.numel() * t.element_size() for t in _tensors(out)))
        return out
