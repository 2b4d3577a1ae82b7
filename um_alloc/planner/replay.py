"""Replay: carrying out one decision per unit while the model runs, through module hooks only.

Each unit's ``forward`` is wrapped (an attribute on the instance, removed by ``detach``):

- keep: it runs as it is.
- move: what autograd saves while it runs goes to pinned host memory (saved-tensor hooks around
  its forward hand it to um_alloc.offload's transfer engine: copies through stages on side streams)
  and comes back ahead of backward, started as the gradient reaches each unit. What the model saves
  outside every unit (its loss) moves the same way when the plan's last decision says so. Only
  what moves pays for the hooks: a Python call per saved tensor.
- recompute / selective: the first time, it runs under ``torch.utils.checkpoint`` (non-reentrant,
  RNG state kept, so dropout masks are equal), and that forward shows what the unit reaches. A
  unit that reaches nothing but its arguments and its own parameters, and whose tensors leave it
  only among its outputs, is from the next step on recomputed as one node of the graph
  (rerun.py), which costs the host less. ``selective`` passes PyTorch's selective-checkpoint
  modes (selective.py), which keep the outputs of matmuls, convolutions and attention and
  recompute the rest. BatchNorm's running statistics are not updated a second time by the
  recomputation. The recomputation reads the inputs as the forward found them, or stops
  (_Unchanged).
- ..._moved: the call's large inputs are held in a slot that checkpoint keeps instead of the tensor;
  after forward the slot's tensor goes to host memory, and the recomputation fetches it back.

Outside every unit, while the root's forward runs, a large cross-entropy is computed in row
chunks (lean_loss.LeanLoss: the same result, half the loss's memory): that is where a model
computes its loss.

While attached, every Hugging Face config the model holds has ``use_cache`` off (an encoder-decoder's
decoder holds a copy of its own): a recomputation would append to the cache again. ``detach``
turns it back on.

A step begins at the root module's forward with gradients enabled and ends when autograd's
backward has finished (a callback queued from the first gradient hook). A loop may call the model
more than once before its backward (a pair of inputs for one contrastive loss, a discriminator's
real and generated batches): a forward that begins while an earlier one's graph is still alive,
with no backward between them and the model in training mode, joins that step, so that the step's
plan and its measurements cover everything backward will need (up to MOST_FORWARDS_A_STEP
forwards). A step whose backward never came (its graph gone, as after an evaluation with
gradients on) is closed at the next forward.
What a step allocates in between comes from the pool's step arenas (arenas.py). The director (the
planner) gives each step its decisions and whether to record it.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from ..offload import ActivationOffload
from ..rebuild import as_saved, broadcast
from ..tensor_trees import is_dtensor, tensors as _tensors
from .arenas import StepArenas
from .blocks import Unit
from .chain import CHAINS_OFF, RerunChain, takes_output
from .lean_loss import LeanLoss
from .planning import Decision
from .record import StepRecorder
from .rebuilt import RebuiltSaves
from .rerun import MadeTensors, RerunCall, RerunNote, foreign_edges, graph_clock
from .selective import SAVED_OPS, KeptOpTimer, selective_contexts

__all__ = ["Runtime", "StepSpec", "SAVED_OPS", "input_signature"]

MiB = 1 << 20
MOST_FORWARDS_A_STEP = 16   # forwards a step gathers before backward; past them the step is closed
RERUN_ALONE_SHARE = 8       # a gap's rerun is timed on an eighth of its batch (_rerun_alone)
RECOMPUTE_OFF = ("leave 'recompute' and 'selective' out of the planner's decisions (their _moved forms recompute "
                 "from copies taken at the end of the forward)")
log = logging.getLogger("um_alloc.planner")


class Director(Protocol):
    def begin(self, signature: tuple, partial: bool = False) -> "StepSpec | None": ...
    def end(self, step: "Step", completed: bool) -> None: ...


@dataclass
class StepSpec:
    """What the director wants of one step."""
    decisions: tuple[Decision, ...]
    recorder: StepRecorder | None = None
    count_ops: bool = False        # time and size the ops a selective recompute keeps, and find
    #                                what a kept unit could rebuild (rebuild_probe.RebuildProbe)
    rebuilds: dict = field(default_factory=dict)  # unit -> what its rebuild decision rebuilds (UnitRecipes)
    full_recompute: bool = False   # no early stop: a recompute rebuilds all a unit saves
    owner: Any = None              # the director's own record of the step's input shape


@dataclass
class Step:
    spec: StepSpec
    transfers: ActivationOffload
    moves: bool = False            # something goes to host memory: the hooks that copy are needed
    in_backward: bool = False
    done: bool = False
    oom: bool = False
    forwards: int = 1              # the model's forwards this step has gathered
    graphs: list = field(default_factory=list)  # per forward that made one, a weak reference to _GraphAlive

    def mark(self, label: str, unit: int | None = None) -> int | None:
        return self.spec.recorder.mark(label, unit) if self.spec.recorder else None

    def awaits_backward(self) -> bool:
        """Whether a backward may still come for a forward of this step: none has begun, and the
        graph of one of its forwards is still held (by the loss, or by outputs kept for it)."""
        return not self.done and not self.in_backward and any(alive() is not None for alive in self.graphs)


class _GraphAlive:
    """Held by the hook on a forward's output, which autograd keeps as long as the graph: a weak
    reference to it tells whether that graph can still be backpropagated through."""
    __slots__ = ("__weakref__",)


class _Parked:
    """A large input of a recomputed call, in the slot checkpoint keeps instead of the tensor: the
    tensor itself until it moves, then its host copy, fetched back for the recomputation."""
    __slots__ = ("tensor", "entry", "requires_grad", "transfers")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.entry, self.transfers = tensor, None, None
        self.requires_grad = tensor.requires_grad

    def fetch(self) -> None:
        """Back from host memory, if it went there (once: the recomputation reads it next)."""
        if self.tensor is None and self.entry is not None:
            # A leaf with the original's requires_grad: autograd saves the same tensors as in forward.
            self.tensor = self.transfers.unpack(self.entry).detach().requires_grad_(self.requires_grad)
            self.entry = None

    def value(self) -> torch.Tensor:
        self.fetch()
        return self.tensor

    def move_out(self, transfers: ActivationOffload) -> int:
        self.entry, self.transfers = transfers.stash(self.tensor), transfers
        nbytes = self.tensor.numel() * self.tensor.element_size()
        self.tensor = None
        return nbytes


def _parkable(value, device: torch.device, min_bytes: int) -> bool:
    """Whether a recomputed call's input goes in a slot that can move it to host memory: a large
    tensor on the unit's device, not a parameter, and not broadcast (rebuild.broadcast): a copy
    would come back dense, which can change the kernels the rerun takes. Under torch.compile
    ViT-B/16's materialised attention mask, expanded to the batch, sent its forward's attention
    to PyTorch's math kernel and its rerun's to cuDNN's, which save different tensors. It stays
    where it is, as it is."""
    return (isinstance(value, torch.Tensor) and value.device == device and not isinstance(value, nn.Parameter)
            and value.numel() * value.element_size() >= min_bytes and not broadcast(value))


class _Enter:
    """Several context managers entered as one, when the time comes (checkpoint's context_fn
    returns them at forward and enters the second only when backward recomputes)."""

    def __init__(self, *factories: Callable[[], Any]):
        self._factories, self._stack = factories, None

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        for make in self._factories:
            self._stack.enter_context(make())
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


class Runtime:
    """Wraps the units' forwards and the root's hooks; asks the director what each step does."""

    def __init__(self, model: nn.Module, units: list[Unit], device: torch.device, director: Director,
                 window: int, min_bytes: int = MiB, lean_loss: bool = True, one_node_recompute: bool = True,
                 recompute_logits: bool = False):
        self.model, self.units, self.device, self.director = model, units, device, director
        self.rest = len(units)                # the decision index of what is saved outside every unit
        self.min_bytes = min_bytes
        # The transfer engine for moved activations and inputs: an offload with no budget of its
        # own (everything it is given moves), its copies back driven by the units' backward.
        self.transfers = ActivationOffload(None, window=window, min_bytes=min_bytes, device=device, rebuild=False)
        self.arenas = StepArenas(device)      # what a step allocates, apart from what outlasts it
        self._anchor = torch.empty(0, device=device)  # a tensor on the device among checkpoint's
        #                                              arguments, so that it keeps that device's RNG state
        # Per unit: its buffers that a state_dict saves (_BuffersBefore), not the caches and masks
        # a module keeps for itself.
        self._buffers = [[(m, name) for m in u.module.modules() for name in m._buffers
                          if name not in m._non_persistent_buffers_set] for u in units]
        self._holders = [[m for m in u.module.modules() if m._parameters] for u in units]  # of parameters
        # Where a block's first parameter lives (read there: moving a model may replace the tensor).
        self._device_witness = next(((m, name) for u in units if u.kind == "block" for m in u.module.modules()
                                     for name, p in m._parameters.items() if p is not None), None)
        self._step: Step | None = None       # the training step whose forward is running
        self._open: Step | None = None       # the last step begun, until its backward ends
        self._where: int = self.rest          # the unit whose forward is running
        self._handles: list = []
        self.lean_loss = LeanLoss(recompute_logits=recompute_logits) if lean_loss else None
        self._sharded_heads_noted = False     # whether FSDP2's turning recompute_logits off was said
        self._outside: list | None = None  # what runs outside every unit, in a step's forward
        self._cached: list = []               # the configs whose use_cache attach turned off
        # Per unit: whether it may be recomputed as one node (rerun.py); None until a call
        # through torch.utils.checkpoint has shown what its forward reaches. What the calls of a
        # step show holds from the next step, so that each step recomputes a unit one way.
        self._reruns: list[bool | None] = [None if one_node_recompute else False for _ in units]
        self._clean: list[set[int]] = [set() for _ in units]  # per unit: rerun.RerunCall's graph sizes
        self._shown: dict[int, bool] = {}
        self._compile_noted = False           # whether the first training step looked for torch.compile
        self._stepped = False                 # whether a training forward of the model has begun a step
        # Whether a backward that builds a graph of its own (create_graph=True: a gradient penalty,
        # a second derivative) has reached the model: recomputations from moved inputs then go
        # through torch.utils.checkpoint, whose graph reaches back through them (one node's cannot).
        self.second_derivatives = False
        self._unplanned_noted = False         # whether a block was seen training outside every step
        self._chain: RerunChain | None = None  # the chain the last unit's call ran in, open to the next
        self._unchained_noted = False         # whether a chained unit was seen not to follow its chain
        # In a measuring step, the last unit's call: (unit, its output, that output's version), to
        # see which calls take the unit before's output (chain.py); and in a probed step its forward
        # and arguments, to time a rerun of it alone once a call takes its output.
        self._last_out: tuple | None = None
        self._last_call: tuple | None = None
        self._reparametrized_noted = False    # whether a unit was seen running with parameters swapped in

    # -- attaching --

    def attach(self) -> None:
        for index, unit in enumerate(self.units):
            forward = unit.module.forward
            unit.module.forward = _Installed(_eager(functools.partial(self._call, index, forward)), forward)
        self._handles = [self.model.register_forward_pre_hook(_Installed(_eager(self._begin), _no_hook),
                                                              with_kwargs=True),
                         self.model.register_forward_hook(_Installed(_eager(self._end_forward), _no_hook),
                                                          always_call=True)]
        self._cached = _caches_off(self.model)

    def detach(self) -> None:
        for unit in self.units:
            unit.module.__dict__.pop("forward", None)
        for config in self._cached:
            config.use_cache = True
        self._cached = []
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._outside_units(False)
        self.close_open_step()
        self.arenas.close()

    # -- steps --

    def _begin(self, module, args, kwargs) -> None:
        if _replica(module, self.model):
            raise _replica_error(module)
        self.begin_step(input_signature(args, kwargs))

    def begin_step(self, signature: tuple, partial: bool = False) -> None:
        """A forward of the root begins: the root's pre-hook, or a caller whose hooks see only
        the positional arguments (`partial`: `signature` is theirs alone; the director decides)."""
        if not torch.is_grad_enabled():
            self._step = None  # evaluation: the units run as they are; an open step stays open
            return
        self._check_device()
        if not self._compile_noted:
            self._compile_noted = True
            if _called_through_torch_compile():
                log.warning(COMPILED_NOTE)
        if self._joins_open_step():
            self._next_forward()
            return
        self.close_open_step()
        self._stepped = True
        for index, shown in self._shown.items():
            self._reruns[index] = shown
        self._shown = {}
        spec = self.director.begin(signature, partial)
        if spec is None:
            self._step = None
            return
        moves = any(d is Decision.MOVE or d.moves_inputs for d in spec.decisions)
        self.arenas.open()
        self._step = self._open = Step(spec, self.transfers, moves)
        self.transfers.begin_step()
        self._where = self.rest
        self._forget_calls()
        self._step.mark("forward start")
        self._outside_units(True)

    def _check_device(self) -> None:
        """A training step of a model on another device than the one it was planned on (planned
        before `.cuda()`) would measure nothing there and plan nothing: refused before it runs."""
        if self._device_witness is None:
            return
        module, name = self._device_witness
        first = module._parameters.get(name)
        if first is not None and first.device != self.device:
            raise RuntimeError(
                f"um_alloc planner: the model was planned on {self.device}, and its blocks are now on {first.device}. "
                "Plan it after moving it to the GPU it trains on (model.cuda(), then um_alloc.plan(model)); "
                "planner.remove() detaches this plan.")

    def _joins_open_step(self) -> bool:
        """Whether this forward belongs to the open step: its forward has ended, a backward may
        still come for it (the model called again before the loss's backward), and the model is
        training (a loop that evaluates with gradients on, holding each output while the next
        forward runs, has called model.eval())."""
        step = self._open
        return (step is not None and self._step is None and self.model.training and step.awaits_backward()
                and step.forwards < MOST_FORWARDS_A_STEP)

    def _next_forward(self) -> None:
        """Another forward of the open step: the same decisions, measured in the same record."""
        step = self._step = self._open
        step.forwards += 1
        self._where = self.rest
        self._forget_calls()
        step.mark("forward start")
        self._outside_units(True)

    def _end_forward(self, module, args, output) -> None:
        if _replica(module, self.model):
            return  # refused as its forward began
        self._outside_units(False)  # also when forward raised (always_call)
        step, self._step = self._step, None
        if step is None:
            return
        self._forget_calls()
        if output is None and sys.exc_info()[1] is not None:
            # Forward raised (an out-of-memory error at the loss): no backward will come. Let go of
            # the step now, so that a loop that runs it again has the room it had.
            self.close_open_step()
            return
        step.mark("forward end")
        alive = self._on_backward(step, None, output, _GraphAlive())
        if alive is not None:
            step.graphs.append(weakref.ref(alive))

    def _saved_tensors_moved(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        """What autograd saves in a moved unit (or, outside every unit, a moved rest): to host memory.
        Under torch.compile the rest's hooks are traced into the graph of what lies between the
        units, where nothing can be copied out; what they see there stays on the GPU."""
        if torch.compiler.is_compiling():
            return tensor
        step = self._step
        if step is None:
            return as_saved(tensor)
        before = self.transfers.stats.out_bytes
        entry = self.transfers.pack(tensor)
        if step.spec.recorder:
            step.spec.recorder.units[self._where].moved_bytes += self.transfers.stats.out_bytes - before
        return entry

    def _unpack(self, packed):
        if torch.compiler.is_compiling():  # traced: _pack kept the tensor
            return packed
        return self.transfers.unpack(packed)

    def close_open_step(self) -> None:
        """A step whose backward never came (an exception, evaluation with gradients on)."""
        step, self._open = self._open, None
        if step is not None and not step.done:
            step.done = True
            self.arenas.close()
            self.transfers.abort_step()
            self.director.end(step, completed=False)

    def _backward_reached(self, step: Step, unit: int | None, grad, token=None) -> None:
        if torch.is_grad_enabled() and not self.second_derivatives:  # as in a backward with create_graph=True
            self.second_derivatives = True
            log.info("planner: a backward with create_graph=True (a second derivative) reached the model: blocks "
                     "recomputed from moved inputs go through torch.utils.checkpoint from here on")
        if not step.in_backward:
            step.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._end_backward, step))
        # Copies back start first: the mark's stretch then holds them, as calibration counts it.
        self.transfers.copy_ahead()
        step.mark("backward" if unit is not None else "backward start", unit)

    def _end_backward(self, step: Step) -> None:
        if step.done:
            return
        step.done = True
        step.mark("backward end")
        self.arenas.close()
        self.transfers.end_step()
        if self._open is step:
            self._open = None
        self.director.end(step, completed=True)

    def _on_backward(self, step: Step, unit: int | None, output, token: "_GraphAlive | None" = None):
        """Hooks the first tensor of `output` that requires grad: backward has reached it. The
        hook holds `token`, which lives as long as the graph holds the hook; returned where hooked."""
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._backward_reached, step, unit, token=token))
                return token
        return None

    # -- one unit's forward --

    def _call(self, index: int, forward, *args, **kwargs):
        step = self._step
        if step is None:
            if not self._stepped and not self._unplanned_noted and torch.is_grad_enabled():
                self._note_unplanned(index)
            return forward(*args, **kwargs)
        decision = step.spec.decisions[index]
        self._outside_units(False)
        chain, self._chain = self._chain, None
        recorder = step.spec.recorder
        follows = self._note_link(step, index, args, kwargs) if recorder else False
        versions = [a._version for a in args if isinstance(a, torch.Tensor)] if recorder else None
        if recorder and step.spec.count_ops and torch.is_grad_enabled():
            unit = self.units[index]
            recorder.alone.note(index, unit.name, unit.module, forward, args, kwargs,
                                functools.partial(_BuffersBefore, self._buffers[index]))
        start = step.mark("pre", index)
        outer, self._where = self._where, index
        heads = self._heads_noted(index)
        if heads is not None:
            heads.__enter__()
        try:
            if decision is Decision.KEEP:
                out = forward(*args, **kwargs)
            elif decision is Decision.REBUILD:
                saves = RebuiltSaves(self.device, self.min_bytes, step.spec.rebuilds.get(index),
                                     self.units[index].name)
                with saves.around(args, kwargs):
                    out = forward(*args, **kwargs)
            elif decision is Decision.MOVE:
                with self._saved_tensors_moved():
                    out = forward(*args, **kwargs)
            elif self._reparametrized(index):
                out = forward(*args, **kwargs)  # kept: a rerun in backward would read the unit's own parameters
            elif self._in_chain(step, index, decision):
                out = self._chained(step, index, decision, chain, forward, args, kwargs)
            else:
                out = self._recomputed(step, index, decision, forward, args, kwargs)
        except torch.OutOfMemoryError:
            step.oom = True
            raise
        finally:
            if heads is not None:
                heads.__exit__(None, None, None)
            self._where = outer
            if chain is not None and chain is not self._chain:
                chain.close()
        end = step.mark("post", index)
        if recorder:
            self._after_call(step, index, forward, args, out, follows, versions)
            recorder.pair("forward", index, start, end)
        self._outside_units(outer == self.rest)
        if step.moves or step.spec.recorder:  # copies back start, and marks are taken, as backward arrives
            self._on_backward(step, index, out)
        return out

    def _heads_noted(self, index: int) -> LeanLoss | None:
        """The chunked cross-entropy's mode, to enter around a gap's forward where the loss makes
        logits again from a linear head's input (recompute_logits): a language model's head is a
        gap, and the mode notes the linear layers it runs. Not under FSDP2, which gathers a
        layer's weight for its own backward and reduces its gradient after it: with the logits
        made again, the head's backward does not run."""
        lean = self.lean_loss
        if lean is None or not lean.recompute_logits or self.units[index].kind != "gap":
            return None
        if _sharded(self.model, []):
            if not self._sharded_heads_noted:
                self._sharded_heads_noted = True
                log.warning("um_alloc planner: recompute_logits is off for %s: FSDP2 shards it, and gathers a "
                            "head's weight only for the head's own backward", type(self.model).__name__)
            return None
        return lean

    def _reparametrized(self, index: int) -> bool:
        """Whether the unit runs with tensors swapped in for its parameters (torch.func.functional_call,
        torch.nn.utils.stateless): they are swapped back by the time backward would rerun it, so a
        recomputation would read the wrong weights. Such a call is kept instead. Said once."""
        swapped = any(p is not None and not isinstance(p, nn.Parameter)
                      for m in self._holders[index] for p in m._parameters.values())
        if swapped and not self._reparametrized_noted:
            self._reparametrized_noted = True
            log.warning("um_alloc planner: %s ran with tensors in place of its parameters (torch.func."
                        "functional_call or the like); a recomputation would read its own parameters instead, "
                        "so such calls keep what they save (more memory than the plan counted)",
                        self.units[index].name)
        return swapped

    def _note_unplanned(self, index: int) -> None:
        """A block trains before any forward of the model began a step: the loop calls the model's
        forward without its hooks, and nothing is planned. Said once."""
        unit = self.units[index]
        if unit.kind != "block":
            return
        self._unplanned_noted = True
        log.warning("um_alloc planner: block %s ran with gradients on before any forward of %s began a training "
                    "step, so it runs unplanned. The planner begins a step in the model's forward hooks, which "
                    "model.forward(...) skips: call model(...), or plan the module the loop calls.",
                    unit.name, type(self.model).__name__)

    def _outside_units(self, on: bool) -> None:
        """Enters (or leaves) what applies outside every unit in a step's forward: the chunked
        cross-entropy (a model's loss comes after its last unit), and the rest's moves if it moves.
        Entered and left directly, twice a unit: no ExitStack to build each time."""
        if on == (self._outside is not None):
            return
        if not on:
            entered, self._outside = self._outside, None
            for context in reversed(entered):
                context.__exit__(None, None, None)
            return
        step, entered = self._step, []
        if self.lean_loss is not None:
            entered.append(self.lean_loss)
        if step is not None and step.spec.decisions[self.rest] is Decision.MOVE:
            entered.append(self._saved_tensors_moved())
        for context in entered:
            context.__enter__()
        self._outside = entered

    def _in_chain(self, step: Step, index: int, decision: Decision) -> bool:
        """Whether this call runs in a chain (chain.py): chained, or the first of one (a gap that
        reruns, or a unit that reruns from its inputs with a chained unit after it)."""
        if decision is Decision.CHAINED:
            return True
        if decision not in (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED):
            return False
        return self.units[index].kind == "gap" or step.spec.decisions[index + 1] is Decision.CHAINED

    def _chained(self, step: Step, index: int, decision: Decision, chain: RerunChain | None, forward, args, kwargs):
        """The call in a chain: the first, whose inputs the chain holds (or moves), or one that
        continues the chain the last call ran in. A chained call that does not (another argument
        than that call's output, or it changed in place since) keeps what it saves."""
        unit = self.units[index]
        buffers = _BuffersBefore(self._buffers[index])
        if decision is Decision.CHAINED:
            if chain is None or not chain.continues_with(index, args, kwargs):
                self._note_unchained(index)
                return forward(*args, **kwargs)
            out = chain.call(index, unit.name, forward, args, kwargs,
                             functools.partial(_as_forward_found, buffers, None, CHAINS_OFF))
            self._chain = chain
            return out
        held, parked = self._held(args, kwargs)
        inputs = _Unchanged(unit.name, (args, kwargs))
        chain = RerunChain(self.device, held, _unpark)
        out = chain.call(index, unit.name, forward, args, kwargs,
                         functools.partial(_as_forward_found, buffers, inputs, CHAINS_OFF))
        inputs.check("by its own forward", f"it cannot head a chain; {CHAINS_OFF}")
        if decision.moves_inputs:
            inputs.forget([p.tensor for p in parked])  # the rerun reads their copies, taken now
            for slot in parked:
                slot.move_out(self.transfers)
        self._chain = chain
        return out

    def _note_unchained(self, index: int) -> None:
        if self._unchained_noted:
            return
        self._unchained_noted = True
        log.warning("um_alloc planner: %s was planned to be rerun from the unit before it, and this call does not "
                    "take that unit's output unchanged as its one argument; it keeps what it saves (more memory "
                    "than the plan counted)", self.units[index].name)

    # -- what a measuring step learns of chains --

    def _forget_calls(self) -> None:
        if self._chain is not None:
            self._chain.close()
        self._chain = self._last_out = self._last_call = None
        if self.lean_loss is not None:
            self.lean_loss.forget()  # a head's output no loss took by the forward's end

    def _note_link(self, step: Step, index: int, args: tuple, kwargs: dict) -> bool:
        """Whether this call takes the unit before's last output, unchanged, as its one argument.
        In the probed step, the unit before, if a gap, is then timed rerunning alone."""
        last, self._last_out = self._last_out, None
        follows = takes_output(last, index, args, kwargs)
        step.spec.recorder.units[index].links.append(follows)
        before, self._last_call = self._last_call, None
        if follows and before is not None and before[0] == index - 1:
            self._rerun_alone(step, *before)
        return follows

    def _after_call(self, step: Step, index: int, forward, args: tuple, out, follows: bool, versions: list) -> None:
        seen = step.spec.recorder.units[index]
        changed = [a._version for a in args if isinstance(a, torch.Tensor)] != versions
        seen.changes_input = seen.changes_input or changed
        self._last_out = (index, weakref.ref(out), out._version) if isinstance(out, torch.Tensor) else None
        if not step.spec.count_ops or self.units[index].kind != "gap" or len(args) != 1 \
                or not isinstance(args[0], torch.Tensor):
            return
        if follows:
            self._rerun_alone(step, index, forward, args, changed)
        else:  # timed once a call of the next unit takes its output
            self._last_call = (index, forward, args, changed)

    def _rerun_alone(self, step: Step, index: int, forward, args: tuple, changes_input: bool) -> None:
        """Times the gap's forward run again by itself, without a graph, its buffers and the RNG's
        state left as they were, on a part of its argument's first dimension (the batch): a
        language model's head makes logits many times its input, which a whole rerun would hold
        beside the step's own. Its GPU time is scaled up by as much (a small batch runs no faster
        a sample: an overestimate, if any); its host time is the launches', as large either way.
        A module that needs the whole batch is not timed, and its gap does not rerun."""
        (whole,) = args
        rows = whole.shape[0] if whole.dim() > 0 else 1
        taken = max(rows // RERUN_ALONE_SHARE, 1)
        part = whole[:taken] if whole.dim() > 0 else whole
        if changes_input:
            part = part.clone()
        timed = step.spec.recorder.rerun_alone(index, whole.numel() * whole.element_size(), scale=rows / taken)
        kept = _BuffersBefore(self._buffers[index]).swap_in()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices), timed:
                forward(part)
        except Exception as error:  # noqa: BLE001 (a probe: the unit only loses the chance to rerun)
            log.info("planner: %s's forward did not run on part of its batch (%s); it is not rerun in chains",
                     self.units[index].name, str(error).splitlines()[0][:200])
        finally:
            _BuffersBefore.put_back(kept)

    def _recomputed(self, step: Step, index: int, decision: Decision, forward, args, kwargs):
        (held_args, held_kwargs), parked = self._held(args, kwargs)
        inputs = _Unchanged(self.units[index].name, (args, kwargs))
        buffers = _BuffersBefore(self._buffers[index])
        call = self._one_node_call(step, index, decision, forward, (args, kwargs), (held_args, held_kwargs), parked,
                                   inputs, buffers)
        if call is not None:
            out = call()
        else:
            out = self._checkpointed(step, index, decision, forward, (args, kwargs), (held_args, held_kwargs),
                                     parked, inputs, buffers)
        inputs.check("by its own forward", "it cannot be recomputed; name other blocks with block_classes=[...]")
        if step.spec.recorder:
            step.spec.recorder.units[index].input_shapes.append(tuple(t.shape for t, _ in inputs.watched))
        if decision.moves_inputs:
            inputs.forget([p.tensor for p in parked])  # the rerun reads their copies, taken now
            moved = sum(p.move_out(self.transfers) for p in parked)
            if step.spec.recorder:
                step.spec.recorder.units[index].input_bytes += moved
        elif step.spec.recorder:
            step.spec.recorder.units[index].input_bytes += sum(
                p.tensor.numel() * p.tensor.element_size() for p in parked)
        return out

    def _one_node_call(self, step: Step, index: int, decision: Decision, forward, called: tuple, held: tuple,
                       parked: list, inputs: "_Unchanged", buffers: "_BuffersBefore") -> RerunCall | None:
        """This call as one node (rerun.py), or None where it is not one: a plain recompute
        (selective needs checkpoint's modes, calibration's probes its hooks) of a unit whose
        forward was seen to reach only its arguments and parameters, with arguments whose every
        tensor the node takes."""
        if decision not in (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED) or step.spec.count_ops \
                or not self._reruns[index] or (decision.moves_inputs and self.second_derivatives):
            return None
        unit = self.units[index]
        rerunning = functools.partial(self._recomputing, step, index, parked, inputs, buffers)
        call = RerunCall(unit.name, unit.module, forward, held, _trained_parameters(unit.module), self.device,
                         _unpark, rerunning, self._clean[index], called, moved_inputs=decision.moves_inputs)
        return call if call.takes(len(inputs.watched)) else None

    def _checkpointed(self, step: Step, index: int, decision: Decision, forward, called: tuple, held: tuple,
                      parked: list, inputs: "_Unchanged", buffers: "_BuffersBefore"):
        """The call under torch.utils.checkpoint: its forward on the arguments it was `called`
        with, its reruns on those `held` as called (_as_called). The first time, its forward also
        shows whether the unit may from then on be recomputed as one node."""
        checks = self._reruns[index] is None and decision in (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED)

        def run(anchor):
            nonlocal checks, called
            if called is not None:  # the forward's call; let go of its arguments: a moved input's may go
                values, called = called, None
            else:
                values = ([_unpark(v) for v in held[0]], {k: _unpark(v) for k, v in held[1].items()})
            if not checks:
                return forward(*values[0], **values[1])
            checks = False  # the forward's call: the recomputation's runs as it is
            with MadeTensors() as made:
                since = graph_clock()
                out = forward(*values[0], **values[1])
                until = graph_clock()
            self._settle_rerun(index, values, out, made, since, until)
            return out

        # The call's arguments live in `run` (checkpoint keeps it until the recomputation) rather
        # than among checkpoint's own, which it would walk twice a call; the anchor alone tells it
        # which device's RNG state to keep.
        context_fn = functools.partial(self._contexts, step, index, decision, parked, inputs, buffers)
        early = set_checkpoint_early_stop(False) if step.spec.full_recompute else contextlib.nullcontext()
        with early:
            return checkpoint(run, self._anchor, use_reentrant=False, context_fn=context_fn, preserve_rng_state=True)

    def _settle_rerun(self, index: int, values, out, made: MadeTensors, since: int, until: int) -> None:
        """What a call through checkpoint showed: may this unit be rerun as one node? Not if its
        forward reached beyond its arguments and parameters, or a tensor it made left it other
        than among its outputs (rerun.py)."""
        if self._shown.get(index) is False:
            return
        outputs = pytree.tree_leaves(out)
        params = _trained_parameters(self.units[index].module)
        found = foreign_edges(outputs, pytree.tree_leaves(values), params, since, until) + \
            made.escaped(outputs, since, until)
        if _sharded(self.model, params):  # FSDP2 gathers them around the unit's own forward and backward
            found.append("parameters FSDP2 shards")
        if found:
            log.info("planner: %s stays recomputed through torch.utils.checkpoint: its forward reaches %s",
                     self.units[index].name, found[0])
        else:
            self._clean[index].add(until - since)  # the size of its graph: a rerun of that size needs no look
        self._shown[index] = not found

    def _held(self, args: tuple, kwargs: dict) -> tuple[tuple[list, dict], list[_Parked]]:
        """A recomputed call's arguments as its rerun reads them (as called, its large inputs in
        slots that can move to host memory), and those slots."""
        parked: list[_Parked] = []
        held = ([self._park(_as_called(a), parked) for a in args],
                {k: self._park(_as_called(v), parked) for k, v in kwargs.items()})
        return held, parked

    def _park(self, value, parked: list[_Parked]):
        if _parkable(value, self.device, self.min_bytes):
            slot = _Parked(value)
            parked.append(slot)
            return slot
        return value

    def _contexts(self, step: Step, index: int, decision: Decision, parked: list, inputs: "_Unchanged",
                  buffers: "_BuffersBefore"):
        forward_ctx: list = []
        recompute_ctx: list = [functools.partial(self._recomputing, step, index, parked, inputs, buffers),
                               functools.partial(_autocast_uncached, self.device.type)]
        if decision in (Decision.SELECTIVE, Decision.SELECTIVE_MOVED):
            saving, replaying = selective_contexts()
            forward_ctx.append(lambda: saving)
            recompute_ctx.append(lambda: replaying)
        elif step.spec.count_ops and step.spec.recorder:
            recompute_ctx.append(lambda: KeptOpTimer(step.spec.recorder, index))
        return (_Enter(*forward_ctx) if forward_ctx else contextlib.nullcontext()), _Enter(*recompute_ctx)

    @contextlib.contextmanager
    def _recomputing(self, step: Step, index: int, parked: list, inputs: "_Unchanged", buffers: "_BuffersBefore"):
        """Around a unit's recomputation: its inputs are as its forward found them, its moved
        inputs are back first (so the recorder's time is the recomputation's, not the wait for the
        link), the buffers its forward changed are as that forward found them and change once
        (BatchNorm does not count the batch twice, spectral norm reruns the same power iteration),
        and the recorder sees the time and the bytes rebuilt."""
        for slot in parked:
            slot.fetch()
        recorder = step.spec.recorder
        probe = recorder.rebuild_probe(index, self.min_bytes).around([p.tensor for p in parked]) \
            if recorder and step.spec.count_ops and self.units[index].kind == "block" else contextlib.nullcontext()
        with _as_forward_found(buffers, inputs, RECOMPUTE_OFF):
            start = step.mark("recompute in", index)
            rerun = RerunNote(counts_saves=recorder is not None)
            try:
                with probe:
                    yield rerun
            finally:
                end = step.mark("recompute out", index)
                if recorder:
                    recorder.pair("recompute", index, start, end, not_saved=rerun.outputs_not_saved)


@contextlib.contextmanager
def _as_forward_found(buffers: "_BuffersBefore", inputs: "_Unchanged | None", remedy: str):
    """Around a rerun: its inputs unchanged since its forward (`remedy`: what to do where they
    changed), and its unit's buffers as that forward found them. A chained unit's inputs are
    the rerun of the unit before it (None): only the chain's first are checked."""
    if inputs is not None:
        inputs.check("after its forward", remedy)
    kept = buffers.swap_in()
    try:
        yield
    finally:
        buffers.put_back(kept)


class _BuffersBefore:
    """A recomputed call's unit's buffers as its forward found them: copies of those a state_dict
    saves, which a forward may change (BatchNorm's running statistics, spectral norm's
    power-iteration vectors), often inside a kernel, where no version counter sees it. Its rerun
    runs on copies of these, so that it computes what the forward computed (spectral norm's
    weight), and the model's own buffers keep the forward's change alone (BatchNorm counts the
    batch once). The buffers themselves are put back after, not copied into: a rerun as one node
    saves what it read for its backward, which has yet to run and checks that nothing it saved
    changed in place. Buffers a state_dict leaves out (the caches and masks a module keeps for
    itself, such as a causal mask) are read as they are."""
    __slots__ = ("_before",)

    def __init__(self, slots: list):
        self._before = [(m, name, m._buffers[name].clone()) for m, name in slots if m._buffers.get(name) is not None]

    def swap_in(self) -> list:
        """Copies of the values the forward found, in the buffers' places; returns what was there."""
        kept = [(m, name, m._buffers[name]) for m, name, _ in self._before]
        for m, name, value in self._before:
            m._buffers[name] = value.clone()  # a rerun may change it again: each gets its own copy
        return kept

    @staticmethod
    def put_back(kept: list) -> None:
        for m, name, buffer in kept:
            m._buffers[name] = buffer


class _Unchanged:
    """The tensor inputs of a recomputed call, with their versions when it began. Its rerun reads
    them as they are then: changed in place (by the call itself, or after it) they would make the
    rerun compute something else, and the gradients would be wrong without a word."""
    __slots__ = ("unit", "watched")

    def __init__(self, unit: str, values):
        self.unit = unit
        self.watched = [(t, t._version) for t in _tensors(values) if not isinstance(t, nn.Parameter)]

    def check(self, when: str, remedy: str) -> None:
        for tensor, version in self.watched:
            if tensor._version != version:
                raise RuntimeError(f"planner: an input of shape {tuple(tensor.shape)} of {self.unit} was changed "
                                   f"in place {when} (version {version} -> {tensor._version}); recomputing "
                                   f"{self.unit} from it would give wrong gradients: {remedy}")

    def forget(self, tensors: list) -> None:
        """Moved inputs: the rerun reads their host copies, and they may go."""
        gone = {id(t) for t in tensors}
        self.watched = [(t, v) for t, v in self.watched if id(t) not in gone]


COMPILED_NOTE = ("planner: the model is called through torch.compile. Under a plan its units run "
                 "uncompiled and each one breaks the graph, so a step loses what compiling its blocks "
                 "gains: on an H100, T5 stepped 1.2 times and ViT-B/16 1.6-2.1 times slower compiled "
                 "under a plan than eager under one. Call the model eagerly under a plan. Compiled, "
                 "transformers gives each layer an attention mask, with which its eager attention runs "
                 "PyTorch's math kernel in fp32 (docs/api.md, Limits). A compiled model's own "
                 "checkpointing keeps its blocks compiled.")


def _called_through_torch_compile() -> bool:
    """Whether something torch.compile made (a compiled module, a module's compile(), a compiled
    training step) is on the stack: the wrapper torch/_dynamo/eval_frame.py calls it through is,
    by name. The planner's own hooks run under torch.compiler.disable, whose wrapper is another."""
    suffix = os.path.join("_dynamo", "eval_frame.py")
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "compile_wrapper" and frame.f_code.co_filename.endswith(suffix):
            return True
        frame = frame.f_back
    return False


class _Installed:
    """What the runtime puts on the model: a unit's forward, the root's hooks. A copy of the model
    (copy.deepcopy, as an EMA or a best-so-far copy is made) or its pickle (torch.save(model)) holds
    `copied` in its place, and is not planned: a unit's own forward, so that a copy's blocks run
    its own weights, and hooks that do nothing. A shallow copy shares the model's attributes and
    children, and is planned as the model is; nn.DataParallel's replicas share its attributes but
    not its children, and are refused (_replica_error)."""
    __slots__ = ("_function", "_copied")

    def __init__(self, function: Callable, copied: Callable):
        self._function, self._copied = function, copied

    def __call__(self, *args, **kwargs):
        return self._function(*args, **kwargs)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._copied, memo)

    def __reduce__(self):
        return _as_copied, (self._copied,)


