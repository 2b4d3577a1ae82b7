"""Tensors in nested containers: a batch, a model's outputs, a list of gradients.

A tree is a tensor, or a mapping (dict, BatchEncoding and other objects with ``items()``),
tuple or list of trees. One walk serves retagging, spilling and micro-batching; the micro-batch
code asks for paths ("batch['labels']") and for every leaf to be a tensor.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, Mapping

import torch

__all__ = ["tensor_leaves", "tensors", "map_tensors", "local_shard", "is_dtensor"]


def tensor_leaves(tree: Any, path: str | None = None, *,
                  strict: bool = False) -> Iterator[tuple[str | None, torch.Tensor]]:
    """(path, tensor) for each tensor in `tree`, depth first, in the containers' order.

    `path` names the root ("batch"); each leaf's path extends it with keys and indices. None
    builds no paths (retagging every step need not pay for them). Other leaves are skipped, or
    with `strict` raise TypeError naming the first one.
    """
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif _is_mapping(tree):
        for key, value in tree.items():
            yield from tensor_leaves(value, None if path is None else f"{path}[{key!r}]", strict=strict)
    elif isinstance(tree, (tuple, list)):
        for index, value in enumerate(tree):
            yield from tensor_leaves(value, None if path is None else f"{path}[{index}]", strict=strict)
    elif strict:
        raise TypeError(f"{path or 'a leaf'} is a {type(tree).__name__}; a batch holds only tensors, "
                        "in (nested) tuples, lists and dicts")


def tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in `tree`, in tensor_leaves' order; other leaves are skipped. No paths and no
    generators: the planner asks for every block's inputs and outputs, every step."""
    found: list[torch.Tensor] = []
    _collect(tree, found)
    return found


_SCALARS = (type(None), bool, int, float, str)


def _collect(tree: Any, found: list[torch.Tensor]) -> None:
    if isinstance(tree, torch.Tensor):
        found.append(tree)
    elif type(tree) in _SCALARS:
        return  # the usual non-tensor leaves, skipped before the slower mapping check
    elif type(tree) in (tuple, list):
        for value in tree:
            _collect(value, found)
    elif type(tree) is dict or _is_mapping(tree):
        for _, value in tree.items():
            _collect(value, found)
    elif isinstance(tree, (tuple, list)):
        for value in tree:
            _collect(value, found)


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this process stores: a DTensor's local shard (FSDP2's parameters, their
    gradients and optimizer state hold 1/world of the whole each), any other tensor itself."""
    if is_dtensor(tensor):
        with torch.no_grad():
            return tensor.to_local()
    return tensor


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor (FSDP2's parameters are)."""
    dtensor = _dtensor_class()
    return dtensor is not None and isinstance(tensor, dtensor)


@functools.cache
def _dtensor_class() -> type | None:
    """DTensor, looked up once: retag asks for every gradient of every step."""
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """Applies fn to every tensor, keeping the container types (dict subclasses, namedtuples).
    Raises TypeError for a leaf that is not a tensor."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if _is_mapping(tree):
        items = {key: map_tensors(fn, value) for key, value in tree.items()}
        try:
            return type(tree)(items)
        except TypeError:  # a mapping type that cannot be built from a dict
            return items
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(map_tensors(fn, value) for value in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(map_tensors(fn, value) for value in tree)
    raise TypeError(f"a batch holds only tensors, got a {type(tree).__name__}")


def _is_mapping(tree: Any) -> bool:
    return isinstance(tree, Mapping) or hasattr(tree, "items")
