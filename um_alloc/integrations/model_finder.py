"""Which module is "the model" a script trains, found without a call in the script.

The rule: the model is the outermost module whose forward runs with gradients enabled and which
has parameters that require them, at its first such forward. Outermost means no other watched
module's forward is running around it, so a block or a loss module called inside the model never
qualifies; a module without trainable parameters (a loss, a frozen teacher) and a forward under
``torch.no_grad()`` (evaluation) never do either. Wrappers (DDP, torch.compile) are unwrapped by
whoever receives the model. Once optimizers have stepped, the model must also hold parameters one of
them steps (``require_params``), which the launcher uses to pick again after a wrong first guess.

PyTorch's global forward hooks see every module's call while the finder watches; it removes them
as soon as it has found the model, so the steps after cost nothing.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

__all__ = ["ModelFinder"]

Found = Callable[[nn.Module, tuple], None]


class ModelFinder:
    """Calls ``on_found(model, args)`` from inside the model's first training forward (its own
    forward hooks added then run from the next call; its children's run in this one).

    Args:
        on_found: what to do with the model; `args` are its forward's positional arguments
            (a global pre-hook does not see keyword arguments).
        within: watch only this module and its descendants (a LightningModule); None: every module.
    """

    def __init__(self, on_found: Found, within: nn.Module | None = None):
        self._on_found = on_found
        self._within = None if within is None else {id(m) for m in within.modules()}
        self._required: set[int] | None = None
        self._depth = 0
        self._handles: list = []

    def watch(self, require_params=None) -> "ModelFinder":
        """Starts (or restarts) watching; with `require_params`, only a module holding one of them
        qualifies."""
        self.remove()
        self._required = None if require_params is None else {id(p) for p in require_params}
        self._depth = 0
        self._handles = [register_module_forward_pre_hook(self._before_forward),
                         register_module_forward_hook(self._after_forward, always_call=True)]
        return self

    @property
    def watching(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _watched(self, module: nn.Module) -> bool:
        return self._within is None or id(module) in self._within

    def _before_forward(self, module: nn.Module, args) -> None:
        if not self._watched(module):
            return
        self._depth += 1
        if self._depth == 1 and torch.is_grad_enabled() and self._qualifies(module):
            self.remove()
            self._on_found(module, args)

    def _after_forward(self, module: nn.Module, args, output) -> None:
        if self._watched(module):
            self._depth -= 1

    def _qualifies(self, module: nn.Module) -> bool:
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not trainable:
            return False
        return self._required is None or any(id(p) in self._required for p in trainable)
