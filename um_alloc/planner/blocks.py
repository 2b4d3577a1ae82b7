"""Finding the units a plan decides for, in any nn.Module, without changes to the user's code.

A *block* is one of the repeated children of a ``ModuleList`` or ``Sequential``: two or more
children of one class that are themselves made of modules (BertLayer, GPT2Block, a ViT encoder
layer, torchvision's Bottleneck). Generic containers are never blocks themselves, and leaves never
are, so the MLP ``Sequential`` inside a ViT layer does not turn its Linear layers into blocks.
Where fewer than MIN_BLOCKS repeated modules hold repeated modules themselves (four stages of
blocks, as in Swin or Hugging Face's ResNet), the search goes one level in: finer units give the
plan more to choose from, and a stage is too coarse to recompute or keep as one.

The same search also runs over the children of every module: blocks held one by one as
attributes (a U-Net's ``down1``, ``down2``, ..., Inception v3's ``Mixed_5b``, ``Mixed_5c``, ...).
Its blocks are taken where no container holds repeated modules, or where they hold every block
the containers' search found and number at least MIN_BLOCKS: GoogLeNet's nine Inception modules
(and its three stem convolutions), not the convolutions of their branches' Sequentials. Inside a
model that has its blocks in a container, two sublayers of one class held as attributes (a
layer's two norms) are not what a plan should recompute. ``block_classes`` overrides the search
with class names.

A *gap* is what lies between blocks: the children along the way from the root to the blocks that
neither are blocks nor contain one (embeddings, a ResNet's stem, the head). A ModuleList or
ModuleDict is never called itself (its owner calls its children: ConvNeXt's downsampling layers),
so its children are the gaps. Their activations can be moved to host memory; a gap is rerun only
as part of a chain (chain.py): gaps whose calls follow one another, rerun in backward from the
first one's inputs.

A model with no blocks at all (a VGG's layers in a ``Sequential``, two parts of different classes)
has gaps only: its leaves, each layer a gap however deep it sits (a training framework's module
holding the model as an attribute), so that a plan can keep one layer's saved tensors, move
another's and rerun a run of them as a chain. ``block_classes`` names what may be recomputed as
blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch.nn as nn

__all__ = ["Unit", "find_units", "block_modules"]

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
MIN_BLOCKS = 8


@dataclass(frozen=True)
class Unit:
    """One module a plan makes a decision for."""
    name: str            # its qualified name in the model ("bert.encoder.layer.3")
    module: nn.Module
    kind: str            # "block" (may be recomputed) or "gap" (may only move)

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


def block_modules(model: nn.Module, block_classes: Iterable[str] | None = None) -> list[tuple[str, nn.Module]]:
    """The blocks of `model` as (qualified name, module), outermost first, in registration order.

    With `block_classes`, every module whose class name is listed is a block (outermost wins);
    a name that matches nothing raises ValueError naming the classes the model has.
    """
    if block_classes is not None:
        return _named_blocks(model, set(block_classes))
    in_containers = _repeated_blocks(model, _CONTAINERS)
    anywhere = _repeated_blocks(model, nn.Module)
    if not in_containers or (len(anywhere) >= MIN_BLOCKS and _all_inside(in_containers, anywhere)):
        return anywhere
    return in_containers


def _all_inside(inner: list[tuple[str, nn.Module]], outer: list[tuple[str, nn.Module]]) -> bool:
    """Whether every block of `inner` lies inside one of `outer` (by qualified name), and none is one."""
    prefixes = tuple(f"{path}." for path, _ in outer)
    return all(path.startswith(prefixes) for path, _ in inner)


def _repeated_blocks(model: nn.Module, holders: type | tuple[type, ...]) -> list[tuple[str, nn.Module]]:
    """The repeated children of the modules of type `holders`, outermost first, one level further
    in while fewer than MIN_BLOCKS hold repeated modules themselves."""
    found: list[tuple[str, nn.Module]] = []
    _search(model, "", found, holders)
    while len(found) < MIN_BLOCKS and any(_holds_repeated(m, holders) for _, m in found):
        found = [inner for path, m in found for inner in _inside(path, m, holders)]
    return found


def _inside(path: str, block: nn.Module, holders) -> list[tuple[str, nn.Module]]:
    """The blocks one level in, or the block itself where it holds no repeated modules."""
    if not _holds_repeated(block, holders):
        return [(path, block)]
    inner: list[tuple[str, nn.Module]] = []
    _search(block, path, inner, holders)
    return inner


def find_units(model: nn.Module, block_classes: Iterable[str] | None = None) -> list[Unit]:
    """The blocks and the gaps between them, in registration order (the order of execution is
    recorded later, in calibration); without blocks, the gaps alone. A model without submodules
    yields no units."""
    blocks = block_modules(model, block_classes)
    block_ids = {id(m) for _, m in blocks}
    if blocks:
        holders = _ancestors_of(model, block_ids)
    else:  # gaps only: down to the layers
        holders = {id(m) for m in model.modules() if next(m.children(), None) is not None}
    units: list[Unit] = []
    _collect(model, "", block_ids, holders, units)
    return units


def _search(module: nn.Module, prefix: str, found: list, holders) -> None:
    repeated = _repeated_children(module) if isinstance(module, holders) else set()
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if id(child) in repeated:
            found.append((path, child))
        else:
            _search(child, path, found, holders)


def _holds_repeated(module: nn.Module, holders) -> bool:
    """Whether `module` or one inside it, of type `holders`, has repeated children (a block is
    never a container, so in the containers' search only those inside count)."""
    return any(isinstance(m, holders) and _repeated_children(m) for m in module.modules())


def _repeated_children(container: nn.Module) -> set[int]:
    """Children sharing a class with another child, made of modules, and not containers."""
    by_class: dict[type, list[nn.Module]] = {}
    for child in container.children():
        if isinstance(child, _CONTAINERS) or next(child.children(), None) is None:
            continue
        by_class.setdefault(type(child), []).append(child)
    return {id(c) for group in by_class.values() if len(group) >= 2 for c in group}


def _named_blocks(model: nn.Module, names: set[str]) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []
    seen_classes: set[str] = set()

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            seen_classes.add(type(child).__name__)
            if type(child).__name__ in names:
                found.append((path, child))
            else:
                visit(child, path)

    visit(model, "")
    missing = names - {type(m).__name__ for _, m in found}
    if missing:
        raise ValueError(f"block_classes: no module of class {', '.join(sorted(missing))} in "
                         f"{type(model).__name__}; its classes are: {', '.join(sorted(seen_classes))}")
    return found


def _ancestors_of(model: nn.Module, block_ids: set[int]) -> set[int]:
    """Modules that contain a block (the root included)."""
    holders: set[int] = set()

    def visit(module: nn.Module) -> bool:
        holds = False
        for child in module.children():
            if id(child) in block_ids:
                holds = True
            elif visit(child):
                holds = True
        if holds:
            holders.add(id(module))
        return holds

    visit(model)
    return holders


def _collect(module: nn.Module, prefix: str, blocks: set[int], holders: set[int], units: list[Unit]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if id(child) in blocks:
            units.append(Unit(path, child, "block"))
        elif id(child) in holders or isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            _collect(child, path, blocks, holders, units)
        elif _has_work(child):
            units.append(Unit(path, child, "gap"))


def _has_work(module: nn.Module) -> bool:
    """Parameterless leaves (activations, dropout, pooling) still save tensors; containers with
    nothing in them do not."""
    return not (isinstance(module, _CONTAINERS) and next(module.children(), None) is None)
