"""Calibration's side of the rebuild decision (rebuilt.py): inside one recomputation of a unit,
which of its saved tensors um_alloc.rebuild's recipes make again byte for byte, in terms of the
unit's places (PlaceRecipe), what they weigh and what their rebuilds cost on both clocks.

A recipe found while a save is made is rebuilt on the spot and compared with the tensor; the
comparisons are read once the recomputation is over, so that the GPU is not left waiting for the
host inside the next rebuild's timing. A call that several recipes read is made once for the unit
call and kept until its forward ends, as replay makes it once in backward, so the timings price it
once.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch.autograd.graph import get_gradient_edge

from ..byte_views import storage_bytes
from ..rebuild import CAST_NODE, MATMUL_FUNCTIONS, Call, Held, Param, Recipe, RootRecorder, Shared, Source
from ..tensor_trees import tensors as _tensors
from .fused_tree import fuse
from .rebuilt import (MAX_ROUTE, Narrowed, Nested, ParamRef, PlaceCall, PlaceRecipe, Slot, UnitRecipes, _Eligible,
                      _Kept, _unchanged)

__all__ = ["RebuildProbe", "place_recipe"]

_DIFFERS = object()  # what _place_call makes of an argument replay could not check


@dataclass
class _UnitCall:
    """One call of a unit in calibration: the tensors it holds, and the roots recipes may start from."""
    eligible: _Eligible
    unit: str = ""                              # its name, for errors
    held: dict = field(default_factory=dict)   # (id, version) -> _Kept
    by_slot: dict = field(default_factory=dict)  # Slot -> _Kept: what replay finds held
    saves: int = 0                              # eligible saves so far
    bases: dict = field(default_factory=dict)   # (root node, output number, cast) -> a number
    calls: dict = field(default_factory=dict)   # (node, output number) -> its bound Call (bind's)

    def __post_init__(self):
        self.roots = RootRecorder(self.held_of, self.eligible.device.type, views_under_casts=True, trees=True)

    def held_of(self, tensor: torch.Tensor) -> _Kept | None:
        entry = self.held.get((id(tensor), tensor._version))
        return entry if entry is not None and entry.tensor is tensor else None

    def hold(self, tensor: torch.Tensor, slot: Slot, root: bool = True) -> None:
        """Holds `tensor` as recipes read it; root=False for one rebuilt itself (made again in replay,
        _MadeAgain), whose other saves rebuild as it does rather than view what replay never holds."""
        entry = _Kept(tensor, tensor._version, self.unit, slot)
        self.held[(id(tensor), tensor._version)] = entry
        self.by_slot[slot] = entry
        self.roots.add_held(tensor, entry, root)

    def close(self) -> None:
        """The call's forward is over: let go of what it held (the recipes keep what they read).
        The recorder and this call refer to each other, so without this the tensors would wait
        for Python's cycle collector, past their backward."""
        self.roots.clear()
        self.held.clear()
        self.by_slot.clear()
        self.bases.clear()
        self.calls.clear()

    def base_number(self, key: tuple) -> int:
        """The number of the base `key` (bind's: its root's node, held here until close) names in
        this call: saves that share a base get one number, without holding the node past forward."""
        return self.bases.setdefault(key, len(self.bases))

    def hold_inputs(self, tensors: list) -> None:
        """Holds the unit's eligible tensor inputs, numbered as replay numbers them (_inputs)."""
        for k, t in enumerate(t for t in tensors if self.eligible(t)):
            self.hold(t, Slot("input", k))

    def place(self) -> int:
        self.saves += 1
        return self.saves - 1

    def recipe_for(self, tensor: torch.Tensor) -> Recipe | None:
        """A recipe worth using: one that makes new memory (a call, or a cast). A view of a held
        tensor, or of a parameter, shares its memory: saving it costs nothing. One that reruns a
        matrix product only where it makes a float32 copy (autocast's of a bf16 linear output, for
        pow: twice the product's bytes); elsewhere the product's output costs its own bytes, and
        rerunning it costs nearly what recomputing the unit does."""
        recipe = self.roots.recipe_for(tensor)
        if recipe is None or (isinstance(recipe.root, Held) and recipe.cast is None):
            return None
        if recipe.cast not in WIDE and isinstance(recipe.root, Call) and _reruns_a_product(recipe.root):
            return None
        return recipe


