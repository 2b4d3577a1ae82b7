"""The model and the optimizer inside the wrappers people train with.

Training frameworks hand callbacks wrapped objects: accelerate's ``AcceleratedOptimizer`` and
Lightning's ``LightningOptimizer`` hold the optimizer in ``.optimizer``; ``DistributedDataParallel``
and ``DataParallel`` hold the model in ``.module``; ``torch.compile`` returns an ``OptimizedModule``
holding it in ``._orig_mod``. Hooks and tags belong on what is inside: a wrapper's ``step()`` calls
the inner optimizer's, and a wrapper's forward calls the inner module's, so hooks there see every step.

Only attributes are read here, never types: neither accelerate nor Lightning needs to be installed.
"""
from __future__ import annotations

import torch.nn as nn

__all__ = ["unwrap_model", "unwrap_optimizer"]

MAX_DEPTH = 8  # wrappers nest (a LightningOptimizer around an AcceleratedOptimizer), never this deep
_MODEL_SLOTS = ("_orig_mod", "module")


def unwrap_optimizer(optimizer):
    """The optimizer that keeps the state: ``.optimizer`` followed while there is one.

    Raises:
        TypeError: what is left has no ``state`` and ``param_groups`` (not an optimizer), or the
            wrappers nest more than MAX_DEPTH deep (a cycle).
    """
    inner = optimizer
    for _ in range(MAX_DEPTH):
        wrapped = getattr(inner, "optimizer", None)
        if wrapped is None or wrapped is inner:
            break
        inner = wrapped
    else:
        raise TypeError(f"um_alloc: {type(optimizer).__name__} wraps optimizers more than {MAX_DEPTH} deep "
                        "through .optimizer (a cycle?)")
    if not (hasattr(inner, "state") and hasattr(inner, "param_groups")):
        raise TypeError(f"um_alloc: expected a torch.optim.Optimizer or a wrapper exposing one as .optimizer; "
                        f"got {type(optimizer).__name__}" + (f" holding {type(inner).__name__}"
                                                               if inner is not optimizer else ""))
    return inner


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module that does the work: ``._orig_mod`` (torch.compile) or ``.module`` (DDP,
    DataParallel, DeepSpeed, Fabric) followed while the wrapper holds nothing else.

    A wrapper is recognised by what it holds, not by its type: the inner module owns every
    parameter and buffer of the outer one. A model of your own with a child named ``module`` beside
    other layers is therefore left as it is.

    Raises:
        TypeError: `model` is not an nn.Module, or wrappers nest more than MAX_DEPTH deep.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"um_alloc: expected an nn.Module (or a wrapper of one), got {type(model).__name__}")
    inner = model
    for _ in range(MAX_DEPTH):
        wrapped = _wrapped_module(inner)
        if wrapped is None:
            return inner
        inner = wrapped
    raise TypeError(f"um_alloc: {type(model).__name__} wraps modules more than {MAX_DEPTH} deep")


def _wrapped_module(outer: nn.Module) -> nn.Module | None:
    for slot in _MODEL_SLOTS:
        inner = getattr(outer, slot, None)
        if isinstance(inner, nn.Module) and inner is not outer and _holds_everything(outer, inner):
            return inner
    return None


def _holds_everything(outer: nn.Module, inner: nn.Module) -> bool:
    """Every tensor of the outer module's is the inner one's: the outer one only wraps."""
    mine = {id(t) for t in (*outer.parameters(), *outer.buffers())}
    theirs = {id(t) for t in (*inner.parameters(), *inner.buffers())}
    return mine <= theirs