def _as_copied(function: Callable) -> Callable:
    return function


def _no_hook(*args, **kwargs) -> None:
    """The root's hooks in a copy of a planned model: nothing."""
    return None


def _replica(module: nn.Module, model: nn.Module) -> bool:
    """Whether the root's hooks were called for a replica nn.DataParallel made of the model."""
    return module is not model and getattr(module, "_is_replica", False)


def _replica_error(module: nn.Module) -> RuntimeError:
    return RuntimeError(
        f"um_alloc planner: {type(module).__name__} was called as an nn.DataParallel replica of the planned "
        "model. The planner plans one model on one GPU, and a replica would run the planned model's own blocks "
        "on its inputs. Run one process per GPU instead (torchrun with DistributedDataParallel, which the "
        "planner supports), or make one GPU visible (CUDA_VISIBLE_DEVICES=0) so that nn.DataParallel does not "
        "replicate.")


def _eager(function: Callable) -> Callable:
    """`function`, run as Python runs it under torch.compile too: its hooks, events and saved-tensor
    hooks are the planner's own bookkeeping, which a compiled graph cannot hold."""
    return torch.compiler.disable(function)


def _caches_off(model: nn.Module) -> list:
    """Turns off use_cache in every config the model's modules hold; returns those it changed."""
    changed: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False) is True and id(config) not in changed:
            config.use_cache = False
            changed[id(config)] = config
    if changed:
        log.info("planner: use_cache turned off in %d config(s) (a recomputation would write the cache again)",
                 len(changed))
    return list(changed.values())


