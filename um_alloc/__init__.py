"""um_alloc: a PyTorch allocator on CUDA Unified Memory.

    import torch, um_alloc
    um_alloc.install("best.yaml")          # before any CUDA work; or set UM_POLICY
    with um_alloc.tag("parameter"):
        model = MyModel().cuda()
    opt = torch.optim.AdamW(model.parameters())
    um_alloc.tag_training(model, opt)      # gradients and optimizer state, as they appear
    um_alloc.plan(model)                   # under a budget: keep, recompute or move each block
    ...
    print(um_alloc.memory_summary())
"""
from . import lms
from .errors import PolicyError
from .floor import BudgetBelowFloor, Floor, check_budget
from .install import Installation, install, installation, is_installed
from .lms import get_enabled_lms, get_limit_lms, get_size_lms, set_enabled_lms, set_limit_lms, set_size_lms
from .planner import BlockPlanner, PlanInfeasible, plan
from .policy import Policy, TagAdvice, load_policy
from .pool import BlockInfo, ChunkPool
from .sizes import format_size, parse_size
from .spill import SpillFrom, spill_from
from .stats import memory_stats, memory_summary
from .tag_names import DEFAULT_TAG, TAGS
from .tags import retag, tag, tag_module, tag_optimizer, tag_training

__all__ = [
    "install", "installation", "is_installed", "Installation",
    "tag", "retag", "tag_module", "tag_optimizer", "tag_training", "TAGS", "DEFAULT_TAG",
    "spill_from", "SpillFrom", "plan", "BlockPlanner", "PlanInfeasible", "check_budget", "BudgetBelowFloor", "Floor",
    "memory_stats", "memory_summary", "block_at", "ranges_for_tag",
    "load_policy", "Policy", "PolicyError", "TagAdvice", "parse_size", "format_size",
    "ChunkPool", "BlockInfo",
    "set_enabled_lms", "get_enabled_lms", "set_limit_lms", "get_limit_lms", "set_size_lms", "get_size_lms",
]


def block_at(ptr: int, device: int | None = None) -> BlockInfo | None:
    """What the installed allocator holds at address `ptr`: the allocation containing it, or None."""
    device = installation().device if device is None else device
    return ChunkPool.for_device(device).block_at(ptr)


def ranges_for_tag(tag_name: str, device: int | None = None) -> list[tuple[int, int]]:
    """(base, bytes) of each live allocation tagged `tag_name` on `device`."""
    device = installation().device if device is None else device
    return ChunkPool.for_device(device).ranges_for_tag(tag_name)
