"""Saved tensors that backward can rebuild from others instead of moving them over the link.

In BERT-Large under bf16 autocast a third of what autograd saves is derived from other saved
tensors by something that costs next to nothing on the GPU (b32 s512 on an H200):

- the bf16 casts of each LayerNorm's output, one per linear that reads it (Q, K, V and the
  intermediate dense: 2.9 GiB), rebuilt from the LayerNorm's own saved input (0.08 ms a cast);
- the GELU outputs saved by the next linear (3.0 GiB), rebuilt from the GELU's saved input
  (0.09 ms each);
- casts and views of tensors saved anyway: the fp32 copy of the log-softmax output (1.9 GiB),
  the attention output saved again as the next linear's input (0.75 GiB), weight casts.

A saved tensor is rebuildable when autograd's graph shows it is views of (at most one cast of)
a *root*: the output of a cheap function (``CHEAP_FUNCTIONS``, seen through a torch function mode
while forward runs) whose tensor inputs are held, or a tensor held itself, or a parameter.
"Held" means saved for backward this step, and so kept or offloaded by ActivationOffload.

Rebuilding reruns the same kernel on the same input under the same autocast state, so it gives
the same bits. ActivationOffload still checks before trusting a recipe: during its calibration
steps it moves every tensor as before *and* rebuilds it, and only recipes whose result was equal
to the moved tensor at that place in the step are used later. A wrong guess costs bytes, never
wrong gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Functions whose outputs are worth recomputing: one pass over the input, no randomness.
CHEAP_FUNCTIONS = {F.gelu, F.silu, F.relu, F.layer_norm, F.rms_norm}

# Autograd nodes of views: the saved tensor shares its root's storage.
VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "TBackward0", "PermuteBackward0",
    "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ReshapeAliasBackward0",
})
CAST_NODE = "ToCopyBackward0"
MAX_CHAIN = 8  # view nodes between a saved tensor and its root; BERT needs 3


@dataclass
class Param:
    """A parameter a recipe reads; it must be unchanged when backward rebuilds."""
    tensor: torch.Tensor
    version: int

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(f"activation offload: a parameter of shape {tuple(self.tensor.shape)} needed "
                               f"to rebuild a saved tensor was modified in place between forward and "
                               f"backward (version {self.version} -> {self.tensor._version})")
        return self.tensor


@dataclass
class Source:
    """A tensor saved this step: ActivationOffload's entry for it (kept tensor or host copy)."""
    entry: Any


@dataclass
class Call:
    """A cheap function's output: rerun it on its inputs."""
    func: Callable
    args: tuple            # Sources, Params or plain values
    kwargs: dict
    autocast: tuple        # (enabled, dtype) for the device type when forward called it
    numel: int


@dataclass
class Held:
    """A tensor saved this step, or a parameter: rebuilt by fetching it."""
    source: Source | Param
    numel: int


@dataclass
class Recipe:
    """How to rebuild one saved tensor: its root, at most one cast, then its own view of that."""
    root: Call | Held
    cast: torch.dtype | None
    size: tuple
    stride: tuple
    path: tuple = ()  # the autograd nodes' type names from the saved tensor down to its root's

    @property
    def sources(self) -> list:
        """The entries it reads (each read counts as a use of that entry)."""
        values = [self.root.source] if isinstance(self.root, Held) else [*self.root.args, *self.root.kwargs.values()]
        return [v.entry for v in values if isinstance(v, Source)]

    def signature(self) -> tuple:
        """What it does, without the tensors it reads: equal across steps that match."""
        if isinstance(self.root, Call):
            what = ("call", self.root.func.__name__)
        else:
            what = ("held", type(self.root.source).__name__)
        return (*what, self.cast, self.size, self.stride)

    def build(self, fetch: Callable[[Any], torch.Tensor], device_type: str) -> torch.Tensor:
        """The tensor, bit for bit; `fetch` turns an entry into its tensor on the GPU."""
        return self.shape(self.build_base(fetch, device_type))

    def build_base(self, fetch: Callable[[Any], torch.Tensor], device_type: str) -> torch.Tensor:
        """The root, cast: what recipes of one root and one cast share (see base_key)."""
        if isinstance(self.root, Call):
            call = self.root
            args = [_value(a, fetch) for a in call.args]
            kwargs = {k: _value(v, fetch) for k, v in call.kwargs.items()}
            enabled, dtype = call.autocast
            with torch.autocast(device_type, dtype=dtype, enabled=enabled):
                base = call.func(*args, **kwargs)
        else:
            base = _value(self.root.source, fetch)
        return base if self.cast is None else base.to(self.cast)

    def shape(self, base: torch.Tensor) -> torch.Tensor:
        """This recipe's own view of what build_base made."""
        return base.as_strided(self.size, self.stride, 0)

    @property
    def base_key(self) -> tuple:
        """Recipes with equal keys in one step build the same base (the query, key and value
        projections each save a cast of one LayerNorm output): it can be built once for them."""
        return id(self.root), self.cast


