"""The tag vocabulary: what kind of data an allocation holds, so that a policy can advise it.

The names and their order are the C++ core's `um::Tag` enum (csrc/tags.hpp); _lib.load() checks
that the two agree. Everything else in the package builds on these names, so this module
imports nothing of it.
"""
from __future__ import annotations

__all__ = ["TAGS", "DEFAULT_TAG", "tag_index"]

# spill: the large temporaries of a region marked with um_alloc.spill_from (um_alloc/spill.py)
TAGS = ("parameter", "gradient", "optimizer_state", "input", "activation", "other", "spill")
DEFAULT_TAG = "activation"  # what an allocation gets outside every tag() scope


def tag_index(tag: str) -> int:
    """The core's number for `tag`. Raises ValueError naming the allowed tags."""
    try:
        return TAGS.index(tag)
    except ValueError:
        raise ValueError(f"unknown tag {tag!r}; allowed: {', '.join(TAGS)}") from None
