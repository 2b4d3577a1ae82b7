"""What a training step can never move off the GPU, and a hard budget's check against it.

Under a hard budget (every shipped policy's) nothing is evicted: parameters, gradients and
optimizer state stay where they are all step, unless the policy places their tag in host memory
the GPU maps (host_optimizer.yaml's optimizer state). Activations can be recomputed or moved
(the planner, the offload); these cannot. A budget below their sum can only end in an
out-of-memory error in the middle of a step, so tag_training() refuses it before the first one.

The figures count each tensor as the pool holds it (a request above half a chunk takes whole
chunks), on whatever device the model is: a model on the CPU or the meta device gives the
figures its GPU copy will have. Optimizer state that does not exist yet (before the first step)
is estimated from the optimizer's class and settings, for those whose state is known (Adam,
AdamW, SGD, Adagrad, RMSprop); for others only existing state is counted. The figures are a
lower bound: a budget above them can still be too small for the step's activations.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .install import installation, is_installed
from .policy import Policy, host_mapped
from .sizes import format_size
from .tensor_trees import local_shard

__all__ = ["Floor", "BudgetBelowFloor", "floor_of", "check_budget", "HOST_OPTIMIZER_HINT"]

# What frees the most GPU memory a step cannot recompute or move, where the policy keeps the
# optimizer's state on the GPU.
HOST_OPTIMIZER_HINT = "keep optimizer state in host memory (host_optimizer.yaml)"

_SMALL_ALIGNMENT = 512  # csrc/chunk_pool.cpp: small requests are rounded to this


@dataclass(frozen=True)
class Floor:
    """Bytes the GPU holds for the whole step, by kind; `largest` is the largest single tensor."""
    parameters: int
    gradients: int
    optimizer_state: int
    largest: int
    state_estimated: bool    # optimizer state not created yet, estimated from the optimizer
    state_known: bool        # False: an optimizer whose state is neither there nor estimated

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def text(self) -> str:
        state = "optimizer state" + (" (expected)" if self.state_estimated else "")
        state += "" if self.state_known else " (not known before the first step: not counted)"
        return (f"parameters {format_size(self.parameters)} + gradients {format_size(self.gradients)} + {state} "
                f"{format_size(self.optimizer_state)} = {format_size(self.total)} ({self.total} bytes); the largest "
                f"single tensor {format_size(self.largest)}")


class BudgetBelowFloor(ValueError):
    """A hard budget smaller than what never leaves the GPU; `floor` holds the figures."""

    def __init__(self, message: str, *, budget: int, floor: Floor):
        super().__init__(message)
        self.budget, self.floor = budget, floor


def floor_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, policy: Policy,
             chunk_size: int | None = None) -> Floor:
    """The bytes of `model`'s parameters and gradients and `optimizer`'s state that stay on the GPU
    under `policy` (tags it places in host memory the GPU maps count nothing)."""
    chunk = chunk_size or policy.pool.chunk_size
    stays = {tag: not host_mapped(policy.tags[tag]) for tag in ("parameter", "gradient", "optimizer_state")}
    params = [p for p in model.parameters()]
    trained = [p for p in params if p.requires_grad]
    state_sizes, estimated, known = _state_sizes(optimizer)
    sizes = {"parameter": [_bytes(p) for p in params], "gradient": [_bytes(p) for p in trained],
             "optimizer_state": state_sizes}
    held = {tag: sum(_pool_bytes(n, chunk) for n in sizes[tag]) if stays[tag] else 0 for tag in sizes}
    largest = max((n for tag in sizes if stays[tag] for n in sizes[tag]), default=0)
    return Floor(held["parameter"], held["gradient"], held["optimizer_state"], largest, estimated, known)


def check_budget(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                 budget: int | None = None, policy: Policy | None = None) -> Floor:
    """Raises BudgetBelowFloor when `budget` (default: the installed one) is below what `model`
    and `optimizer` hold on the GPU all step; returns the figures. Without a budget, or under a
    reactive one (evict_live: true), which may evict anything, it only returns them."""
    if policy is None or budget is None:
        if not is_installed():
            raise ValueError("check_budget: um_alloc is not installed; pass budget= and policy=")
        chosen = installation()
        policy = policy or chosen.policy
        budget = chosen.budget if budget is None else budget
    floor = floor_of(model, optimizer, policy)
    if budget and not policy.scheduler.evict_live and floor.total > budget:
        raise BudgetBelowFloor(_refusal(budget, floor, policy), budget=budget, floor=floor)
    return floor


def _refusal(budget: int, floor: Floor, policy: Policy) -> str:
    hint = "raise the budget, train a smaller model"
    if floor.optimizer_state:
        hint += ", or " + HOST_OPTIMIZER_HINT
    return (f"GPU budget {format_size(budget)} ({budget} bytes) is below what stays on the GPU all step under "
            f"policy {policy.name!r}: {floor.text()}. Nothing of these can be recomputed or moved under a hard "
            f"budget, so training would run out of memory in its first step; {hint}")


def _state_sizes(optimizer) -> tuple[list[int], bool, bool]:
    """(bytes of each state tensor, estimated?, known?): the state there is, or, before the first
    step, what the optimizer's class will create."""
    if optimizer is None:
        return [], False, True
    existing = [_bytes(v) for state in optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and not _is_host(v)]
    if optimizer.state:
        return existing, False, True
    sizes: list[int] = []
    for group in optimizer.param_groups:
        copies = _state_copies(optimizer, group)
        if copies is None:
            return [], False, False
        sizes += [_bytes(p) for p in group["params"] if p.requires_grad for _ in range(copies)]
    return sizes, True, True


def _state_copies(optimizer, group: dict) -> int | None:
    """Tensors of a parameter's size each parameter gets as state, for optimizers whose state is
    known; None for others."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 3 if group.get("amsgrad") else 2                       # exp_avg, exp_avg_sq (max_exp_avg_sq)
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum") else 0                      # momentum_buffer
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1                                                      # sum
    if isinstance(optimizer, torch.optim.RMSprop):
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))  # square_avg, momentum_buffer, grad_avg
    return None


def _bytes(tensor: torch.Tensor) -> int:
    tensor = local_shard(tensor)  # under FSDP2 a rank holds its shard of each
    return tensor.numel() * tensor.element_size()


def _is_host(tensor: torch.Tensor) -> bool:
    # A step count kept on the CPU (non-fused Adam) never touches the pool.
    return tensor.device.type == "cpu" and tensor.numel() <= 1


def _pool_bytes(nbytes: int, chunk: int) -> int:
    """What a request of `nbytes` takes in the pool: whole chunks above half a chunk, else a
    512-byte-aligned slot in a shared chunk."""
    unit = chunk if nbytes > chunk // 2 else _SMALL_ALIGNMENT
    return -(-nbytes // unit) * unit
