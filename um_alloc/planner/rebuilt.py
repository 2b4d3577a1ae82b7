"""The rebuild decision: a unit's saved tensors stay on the GPU, except those backward can make
again from others in a fraction of a millisecond (um_alloc.rebuild's recipes).

A transformer block saves, beside what its backward needs, tensors it can make again cheaply
from tensors it saves anyway: the bf16 casts of its input and of its LayerNorm outputs, which each
linear under autocast saves for itself; the GELU output the next linear saves; casts of its
weights. In a BERT-Large block that is about half of what it saves. Kept but rebuilt, a block
holds the rest, and backward reruns a cast, a LayerNorm or a GELU where it needs one.

Calibration finds them (rebuild_probe.py): while the first measured step recomputes each block,
every saved tensor with a recipe is rebuilt on the spot and compared with it, byte for byte. A
recipe is kept in terms of places (PlaceRecipe): the tensor saved at place p is a view of a cast of GELU of
the tensor saved at place q (or of the unit's input k, or of a parameter), through these autograd
nodes. The equal ones, with their bytes and the time the rebuilds took, are what a plan may count on.

Replay (RebuiltSaves) watches none of the unit's calls, which would cost the host a Python dispatch
of every op in forward: at a place with a recipe it checks that the tensor's dtype, shape and
strides, the types of the autograd nodes down to its root, and the root's inputs (the tensors held
at calibration's places) are calibration's, and stands the recipe in for the tensor; elsewhere it
keeps the tensor, so a step that differs costs bytes, never a wrong gradient. It holds only the
saves and inputs some recipe reads.

A recipe's root is either a cheap call recorded while the unit ran, or a tensor the unit holds:
one it saved, or its own input, which the unit holds for this (the plan counts a kept unit's inputs)
so that the casts of it need not be held too.

A recipe reads the tensors it starts from as they are when backward rebuilds. Autograd checks that
the tensors it saved were not changed in place since; a unit's input it did not save, nobody
checks. A recipe does, and stops backward with an error naming the unit rather than rebuild from
a changed tensor (a model that scales a block's input in place after the block, under autocast,
where the block's linears saved casts of it and plain autograd is content).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.autograd.graph import get_gradient_edge

from ..rebuild import (CAST_NODE, EXACT_WIDENINGS, MAX_CHAIN, VIEW_NODES, Call, Held, Param, Recipe, Shared, Source,
                       _root_of, as_saved)
from .fused_tree import FusedGroup, FusedTree, only_source, single_program

__all__ = ["RebuiltSaves", "PlaceRecipe", "UnitRecipes"]


class Slot(NamedTuple):
    """Where a tensor a unit holds came from: its `index`-th input, or its save at place `index`.
    A tuple, so that replay's lookups by slot, at every save of a forward, hash in C."""
    kind: str    # "input" or "save"
    index: int


class ParamRef:
    """A parameter a recipe reads, the same object in every step (its version is read as it is held)."""
    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __eq__(self, other) -> bool:
        return isinstance(other, ParamRef) and other.tensor is self.tensor

    def __hash__(self) -> int:
        return id(self.tensor)


@dataclass(frozen=True)
class PlaceCall:
    """A call inside a recipe's tree, in terms of places: what its output feeds is checked through
    the autograd graph, from the node of the call that reads it."""
    func: Callable
    args: tuple                  # Slots, ParamRefs, plain values and Nested calls
    kwargs: tuple                # (name, value) pairs, values as in args
    autocast: tuple
    node: str                    # its node's type name
    edges: tuple                 # (Slot of a tensor it reads, the Route to its edge from its node's inputs)
    widened: tuple = ()          # (Slot of a widening it reads back, the Route to the widened tensor's edge)
    binders: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "binders", _binders(self.args, self.kwargs))


@dataclass(frozen=True)
class Narrowed:
    """An input of a call that the tensor held at `slot` is an exact widening of (autocast's float32
    copy for pow): that tensor cast back to `dtype`, the same bits."""
    slot: Slot
    dtype: torch.dtype


@dataclass(frozen=True)
class Nested:
    """An input of a call that is another call's output, reached from the reader's node by `route`."""
    route: tuple
    call: PlaceCall


