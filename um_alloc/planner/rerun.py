"""A unit recomputed as one node of the step's graph: its forward run once keeping nothing for
backward, and again in backward, where the node takes the gradients of its inputs and its
parameters from the rerun.

``torch.utils.checkpoint`` (non-reentrant) passes every tensor the unit saves through a Python
hook in forward, another in the recomputation and a third when backward reads it, and compares
what the recomputation saved with what forward did. On the host that costs a good part of the
recomputation again. bench/host_overhead.py measures it: on one thread of a 2-core AMD EPYC,
24-layer models 64 wide, whose kernels cost next to nothing, recomputing every layer this way added
0.80 ms a layer to a GPT-2 step, 1.04 to a Llama's and 0.98 to a BERT's, and as one node 0.62,
0.68 and 0.72 (bench/results/host_overhead). Where the host sets a recomputed backward's pace,
that is the step's time.

As one node (the shape of reentrant checkpointing): forward runs as plain autograd runs it (with
gradients on: some kernels are chosen by it) but saves nothing, and its graph is dropped when the
node takes the outputs; the node's inputs are the call's tensors and the unit's own parameters,
so the step's graph reaches them as it would the unit's ops. Backward reruns the forward with the
RNG state and autocast of the first run, on detached copies of the inputs, and hands the
gradients of the inputs and the parameters back through the node, to be accumulated by the
step's own backward as plain autograd's are: DDP's hooks, a parameter's gradient hooks (once:
the rerun reads stand-ins of the parameters that have any), ``.grad()`` and
``backward(inputs=...)`` work as they do. Under ``create_graph`` the rerun reads the inputs
themselves and keeps its graph, for the second derivative.

What one node cannot carry: a tensor the unit reads other than through its arguments that
requires a gradient (another module's parameter, a tensor kept on an attribute), whose gradient
would stop at the rerun; and a tensor made inside the unit that leaves it other than among its
outputs (kept on an attribute, caught by a hook, inside an object torch.utils._pytree does not
open), whose graph the first run did not keep. The runtime runs a unit's first call under
torch.utils.checkpoint, which carries both, and looks for them (``foreign_edges``,
``MadeTensors``); a unit that has any stays with checkpoint. Later, a call whose graph has a size
not seen before is looked at again: another module's parameter it reads joins the node's inputs;
any other tensor stops the forward, and a tensor that leaves the unit stops backward, each with
an error that says so: never a wrong gradient.

A tensor several units read (an encoder's output in every decoder block, a layer called at
every depth) gets its gradient from each; as one node, a unit's shares are summed before they
meet the others': the same sum, added in another order.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.utils._pytree as pytree
from torch.autograd.graph import get_gradient_edge

from ..rebuild import as_saved

__all__ = ["AutocastState", "MadeTensors", "RerunCall", "RerunNote", "RngState", "foreign_edges", "graph_clock"]

ACCUMULATE = "AccumulateGrad"
CAST = "ToCopyBackward0"


class _Rerun(torch.autograd.Function):
    """The node: forward without a graph, backward through a rerun of it.

    The call (and through it the inputs the rerun reads) rides on `carrier`, saved for backward as
    a tensor is: autograd lets it go once a backward that does not retain the graph has run the
    node, as it does checkpoint's saved inputs. Held on ``ctx`` instead, every recomputed unit's
    inputs would stay until the whole graph is gone, at the end of backward: one input of each
    unit more at backward's peak than calibration (through checkpoint) measured, 544 MiB for 17
    layers of a Llama-style decoder at batch 8 x 1024."""

    @staticmethod
    def forward(ctx, carrier: torch.Tensor, *tensors: torch.Tensor):
        ctx.set_materialize_grads(False)  # an output nothing used gives None, not zeros to carry
        ctx.save_for_backward(carrier)
        return carrier.call.take_outputs()  # made by the first run, their graph replaced by this node

    @staticmethod
    def backward(ctx, *grads):
        (carrier,) = ctx.saved_tensors  # autograd's own error after a backward that did not retain it
        return (None, *carrier.call.gradients(grads))


class RerunCall:
    """One call of a unit recomputed as one node.

    `values` are the call's (args, kwargs) as the rerun reads them; a value may stand in for a
    tensor (an input moved to host memory, see replay._Parked): `resolve` gives the tensor back,
    the input itself unless `moved_inputs`. `called` are the arguments the forward itself runs on
    (the caller's own lists and dicts, which `values` copy). `rerunning` returns the context the
    rerun runs in (the runtime's marks and checks)."""

    def __init__(self, name: str, module: torch.nn.Module, forward: Callable, values, params: list[torch.Tensor],
                 device: torch.device, resolve: Callable[[Any], Any], rerunning: Callable[[], ContextManager],
                 clean: set[int], called: tuple, moved_inputs: bool = False):
        """`params`: the unit `module`'s own that require a gradient. `clean`: the unit's graph
        sizes (in nodes) of calls seen to reach nothing beyond their arguments and its parameters;
        a call of another size is looked at, and added if clean."""
        self._name, self._module, self._moved_inputs, self._clean = name, module, moved_inputs, clean
        self._forward, self._resolve, self._rerunning = forward, resolve, rerunning
        self._leaves, self._spec = pytree.tree_flatten(values)
        # The call's tensors the node takes (a moved input's own, until the node has it).
        self._tensors: list | None = [t for t in map(resolve, self._leaves) if isinstance(t, torch.Tensor)]
        self._called: tuple | None = called  # until the forward has run on them
        self._params = params
        self._rng = RngState(device)
        self._autocast = AutocastState(device.type)
        self._outputs: tuple[list, Any, list[int]] | None = None  # (non-tensor leaves, spec, tensor places)
        self._made: tuple[torch.Tensor, ...] = ()  # the first run's output tensors, until the node takes them

    def takes(self, tensors: int) -> bool:
        """Whether the node takes all of the call's `tensors` tensors other than parameters (as
        tensor_trees counts them): none hidden in an object torch.utils._pytree does not open."""
        return sum(not isinstance(t, torch.nn.Parameter) for t in self._tensors) == tensors

    def __call__(self):
        """The call's output, from the node: tensors in the places of the forward's own."""
        tensors = self._tensors
        since = graph_clock()
        made = self._first_run()
        self._params = self._params + self._borrowed(made, tensors, since, graph_clock())
        with torch.autograd.graph.saved_tensors_hooks(_same, _same):  # the carrier itself, whatever else hooks
            outs = _Rerun.apply(_carrier(self), *tensors, *self._params)
        self._tensors = None  # an input that moves to host memory next is held by nothing here
        leaves, spec, places = self._outputs
        leaves = list(leaves)
        for place, tensor in zip(places, outs):
            leaves[place] = tensor
        return pytree.tree_unflatten(leaves, spec)

    def _first_run(self) -> tuple[torch.Tensor, ...]:
        """The forward, as plain autograd runs it (with gradients on: some kernels are chosen by
        it), but nothing saved: the graph it builds is dropped when the node takes its outputs."""
        (args, kwargs), self._called = self._called, None  # a moved input's tensor may go once it has run
        with torch.autograd.graph.saved_tensors_hooks(_dropped, self._never_read):
            flat, spec = pytree.tree_flatten(self._forward(*args, **kwargs))
        places = [k for k, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        self._outputs = ([None if isinstance(v, torch.Tensor) else v for v in flat], spec, places)
        self._made = tuple(flat[k] for k in places)
        return self._made

    def take_outputs(self) -> tuple[torch.Tensor, ...]:
        made, self._made = self._made, ()
        return made

    def _borrowed(self, outputs, inputs, since: int, until: int) -> list[torch.Tensor]:
        """What this call's graph reaches beyond its inputs and the unit's parameters: nothing
        for a graph of a size seen clean. Leaves (another module's parameters) join the node's
        inputs, so that their gradients reach them; any other tensor stops the step."""
        size = until - since
        if size in self._clean:
            return []
        leaves, others = _beyond(outputs, inputs, self._params, since, until)
        others += [f"a leaf of shape {tuple(t.shape)} with gradient hooks" for t in leaves if t._backward_hooks]
        if others:
            raise RuntimeError(
                f"planner: {self._name} read {others[0]}, which requires a gradient, other than through its "
                "arguments, in a step after its first: as one node it could not pass that tensor its gradient. "
                "Turn off the one-node recomputation (one_node_recompute=False, or scheduler.one_node_recompute: "
                "false in the policy), or pass the tensor as an argument")
        if not leaves:
            self._clean.add(size)
        return leaves

    def _never_read(self, _) -> torch.Tensor:
        raise RuntimeError(
            f"planner: backward reached the graph of {self._name}'s first run, which keeps nothing: a tensor "
            "made inside it requires a gradient and left it other than among its outputs (kept on an attribute, "
            "caught by a hook, or inside an object torch.utils._pytree does not open). Turn off the one-node "
            "recomputation (one_node_recompute=False, or scheduler.one_node_recompute: false in the policy)")

    def gradients(self, grads) -> list[torch.Tensor | None]:
        """The rerun, and the gradients of the node's inputs (the call's tensors, then the params).

        The rerun reads stand-ins: detached copies of the inputs, and of the parameters that have
        gradient hooks (which would run once in the rerun's gradient and again as the node hands
        it on). Under ``create_graph`` (a second derivative follows) the stand-ins of inputs and
        parameters are views of them instead, so that the gradients' own graph reaches back."""
        create_graph = torch.is_grad_enabled()
        if create_graph and self._moved_inputs:
            raise RuntimeError(f"planner: a second derivative (create_graph=True) through {self._name}, whose "
                               "inputs went to host memory, cannot reach back through them as one node. From the "
                               "next step on such blocks are recomputed through torch.utils.checkpoint, which can: "
                               "run this step again (or leave 'recompute_moved' out of the planner's decisions)")
        leaves = [self._resolve(v) for v in self._leaves]
        inputs = []
        for k, value in enumerate(leaves):
            if isinstance(value, torch.Tensor):
                leaves[k] = _stand_in(value, create_graph)
                inputs.append(leaves[k])
        params = {id(p): _stand_in(p, create_graph) for p in self._params if create_graph or p._backward_hooks}
        with self._rng.restored(), self._autocast.restored(), torch.enable_grad(), \
                _parameters_standing_in(self._module, params), self._rerunning() as note:
            args, kwargs = pytree.tree_unflatten(leaves, self._spec)
            if note is not None and note.counts_saves:
                saved = _SavedStorages()
                with saved:
                    flat = pytree.tree_leaves(self._forward(*args, **kwargs))
                note.outputs_not_saved = saved.bytes_beside(flat, inputs)
            else:
                flat = pytree.tree_leaves(self._forward(*args, **kwargs))
        outs = [flat[k] for k in self._outputs[2]]
        # The outputs' places in the graph, not the outputs: what backward does not save of them
        # may go before it runs, as the last op checkpoint's early stop never reruns.
        roots = [(get_gradient_edge(out), grad) for out, grad in zip(outs, grads)
                 if grad is not None and out.requires_grad]
        del flat, outs
        wanted = [t for t in inputs if t.requires_grad] + [params.get(id(p), p) for p in self._params]
        found = iter(torch.autograd.grad([r for r, _ in roots], wanted, [g for _, g in roots], allow_unused=True,
                                         create_graph=create_graph) if roots and wanted else [None] * len(wanted))
        return [next(found) if t.requires_grad else None for t in inputs] + list(found)


def _dropped(tensor: torch.Tensor) -> None:
    return None


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _carrier(call: RerunCall) -> torch.Tensor:
    """An empty tensor that carries `call` to the node's backward. Saved unpacked (hooks that
    return it as it is), it comes back as the same Python object, attribute and all."""
    carrier = torch.empty(0)
    carrier.call = call
    return carrier


def _stand_in(tensor: torch.Tensor, connected: bool) -> torch.Tensor:
    """What a rerun reads for `tensor`: a view of it (its graph reaches `tensor`), or a detached
    copy that requires a gradient as it does; never `tensor` itself, whose gradient hooks would
    run in the rerun's gradient as well as in the step's."""
    if connected:
        return tensor.view_as(tensor)
    return tensor.detach().requires_grad_(tensor.requires_grad)


@contextlib.contextmanager
def _parameters_standing_in(module: torch.nn.Module, stand_ins: dict[int, torch.Tensor]):
    """`module`'s parameters replaced by their stand-ins (by the parameter's id) while entered,
    wherever they are registered in it (a tied one under each of its names)."""
    if not stand_ins:
        yield
        return
    replaced = [(owner, name, p) for owner in module.modules() for name, p in owner._parameters.items()
                if p is not None and id(p) in stand_ins]
    for owner, name, p in replaced:
        owner._parameters[name] = stand_ins[id(p)]
    try:
        yield
    finally:
        for owner, name, p in replaced:
            owner._parameters[name] = p


class RerunNote:
    """What the context a rerun runs in learns of it: for a calibration that counts the bytes a
    recomputation leaves live (`counts_saves`), those of its outputs that backward does not keep."""

    def __init__(self, counts_saves: bool):
        self.counts_saves = counts_saves
        self.outputs_not_saved = 0


class _SavedStorages(torch.autograd.graph.saved_tensors_hooks):
    """The storages of what autograd saves while it is entered (autograd keeps aliases of the
    tensors, as_saved)."""

    def __init__(self):
        self.pointers: set[int] = set()
        super().__init__(self._note, lambda tensor: tensor)

    def _note(self, tensor: torch.Tensor) -> torch.Tensor:
        self.pointers.add(tensor.untyped_storage().data_ptr())
        return as_saved(tensor)

    def bytes_beside(self, outputs, inputs) -> int:
        """The bytes of the outputs' storages that are neither saved nor an input's."""
        known = self.pointers | {t.untyped_storage().data_ptr() for t in inputs}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in outputs if isinstance(t, torch.Tensor)}
        return sum(nbytes for pointer, nbytes in storages.items() if pointer not in known)


class RngState:
    """The CPU's and the unit's device's RNG state when forward began, for the rerun: dropout
    draws the same masks."""

    def __init__(self, device: torch.device):
        self._devices = [device] if device.type == "cuda" else []
        self._cpu = torch.get_rng_state()
        self._gpu = [torch.cuda.get_rng_state(d) for d in self._devices]

    @contextlib.contextmanager
    def restored(self):
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self._cpu)
            for device, state in zip(self._devices, self._gpu):
                torch.cuda.set_rng_state(state, device)
            yield


class AutocastState:
    """Autocast as forward had it, on the device and on the CPU. The rerun casts without the
    cache: forward's cache is gone, and with it a leaf's casts would be shared where forward
    made one per use."""

    def __init__(self, device_type: str):
        self._states = [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
                        for kind in dict.fromkeys((device_type, "cpu"))]

    @contextlib.contextmanager
    def restored(self):
        with contextlib.ExitStack() as stack:
            for kind, enabled, dtype in self._states:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled, cache_enabled=False))
            yield


