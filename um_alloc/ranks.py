"""Which GPU this process manages: the one named, else torchrun's LOCAL_RANK, else 0.

torchrun (and the launchers of accelerate, Lightning and DeepSpeed) start one process per GPU and
tell each its place through environment variables: RANK (0 to WORLD_SIZE - 1 over all nodes) and
LOCAL_RANK (0 to LOCAL_WORLD_SIZE - 1 on this node). By convention process LOCAL_RANK drives CUDA
device LOCAL_RANK, so that is the device um_alloc installs for: the pool, the cap taken from the
device's free memory and the budget are that GPU's alone, one process per GPU.

Reading them touches neither CUDA nor NVML; a value that is not a whole number is refused here,
before install() asks NVML anything.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

from . import arguments
from .errors import At

__all__ = ["ChosenDevice", "choose_device", "local_rank", "global_rank"]

_WHOLE = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class ChosenDevice:
    """A CUDA device index and what chose it, for the errors that name it."""
    index: int
    source: str                   # "device=1" (named), "LOCAL_RANK=1" or "the default"
    from_local_rank: bool = False


def choose_device(device: int | None, at: At) -> ChosenDevice:
    """`device` if given (checked as the argument at `at`), else LOCAL_RANK, else 0.

    Raises:
        PolicyError: `device` is not an integer >= 0, or LOCAL_RANK is set to anything but one.
    """
    if device is not None:
        return ChosenDevice(arguments.whole_number(device, at), f"{at.key}={device}")
    local = local_rank()
    if local is None:
        return ChosenDevice(0, "the default")
    return ChosenDevice(local, f"LOCAL_RANK={local}", from_local_rank=True)


def local_rank() -> int | None:
    """LOCAL_RANK as an int, or None where it is not set (no torchrun)."""
    return _whole_number_from_environment("LOCAL_RANK")


def global_rank() -> int:
    """RANK as an int; 0 where it is not set."""
    rank = _whole_number_from_environment("RANK")
    return 0 if rank is None else rank


def _whole_number_from_environment(name: str) -> int | None:
    text = os.environ.get(name)
    if text is None:
        return None
    # Only digits: int() would also take " 1", "+1" and "1_0", which no launcher writes.
    if not _WHOLE.fullmatch(text):
        raise At("environment variable", name).error(
            "not a whole number", allowed="an integer >= 0, as torchrun sets it for each process", received=text)
    return int(text)
