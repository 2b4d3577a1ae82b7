"""The rebuild decision: a unit's saved tensors stay on the GPU, except those backward can make
again from others in a fraction of a millisecond (um_alloc.rebuild's recipes).

A transformer block saves, beside what its backward needs, tensors it can make again cheaply
from tensors it saves anyway: the bf16 casts of its input and of its LayerNorm outputs, which each
linear under autocast saves for itself; the GELU output the next linear saves; casts of its
weights. In a BERT-Large block that is about half of what it saves. Kept but rebuilt, a block
holds the rest, and backward reruns a cast, a LayerNorm or a GELU where it needs one.

Calibration finds them (RebuildProbe): while the first measured step recomputes each block, every
saved tensor with a recipe is rebuilt on the spot and compared with the tensor, byte for byte. The
equal ones, by their place among the unit's saves, are what a plan may count on, with their bytes
and the time the rebuilds took. Replay (RebuiltSaves) rebuilds a tensor only where that place in
the unit has a recipe of the same signature and keeps the others, so a step that differs costs
bytes, never a wrong gradient.

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
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..byte_views import storage_bytes
from ..rebuild import Held, Recipe, RootRecorder
from ..tensor_trees import tensors as _tensors

__all__ = ["RebuildProbe", "RebuiltSaves", "Signatures"]

Signatures = dict  # place among a unit's eligible saves -> Recipe.signature() that rebuilt equal


@dataclass
class _Base:
    """A root and cast that several saved tensors share (the query, key and value projections
    each save a cast of one input): built once in backward for all of them."""
    uses: int = 0
    tensor: torch.Tensor | None = None


@dataclass
class _Rebuilt:
    """What autograd holds instead of a saved tensor: how to make it again."""
    recipe: Recipe
    base: _Base
    device_type: str

    def tensor(self) -> torch.Tensor:
        base = self.base
        if base.tensor is None:
            base.tensor = self.recipe.build_base(_unchanged, self.device_type)
        out = self.recipe.shape(base.tensor)
        base.uses -= 1
        if base.uses <= 0:  # the last saved tensor of this base: let go of it
            base.tensor = None
        return out


@dataclass
class _Kept:
    """A tensor a unit holds, as its recipes read it: with its version when held."""
    tensor: torch.Tensor
    version: int
    unit: str


def _unchanged(entry: _Kept) -> torch.Tensor:
    """The held tensor itself, if nothing changed it in place since it was held."""
    tensor = entry.tensor
    if tensor._version != entry.version:
        raise RuntimeError(f"planner: a tensor of shape {tuple(tensor.shape)} that {entry.unit or 'a unit'} holds "
                           f"to rebuild others from was changed in place after its forward (version "
                           f"{entry.version} -> {tensor._version}); rebuilding from it would give wrong "
                           "gradients. Leave 'rebuild' out of the planner's decisions for this model")
    return tensor


@dataclass
class _UnitCall:
    """One call of a unit: the tensors it holds, and the roots recipes may start from."""
    device: torch.device
    min_bytes: int
    unit: str = ""                              # its name, for errors
    held: dict = field(default_factory=dict)   # (id, version) -> _Kept
    saves: int = 0                              # eligible saves so far

    def __post_init__(self):
        self.roots = RootRecorder(self.held_of, self.device.type, views_under_casts=True)

    def held_of(self, tensor: torch.Tensor) -> _Kept | None:
        entry = self.held.get((id(tensor), tensor._version))
        return entry if entry is not None and entry.tensor is tensor else None

    def hold(self, tensor: torch.Tensor) -> None:
        entry = _Kept(tensor, tensor._version, self.unit)
        self.held[(id(tensor), tensor._version)] = entry
        self.roots.add_held(tensor, entry)

    def close(self) -> None:
        """The call's forward is over: let go of what it held (the recipes keep what they read).
        The recorder and this call refer to each other, so without this the tensors would wait
        for Python's cycle collector, past their backward."""
        self.roots.clear()
        self.held.clear()

    def hold_inputs(self, values) -> None:
        for t in _tensors(values):
            if self.eligible(t):
                self.hold(t)

    def eligible(self, tensor: torch.Tensor) -> bool:
        """On the unit's device, at least min_bytes, not a parameter (nor a view of one). Not "a
        leaf that requires grad": a recomputed unit's input is one, the same input kept is not,
        and both must count the same places."""
        base = tensor._base if tensor._base is not None else tensor
        return (tensor.device == self.device and tensor.numel() * tensor.element_size() >= self.min_bytes
                and not isinstance(base, torch.nn.Parameter))

    def place(self) -> int:
        self.saves += 1
        return self.saves - 1

    def recipe_for(self, tensor: torch.Tensor) -> Recipe | None:
        """A recipe worth using: one that makes new memory (a call, or a cast). A view of a held
        tensor, or of a parameter, shares its memory: saving it costs nothing."""
        recipe = self.roots.recipe_for(tensor)
        if recipe is None or (isinstance(recipe.root, Held) and recipe.cast is None):
            return None
        return recipe