WIDE = (torch.float32, torch.float64)  # the casts a recipe that reruns a product may end in


def _reruns_a_product(call: Call) -> bool:
    return call.func in MATMUL_FUNCTIONS or any(_reruns_a_product(c) for c in call.nested())


def place_recipe(recipe: Recipe, tensor: torch.Tensor) -> PlaceRecipe | None:
    """`recipe`, found while `tensor` was saved, in terms of places: None where replay could not
    check it (a held tensor it reads that does not require grad, whose autograd edge says nothing)."""
    node, nr = tensor.grad_fn, tensor.output_nr
    for _ in recipe.path:
        node, nr = node.next_functions[0]
    reads: dict[Slot, tuple] = {}

    def place_of(value):
        if isinstance(value, Source):
            held = value.entry.tensor
            reads[value.entry.slot] = (value.entry.slot, held.dtype, tuple(held.size()), tuple(held.stride()))
            return value.entry.slot
        return ParamRef(value.tensor) if isinstance(value, Param) else value

    shape = dict(path=recipe.path, cast=recipe.cast, dtype=tensor.dtype, size=recipe.size, stride=recipe.stride,
                 nbytes=tensor.untyped_storage().nbytes())
    root = recipe.root
    if isinstance(root, Held):
        source = place_of(root.source)
        return PlaceRecipe("param" if isinstance(source, ParamRef) else "held", source=source,
                           reads=tuple(reads.values()), **shape)
    described = _place_call(root, node, place_of)
    if described is None:
        return None
    return PlaceRecipe("call", func=root.func, args=described.args, kwargs=described.kwargs, autocast=root.autocast,
                       node=described.node, edges=described.edges, widened=described.widened,
                       reads=tuple(reads.values()), **shape)


def _place_call(call: Call, node, place_of: Callable) -> PlaceCall | None:
    """`call`, whose output autograd's `node` made, in terms of places: the edges by which the node
    reads each held tensor, and each nested call at the index of its node among the node's inputs.
    None where replay could not check it (a held tensor read that does not require grad, whose
    autograd edge says nothing)."""
    inputs, edges, widened = node.next_functions, [], []

    def placed(value):
        if isinstance(value, Source) and value.cast is not None:
            # The call read the narrow tensor (0.5 * x reads x), or the widening itself: the call
            # that saved it (pow) reads autocast's copy, which its rerun makes again.
            held = value.entry.tensor
            below = held.grad_fn.next_functions[0] if type(held.grad_fn).__name__ == CAST_NODE else None
            route = route_to(inputs, *below) if below is not None else None
            if route is not None:
                widened.append((value.entry.slot, route))
            else:
                edge = get_gradient_edge(held)
                route = route_to(inputs, edge.node, edge.output_nr)
                if route is None:
                    return _DIFFERS
                edges.append((value.entry.slot, route))
            return Narrowed(place_of(value), value.cast)
        if isinstance(value, Call):
            route = route_to(inputs, *value.made)
            inner = _place_call(value, value.made[0], place_of) if route is not None else None
            return _DIFFERS if inner is None else Nested(route, inner)
        if isinstance(value, Source):
            if not value.entry.tensor.requires_grad:
                return _DIFFERS
            edge = get_gradient_edge(value.entry.tensor)
            route = route_to(inputs, edge.node, edge.output_nr)
            if route is None:
                return _DIFFERS
            edges.append((value.entry.slot, route))
        return place_of(value)

    args = tuple(placed(a) for a in call.args)
    kwargs = tuple((k, placed(v)) for k, v in call.kwargs.items())
    if any(v is _DIFFERS for v in (*args, *(v for _, v in kwargs))):
        return None
    return PlaceCall(call.func, args, kwargs, call.autocast, type(node).__name__, tuple(edges), tuple(widened))


def route_to(inputs: tuple, node, nr: int) -> tuple | None:
    """The shortest Route from `inputs` (a node's next_functions) to the edge (node, nr), through
    at most MAX_ROUTE nodes, or None. Breadth first, each node's inputs in order: one answer."""
    frontier = [((i,), fn, fn_nr) for i, (fn, fn_nr) in enumerate(inputs)]
    for depth in range(MAX_ROUTE + 1):
        for route, fn, fn_nr in frontier:
            if fn is node and fn_nr == nr:
                return route
        if depth == MAX_ROUTE:
            return None
        frontier = [((*route, type(fn).__name__, i), below, below_nr) for route, fn, _ in frontier if fn is not None
                    for i, (below, below_nr) in enumerate(fn.next_functions)]
    return None


