"""What the launcher and the training-framework callbacks share: choosing and checking the policy,
installing before CUDA starts, attaching the planner, and the report at the end.

Rules, the same everywhere:
- The policy is the one named, else ``UM_POLICY``, else ``planner.yaml`` when a budget is given
  (a budget then gets the block planner) and ``none.yaml`` without one.
- The planner attaches when there is a budget and the policy's ``scheduler.strategy`` is ``auto`` or
  ``checkpoint``, unless one is attached already (the script called ``um_alloc.plan``) or the model
  recomputes with its own gradient checkpointing (Hugging Face's ``gradient_checkpointing=True``):
  that choice is the user's, and the budget still holds.
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch

from ..install import install, installation
from ..planner import BlockPlanner, plan, planner_of
from ..policy import ENV_VAR, Policy, load_policy, with_budget
from ..stats import memory_stats, memory_summary
from ..tags import tag_module, tag_training
from ..wrappers import unwrap_model

__all__ = ["choose_policy", "install_before_cuda", "attach_planner", "Attached", "report", "summary_text", "plan_text",
           "write_json"]

log = logging.getLogger("um_alloc")

BUDGET_POLICY = "planner"            # the policy a budget gets when none is named
PLANNED_STRATEGIES = ("auto", "checkpoint")


def choose_policy(policy, budget, *, source: str) -> Policy:
    """The policy to install, checked before any CUDA work (PolicyError: the policy's own errors).

    Args:
        policy: a path, a shipped name, a dict, a Policy, or None (UM_POLICY, else see the rules).
        budget: None, bytes, a size ("12GiB") or a fraction of device memory (0.5).
        source: where the budget came from, for its errors ("--budget", "UMAllocCallback(budget=...)").
    """
    if policy is None and budget is not None and not os.environ.get(ENV_VAR):
        policy = BUDGET_POLICY
    chosen = load_policy(policy)
    return chosen if budget is None else with_budget(chosen, budget, source=source)


def install_before_cuda(policy: Policy, *, device: int | None, installed_by: str, too_late_hint: str):
    """um_alloc.install(policy) on `device` (None: LOCAL_RANK, else 0); when CUDA has already
    started, a RuntimeError that says what to move (`too_late_hint`) instead of install()'s own advice."""
    if torch.cuda.is_initialized():
        raise RuntimeError(f"{installed_by}: CUDA was initialised before um_alloc could install, and PyTorch "
                           f"takes a new allocator only before CUDA starts. {too_late_hint}")
    return install(policy, device=device, installed_by=installed_by)


def install_for_callback(budget, policy, device: int | None, too_late_hint: str):
    """What a framework callback does when made: the policy (choose_policy) installed on `device`
    (default LOCAL_RANK), before CUDA starts."""
    chosen = choose_policy(policy, budget, source="UMAllocCallback(budget=...)")
    return install_before_cuda(chosen, device=device, installed_by="UMAllocCallback", too_late_hint=too_late_hint)


def attach_planner(model: torch.nn.Module, **options) -> BlockPlanner | None:
    """The block planner on `model` (unwrapped) when the installed policy asks for one under a
    budget (see the module's rules), else None. A planner already attached is returned as is."""
    model = unwrap_model(model)
    attached = planner_of(model)
    if attached is not None:
        return attached
    chosen = installation()
    strategy = chosen.policy.scheduler.strategy
    if strategy not in PLANNED_STRATEGIES or not chosen.budget:
        return None
    if _checkpoints_itself(model):
        log.info("um_alloc: %s recomputes with its own gradient checkpointing: no planner (the budget holds)",
                 type(model).__name__)
        return None
    return plan(model, strategy=strategy, **options)


def _checkpoints_itself(model: torch.nn.Module) -> bool:
    """Hugging Face's gradient checkpointing is on (transformers 5 renamed the property)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        value = getattr(type(model), name, None)
        if value is not None:
            return bool(getattr(model, name))
    return False


def report(planner: BlockPlanner | None, **extra) -> dict:
    """The memory statistics and the plan, as plain data (what --json writes)."""
    out = {"policy": installation().policy.name, "budget_bytes": installation().budget,
           "device": installation().device, **extra, "memory_stats": memory_stats()}
    if planner is not None:
        out["planner"] = planner.to_dict()
        out["plan_table"] = planner.table()
    return out


def summary_text(planner: BlockPlanner | None) -> str:
    """memory_summary(), then the plan's table when a planner ran."""
    text = memory_summary()
    return text if planner is None else f"{text}\n{plan_text(planner)}"


def plan_text(planner: BlockPlanner) -> str:
    """The plan's table and, once the plan has run, its measured step beside the predicted one."""
    plan = planner.plan
    measured = planner.measured_step_s() if plan is not None else None
    if measured is None:
        return planner.table()
    return (f"{planner.table()}\nmeasured step {1e3 * measured:.1f} ms, the median of the plan's steps "
            f"(predicted {1e3 * plan.predicted_step_s:.1f} ms)")


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


class Attached:
    """Tags on a model and its optimizers and, when the policy asks (see the rules above), the
    planner: what a callback attaches when training begins and takes off when it ends."""

    def __init__(self, model: torch.nn.Module, optimizers, **planner_options):
        self.model = unwrap_model(model)
        self._tags = [tag_training(self.model, optimizer) for optimizer in optimizers if optimizer is not None]
        if not self._tags:
            tag_module(self.model)
        attached = planner_of(self.model)
        self.planner = attach_planner(self.model, **planner_options)
        self._own_planner = self.planner is not None and attached is None

    def finish(self, json_path: str | os.PathLike | None = None, *, print_summary: bool = True, **extra) -> dict:
        """Reports (stderr and `json_path`), then takes the tags' hooks and its planner off."""
        data = report(self.planner, model=type(self.model).__name__, **extra)
        if print_summary:
            print(summary_text(self.planner), file=sys.stderr)
        if json_path:
            write_json(json_path, data)
        for tags in self._tags:
            tags.remove()
        if self._own_planner:
            self.planner.remove()
        return data