# A Route leads from a node's inputs to an edge below it: (index, [type name, index]...). The first
# index picks one of the node's inputs; each pair after it steps through a node of that type to its
# index-th input. A call reads most tensors directly, (index,); others through nodes it makes
# itself: autocast's cast of the input (pow's float32 copy, a linear's bf16 one), the views inside a
# linear (a view, the product, a view of its input, a cast).
MAX_ROUTE = 4  # nodes a route steps through


def reached(inputs: tuple, route: tuple) -> tuple | None:
    """The edge (node, output number) `route` leads to from `inputs` (a node's next_functions), or
    None where a node on the way is not the route's."""
    index = route[0]
    if index >= len(inputs):
        return None
    fn, nr = inputs[index]
    for k in range(1, len(route), 2):
        if fn is None or type(fn).__name__ != route[k]:
            return None
        below = fn.next_functions
        if route[k + 1] >= len(below):
            return None
        fn, nr = below[route[k + 1]]
    return fn, nr


@dataclass(frozen=True)
class PlaceRecipe:
    """How calibration rebuilt the tensor a unit saves at one place, in terms of what the unit holds
    (its inputs, its saves at earlier places, parameters), so that replay need not watch the
    unit's calls: it checks the saved tensor's autograd path against calibration's and binds the
    held tensors by place.

    root: "call" (rerun `func` on `args`), "held" (the tensor held at `source`) or "param".
    """
    root: str
    path: tuple                  # node type names from the saved tensor down to the root
    cast: torch.dtype | None
    dtype: torch.dtype
    size: tuple
    stride: tuple
    nbytes: int                  # of its storage, which it covers
    reads: tuple = ()            # (Slot, dtype, size, stride) of each held tensor it reads
    source: Any = None           # "held": a Slot; "param": a ParamRef
    func: Callable | None = None
    args: tuple = ()             # Slots, ParamRefs and plain values
    kwargs: tuple = ()           # (name, value) pairs, values as in args
    autocast: tuple = ()
    node: str = ""               # the root node's type name ("call")
    edges: tuple = ()            # (Slot of a tensor it reads, the Route to its edge from the root node's inputs)
    widened: tuple = ()          # as PlaceCall's
    # Replay's forms of reads, args and kwargs, made once: bind runs at every save of every step.
    layouts: tuple = field(init=False, repr=False, compare=False)   # (Slot, (dtype, size, stride))
    binders: tuple = field(init=False, repr=False, compare=False)   # see _binders

    def __post_init__(self):
        object.__setattr__(self, "layouts", tuple((slot, tuple(layout)) for slot, *layout in self.reads))
        object.__setattr__(self, "binders", _binders(self.args, self.kwargs))

    def bind(self, tensor: torch.Tensor, held: dict, calls: dict) -> tuple[Recipe, tuple] | None:
        """The recipe for `tensor` saved at this place, and the key of the base it shares with
        other places (its root's autograd node, held by the key), or None where this call
        differs from calibration's at this place. `held` holds the unit call's held tensors by
        Slot (_Kept), `calls` its calls bound so far, by (node, output number): a tree reads the
        one Call of a node that places share."""
        if (tensor.dtype is not self.dtype or tensor.stride() != self.stride or tensor.size() != self.size
                or tensor.storage_offset() != 0 or tensor.untyped_storage().nbytes() != self.nbytes):
            return None
        for slot, layout in self.layouts:
            entry = held.get(slot)
            if entry is None or entry.layout != layout:
                return None
        node, nr = tensor.grad_fn, tensor.output_nr
        for name in self.path:
            if node is None or type(node).__name__ != name:
                return None
            node, nr = node.next_functions[0]
        root = self._root(node, nr, held, calls)
        if root is None:
            return None
        # The node itself, not its id: its Python object may be made afresh each time it is asked
        # for and dropped at once, leaving its id to another node, whose base this one would take.
        return Recipe(root, self.cast, self.size, self.stride), (node, nr, self.cast)

    def _root(self, node, nr: int, held: dict, calls: dict) -> Call | Held | None:
        if node is None:
            return None
        if self.root == "param":
            param = self.source.tensor
            ok = type(node).__name__ == "AccumulateGrad" and node.variable is param
            return Held(Param(param, param._version), param.numel()) if ok else None
        if self.root == "held":
            entry = held[self.source]
            if entry.tensor is None:
                return None  # made again itself (_MadeAgain): a view of it keeps its own bytes
            return Held(Source(entry), entry.tensor.numel()) if _reaches(node, nr, entry.tensor) else None
        call = _bound_call(self, node, nr, held, calls)
        if call is not None and not call.numel:
            call.numel = math.prod(self.size)
        return call