class RootRecorder:
    """Per step: the roots recipes start from, keyed by (autograd node, output number)."""

    def __init__(self, held_of: Callable[[torch.Tensor], Any], device_type: str, views_under_casts: bool = False):
        self._held_of = held_of          # tensor -> its entry if saved this step, else None
        self._device_type = device_type
        # Whether a cast of a view of the root (a linear reading x.view(-1, n)) may have a recipe:
        # rebuilt right only where the view only reshapes; for callers that compare every recipe's
        # result with the tensor before trusting it.
        self._views_under_casts = views_under_casts
        self._roots: dict[tuple, tuple[Any, Call | Held]] = {}  # (id(node), nr) -> (node, root)

    def mode(self) -> TorchFunctionMode:
        """Active while forward runs: records the calls of CHEAP_FUNCTIONS."""
        return _CheapCallMode(self)

    def clear(self) -> None:
        self._roots.clear()

    def add_held(self, tensor: torch.Tensor, entry: Any) -> None:
        """`tensor` was just saved and is held as `entry`: views and casts of it need not move."""
        node, nr = _root_of(tensor)
        if node is not None and _covers_storage(tensor):
            self._roots[(id(node), nr)] = (node, Held(Source(entry), tensor.numel()))

    def add_call(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is None or not _covers_storage(out):
            return
        # The key holds on to the node's Python object: one made afresh each time it is asked for,
        # dropped at once, would leave its id free for another node.
        key = (id(node), out.output_nr)
        if key in self._roots:
            return
        args = tuple(self._input(a) for a in args)
        kwargs = {k: self._input(v) for k, v in kwargs.items()}
        if any(a is _UNHELD for a in (*args, *kwargs.values())):
            return  # an input backward will not have: recomputing would mean keeping it
        autocast = (torch.is_autocast_enabled(self._device_type), torch.get_autocast_dtype(self._device_type))
        self._roots[key] = (node, Call(func, args, kwargs, autocast, out.numel()))

    def recipe_for(self, tensor: torch.Tensor) -> Recipe | None:
        """How to rebuild `tensor` (views of at most one cast of a root), or None."""
        if tensor.grad_fn is None or not _covers_storage(tensor):
            return None
        node, nr, cast, path = tensor.grad_fn, tensor.output_nr, None, []
        for _ in range(MAX_CHAIN):
            found = self._roots.get((id(node), nr))
            if found is not None and found[0] is node:
                return _recipe(tensor, found[1], cast, path)
            name = type(node).__name__
            if name == "AccumulateGrad":
                return _recipe(tensor, self._leaf(node.variable), cast, path)
            if len(node.next_functions) != 1 or (cast is not None and not self._views_under_casts):
                return None   # views of a cast of a view: the layout need not be the root's
            if name == CAST_NODE:
                if cast is not None:
                    return None  # two casts: the first could lose what the second cannot give back
                cast = tensor.dtype
            elif name not in VIEW_NODES:
                return None
            path.append(name)
            node, nr = node.next_functions[0]
            if node is None:
                return None
        return None

    def _leaf(self, leaf: torch.Tensor) -> Held:
        """A leaf: one held this step (a recomputed block's input), or a parameter."""
        entry = self._held_of(leaf)
        if entry is not None:
            return Held(Source(entry), leaf.numel())
        return Held(Param(leaf, leaf._version), leaf.numel())

    def _input(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        entry = self._held_of(value)
        if entry is not None:
            return Source(entry)
        if value.is_leaf and value.requires_grad:
            return Param(value, value._version)
        return _UNHELD


class _CheapCallMode(TorchFunctionMode):
    def __init__(self, recorder: RootRecorder):
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in CHEAP_FUNCTIONS and torch.is_grad_enabled():
            self._recorder.add_call(func, args, kwargs, out)
        return out


_UNHELD = object()


def _recipe(tensor: torch.Tensor, root: Call | Held, cast, path: list) -> Recipe | None:
    if root.numel != tensor.numel():
        return None  # a view of part of the root: not its whole storage
    return Recipe(root, cast, tuple(tensor.size()), tuple(tensor.stride()), tuple(path))


def _value(value, fetch):
    if isinstance(value, Param):
        return value.get()
    return fetch(value.entry) if isinstance(value, Source) else value


def _covers_storage(tensor: torch.Tensor) -> bool:
    """Dense from the start of its storage to the end: as_strided on a fresh copy rebuilds it."""
    return (tensor.storage_offset() == 0 and dense(tensor)
            and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size())


def as_saved(tensor: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook hands autograd, or holds, for a tensor it leaves on the GPU as
    it is: an alias with no autograd history (the same storage and version counter). Never the
    tensor itself: where an op saves its own output, the op's node would hold the hook's result,
    which would hold the tensor, whose grad_fn is that node. The cycle runs through autograd's C++,
    where Python's cycle collector cannot see it, and only backward breaks it: a step that fails
    before its backward (an out-of-memory error at the loss) would keep its whole graph."""
    return tensor.detach()


def dense(tensor: torch.Tensor) -> bool:
    """Its elements fill a block of memory once each, in some order of its dimensions."""
    expected = 1
    for size, stride in sorted((d for d in zip(tensor.shape, tensor.stride()) if d[0] != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def broadcast(tensor: torch.Tensor) -> bool:
    """Some of its elements are one element of memory: a stride of 0 where its size is more than 1
    (what expand() makes, as the attention masks transformers expands to the batch). It holds
    fewer bytes than its size says, and a copy of it is laid out densely."""
    return any(stride == 0 and size > 1 for size, stride in zip(tensor.shape, tensor.stride()))


def _root_of(tensor: torch.Tensor) -> tuple[Any, int]:
    """The node that made `tensor`'s storage: below its view nodes, if it is a view."""
    node, nr = tensor.grad_fn, tensor.output_nr
    if tensor._base is None:
        return node, nr
    for _ in range(MAX_CHAIN):
        if node is None or type(node).__name__ not in VIEW_NODES:
            return node, nr
        if len(node.next_functions) != 1:
            return None, 0
        node, nr = node.next_functions[0]
    return None, 0