def _autocast_uncached(device_type: str):
    """Autocast as forward had it (checkpoint restores that), without its cache of casts of leaves.
    A moved input comes back as a leaf that requires grad, and with the cache the query, key and
    value projections would share one cast of it where forward made three: calibration would count
    a third of what a kept block holds and a rebuilt one rebuilds."""
    return torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                          enabled=torch.is_autocast_enabled(device_type), cache_enabled=False)


def _as_called(value):
    """The argument as the forward found it. A list or dict the caller goes on changing after the
    call is copied, so that a rerun reads what the forward read: DenseNet's layers each take the
    list of every feature so far, and the block appends each layer's output to that same list.
    Tensors and other values stay the objects they are; so do containers of other types."""
    if type(value) is list:
        return [_as_called(v) for v in value]
    if type(value) is tuple:
        return tuple(_as_called(v) for v in value)
    if type(value) is dict:
        return {k: _as_called(v) for k, v in value.items()}
    return value


def _unpark(value):
    return value.value() if isinstance(value, _Parked) else value


def _trained_parameters(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters that require a gradient, each once: what Module.parameters()
    gives, without the names it builds (a unit's call asks for them every step)."""
    found, seen, stack = [], set(), [module]
    while stack:
        current = stack.pop()
        for p in current._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                found.append(p)
        stack.extend(child for child in current._modules.values() if child is not None)
    return found


def _sharded(model: nn.Module, params: list[torch.Tensor]) -> bool:
    """Whether FSDP2 manages the model: a module of it sharded with fully_shard (inside a unit's
    forward its parameters are gathered, plain tensors), or parameters that are DTensors."""
    if any(is_dtensor(p) for p in params):
        return True
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a PyTorch built without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def input_signature(args, kwargs) -> tuple:
    """The shapes and dtypes of a forward's tensor arguments: a new one gets a new plan."""
    return tuple((tuple(t.shape), t.dtype) for t in _tensors([args, kwargs]))