@dataclass
class _Tried:
    """A recipe rebuilt during a recomputation, its comparison with the tensor still on the GPU.
    Not the recipe itself: it holds the tensors it rebuilds from, which must go with the
    recomputation's own (a recomputation that stops early leaves this in a reference cycle with
    its frame until Python's cycle collector runs: a whole step's activations on the GPU)."""
    place: int
    recipe: PlaceRecipe
    base_key: int            # the base's number in its call (saves that share one share it)
    nbytes: int
    storage: int
    timing: tuple            # (start clock, end clock, host seconds) of building its base
    differs: object          # a bool, or a one-element tensor the GPU fills in
    fused: object = None     # the FusedTree its root ran as, if one


class RebuildProbe:
    """Calibration: inside one recomputation of a unit, which of its saved tensors rebuild byte
    for byte, what they weigh, what their rebuilds take on both clocks, and what replay's checks
    of them take the host (replay does that again in each forward).

    It wraps the saved-tensor hooks in force (the recomputation's own, torch.utils.checkpoint's):
    each tensor goes on to them unchanged. Where PyTorch does not say which hooks are in force, it
    finds nothing and the plan rebuilds nothing. Each recipe found is put in terms of places and
    rebuilt the way replay will rebuild it. The comparisons are read once the recomputation is
    over: read one by one, each would wait for the GPU, which would then sit idle inside the next
    rebuild's timing while the host issued it."""

    def __init__(self, device: torch.device, min_bytes: int, timer):
        self._eligible = _Eligible(device, min_bytes)
        self._timer = timer               # () -> a clock; (start, end) of GPU work in seconds later
        self.recipes: UnitRecipes | None = None   # None until a call of the unit has been probed
        self.rebuilt_bytes = 0
        self.timings: list[tuple[object, object, float]] = []  # (start, end, host seconds) per base built
        self.forward_cpu_s = 0.0          # the host's time of what replay does as the unit saves: check
        #                                   a place's recipe against the tensor, or hold one recipes read

    @contextlib.contextmanager
    def around(self, values) -> Iterator[None]:
        hooks = _hooks_in_force()
        if hooks is None:
            yield
            return
        outer_pack, outer_unpack = hooks
        device_type = self._eligible.device.type
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        call = _UnitCall(self._eligible)
        call.hold_inputs(list(_tensors(values)))
        tried: list[_Tried] = []
        hold_s: dict[int, float] = {}

        def pack(tensor):
            self._look(call, tensor, tried, hold_s)
            return outer_pack(tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), call.roots.mode():
                yield
        finally:
            call.close()
        self._settle(tried, autocast, hold_s)

    def _look(self, call: _UnitCall, tensor: torch.Tensor, tried: list, hold_s: dict) -> None:
        begun = time.perf_counter()
        if not self._eligible(tensor):
            return
        place = call.place()
        self.forward_cpu_s += time.perf_counter() - begun
        call.roots.when_recorded(lambda: self._examine(call, place, tensor, tried, hold_s))

    def _examine(self, call: _UnitCall, place: int, tensor: torch.Tensor, tried: list, hold_s: dict) -> None:
        """Finds the recipe of the tensor saved at `place`, rebuilds and compares it, or holds it."""
        recipe = call.recipe_for(tensor)
        planned = place_recipe(recipe, tensor) if recipe is not None else None
        begun = time.perf_counter()
        bound = planned.bind(tensor, call.by_slot, call.calls) if planned is not None else None
        checked = time.perf_counter()
        if bound is None:
            call.hold(tensor, Slot("save", place))
            hold_s[place] = time.perf_counter() - checked  # replay holds it only if a recipe reads it
            return
        self.forward_cpu_s += checked - begun
        # Not held, as in replay, where it is rebuilt; should it turn out unequal, the recipes
        # that could have read it are missed, which costs bytes, not correctness. A cast (pow's
        # float32 copy of a linear's output) is read as held all the same: replay makes it once for
        # its readers (_MadeAgain), which then need not rerun the linear each.
        if type(tensor.grad_fn).__name__ == CAST_NODE and tensor.dtype in WIDE:
            call.hold(tensor, Slot("save", place), root=False)
        rebuild, key = bound
        base_key = call.base_number(key)  # not the node: held by _Tried, it would wait for the cycle collector
        fused = None
        if isinstance(rebuild.root, Call):
            _keep_results(rebuild.root)
            # Compiled and compared outside the timing: replay runs what is timed here.
            fused = rebuild.root.fused = fuse(rebuild.root, _unchanged, tensor.device.type)
        _keep_busy(tensor.device)
        start, host = self._timer(), time.perf_counter()
        with torch.no_grad():
            base = rebuild.build_base(_unchanged, tensor.device.type)
        timing = (start, self._timer(), time.perf_counter() - host)
        tried.append(_Tried(place, planned, base_key, tensor.numel() * tensor.element_size(),
                            tensor.untyped_storage().data_ptr(), timing, _differs(rebuild.shape(base), tensor),
                            fused))

    def _settle(self, tried: list, autocast: tuple, hold_s: dict) -> None:
        """The places whose rebuild came out equal; their bytes (a storage once) and the time of
        their bases (a base once: in backward a shared one is built once)."""
        storages, bases, found, fused = set(), set(), {}, {}
        for t in tried:
            if bool(t.differs):
                continue
            found[t.place] = t.recipe
            if t.fused is not None:
                fused[t.place] = t.fused
            if t.storage not in storages:
                storages.add(t.storage)
                self.rebuilt_bytes += t.nbytes
            if t.base_key not in bases:
                bases.add(t.base_key)
                self.timings.append(t.timing)
        self._agree(UnitRecipes(found, autocast, fused))
        sources = self.recipes.sources
        self.forward_cpu_s += sum(s for place, s in hold_s.items() if Slot("save", place) in sources)

    def _agree(self, found: UnitRecipes) -> None:
        """Calls of one unit that disagree at a place: nothing is rebuilt there."""
        if self.recipes is None:
            self.recipes = found
        elif found.autocast != self.recipes.autocast:
            self.recipes = UnitRecipes({}, self.recipes.autocast)
        else:
            self.recipes.places = {p: r for p, r in self.recipes.places.items() if found.places.get(p) == r}


