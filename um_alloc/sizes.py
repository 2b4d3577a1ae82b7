"""Sizes in bytes: "2MiB" and 2097152 in, "2.0 MiB" out.

Every size um_alloc takes, in a policy file or as a function's argument, is read here.
Only binary units are accepted: people mean both 10**9 and 2**30 by "GB", and a budget off by
7% is a silent out-of-memory error.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from .errors import At

__all__ = ["KiB", "MiB", "GiB", "TiB", "SIZE_ALLOWED", "parse_size", "parse_size_at", "size_arg",
           "positive_size_arg", "format_size"]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
SIZE_ALLOWED = ("an integer number of bytes >= 0, or a string like 512KiB, 2MiB, 1.5GiB "
                "(units B, KiB, MiB, GiB, TiB)")
_UNITS = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB}
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(value: Any, *, key: str, source: str) -> int:
    """Bytes from an int >= 0 or a string "<number>[ ]<B|KiB|MiB|GiB|TiB>" (rounded to int).

    Decimal units (KB, MB, GB, TB, K, M, G) are refused. Raises PolicyError naming key and source.
    """
    return parse_size_at(value, At(source, key))


def parse_size_at(value: Any, at: At, allowed: str = SIZE_ALLOWED) -> int:
    """parse_size for a value at a policy's place; `allowed` words what the key accepts."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise at.error("not a size", allowed=allowed, received=value)
    if isinstance(value, float):
        raise at.error("a bare decimal number is not a size", allowed=allowed,
                       received=value, hint=f"Write the unit, e.g. '{value:g}GiB'.")
    if isinstance(value, int):
        if value < 0:
            raise at.error("size must be >= 0", allowed=allowed, received=value)
        return value
    match = _SIZE_RE.fullmatch(value)
    if not match:
        negative = value.strip().startswith("-")
        raise at.error("size must be >= 0" if negative else "unparsable size",
                       allowed=allowed, received=value)
    number, unit = match.groups()
    if unit.lower() not in _UNITS:
        raise at.error("unknown size unit", allowed=allowed, received=value,
                       hint=_unit_hint(value, number, unit))
    return round(Fraction(number) * _UNITS[unit.lower()])


def _unit_hint(value: str, number: str, unit: str) -> str | None:
    if not unit:
        return f"A string needs a unit: write {number}B, or {number} unquoted for bytes."
    binary = {"k": "KiB", "m": "MiB", "g": "GiB", "t": "TiB"}.get(unit[0].lower())
    if binary and unit.lower() in (unit[0].lower(), unit[0].lower() + "b"):
        power = {"KiB": 10, "MiB": 20, "GiB": 30, "TiB": 40}[binary]
        return (f"'{value.strip()}' is ambiguous: write {number}{binary} (2**{power}) "
                f"or the exact number of bytes.")
    return None


def size_arg(value: Any, what: str, source: str) -> int:
    """A size given to a function: an int >= 0 (bytes) or a string like "1GiB". ValueError otherwise."""
    if isinstance(value, str):
        return parse_size(value, key=what, source=source)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{source}: {what} must be bytes >= 0 or a size like '1GiB', got {value!r}")
    return value


def positive_size_arg(value: Any, what: str, source: str) -> int:
    """size_arg, and more than 0 bytes (a large-allocation scope's smallest size, say)."""
    size = size_arg(value, what, source)
    if size == 0:
        raise ValueError(f"{source}: {what} must be > 0 bytes")
    return size


def format_size(n: int) -> str:
    """2097152 -> "2.0 MiB"; below 1 KiB, whole bytes ("512 B")."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
