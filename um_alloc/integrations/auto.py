"""Tags and the planner for a script that makes no um_alloc call: PyTorch's global hooks only.

- The model (model_finder's rule) has its parameters and buffers tagged at its first training
  forward, and the planner attached there when the policy asks for one (attach.py's rules); that
  forward is the planner's first step.
- Every optimizer, at its first step, gets um_alloc.tags.StepTags through the global step hooks:
  gradients retagged before each step, optimizer state born under its tag.
- If the first optimizer to step holds none of the chosen model's parameters, the guess was wrong:
  the planner comes off, and the finder waits for a module holding that optimizer's parameters.
"""
from __future__ import annotations

import logging
import weakref

import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..planner import BlockPlanner, planner_of
from ..tags import StepTags, optimizer_params, retag, tag_module
from ..wrappers import unwrap_model
from .attach import attach_planner
from .model_finder import ModelFinder

__all__ = ["AutoAttach"]

log = logging.getLogger("um_alloc")


class AutoAttach:
    """Watches a script's training through global hooks until remove(). See the module docstring.

    Args:
        within: only this module and its descendants may be the model (None: any module).
        planner_options: keyword arguments for um_alloc.plan.
    """

    def __init__(self, within: nn.Module | None = None, **planner_options):
        self.model: nn.Module | None = None
        self.planner: BlockPlanner | None = None
        self._own_planner = False
        self._planner_options = planner_options
        self._step_tags: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self._checked = False
        self._finder = ModelFinder(self._found, within).watch()
        self._handles = [register_optimizer_step_pre_hook(self._before_step),
                         register_optimizer_step_post_hook(self._after_step)]

    def remove(self) -> None:
        """Stops watching; the planner this attached comes off the model (`planner` still reports)."""
        self._finder.remove()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.planner is not None and self._own_planner:
            self.planner.remove()

    def _found(self, module: nn.Module, args: tuple) -> None:
        self.model = unwrap_model(module)
        tag_module(self.model)
        attached = planner_of(self.model)  # the script's own um_alloc.plan(), kept as it is
        try:
            self.planner = attach_planner(self.model, **self._planner_options)
        except ValueError as error:  # no submodules in it, say: the script runs on, under the budget alone
            log.warning("um_alloc run: no planner for %s: %s", type(self.model).__name__, error)
            self.planner = None
        self._own_planner = self.planner is not None and attached is None
        log.info("um_alloc run: the model is %s%s", type(self.model).__name__,
                 ", planned per block" if self.planner else "")
        if self._own_planner and self.model is module:
            # Its own hooks were added inside this forward's hooks: they run from the next call.
            # A global pre-hook sees no keyword arguments: the planner counts this step for the
            # input of the next, as it would have counted it under its own hooks.
            self.planner.begin_forward(args)

    def _before_step(self, optimizer, args, kwargs) -> None:
        tags = self._step_tags.get(optimizer)
        if tags is None:
            params = optimizer_params(optimizer)
            retag(params, "parameter")  # those of a model the finder did not pick
            tags = self._step_tags[optimizer] = StepTags(params)
            self._check_model(params)
        tags.before(optimizer)

    def _after_step(self, optimizer, args, kwargs) -> None:
        tags = self._step_tags.get(optimizer)
        if tags is not None:
            tags.after(optimizer)

    def _check_model(self, params: list) -> None:
        """At the first optimizer step: does it step the chosen model? If not, pick again."""
        if self._checked:
            return
        self._checked = True
        if self.model is None or _shares(self.model, params):
            return
        log.warning("um_alloc run: %s holds none of the parameters the first optimizer steps; waiting for the "
                    "module that does", type(self.model).__name__)
        self._drop_planner()
        self.model = None
        self._finder.watch(require_params=params)

    def _drop_planner(self) -> None:
        if self.planner is not None and self._own_planner:
            self.planner.remove()
        self.planner, self._own_planner = None, False


def _shares(model: nn.Module, params: list) -> bool:
    ids = {id(p) for p in params}
    return any(id(p) in ids for p in model.parameters())