def _keep_results(call: Call) -> None:
    """Calibration: each call of the unit call is made once, as replay makes it, and kept until the
    unit's forward ends (_UnitCall.close), when its readers are not known yet: the timings then
    price a call that trees share once."""
    if call.shared is None:
        call.shared = Shared(uses=KEPT)
        for nested in call.nested():
            _keep_results(nested)


KEPT = 1 << 62  # a use count no unit call reaches


# GPU cycles of work queued ahead of a timed rebuild: about 1 ms at an H100's or H200's clock,
# longer than the host takes to issue one rebuild (a cast, a LayerNorm or a GELU through Python).
BUSY_CYCLES = 2_000_000


def _keep_busy(device: torch.device) -> None:
    """Queues GPU work to run while the host issues a timed rebuild, so that the events around it
    time its kernels alone. Without it, a recomputation paced by the host (as BERT-Large's are)
    leaves the GPU idle between the rebuild's kernels, and the GPU's time of a rebuild came out
    as the host's: 0.6 to 0.75 ms for a block's 280 MiB of casts and GELU on an H100."""
    if device.type == "cuda":
        torch.cuda._sleep(BUSY_CYCLES)


# The bytes compared at once: the comparison's temporary is one byte per byte compared, and a
# saved tensor can be a large share of the budget (ResNet-50's first-stage outputs at batch 704:
# 1.1 GB each), beside the rebuilt copy the probe already holds.
COMPARED_BYTES = 64 << 20


def _differs(rebuilt: torch.Tensor, tensor: torch.Tensor):
    """Whether the bits differ where both tensors cover their storages (what recipes rebuild):
    True, or a one-element tensor computed on the tensors' device without waiting for it."""
    if rebuilt.dtype != tensor.dtype or rebuilt.shape != tensor.shape or rebuilt.stride() != tensor.stride():
        return True
    a, b = storage_bytes(rebuilt), storage_bytes(tensor)
    if a.numel() != b.numel():
        return True
    if a.numel() <= COMPARED_BYTES:
        return torch.ne(a, b).any()
    return torch.stack([torch.ne(a[i:i + COMPARED_BYTES], b[i:i + COMPARED_BYTES]).any()
                        for i in range(0, a.numel(), COMPARED_BYTES)]).any()


def _hooks_in_force():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None