class MadeTensors(torch.overrides.TorchFunctionMode):
    """While entered, weak references to the tensors torch functions return that require a
    gradient: after a call, those still alive that are not its outputs left it another way."""

    def __init__(self):
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                self.refs.append(weakref.ref(tensor))
        return out

    def escaped(self, outputs, since: int, until: int) -> list[str]:
        """The tensors made while entered (their nodes made between the graph clocks `since` and
        `until`: a function may return its input itself), alive and requiring a gradient, that
        share no storage with `outputs` (their views and bases do) and are not a cast of a leaf
        (autocast keeps those for the step; their gradient needs nothing saved)."""
        visible = {t.untyped_storage().data_ptr() for t in outputs if isinstance(t, torch.Tensor)}
        found = []
        for ref in self.refs:
            tensor = ref()
            if tensor is None or not tensor.requires_grad or tensor.grad_fn is None or \
                    _is_cast(tensor.grad_fn, _is_leaf_node):
                continue
            if not since <= tensor.grad_fn._sequence_nr() < until:
                continue
            if tensor.untyped_storage().data_ptr() not in visible:
                found.append(f"a tensor of shape {tuple(tensor.shape)} made by {type(tensor.grad_fn).__name__}, "
                             "kept beyond its outputs")
        return found


def _is_cast(node, of: Callable[[Any], bool]) -> bool:
    """Whether `node` is a cast of tensors whose nodes pass `of` (autocast's cache holds casts of
    parameters for the whole forward; their gradient needs nothing saved)."""
    return type(node).__name__ == CAST and all(n is None or of(n) for n, _ in node.next_functions)


