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

A root may also be a tree of elementwise calls (``ELEMENTWISE_FUNCTIONS``: mul, add, sub, div,
pow, tanh, sigmoid, exp, rsqrt, neg; at most ``MAX_CALLS``) whose leaves are held tensors,
parameters or plain values, for callers that ask for it (``RootRecorder(trees=True)``, the
planner's rebuild decision): GPT-2's GELU, ``0.5 * x * (1 + tanh(c * (x + k * x**3)))``, saves
its tanh output, ``1 + t``, ``0.5 * x`` and the product, each such a tree over ``x``, which pow
saves. A call several trees read is one ``Call`` object, whose output ``Shared`` makes once.
Such a tree may also rerun matrix products (``MATMUL_FUNCTIONS``) and read inputs through views
(``VIEW_FUNCTIONS``): the float32 copy of ``x`` that pow saves under CUDA autocast is a cast of
the first linear's product of a LayerNorm's output.

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

# Elementwise functions a recipe may chain (RootRecorder(trees=True)): deterministic, one pass,
# no randomness, no reduction. Each in the forms a torch function mode sees: torch.mul, Tensor.mul
# (what `0.5 * x` arrives as), the operators' Tensor.__op__ / __rop__.
_ELEMENTWISE = ("mul", "add", "sub", "div", "true_divide", "pow", "tanh", "sigmoid", "exp", "rsqrt", "neg")
_OPERATORS = ("__mul__", "__rmul__", "__add__", "__radd__", "__sub__", "__rsub__", "__truediv__",
              "__rtruediv__", "__div__", "__rdiv__", "__pow__", "__rpow__", "__neg__")
ELEMENTWISE_FUNCTIONS = frozenset([getattr(torch, n) for n in _ELEMENTWISE]
                                  + [getattr(torch.Tensor, n) for n in (*_ELEMENTWISE, *_OPERATORS)])
# Matrix products a tree may rerun (RootRecorder(trees=True)). GPT-2's GELU under autocast saves
# autocast's float32 copy of the first linear's bf16 output, twice that output's bytes: rerunning
# the product in backward costs a fraction of recomputing the block, and the block holds neither.
# Which recipes may rerun one is the caller's choice (the planner's: only those that end in such a
# copy). Deterministic for one shape on one device; calibration compares every rebuild with the
# tensor, byte for byte, all the same.
MATMUL_FUNCTIONS = frozenset({torch.addmm, torch.mm, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__,
                              F.linear})
# Views a tree's calls may read their inputs through (a linear reading x.view(-1, n)): recorded
# as calls that only reshape, found when a recipe asks for an input, never roots of their own.
VIEW_FUNCTIONS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape})
MAX_CALLS = 12  # calls in one recipe's tree, each counted once: GPT-2's GELU product needs 8