# How _binders marks each argument of a described call, for _bound_values.
_PLAIN, _SLOT, _PARAM, _NARROWED, _NESTED = range(5)


def _binders(args: tuple, kwargs: tuple) -> tuple:
    """A described call's arguments, each as (kind, value, keyword or None): sorted once, so that
    binding them at every save is one loop with no isinstance chain."""
    def kind(value) -> int:
        if isinstance(value, Slot):
            return _SLOT
        if isinstance(value, ParamRef):
            return _PARAM
        if isinstance(value, Narrowed):
            return _NARROWED
        return _NESTED if isinstance(value, Nested) else _PLAIN

    return (*((kind(a), a, None) for a in args), *((kind(v), v, k) for k, v in kwargs))


def _bound_call(described, node, nr: int, held: dict, calls: dict) -> Call | None:
    """The Call `described` (a PlaceRecipe's root or a PlaceCall) makes at (node, nr), if the graph
    there is calibration's: the node's type, its edges to the held tensors it reads, and each
    nested call's the same way along its route. A node already bound in this unit call gives
    its Call, which the trees that read it share."""
    if node is None or type(node).__name__ != described.node:
        return None
    known = calls.get((node, nr))
    if known is not None:
        return known
    inputs = node.next_functions
    for slot, route in described.edges:
        edge = reached(inputs, route)
        edge_node, edge_nr = held[slot].edge()
        if edge is None or edge[0] is not edge_node or edge[1] != edge_nr:
            return None
    for slot, route in described.widened:
        below = held[slot].widened_from()
        edge = reached(inputs, route)
        if below is None or edge is None or edge[0] is not below[0] or edge[1] != below[1]:
            return None
    bound = _bound_values(described.binders, held, inputs, calls)
    if bound is None:
        return None
    args, kwargs = bound
    # The node is the key, held by the unit call's dict until its forward ends; never by the Call,
    # which autograd holds until backward (a cycle through its C++, see RebuiltSaves.around).
    call = calls[(node, nr)] = Call(described.func, args, kwargs, described.autocast, 0)
    return call


@dataclass
class UnitRecipes:
    """What calibration found a unit can rebuild: a PlaceRecipe per place, the places and inputs
    they read (the only saves replay holds on to), and the autocast state the unit ran under."""
    places: dict = field(default_factory=dict)   # place -> PlaceRecipe
    autocast: tuple = ()
    fused: dict = field(default_factory=dict)    # place -> the FusedTree its root's tree runs as
    # place -> (slot of the copy made again, (program, dtype)) of a recipe its copy's group makes,
    # or None for one it cannot: found by replay in the first step that makes the copy again.
    members: dict = field(default_factory=dict, repr=False, compare=False)
    _read: tuple = field(default=(None, frozenset(), frozenset()), init=False, repr=False, compare=False)

    @property
    def sources(self) -> frozenset:
        """The Slots the recipes read."""
        return self._reads()[1]

    @property
    def held_places(self) -> frozenset:
        """The places among the sources: the saves replay holds."""
        return self._reads()[2]

    def _reads(self) -> tuple:
        # Found once per set of places: replay asks at every call of the unit, and calibration
        # replaces the dict (RebuildProbe._agree) rather than changing it.
        if self._read[0] is not self.places:
            sources = frozenset(slot for recipe in self.places.values() for slot, *_ in recipe.reads)
            self._read = (self.places, sources, frozenset(slot.index for slot in sources if slot.kind == "save"))
        return self._read


