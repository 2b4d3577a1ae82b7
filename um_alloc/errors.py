"""PolicyError, and the place of a value (file and dotted key) that words it.

Policy keys and size arguments fail the same way: one message naming the file, the key, the
problem, the value received and the values allowed. Sizes (sizes.py) and policies (policy.py)
both raise it, so it sits below both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["PolicyError", "At"]


class PolicyError(ValueError):
    """A policy that cannot be used. ``str()`` is the whole message; the parts are attributes."""

    def __init__(self, message: str, *, source: str | None = None, key: str | None = None):
        super().__init__(message)
        self.source, self.key = source, key


@dataclass(frozen=True)
class At:
    """Where a value sits: the file and the dotted key. Builds the errors for that place."""
    source: str
    key: str = ""

    def child(self, name: Any) -> At:
        return At(self.source, f"{self.key}.{name}" if self.key else str(name))

    def error(self, problem: str, *, allowed: str | None = None, received: Any = ...,
              hint: str | None = None) -> PolicyError:
        # "<file>: <key>: <problem> (got <value>; allowed: <values>). <hint>"
        details = [f"got {received!r}"] if received is not ... else []
        details += [f"allowed: {allowed}"] if allowed else []
        text = f"{self.source}: {self.key}: {problem}" if self.key else f"{self.source}: {problem}"
        text += f" ({'; '.join(details)})" if details else ""
        text += f". {hint}" if hint else ""
        return PolicyError(text, source=self.source, key=self.key or None)
