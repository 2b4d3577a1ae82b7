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
           "positive_size_arg", "size_at_least", "format_size", "size_text"]

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_SIZE_FORMS = "a string like 512KiB, 2MiB, 1.5GiB (units B, KiB, MiB, GiB, TiB)"
SIZE_ALLOWED = f"an integer number of bytes >= 0, or {_SIZE_FORMS}"
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
            raise at.error("negative size", allowed=allowed, received=value)
        return value
    match = _SIZE_RE.fullmatch(value)
    if not match:
        negative = value.strip().startswith("-")
        raise at.error("negative size" if negative else "unparsable size",
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


def size_at_least(value: Any, at: At, minimum: int, allowed: str | None = None) -> int:
    """parse_size_at, and at least `minimum` bytes; the allowed text says so unless given."""
    allowed = allowed or _allowed_from(minimum)
    size = parse_size_at(value, at, allowed)
    if size < minimum:
        problem = "size must be > 0" if minimum == 1 else f"must be at least {size_text(minimum)}"
        raise at.error(problem, allowed=allowed, received=value)
    return size


def _allowed_from(minimum: int) -> str:
    if minimum <= 0:
        return SIZE_ALLOWED
    least = "> 0" if minimum == 1 else f">= {minimum} ({size_text(minimum)})"
    return f"an integer number of bytes {least}, or {_SIZE_FORMS}"


def size_arg(value: Any, what: str, source: str) -> int:
    """A size given to a function: bytes >= 0 or a string like "1GiB". PolicyError (a ValueError)
    naming `source` and the argument `what` otherwise."""
    return size_at_least(value, At(source, what), 0)


def positive_size_arg(value: Any, what: str, source: str) -> int:
    """size_arg, and more than 0 bytes (a large-allocation scope's smallest size, say)."""
    return size_at_least(value, At(source, what), 1)


def format_size(n: int) -> str:
    """2097152 -> "2.0 MiB"; below 1 KiB, whole bytes ("512 B")."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def size_text(n: int) -> str:
    """Bytes as a user writes them, exactly: 34359738368 -> "32GiB", 1610612736 -> "1.5GiB",
    1000 -> "1000B". The largest unit in which the number has at most two decimals."""
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        hundredths, rest = divmod(n * 100, scale)
        if abs(n) >= scale and rest == 0:
            whole, cents = divmod(hundredths, 100)
            return f"{whole}{f'.{cents:02d}'.rstrip('0') if cents else ''}{unit}"
    return f"{n}B"