def _bound_values(binders: tuple, held: dict, inputs: tuple, calls: dict) -> tuple[tuple, dict] | None:
    """A described call's arguments bound to this unit call, (args, kwargs), or None where a nested
    call's graph differs."""
    args, kwargs = [], {}
    for kind, value, keyword in binders:
        if kind == _PLAIN:
            bound = value
        elif kind == _SLOT:
            bound = Source(held[value])
        elif kind == _PARAM:
            bound = Param(value.tensor, value.tensor._version)
        elif kind == _NARROWED:
            bound = Source(held[value.slot], cast=value.dtype)
        else:
            edge = reached(inputs, value.route)
            if edge is None:
                return None
            bound = _bound_call(value.call, edge[0], edge[1], held, calls)
            if bound is None:
                return None
        if keyword is None:
            args.append(bound)
        else:
            kwargs[keyword] = bound
    return tuple(args), kwargs



def count_reads(call: Call) -> None:
    """One more read of `call`'s output in backward (a new base built from it, or a call that reads
    it made once): its first read counts the reads of the calls it reads."""
    if call.shared is None:
        call.shared = Shared()
        for nested in call.nested():
            count_reads(nested)
    call.shared.uses += 1


def _reaches(node, nr: int, tensor: torch.Tensor) -> bool:
    """Whether (node, nr), reached from a saved tensor, is where `tensor`'s storage was made:
    its root below its views, or its accumulator if it is a leaf (as a recomputed unit's input is
    in calibration, and the same input kept is not in replay)."""
    if tensor.grad_fn is None:
        return type(node).__name__ == "AccumulateGrad" and node.variable is tensor
    want, want_nr = _root_of(tensor)
    for _ in range(MAX_CHAIN):
        if node is want and nr == want_nr:
            return True
        if node is None or type(node).__name__ not in VIEW_NODES or len(node.next_functions) != 1:
            return False
        node, nr = node.next_functions[0]
    return False


@dataclass
class _Rebuilt:
    """What autograd holds instead of a saved tensor: how to make it again. Its base is a root and
    cast that several saved tensors share (the query, key and value projections each save a cast
    of one input): built once in backward for all of them."""
    recipe: Recipe
    base: Shared
    device_type: str

    def tensor(self) -> torch.Tensor:
        return self.recipe.shape(self.base.take(self.build_base))

    def build_base(self) -> torch.Tensor:
        return self.recipe.build_base(_unchanged, self.device_type)


_NOT_LOOKED = object()  # a cached lookup not made yet (its answer may be None)


class _Kept:
    """A tensor a unit holds, as its recipes read it: with its version when held, and its layout
    (dtype, size, stride), which every place whose recipe reads it compares."""
    __slots__ = ("tensor", "version", "unit", "slot", "layout", "_edge", "_widened_from")

    def __init__(self, tensor: torch.Tensor, version: int, unit: str, slot: Slot | None = None):
        self.tensor, self.version, self.unit, self.slot = tensor, version, unit, slot
        self.layout = (tensor.dtype, tuple(tensor.size()), tensor.stride())
        self._edge = None
        self._widened_from = _NOT_LOOKED

    def get(self) -> torch.Tensor:
        """The tensor, if nothing changed it in place since it was held."""
        tensor = self.tensor
        if tensor._version != self.version:
            raise RuntimeError(f"planner: a tensor of shape {tuple(tensor.shape)} that {self.unit or 'a unit'} holds "
                               f"to rebuild others from was changed in place after its forward (version "
                               f"{self.version} -> {tensor._version}); rebuilding from it would give wrong "
                               "gradients. Leave 'rebuild' out of the planner's decisions for this model")
        return tensor

    def widened_from(self) -> tuple | None:
        """The edge (node, output number) of the tensor it is a cast of, if it is one: found once."""
        if self._widened_from is _NOT_LOOKED:
            node = self.tensor.grad_fn
            cast = type(node).__name__ == CAST_NODE and len(node.next_functions) == 1
            self._widened_from = node.next_functions[0] if cast else None
        return self._widened_from

    def edge(self) -> tuple:
        """Its autograd edge (node, output number), found once: several places' roots read one held
        tensor, and finding a leaf's accumulator makes a view of it."""
        if self._edge is None:
            edge = get_gradient_edge(self.tensor)
            self._edge = (edge.node, edge.output_nr)
        return self._edge