def _is_leaf_node(node) -> bool:
    return type(node).__name__ == ACCUMULATE


def graph_clock() -> int:
    """The sequence number the next autograd node made on this thread would take: nodes a
    computation makes lie between its value before and after. Needs gradients enabled."""
    return torch.empty(0, requires_grad=True).view(0).grad_fn._sequence_nr()


def foreign_edges(outputs, inputs, params, since: int, until: int) -> list[str]:
    """What a call's graph reaches beyond its own inputs and the unit's own parameters: a
    description of each, empty when there is none. `outputs` are the call's, its nodes made
    between the graph clocks `since` and `until` (on this thread); `inputs` the tensors it ran
    on. Nodes of another thread's numbering that happen to fall in between are walked into and
    lead out soon after: a false find, never a missed one."""
    leaves, others = _beyond(outputs, inputs, params, since, until)
    return [f"a parameter or leaf of shape {tuple(t.shape)}" for t in leaves] + others


def _beyond(outputs, inputs, params, since: int, until: int) -> tuple[list[torch.Tensor], list[str]]:
    """foreign_edges' finds: the leaves, and a description of each other tensor."""
    allowed = {get_gradient_edge(t).node for t in list(inputs) + list(params)
               if isinstance(t, torch.Tensor) and t.requires_grad}
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, leaves, others = set(), [], []
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in allowed:
            continue
        seen.add(node)
        if _is_leaf_node(node):
            leaves.append(node.variable)
        elif since <= node._sequence_nr() < until:
            stack.extend(next_node for next_node, _ in node.next_functions)
        elif not _is_cast(node, allowed.__contains__):  # autocast's cached cast of a parameter is not foreign
            others.append(f"the output of {type(node).__name__} made before the call")
    return leaves, others