# Autograd nodes of views: the saved tensor shares its root's storage.
VIEW_NODES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "TransposeBackward0", "TBackward0", "PermuteBackward0",
    "AliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "ReshapeAliasBackward0",
})
CAST_NODE = "ToCopyBackward0"
# (narrow, wide) dtypes whose widening keeps every value: the wide copy cast back gives the same bits.
EXACT_WIDENINGS = frozenset({(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                             (torch.bfloat16, torch.float64), (torch.float16, torch.float64),
                             (torch.float32, torch.float64)})
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
    """A tensor saved this step: ActivationOffload's entry for it (kept tensor or host copy), or,
    with `cast`, the narrower tensor it is an exact widening of (autocast runs pow in float32 and
    saves the float32 copy of a bf16 input, which the GELU's other calls read as it was)."""
    entry: Any
    cast: torch.dtype | None = None

    def read(self, fetch: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The tensor, cast: where the entry has it in that dtype already, that one (narrowed)."""
        tensor = fetch(self.entry)
        if self.cast is None or tensor.dtype is self.cast:
            return tensor
        made = self.narrowed(self.cast)
        return made if made is not None else tensor.to(self.cast)

    def narrowed(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The entry's tensor in `dtype`, or None: an entry that made its tensor by widening one of
        `dtype` it still has (the planner's copy made again from a linear's product) gives that one,
        the same bits with no kernel, from its own `narrowed(dtype)`. Asked once the tensor is made."""
        narrowed = getattr(self.entry, "narrowed", None)
        return narrowed(dtype) if narrowed is not None else None


@dataclass
class Shared:
    """A result several rebuilds read in one backward: made at the first, let go after the last."""
    uses: int = 0
    tensor: torch.Tensor | None = None

    def take(self, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if self.tensor is None:
            self.tensor = make()
        out = self.tensor
        self.uses -= 1
        if self.uses <= 0:  # its last reader: let go of it
            self.tensor = None
        return out


@dataclass(eq=False)
class Call:
    """A cheap function's output: rerun it on its inputs."""
    func: Callable
    args: tuple            # Sources, Params, plain values, or Calls whose outputs it reads (a tree)
    kwargs: dict
    autocast: tuple        # (enabled, dtype) for the device type when forward called it
    numel: int             # of its output; 0 for a call inside a tree, which nothing views
    shared: Shared | None = None   # where several rebuilds read its output: made once for them
    made: tuple = ()       # (autograd node, output number) of its output, while the recorder holds it
    fused: Any = None      # (call, fetch) -> its tree's output from one kernel, or None (the planner's)
    ahead: Any = None      # a kernel that makes its output with others' and holds it until taken (the planner's)

    @property
    def inputs(self) -> list:
        return [*self.args, *self.kwargs.values()]

    def nested(self) -> list:
        """The calls whose outputs it reads."""
        return [v for v in self.inputs if isinstance(v, Call)]

    def run(self, fetch: Callable[[Any], torch.Tensor], device_type: str) -> torch.Tensor:
        """Its output, from its inputs made again, under the autocast state forward ran it in."""
        if self.shared is not None:
            return self.shared.take(lambda: self._run(fetch, device_type))
        return self._run(fetch, device_type)

    def run_cast(self, fetch: Callable[[Any], torch.Tensor], device_type: str, dtype: torch.dtype) -> torch.Tensor:
        """Its output cast to `dtype`. Where this is its only read, a fused tree may write `dtype`
        itself (FusedTree), with no float32 output to cast."""
        shared = self.shared
        one_read = shared is None or (shared.uses == 1 and shared.tensor is None)
        if (self.fused is not None or self.ahead is not None) and one_read:
            out = self._fused(fetch, dtype)
            if out is not None:
                if shared is not None:
                    shared.uses = 0
                for nested in self.nested():
                    nested.skip()
                return out
        return self.run(fetch, device_type).to(dtype)

    def made_once(self, fetch: Callable[[Any], torch.Tensor], device_type: str) -> torch.Tensor:
        """Its output, made if nothing made it yet, without counting a read: a kernel that reads it
        as one of its tree's leaves, whose calls then each give up their own read (skip)."""
        shared = self.shared
        if shared is None:
            return self._run(fetch, device_type)
        if shared.tensor is None:
            shared.tensor = self._run(fetch, device_type)
        return shared.tensor

    def skip(self) -> None:
        """One read fewer of its output: its reader made its own from the tree's leaves (fused).
        Its last read skipped with nothing made, it never will be: its own reads are skipped too,
        as making it would have taken them. (A call skipped by one reader and made for another
        takes them as it is made.)"""
        shared = self.shared
        if shared is None:
            return
        shared.uses -= 1
        if shared.uses > 0:
            return
        if shared.tensor is None:
            for nested in self.nested():
                nested.skip()
        shared.tensor = None
        if self.ahead is not None:
            self.ahead.drop(self)

    def _run(self, fetch, device_type: str) -> torch.Tensor:
        out = self._fused(fetch, None)
        if out is not None:
            for nested in self.nested():
                nested.skip()
            return out
        return self.eager(fetch, device_type)

    def eager(self, fetch, device_type: str) -> torch.Tensor:
        """Its function run on its inputs (each made again), under the autocast state forward ran it in."""
        args = [_value(a, fetch, device_type) for a in self.args]
        kwargs = {k: _value(v, fetch, device_type) for k, v in self.kwargs.items()}
        enabled, dtype = self.autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return self.func(*args, **kwargs)

    def _fused(self, fetch, dtype: torch.dtype | None) -> torch.Tensor | None:
        """Its output in `dtype` (None: its own) without running its calls one by one: made ahead
        with others' (ahead), or by its tree's kernel (fused); None where neither gives it."""
        out = self.ahead.take(self, fetch, dtype) if self.ahead is not None else None
        if out is None and self.fused is not None:
            out = self.fused(self, fetch, dtype)
        return out


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
        return [v.entry for v in _leaves(self.root) if isinstance(v, Source)]

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
        if self.cast is not None and isinstance(self.root, Call):
            return self.root.run_cast(fetch, device_type, self.cast)
        return self.cast_root(self.build_root(fetch, device_type))

    def build_root(self, fetch: Callable[[Any], torch.Tensor], device_type: str) -> torch.Tensor:
        """The root's output, before the cast."""
        if isinstance(self.root, Call):
            return self.root.run(fetch, device_type)
        return _value(self.root.source, fetch, device_type)

    def cast_root(self, root: torch.Tensor) -> torch.Tensor:
        return root if self.cast is None else root.to(self.cast)

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

    def __init__(self, held_of: Callable[[torch.Tensor], Any], device_type: str, views_under_casts: bool = False,
                 trees: bool = False):
        self._held_of = held_of          # tensor -> its entry if saved this step, else None
        self._device_type = device_type
        # Whether a cast of a view of the root (a linear reading x.view(-1, n)) may have a recipe:
        # rebuilt right only where the view only reshapes; for callers that compare every recipe's
        # result with the tensor before trusting it.
        self._views_under_casts = views_under_casts
        # Whether a root may be a tree of ELEMENTWISE_FUNCTIONS calls (GPT-2's GELU): its inputs are
        # found when a recipe asks for them, not when it runs, since the tensors a chain starts from
        # are often saved only by a later op of the chain (x by the pow after 0.5 * x).
        self._trees = trees
        self.functions = (CHEAP_FUNCTIONS | ELEMENTWISE_FUNCTIONS | MATMUL_FUNCTIONS | VIEW_FUNCTIONS if trees
                          else CHEAP_FUNCTIONS)
        self._roots: dict[tuple, tuple[Any, Call | Held]] = {}  # (id(node), nr) -> (node, root)
        self._views: dict[tuple, tuple[Any, Call]] = {}  # the same for VIEW_FUNCTIONS' calls: inputs, not roots
        self._held_edges: dict[tuple, tuple] = {}  # (id(grad_fn), nr) -> (grad_fn, entry, version when held)
        # (id(node), nr) of a tensor a held tensor is an exact widening of -> (node, entry, its version, dtype)
        self._widened: dict[tuple, tuple] = {}
        self._inputs_now: list = []  # the tensors the call just recorded read, while saves made in it are looked at
        self._waiting: list | None = None  # while a recorded function runs: what waits for its record

    def mode(self) -> TorchFunctionMode:
        """Active while forward runs: records the calls of self.functions."""
        return _CheapCallMode(self)

    def clear(self) -> None:
        self._roots.clear()
        self._views.clear()
        self._held_edges.clear()
        self._widened.clear()

    def when_recorded(self, look: Callable[[], None]) -> None:
        """Runs `look` once the function running now is recorded, or at once if none runs. A
        tensor saved while it runs may be its output (tanh and sigmoid save theirs), whose root is
        that call: autograd saves it before the call returns to be recorded."""
        if self._waiting is None:
            look()
        else:
            self._waiting.append(look)

    def add_held(self, tensor: torch.Tensor, entry: Any, root: bool = True) -> None:
        """`tensor` was just saved and is held as `entry`: views and casts of it need not move. With
        root=False, only calls read it as held (a tensor rebuilt itself, which the caller makes once
        for its readers): a save of it, or of a view or cast of it, finds its own recipe."""
        if self._trees and tensor.grad_fn is not None:
            self._held_edges[(id(tensor.grad_fn), tensor.output_nr)] = (tensor.grad_fn, entry, tensor._version)
            self._note_widening(tensor, entry)
        node, nr = _root_of(tensor)
        if root and node is not None and _covers_storage(tensor):
            self._roots[(id(node), nr)] = (node, Held(Source(entry), tensor.numel()))

    def _note_widening(self, tensor: torch.Tensor, entry: Any) -> None:
        """Where `tensor` is autocast's exact widening of an input of the call that saved it (pow
        under CUDA autocast saves a float32 copy of its bf16 input), that input can be had back from
        it: casting it back down gives the same bits."""
        node = tensor.grad_fn
        if type(node).__name__ != CAST_NODE or len(node.next_functions) != 1:
            return
        below, below_nr = node.next_functions[0]
        for value in self._inputs_now:
            exact = (value.dtype, tensor.dtype) in EXACT_WIDENINGS
            if value.grad_fn is below and value.output_nr == below_nr and exact:
                self._widened[(id(below), below_nr)] = (below, entry, value._version, value.dtype)
                return

    def add_call(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        node = out.grad_fn if isinstance(out, torch.Tensor) else None
        if node is None or not _covers_storage(out):
            return
        # The key holds on to the node's Python object: one made afresh each time it is asked for,
        # dropped at once, would leave its id free for another node.
        key = (id(node), out.output_nr)
        calls = self._views if func in VIEW_FUNCTIONS else self._roots
        if key in calls:
            return
        args = tuple(self._input(a) for a in args)
        kwargs = {k: self._input(v) for k, v in kwargs.items()}
        if any(a is _UNHELD for a in (*args, *kwargs.values())):
            return  # an input backward will not have: recomputing would mean keeping it
        autocast = (torch.is_autocast_enabled(self._device_type), torch.get_autocast_dtype(self._device_type))
        made = (node, out.output_nr) if self._trees else ()
        calls[key] = (node, Call(func, args, kwargs, autocast, out.numel(), made=made))

    def recipe_for(self, tensor: torch.Tensor) -> Recipe | None:
        """How to rebuild `tensor` (views of at most one cast of a root), or None."""
        if tensor.grad_fn is None or not _covers_storage(tensor):
            return None
        node, nr, cast, path = tensor.grad_fn, tensor.output_nr, None, []
        for _ in range(MAX_CHAIN):
            found = self._roots.get((id(node), nr))
            if found is not None and found[0] is node:
                root = self._tree(found[1], [MAX_CALLS], {}) if self._trees and isinstance(found[1], Call) else found[1]
                return _recipe(tensor, root, cast, path) if root is not None else None
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

    def _tree(self, call: Call, budget: list, found: dict) -> Call | None:
        """`call` with the tensors it read found: held ones as Sources, outputs of recorded calls as
        nested Calls (at most budget[0] calls in all, each counted once: `found` holds the tree's
        calls by the recorded call, which several of its calls may read), or None where one is
        neither."""
        budget[0] -= 1
        if budget[0] < 0:
            return None
        resolved = []
        for value in call.inputs:
            if isinstance(value, _Ref):
                value = self._found(value, budget, found)
                if value is None:
                    return None
            resolved.append(value)
        args, kwargs = resolved[:len(call.args)], resolved[len(call.args):]
        return Call(call.func, tuple(args), dict(zip(call.kwargs, kwargs)), call.autocast, call.numel, made=call.made)

    def _found(self, ref: _Ref, budget: list, found: dict):
        held = self._held_edges.get((id(ref.node), ref.nr))
        if held is not None and held[0] is ref.node:
            _, entry, version = held
            # Held as it was when the call read it: unchanged in place in between.
            return Source(entry) if version == ref.version else None
        widened = self._widened.get((id(ref.node), ref.nr))
        if widened is not None and widened[0] is ref.node:
            _, entry, version, dtype = widened
            return Source(entry, cast=dtype) if (version, dtype) == (ref.version, ref.dtype) else None
        recorded = self._roots.get((id(ref.node), ref.nr)) or self._views.get((id(ref.node), ref.nr))
        if recorded is None or recorded[0] is not ref.node or not isinstance(recorded[1], Call):
            return None
        if id(recorded[1]) not in found:
            nested = found[id(recorded[1])] = self._tree(recorded[1], budget, found)
            if nested is not None:
                nested.numel = 0
        return found[id(recorded[1])]

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
        if self._trees and value.grad_fn is not None:
            return _Ref(value.grad_fn, value.output_nr, value._version, value.dtype)
        return _UNHELD


@dataclass
class _Ref:
    """A tensor a recorded call read, found when a recipe asks: held by then, or a recorded call's
    output. The node, not the tensor: holding tensors would keep a unit's temporaries alive."""
    node: Any
    nr: int
    version: int
    dtype: torch.dtype


class _CheapCallMode(TorchFunctionMode):
    def __init__(self, recorder: RootRecorder):
        super().__init__()
        self._recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        recorder = self._recorder
        if func not in recorder.functions or not torch.is_grad_enabled():
            return func(*args, **kwargs)
        recorder._waiting = []
        try:
            out = func(*args, **kwargs)
            recorder.add_call(func, args, kwargs, out)
            waiting = recorder._waiting
        finally:
            recorder._waiting = None
        recorder._inputs_now = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        try:
            for look in waiting:
                look()
        finally:
            recorder._inputs_now = []
        return out


_UNHELD = object()


def _recipe(tensor: torch.Tensor, root: Call | Held, cast, path: list) -> Recipe | None:
    if root.numel != tensor.numel():
        return None  # a view of part of the root: not its whole storage
    return Recipe(root, cast, tuple(tensor.size()), tuple(tensor.stride()), tuple(path))


def _value(value, fetch, device_type: str):
    if isinstance(value, Param):
        return value.get()
    if isinstance(value, Call):
        return value.run(fetch, device_type)
    if isinstance(value, Source):
        return value.read(fetch)
    return value


def _leaves(root: Call | Held) -> list:
    """The Sources, Params and plain values a recipe's root reads, through its tree."""
    if isinstance(root, Held):
        return [root.source]
    return [leaf for v in root.inputs for leaf in (_leaves(v) if isinstance(v, Call) else [v])]


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