class _MadeAgain(_Kept):
    """A tensor a unit rebuilds that other recipes read as well (autocast's float32 copy of a
    linear's output, which pow saves and the GELU's trees read back): nothing is held, and backward
    makes it once from its own recipe, for itself and its readers. It goes with the last of them.

    Where it is an exact widening of its recipe's root (the float32 copy of the bf16 product), the
    root stays with it too: a reader of the narrower tensor (0.5 * x, the GELU's bf16 product) takes
    that instead of casting the copy back, which on GPT-2-medium costs two passes over 128 MiB a
    block.

    The recipes that read nothing else (the GELU's trees and 0.5 * x) join its group: one kernel
    makes their outputs with the copy, from the root read once (fused_tree.FusedGroup)."""
    __slots__ = ("rebuilt", "group", "_made", "_narrow", "__weakref__")

    def __init__(self, tensor: torch.Tensor, unit: str, rebuilt: _Rebuilt, slot: Slot | None = None):
        super().__init__(tensor, tensor._version, unit, slot)
        # What replay checks of it, found while the tensor is here: it is not held past forward.
        self.edge()
        self.widened_from()
        self.tensor = None
        self.rebuilt, self._made, self._narrow = rebuilt, None, None
        self.group: FusedGroup | None = None  # made when a first recipe joins it

    def get(self) -> torch.Tensor:
        if self._made is None:
            self._made = self.rebuilt.recipe.shape(self.rebuilt.base.take(self._build_base))
        return self._made

    def narrowed(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The tensor in `dtype`, if it was made by widening one of that dtype exactly (Source.read)."""
        if self._narrow is None or self._narrow.dtype is not dtype:
            return None
        return self.rebuilt.recipe.shape(self._narrow)

    def _build_base(self) -> torch.Tensor:
        recipe = self.rebuilt.recipe
        root = recipe.build_root(_unchanged, self.rebuilt.device_type)
        exact = recipe.cast is not None and (root.dtype, recipe.cast) in EXACT_WIDENINGS
        wide = self.group.launch(root, recipe.cast, recipe.shape) if exact and self.group is not None else None
        if wide is None:
            wide = recipe.cast_root(root)
        if exact and root.stride() == wide.stride():
            self._narrow = root
        return wide

    def join(self, call: Call, member: tuple, cast: torch.dtype | None, fused: FusedTree | None) -> None:
        """`call` (`member`: its program and dtype, _group_member's) is made by this copy's group."""
        if self.group is None:
            self.group = FusedGroup(self, self.rebuilt.device_type)
        self.group.join(call, *member, cast, fused)


def _group_member(rebuild: Recipe, fused: FusedTree | None, dtype: torch.dtype) -> tuple | None:
    """(program, dtype) of a recipe whose root reads nothing but a copy made again, by which the
    copy's group makes it: a fused tree, or one call the kernel can write whose output is the saved
    tensor (`dtype`); None for any other."""
    if fused is not None:
        return fused.program, fused.dtype
    program = single_program(rebuild.root, dtype) if rebuild.cast is None else None
    return (program, dtype) if program is not None else None


def _unchanged(entry: _Kept) -> torch.Tensor:
    """The held tensor itself, if nothing changed it in place since it was held (or one made again)."""
    return entry.get()


class _Eligible:
    """Which saves count as places: on the unit's device, at least min_bytes, not a parameter (nor
    a view of one). Not "a leaf that requires grad": a recomputed unit's input is one, the same
    input kept is not, and both must count the same places."""
    __slots__ = ("device", "min_bytes")

    def __init__(self, device: torch.device, min_bytes: int):
        self.device, self.min_bytes = device, min_bytes

    def __call__(self, tensor: torch.Tensor) -> bool:
        if tensor.nbytes < self.min_bytes or tensor.device != self.device:
            return False
        base = tensor._base
        if base is None:
            base = tensor
        # Only a leaf can be a parameter; isinstance asks Parameter's metaclass, in Python.
        return base.grad_fn is not None or not isinstance(base, torch.nn.Parameter)


def _inputs(values) -> list[torch.Tensor]:
    """A unit's tensor inputs as calibration numbers them: its positional, then keyword arguments."""
    args, kwargs = values
    return [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]


class RebuiltSaves:
    """Replay: around one call of a unit the plan rebuilds, the saved-tensor hooks that hold what
    must stay and stand a recipe in for what backward can make again.

    Replay watches no call of the unit: at a place where calibration rebuilt equal, the tensor's
    dtype, size and strides, its autograd path down to its root (the nodes' types, and the root's
    inputs being the tensors held at calibration's places) must be calibration's, or it is kept.
    Only the saves and inputs some recipe reads are held."""

    def __init__(self, device: torch.device, min_bytes: int, recipes: UnitRecipes | None, unit: str = ""):
        self._eligible = _Eligible(device, min_bytes)
        self._device_type = device.type
        self._recipes = recipes or UnitRecipes()
        self._sources = self._recipes.sources
        self._held_places = self._recipes.held_places
        self._unit = unit
        self._held: dict[Slot, _Kept] = {}
        self._bases: dict[tuple, Shared] = {}
        self._calls: dict[tuple, Call] = {}   # (node, output number) -> the Call trees share
        self._saves = 0
        self.rebuilt_bytes = 0
        self.bases = 0          # bases the rebuilt tensors share, built once each in backward

    @contextlib.contextmanager
    def around(self, args, kwargs) -> Iterator[None]:
        recipes = self._recipes
        autocast = (torch.is_autocast_enabled(self._device_type), torch.get_autocast_dtype(self._device_type))
        if not recipes.places or autocast != recipes.autocast:
            yield  # nothing calibration found applies to this call
            return
        inputs = [t for t in _inputs((args, kwargs)) if self._eligible(t)]
        for k, t in enumerate(inputs):
            if Slot("input", k) in self._sources:
                self._held[Slot("input", k)] = _Kept(t, t._version, self._unit)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield
        finally:
            # Every tensor saved under the hooks holds them, and with them this object, until its
            # backward: the held tensors and the bases' keys (autograd nodes) must not stay here,
            # or a step whose backward never comes would keep its graph in a cycle through
            # autograd's C++. The rebuilt tensors' recipes keep what they read, the bases stay
            # with the rebuilt tensors that share them.
            self._held = {}
            self._bases = {}
            self._calls = {}

    def _pack(self, tensor: torch.Tensor):
        if not self._eligible(tensor):
            return as_saved(tensor)
        place = self._saves
        self._saves += 1
        recipe = self._recipes.places.get(place)
        bound = recipe.bind(tensor, self._held, self._calls) if recipe is not None else None
        if bound is None:
            if place in self._held_places:
                self._held[Slot("save", place)] = _Kept(tensor, tensor._version, self._unit)
            return as_saved(tensor)
        rebuild, key = bound
        fused = self._recipes.fused.get(place)
        if fused is not None:
            rebuild.root.fused = fused
        base = self._bases.get(key)
        if base is None:
            base = self._bases[key] = Shared()
            self.bases += 1
            if isinstance(rebuild.root, Call):
                count_reads(rebuild.root)  # built once for this base
                self._join_group(place, rebuild, fused, tensor.dtype)
        base.uses += 1
        self.rebuilt_bytes += tensor.nbytes
        rebuilt = _Rebuilt(rebuild, base, self._device_type)
        if place in self._held_places:  # other recipes read it: made once for them and for itself
            made = self._held[Slot("save", place)] = _MadeAgain(tensor, self._unit, rebuilt, Slot("save", place))
            return made
        return rebuilt

    def _join_group(self, place: int, rebuild: Recipe, fused: FusedTree | None, dtype: torch.dtype) -> None:
        """Where the recipe at `place` reads nothing but a copy made again, the copy's group makes
        it. Whether it does, the copy's slot and the program are found in the first step that
        makes the copy again (a Python walk of the tree, 40 us a recipe) and kept with the unit's
        recipes for the steps after."""
        members = self._recipes.members
        found = members.get(place, _NOT_LOOKED)
        if found is _NOT_LOOKED:
            entry = only_source(rebuild.root)
            if entry is None:  # it reads a parameter, a call or more than one tensor: it never joins
                members[place] = None
                return
            if not isinstance(entry, _MadeAgain):
                return  # looked at again in a step that makes the copy again
            member = _group_member(rebuild, fused, dtype)
            found = members[place] = (entry.slot, member) if member is not None else None
        if found is not None:
            slot, member = found
            entry = self._held.get(slot)
            if isinstance(entry, _MadeAgain):
                entry.join(rebuild.root, member, rebuild.cast, fused)


def _unpack(packed):
    kind = type(packed)
    if kind is _Rebuilt:
        return packed.tensor()
    return packed.get() if kind is _MadeAgain else packed
