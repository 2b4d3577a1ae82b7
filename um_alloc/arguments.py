"""Checks of the arguments that functions and commands take, worded as a policy key's are.

Each check takes the value as the caller wrote it and the place it was given, an ``At`` such as
``At("install()", "max_reserved")`` or ``At("command line", "--budget")``, and returns the value
converted, or raises PolicyError (a ValueError) naming the place, the value received and what is
allowed. The policy's own keys go through the same checks (policy.py). Nothing here touches CUDA
or NVML, so an entry point can check every argument before it starts either.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from .errors import At
from .sizes import size_at_least

__all__ = ["At", "size", "optional_size", "whole_number", "number_in", "flag", "one_of", "function"]


def size(value: Any, at: At, *, minimum: int = 0, allowed: str | None = None) -> int:
    """Bytes: an int, or a string like "16GiB"; at least `minimum` bytes."""
    return size_at_least(value, at, minimum, allowed)


def optional_size(value: Any, at: At, *, minimum: int = 0) -> int | None:
    """size(), or None left as None (the argument's default: the policy's, or none)."""
    return None if value is None else size(value, at, minimum=minimum)


def whole_number(value: Any, at: At, *, minimum: int = 0, maximum: int | None = None) -> int:
    """An int in [minimum, maximum]; True and False are not numbers here, though Python allows it."""
    allowed = f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise at.error("not an integer", allowed=allowed, received=value)
    if value < minimum or (maximum is not None and value > maximum):
        raise at.error("out of range", allowed=allowed, received=value)
    return value


def number_in(value: Any, at: At, low: float, high: float, *, low_open: bool = True,
              high_open: bool = False) -> float:
    """A finite int or float between `low` and `high` (open or closed at either end)."""
    allowed = f"a number {'>' if low_open else '>='} {low:g}"
    allowed += f" and {'<' if high_open else '<='} {high:g}" if math.isfinite(high) else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise at.error("not a finite number", allowed=allowed, received=value)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (above and below):
        raise at.error("out of range", allowed=allowed, received=value)
    return float(value)


def flag(value: Any, at: At) -> bool:
    """True or False only: bool("no") is True, so a string is never read as a flag."""
    if isinstance(value, bool):
        return value
    hint = "Write true or false without quotes." if isinstance(value, str) else None
    raise at.error("expected a boolean", allowed="true, false", received=value, hint=hint)


def one_of(value: Any, at: At, choices: tuple[str, ...]) -> str:
    if isinstance(value, str) and value in choices:
        return value
    raise at.error("invalid value", allowed=", ".join(choices), received=value)


def function(value: Any, at: At, *, optional: bool = False) -> Callable | None:
    """A callable (or None where `optional`): caught here rather than at the first step."""
    if (value is None and optional) or callable(value):
        return value
    allowed = "a function, or None" if optional else "a function"
    raise at.error("not callable", allowed=allowed, received=value)