class RebuiltSaves:
    """Replay: around one call of a unit the plan rebuilds, the saved-tensor hooks that hold what
    must stay and stand a recipe in for what backward can make again."""

    def __init__(self, device: torch.device, min_bytes: int, signatures: Signatures, unit: str = ""):
        self._call = _UnitCall(device, min_bytes, unit)
        self._signatures = signatures
        self._bases: dict[tuple, _Base] = {}
        self.rebuilt_bytes = 0

    @contextlib.contextmanager
    def around(self, args, kwargs) -> Iterator[None]:
        self._call.hold_inputs((args, kwargs))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack), self._call.roots.mode():
                yield
        finally:
            self._call.close()

    def _pack(self, tensor: torch.Tensor):
        call = self._call
        if not call.eligible(tensor):
            return tensor
        expected = self._signatures.get(call.place())
        recipe = call.recipe_for(tensor) if expected is not None else None
        if recipe is None or recipe.signature() != expected:
            call.hold(tensor)
            return tensor
        base = self._bases.setdefault(recipe.base_key, _Base())
        base.uses += 1
        self.rebuilt_bytes += tensor.numel() * tensor.element_size()
        return _Rebuilt(recipe, base, tensor.device.type)


def _unpack(packed):
    return packed.tensor() if type(packed) is _Rebuilt else packed


@dataclass
class _Tried:
    """A recipe rebuilt during a recomputation, its comparison with the tensor still on the GPU.
    Not the recipe itself: it holds the tensors it rebuilds from, which must go with the
    recomputation's own (a recomputation that stops early leaves this in a reference cycle with
    its frame until Python's cycle collector runs: a whole step's activations on the GPU)."""
    place: int
    signature: tuple
    base_key: object
    nbytes: int
    storage: int
    timing: tuple            # (start clock, end clock, host seconds) of building its base
    differs: object          # a bool, or a one-element tensor the GPU fills in


class RebuildProbe:
    """Calibration: inside one recomputation of a unit, which of its saved tensors rebuild byte
    for byte, what they weigh, what their rebuilds take on both clocks, and what finding them
    takes the host (replay does that again in each forward).

    It wraps the saved-tensor hooks in force (the recomputation's own, torch.utils.checkpoint's):
    each tensor goes on to them unchanged. Where PyTorch does not say which hooks are in force, it
    finds nothing and the plan rebuilds nothing. The comparisons are read once the recomputation
    is over: read one by one, each would wait for the GPU, which would then sit idle inside the
    next rebuild's timing while the host issued it."""

    def __init__(self, device: torch.device, min_bytes: int, timer):
        self._device, self._min_bytes = device, min_bytes
        self._timer = timer               # () -> a clock; (start, end) of GPU work in seconds later
        self.signatures: Signatures = {}
        self.rebuilt_bytes = 0
        self.timings: list[tuple[object, object, float]] = []  # (start, end, host seconds) per base built
        self.forward_cpu_s = 0.0          # the host's time of what replay does as the unit saves: look for
        #                                   a recipe, or hold the tensor for others to rebuild from

    @contextlib.contextmanager
    def around(self, values) -> Iterator[None]:
        hooks = _hooks_in_force()
        if hooks is None:
            yield
            return
        outer_pack, outer_unpack = hooks
        call = _UnitCall(self._device, self._min_bytes)
        call.hold_inputs(values)
        tried: list[_Tried] = []

        def pack(tensor):
            self._look(call, tensor, tried)
            return outer_pack(tensor)

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, outer_unpack), call.roots.mode():
                yield
        finally:
            call.close()
        self._settle(tried)

    def _look(self, call: _UnitCall, tensor: torch.Tensor, tried: list) -> None:
        begun = time.perf_counter()
        if not call.eligible(tensor):
            return
        place = call.place()
        recipe = call.recipe_for(tensor)
        if recipe is None:
            call.hold(tensor)
            self._note(place, None)
        self.forward_cpu_s += time.perf_counter() - begun
        if recipe is None:
            return
        # Not held, as in replay, where it is rebuilt; should it turn out unequal, the recipes
        # that could have read it are missed, which costs bytes, not correctness.
        _keep_busy(tensor.device)
        start, host = self._timer(), time.perf_counter()
        with torch.no_grad():
            base = recipe.build_base(_unchanged, tensor.device.type)
        timing = (start, self._timer(), time.perf_counter() - host)
        tried.append(_Tried(place, recipe.signature(), recipe.base_key, tensor.numel() * tensor.element_size(),
                            tensor.untyped_storage().data_ptr(), timing, _differs(recipe.shape(base), tensor)))

    def _settle(self, tried: list) -> None:
        """The places whose rebuild came out equal; their bytes (a storage once) and the time of
        their bases (a base once: in backward a shared one is built once)."""
        storages, bases = set(), set()
        for t in tried:
            equal = not bool(t.differs)
            self._note(t.place, t.signature if equal else None)
            if not equal:
                continue
            if t.storage not in storages:
                storages.add(t.storage)
                self.rebuilt_bytes += t.nbytes
            if t.base_key not in bases:
                bases.add(t.base_key)
                self.timings.append(t.timing)

    def _note(self, place: int, signature) -> None:
        """Calls of one unit that disagree at a place: nothing is rebuilt there."""
        if self.signatures.get(place, signature) != signature:
            signature = None
        self.signatures[place] = signature


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


def _differs(rebuilt: torch.Tensor, tensor: torch.Tensor):
    """Whether the bits differ where both tensors cover their storages (what recipes rebuild):
    True, or a one-element tensor computed on the tensors' device without waiting for it."""
    if rebuilt.dtype != tensor.dtype or rebuilt.shape != tensor.shape or rebuilt.stride() != tensor.stride():
        return True
    a, b = storage_bytes(rebuilt), storage_bytes(tensor)
    return True if a.numel() != b.numel() else torch.ne(a, b).any()


def _hooks_in_force():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top(True) if top is not None else None
