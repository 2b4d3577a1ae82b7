"""The block planner: record → plan → replay, attached to a model.

    planner = um_alloc.plan(model)            # the installed policy's budget; or budget="16GiB"
    for batch in loader:                      # any loop: plain, Hugging Face Trainer, Lightning
        loss = model(**batch).loss
        loss.backward()
        optimizer.step(); optimizer.zero_grad()
    print(planner.table())

The first input shape's first two training steps run in the safe mode (every block recomputed
with its inputs in host memory, every gap's activations in host memory) and measure; the third
runs the plan. Where the plan rebuilds or moves, whose cost depends on the host more than one
measured step shows, the best plans without them are tried beside it, three steps at a time in
turn and back, and the fastest measured stays (trials.py). A step that runs out of memory makes
the planner keep less (its margin grows) and plan again; the loop decides whether to repeat the
step (bert_example/train.py does).

Inputs whose shape changes (dynamic padding, a last smaller batch): a new input that a planned one
holds (the same tensors, dtypes and ranks, no dimension larger) runs that input's plan, or its
best plan without rebuilds (a rebuild's recipes are made for one shape), until it has come
BORROWED_STEPS times; then, like an input no planned one holds, it is measured in one safe step
of its own, without the probes of rebuilds and selective recomputation, which its plan then
leaves out. The first input's calibration, too, ends after one step when the next step is of
another input.

Troubleshooting:
- "no repeated blocks found" (a warning): no module of the model holds two or more modules of one
  class (in a container or as attributes), so its layers are gaps, which a plan keeps or moves and
  never recomputes; name the block classes to recompute: ``plan(model, block_classes=["MyLayer"])``.
- PlanInfeasible: the budget is below what the safe mode needs, by more than the overflow below
  (or, without um_alloc's pool, at all); the message gives the smallest budget that fits, and a
  round one to ask for. Lower the batch, or keep optimizer state in host
  memory (host_optimizer.yaml). Raised before a step's forward also where memory in use between
  steps grew after the measuring steps (the optimizer's state made after them under gradient
  accumulation) and no plan fits with it: each step that begins with more in use plans again.
- A plan that needs more than the budget holds: under um_alloc's hard budget the step's excess goes
  to host memory the GPU maps (up to ``overflow=``; slower, never a failed step), and the next steps
  use a margin larger by that excess. Where even the safe mode needs more than the budget, plans no
  larger than it run on that way (the model's fastest, tried against the safe mode's own): the
  budget trains, slower. Past the overflow, or without um_alloc, the step runs out of memory, and
  the next steps use a larger margin (``margin=`` sets the start).
- Hugging Face models: ``use_cache`` is turned off in every config the model holds (an
  encoder-decoder's decoder has its own), as their own gradient checkpointing does, since a cache
  would be written again by each recomputation; ``remove()`` turns it back on.
"""
from __future__ import annotations

import functools
import logging
import math
import statistics
import weakref
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.nn as nn

from ..install import installation, is_installed
from ..offload import STAGE_BYTES
from ..policy import host_mapped
from .. import arguments
from ..errors import At
from ..floor import HOST_OPTIMIZER_HINT
from ..sizes import format_size
from ..wrappers import unwrap_model
from .blocks import Unit, find_units
from .planning import (BLOCK_DECISIONS, SAFE, Calibration, Decision, Plan, PlanInfeasible, UnitCost,
                       calibration_to_dict, checkpointing_plan, evaluate, gaps_chained, make_plan, pool_repeats)
from .record import MemoryProbe, StepRecorder, link_rate
from .replay import Runtime, Step, StepSpec, input_signature
from .trials import PlanTrials, runners_up

__all__ = ["BlockPlanner", "plan", "planner_of", "STRATEGIES"]

log = logging.getLogger("um_alloc.planner")

REST = "(outside the units)"         # what the model's forward saves outside every unit: its loss
STRATEGIES = ("auto", "checkpoint")
# auto: this planner; checkpoint: every block recomputed
DEFAULT_DECISIONS = ("keep", "rebuild", "move", "recompute", "recompute_moved", "chained")
CALIBRATION_STEPS = 2                # the first counts the ops a selective recompute keeps
BORROWED_STEPS = 16                  # steps an input runs a larger input's plan before it is measured itself
PROBED = frozenset({Decision.REBUILD, Decision.SELECTIVE, Decision.SELECTIVE_MOVED})  # need the first step's probes
# PyTorch's selective checkpointing refuses a second backward through what it recomputed.
NO_SECOND_DERIVATIVE = frozenset({Decision.SELECTIVE, Decision.SELECTIVE_MOVED})
GROWTH_PLANNED_AGAIN = 64 << 20      # more in use as a step begins than a plan was measured with
MAX_WINDOW = 512 << 20               # copies back in flight ahead of backward, at most (default_window)
MAX_MARGIN = 512 << 20               # room left under the budget, at most (default_margin)
MIN_OVERFLOW = 1 << 30               # host memory a step may overflow to, at least (default_overflow)
OVERFLOW_SLACK = 64 << 20            # beyond what a step overflowed, what the margin grows by
_KEEP_STARTS = 64                    # step start events kept for the measured step time
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, BlockPlanner]" = weakref.WeakKeyDictionary()


@dataclass
class _Shape:
    """What the planner knows of one input shape."""
    calibrated: int = 0
    probed: bool = False                           # its first step ran the probes (rebuilds, selective ops)
    first: dict = field(default_factory=dict)      # unit -> figures only the first step measures
    probed_inputs: list = field(default_factory=list)  # the shapes the units' calls took in that step
    recipes: dict = field(default_factory=dict)  # unit -> what its saves rebuild equal from (UnitRecipes)
    calibration: Calibration | None = None
    plan: Plan | None = None
    trials: PlanTrials | None = None               # the plan and its runners-up, tried in turn
    failures: int = 0                              # safe-mode steps that ran out of memory
    lender: "_Shape | None" = None                 # the planned input whose plan this one runs
    borrowed: int = 0                              # steps it ran another input's plan
    lent: tuple | None = None                      # (its plan, that plan as inputs it holds run it)
    signature: tuple = ()
    seen: int = 0                                  # steps begun with this input
    first_sighting: bool = False                   # its calibration is of the step that first saw it
    measured_overflow: int = 0                     # what the step its calibration is of overflowed to host memory


class BlockPlanner:
    """Keeps, recomputes or moves each block's activations so that training fits a GPU budget,
    in the least predicted step time. See the module docstring.

    Args:
        model: the nn.Module to train, or a wrapper of it (DDP, torch.compile: um_alloc.wrappers);
            its repeated blocks are found by um_alloc.planner.blocks.
        budget: GPU memory for the whole training (bytes or "16GiB"); default: the installed
            policy's scheduler.budget.
        strategy: "auto" (plan per block) or "checkpoint" (recompute every block: an ablation).
        block_classes: class names of the blocks, where the search finds none or the wrong ones.
            Default: the installed policy's scheduler.block_classes, where it names any.
        margin: room left under the budget (default: a thirty-second of it, at most 512 MiB); grows
            after a step that overflowed or ran out of memory, shrinks where no plan fits with it.
        overflow: under um_alloc's hard budget, bytes of a step's requests that the budget refuses
            which go to host memory the GPU maps instead of failing the step (default: a quarter of
            the budget, at least 1 GiB, where the installed policy's scheduler.overflow says auto;
            0: none, such a step runs out of memory). The step is slower, its kernels reaching those
            bytes over the link, and the next steps plan with the margin grown by them. Where even
            the plan that keeps least needs more than the budget, and no more than this beyond it,
            plans no larger than it run with their excess in host memory instead of PlanInfeasible.
        window: bytes of copies back in flight ahead of backward (default: a sixteenth of the
            budget, at most 512 MiB). The safe mode holds them at its backward's peaks, so a window
            that is a large share of a small budget is what keeps the safe mode from fitting.
        hide_fraction: share of the link's time under compute that moves may take (default 0.7).
        decisions: the decisions the plan may use (default DEFAULT_DECISIONS: keep, rebuild,
            move, recompute, recompute_moved, chained). "selective" and "selective_moved" (PyTorch's selective
            checkpointing: keep matmul and attention outputs, recompute the rest) save GPU time but
            run every op through a Python dispatch mode, twice, which costs more CPU time than
            many hosts can hide; ask for them where the GPU, not the CPU, sets the pace.
        lean_loss: compute a cross-entropy of at least 512 MiB of logits inside the model's forward
            (a Hugging Face model's loss) in row chunks, bit for bit PyTorch's result with 2 GB less
            at BERT-Large's peaks, and from the bf16 logits where the model upcast them
            (um_alloc.planner.lean_loss). Default: the installed policy's scheduler.lean_loss
            (true unless a policy says otherwise).
        recompute_logits: where that cross-entropy's logits are a linear head's output, make them
            again a chunk of rows at a time in backward from the head's input, and give the head
            its gradients directly: neither the logits nor their gradient are read in backward,
            which saves the link's time where they live in host memory (um_alloc.spill). The loss
            is bit for bit PyTorch's, the gradient the same to rounding. Needs lean_loss.
            Default: the installed policy's scheduler.recompute_logits (false unless a policy says so).
        one_node_recompute: recompute a block, once its first call has shown that it reaches only
            its arguments and its own parameters, as one node of the graph (um_alloc.planner.rerun)
            rather than through torch.utils.checkpoint, which costs the host twice as much. False
            keeps torch.utils.checkpoint throughout. Default: the installed policy's
            scheduler.one_node_recompute (true unless a policy says otherwise).
        chains: let a plan rerun units whose calls follow one another in chains, from the first
            one's inputs (um_alloc.planner.chain). False leaves "chained" out of the decisions.
            Default: the installed policy's scheduler.chains (true unless a policy says otherwise).

    Attributes:
        safe_steps: steps run in the safe mode to measure an input (``to_dict()["inputs"]`` says
            how many inputs have a plan of their own, run another's, or are being measured).

    Raises:
        ValueError: a bad argument, no budget, or no blocks in the model (before any GPU work).
    """

    def __init__(self, model: nn.Module, budget: int | str | None = None, *, strategy: str = "auto",
                 block_classes: list[str] | None = None, margin: int | str | None = None,
                 overflow: int | str | None = None,
                 window: int | str | None = None, hide_fraction: float = 0.7,
                 decisions: list[str] | None = None, lean_loss: bool | None = None,
                 recompute_logits: bool | None = None,
                 one_node_recompute: bool | None = None, chains: bool | None = None):
        if not isinstance(model, nn.Module):
            raise _at("model").error("not a torch.nn.Module", received=model)
        self.strategy = arguments.one_of(strategy, _at("strategy"), STRATEGIES)
        self.hide_fraction = arguments.number_in(hide_fraction, _at("hide_fraction"), 0, 1)
        model = unwrap_model(model)
        self.budget = _budget(budget)
        self.margin = default_margin(self.budget) if margin is None else arguments.size(margin, _at("margin"))
        self.overflow = _overflow(overflow, self.budget)
        window = default_window(self.budget) if window is None else arguments.size(window, _at("window"))
        lean_loss = _switch(lean_loss, "lean_loss")
        recompute_logits = _switch(recompute_logits, "recompute_logits", default=False)
        if recompute_logits and not lean_loss:
            raise _at("recompute_logits").error("needs lean_loss (the chunked cross-entropy makes the logits "
                                                "again); turn lean_loss on or recompute_logits off",
                                                received=recompute_logits)
        one_node_recompute = _switch(one_node_recompute, "one_node_recompute")
        self.allowed = _decisions(decisions)
        if not _switch(chains, "chains"):
            self.allowed -= {Decision.CHAINED}
        block_classes = _block_classes(block_classes)
        self.units: list[Unit] = find_units(model, block_classes)
        if not self.units:
            raise ValueError(f"BlockPlanner: {type(model).__name__} has no submodules to plan (its forward does "
                             "all its work itself); the planner decides for a model's blocks and layers")
        if not any(u.kind == "block" for u in self.units):
            log.warning("planner: no repeated blocks found in %s (no module of it holds two or more modules of one "
                        "class): its %d layers' saved tensors may move to host memory, or layers that follow one "
                        "another rerun in chains, and none is recomputed as a block. To recompute blocks, name their "
                        "classes: block_classes=[...], or scheduler.block_classes: [...] "
                        "in the policy (python -m um_alloc run and the callbacks, no code changed)",
                        type(model).__name__, len(self.units))
        self.device = _device_of(model)
        self._probe = MemoryProbe(self.device)
        self._reserved = STAGE_BYTES if self.device.type == "cuda" and is_installed() else 0
        self._link: float | None = None
        self._shapes: dict[tuple, _Shape] = {}
        self._pending: tuple[_Shape, StepRecorder, bool] | None = None  # and whether it probes
        self._unkeyed: tuple[tuple, _Shape] | None = None  # a step's shape known only in part (begin_forward)
        self._last_shape: _Shape | None = None             # the input of the step begun last
        self._starts: list[tuple[Plan, object]] = []
        self._current: Plan | None = None
        self._borrowing: _Shape | None = None              # the input of the step begun last, if it borrows
        self.safe_steps = 0                                # steps run in the safe mode, to measure
        self._last_safe = False                            # whether the step begun last was a safe one
        self._lay_out_anew = False                         # a step ran out of memory or overflowed
        self.overflowed_steps = 0                          # planned steps that overflowed to host memory
        self._overflow_settled = False                     # the margin is as large as any plan allows
        self._ooms = self._probe.out_of_memory_count()
        self._second_derivatives_planned = False          # plans were made again once a second derivative came
        self._runtime = Runtime(model, self.units, self.device, self,
                                window=window, lean_loss=lean_loss, one_node_recompute=one_node_recompute,
                                recompute_logits=recompute_logits)
        self._runtime.attach()
        _ATTACHED[model] = self

    # -- the director: what each step does --

    def begin(self, signature: tuple, partial: bool = False) -> StepSpec:
        shape = self._shape(signature, partial)
        self._close_calibration(shape)
        self._follow_memory_in_use()
        self._follow_second_derivatives()
        if shape.failures >= 2:
            raise PlanInfeasible(f"budget {format_size(self.budget)}: the safe mode (every block recomputed, "
                                 f"activations in host memory) ran out of memory {shape.failures} times for "
                                 f"input {_shape_text(signature)}; {_lighter_hint()}", 0)
        follows, self._last_shape = self._last_shape is shape, shape
        shape.seen += 1
        self._borrowing = None
        lent = self._borrow(shape) if not partial else None
        if lent is not None:
            self._new_layout(safe=False)
            self._borrowing = shape
            self._current = lent
            self._note_start(lent)
            return StepSpec(lent.decisions, owner=shape)
        if shape.plan is not None:
            if shape.trials is not None and not shape.trials.done:
                # A step of another input in between is in this interval: it does not count.
                shape.plan = shape.trials.begin_step(follows)
                if shape.trials.done:
                    log.info("planner: %s", shape.trials.summary())
            self._new_layout(safe=False)
            self._current = shape.plan
            self._note_start(shape.plan)
            return StepSpec(shape.plan.decisions, owner=shape, rebuilds=shape.recipes)
        # The probes of the first step (rebuilds, selective ops) slow it down; only the first input's
        # plan waits for a clean second step. Another input is measured in one clean step, and so is
        # one whose probing step ran out of memory: a probe holds a rebuilt copy of a saved tensor.
        probes = (shape.calibrated == 0 and shape.failures == 0
                  and not any(s.calibration is not None for s in self._shapes.values()))
        if shape.calibrated == 0:
            log.info("planner: measuring %s in the safe mode for input %s",
                     f"{CALIBRATION_STEPS} steps" if probes else "one step",
                     "of the next step (this one's keyword arguments are not seen)" if partial
                     else _shape_text(signature))
        shape.probed = shape.probed or probes
        # Before the recorder: its step's backed memory is measured from here. The clean second
        # step of an input repeats its probing step's layout in the arenas that step backed, whose
        # pages are made: in new arenas the GPU's first write of each page would make it again,
        # and the step would be timed with that (BERT-Large at batch 160 under 8 GiB: its spilled
        # logits' 5 GB took 1.2 s more to write, bench/results/scale_8GiB/measuring_step/).
        self._new_layout(safe=True, repeat=follows and self._last_safe)
        recorder = StepRecorder(self.device, self._probe, len(self.units) + 1,
                                ahead=self._runtime.transfers.ahead_low_water)
        self._pending = (shape, recorder, probes)
        shape.first_sighting = shape.seen == 1
        self.safe_steps += 1
        if self.device.type == "cuda":
            self._runtime.transfers.time_copies()
        safe = tuple(SAFE[u.kind] for u in self.units) + (SAFE["gap"],)
        return StepSpec(safe, recorder, count_ops=probes, full_recompute=True, owner=shape)

    def _follow_memory_in_use(self) -> None:
        """Memory that outlasts steps can grow after the steps that measured: the optimizer's state
        is made at its first step, which comes after them where a loop accumulates gradients over
        micro-batches, and accumulated gradients are in use all through every micro-batch but the
        first. Where a step begins with more in use than an input's plan was measured with, that
        input's figures move up by the difference and its plan is made again, before the step runs."""
        live = self._probe.live()
        for shape in self._shapes.values():
            cal = shape.calibration
            grown = 0 if cal is None else live - cal.start_live_bytes
            if grown <= GROWTH_PLANNED_AGAIN:
                continue
            shape.calibration = cal.with_more_in_use(grown)
            log.info("planner: %s more in use as a step begins than when input %s was measured (the optimizer's "
                     "state made since, gradients accumulated): planning it again", format_size(grown),
                     _shape_text(shape.signature))
            try:
                self._plan_shape(shape)
            except PlanInfeasible as error:
                raise PlanInfeasible(
                    f"{format_size(grown)} more GPU memory is in use as this step begins than when input "
                    f"{_shape_text(shape.signature)} was measured (the optimizer's state, made at its first step "
                    f"after the measuring ones, or gradients accumulated over micro-batches), and no plan fits "
                    f"with it: {error}", error.smallest_bytes) from None

    def _follow_second_derivatives(self) -> None:
        """Once a backward with create_graph=True has reached the model, plans that recompute
        selectively are made again without it."""
        if not self._runtime.second_derivatives or self._second_derivatives_planned:
            return
        self._second_derivatives_planned = True
        if any(s.plan is not None and NO_SECOND_DERIVATIVE & set(s.plan.decisions) for s in self._shapes.values()):
            log.info("planner: a second derivative reached the model; planning again without selective recomputation")
            self._plan_again()

    def _new_layout(self, safe: bool, repeat: bool = False) -> None:
        """Where a step lays its activations out anew (a safe step that does not `repeat` the
        safe step before it, the first planned step after one, any step after one that ran out
        of memory or overflowed), the step arenas the last layout left backed are given back
        first (arenas.py): its free chunks, scattered where the new layout wants other sizes,
        would otherwise hold budget that the new layout's requests cannot use. Every step may
        overflow to host memory, a measuring one too: the pool counts overflowed bytes as live,
        so its peaks are still what the step asked of the GPU."""
        anew = not repeat if safe else self._last_safe
        if anew or self._lay_out_anew:
            released = self._runtime.arenas.release()
            if released:
                log.info("planner: %s of free arenas given back for a new layout", format_size(released))
        self._runtime.arenas.allow_overflow(self.overflow)
        self._last_safe, self._lay_out_anew = safe, False

    def _borrow(self, shape: _Shape) -> Plan | None:
        """The plan this input runs, if it runs another's: that of the smallest planned input that
        holds it (see the module docstring; _lent). None: it has or makes its own."""
        if shape.plan is not None or shape.calibrated or self.strategy == "checkpoint":
            return None
        if shape.lender is None and shape.borrowed == 0:
            holders = [s for s in self._shapes.values()
                       if s.plan is not None and s.lender is None and _holds(s.signature, shape.signature)]
            shape.lender = min(holders, key=lambda s: _elements(s.signature), default=None)
            if shape.lender is not None:
                log.info("planner: input %s runs the plan of input %s, which holds it, for up to %d steps",
                         _shape_text(shape.signature), _shape_text(shape.lender.signature), BORROWED_STEPS)
        if shape.lender is None:
            return None
        shape.borrowed += 1
        if shape.borrowed > BORROWED_STEPS:  # it comes often: a plan of its own is worth a step's measuring
            shape.lender = None
            return None
        return self._lent(shape.lender)

    def _lent(self, lender: _Shape) -> Plan:
        """The lender's plan as inputs it holds run it: its own where it rebuilds nothing, else its
        best plan without rebuilds (a rebuild's recipes hold for the lender's shapes only, and a
        smaller input's kept saves may outweigh a larger one's rebuilt), or where none fits the
        margin (a lender planned at the budget's edge: _fitting), the plan that keeps least."""
        if lender.lent is None or lender.lent[0] is not lender.plan:
            if Decision.REBUILD in lender.plan.decisions:
                plan = (self._make_or_none(lender.calibration, self._allowed(lender) - {Decision.REBUILD})
                        or self._least(lender.calibration))
            else:  # an object of its own: measured_step_s times the steps of one plan object
                plan = replace(lender.plan)
            lender.lent = (lender.plan, plan)
        return lender.lent[1]

    def _allowed(self, shape: _Shape) -> frozenset[Decision]:
        """What its plan may use: what the figures of its steps support, and what a second
        derivative can pass through once one has been seen."""
        allowed = self.allowed if shape.probed else self.allowed - PROBED
        return allowed - NO_SECOND_DERIVATIVE if self._runtime.second_derivatives else allowed

    def _shape(self, signature: tuple, partial: bool) -> _Shape:
        """The record of this input. A step whose keyword arguments were not seen (`partial`:
        begun by begin_forward) is kept aside and counted as the next step's input when that
        one's tensors start with its own: that is the case for a model called as
        ``model(**batch)``, and its first step then calibrates as under the planner's own hooks."""
        unkeyed, self._unkeyed = self._unkeyed, None
        if partial:
            self._unkeyed = (signature, _Shape(signature=signature))
            return self._unkeyed[1]
        if unkeyed is not None and signature not in self._shapes and signature[:len(unkeyed[0])] == unkeyed[0]:
            unkeyed[1].signature = signature  # the object the pending calibration holds
            self._shapes[signature] = unkeyed[1]
        return self._shapes.setdefault(signature, _Shape(signature=signature))

    def end(self, step: Step, completed: bool) -> None:
        overflowed = self._runtime.arenas.overflow_peak()
        if completed:
            if overflowed and step.spec.recorder is None:
                self.on_overflow(overflowed)
            elif overflowed:  # the calibration counts what it needed (_close_calibration)
                step.spec.recorder.overflowed_bytes = overflowed
                log.info("planner: the measuring step overflowed %s to host memory; its times include the "
                         "accesses over the link", format_size(overflowed))
            return
        self._pending = None
        if step.spec.recorder is not None:  # its copies' timings end with it, not in the steps after
            self._runtime.transfers.stop_timing()
        ooms = self._probe.out_of_memory_count()
        if step.oom or ooms > self._ooms:
            self._ooms = ooms
            self._lay_out_anew = True
            if step.spec.recorder is not None:  # the safe mode itself did not fit
                owner = step.spec.owner
                owner.failures += 1
                retry = "A loop that runs the step again tries once more"
                if step.spec.count_ops:  # its probes' figures are lost with it; the retry runs without them
                    owner.probed = False
                    retry += ", without the first step's probes (which hold a rebuilt copy of a saved tensor)"
                log.warning("planner: the step measuring input %s in the safe mode ran out of memory under the %s "
                            "budget (%d of 2 tries). The safe mode (every block recomputed, activations in host "
                            "memory) takes the least memory of any plan, so none is likely to fit: %s, or raise "
                            "the budget. %s", _shape_text(owner.signature), format_size(self.budget), owner.failures,
                            _lighter_hint(), f"{retry}." if owner.failures < 2
                            else "A loop that runs it again is refused (PlanInfeasible).")
            else:
                self.on_out_of_memory()

    def _close_calibration(self, following: _Shape) -> None:
        """The step measured last ended at this forward, of input `following`: its figures become
        a calibration, planned unless a clean second step of the same input follows its probes."""
        if self._pending is None:
            return
        shape, recorder, probed = self._pending
        self._pending = None
        recorder.mark("next forward")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        copied = self._runtime.transfers.copy_rates() if self.device.type == "cuda" else None
        shared = recorder.overflowed_bytes > 0 or recorder.probe.spilled()
        link = calibration_link(copied, shared, self._probed_link)
        names = [(u.name, u.kind) for u in self.units] + [(REST, "gap")]
        cal = recorder.calibration(names, recorder.marks[-1].clock, link, self._reserved)
        stalls = self._runtime.transfers.copy_stalls_s() if self.device.type == "cuda" else None
        if stalls:
            cal = replace(cal, copy_stalls_s=stalls)
        if recorder.overflowed_bytes:  # it needed the budget, all backed, and that much more
            cal = cal.needing(self.budget + recorder.overflowed_bytes)
        shape.measured_overflow = recorder.overflowed_bytes
        shape.calibrated += 1
        if probed:
            cal = self._with_alone_times(cal, recorder)
            shape.first = {j: {name: getattr(u, name) for name in _first_step_figures(u)}
                           for j, u in enumerate(cal.units)}
            shape.recipes = recorder.recipes()
            shape.probed_inputs = _input_shapes(recorder)
            if following is shape:
                return  # the clean step
            if all(s is not shape for s in self._shapes.values()):
                return  # a step whose input was never known (begin_forward's), nobody's plan
            # The only step of its input for now: its recomputations ran the probes, slower than they are.
        elif shape.first and shape.probed_inputs != _input_shapes(recorder):
            # The probes ran on another input (a step begun by begin_forward, counted for this
            # one's): their figures and recipes are not this input's.
            log.info("planner: the probed step's input was not %s; its plan neither rebuilds nor recomputes "
                     "selectively", _shape_text(shape.signature))
            shape.first, shape.recipes, shape.probed = {}, {}, False
            shape.first_sighting = True  # the probed step was another input's: this one was new
        groups = [u.class_name for u in self.units] + [None]
        shape.calibration = pool_repeats(_with_first_step(cal, shape.first), groups)
        self._plan_shape(shape)

    def _with_alone_times(self, cal: Calibration, recorder: StepRecorder) -> Calibration:
        """`cal` with each unit's forward and backward run by itself (alone.py), now that nothing
        of the probed step is in flight. They allocate from the step arenas, as a step does, and
        never overflow to host memory, whose reads over the link would be timed instead: a unit
        the budget cannot hold by itself is priced from the safe step."""
        with self._runtime.arenas.between_steps():
            timed = recorder.alone.time()
        self._ooms = self._probe.out_of_memory_count()  # one that did not fit is not the next step's
        units = list(cal.units)
        for j, alone in timed.items():
            units[j] = replace(units[j], alone_forward_s=alone.forward_s, alone_backward_s=alone.backward_s,
                               alone_forward_cpu_s=alone.forward_cpu_s)
        return replace(cal, units=tuple(units))

    def _probed_link(self) -> float:
        self._link = self._link or link_rate(self.device)
        return self._link

    def _plan_shape(self, shape: _Shape) -> None:
        """The shape's plan from its calibration, and its runners-up to try (trials.py)."""
        allowed = self._allowed(shape)
        shape.plan, shape.trials = self._make(shape.calibration, allowed), None
        if self.strategy == "checkpoint":
            return
        if self._overflow_settled:
            # At the budget's edge a misjudged peak costs host memory every step, which no model
            # predicts: the plan that keeps least, whose peak was measured, is tried against it
            # (ResNet-50 under 8 GiB, one H200: at batch 640 the plan ran 990 ms a step, its
            # predicted 7.2 GiB peak 8.1 GiB live, against the plan that keeps least's 670 ms).
            least = self._least(shape.calibration)
            candidates = [shape.plan] + [p for p in (least, self._least_chained(shape.calibration, least))
                                         if p is not None and p.decisions != shape.plan.decisions]
            if len(candidates) > 1:
                shape.trials = PlanTrials(candidates, self.device)
                log.info("planner: trying %s against it, %d steps at a time, in turn and back",
                         " and ".join(p.made for p in candidates[1:]), shape.trials.steps)
            return
        candidates = runners_up(shape.plan, functools.partial(self._make_or_none, shape.calibration), allowed,
                                checkpointing_plan(shape.calibration, self.budget, margin_bytes=self.margin))
        if len(candidates) > 1:
            shape.trials = PlanTrials(candidates, self.device)
            log.info("planner: trying %d plans %d steps at a time, in turn and back; the fastest stays: %s",
                     len(candidates), shape.trials.steps,
                     "; ".join(f"{p.made}: {p.table().splitlines()[-1]}" for p in candidates[1:]))

    def _make(self, cal: Calibration, allowed: frozenset[Decision]) -> Plan:
        if self.strategy == "checkpoint":
            forced = tuple(Decision.RECOMPUTE if u.kind == "block" else Decision.KEEP for u in cal.units)
            made = replace(evaluate(cal, forced, self.budget, margin_bytes=self.margin),
                           made="every block recomputed (strategy: checkpoint)")
        else:
            made = self._fitting(cal, allowed)
        log.info("planner: %s", made.table().splitlines()[-1])
        return made

    def _fitting(self, cal: Calibration, allowed: frozenset[Decision]) -> Plan:
        """The fastest plan within the budget less the margin. Where none fits and the pool can
        overflow (um_alloc's hard budget), the fastest plan that needs no more of the GPU than the
        plan that keeps least: the margin shrinks to what that plan leaves under the budget, and
        where not even it fits, the plans its peak holds run anyway, their excess in host memory,
        if that excess is within the overflow (the safe steps that measured it ran). The margin is
        then settled: later overflows plan nothing again (on_overflow), and _plan_shape tries the
        plan against the plan that keeps least. Past the budget a chain's rerun at once has no
        room: such plans leave chains out, and the trials offer them in the plan that keeps least."""
        if self._overflow_settled:
            allowed = allowed - {Decision.CHAINED}
        try:
            return self._best(cal, allowed)
        except PlanInfeasible as refused:
            excess = cal.smallest_budget(0) - self.budget
            if not self._runtime.arenas.can_overflow:
                raise
            # The copy stages are device memory beside the pool, which never goes to host memory:
            # what overflows is the pool's share of the excess.
            if excess - cal.reserved_bytes > self.overflow:
                raise PlanInfeasible(f"{refused}; a step may overflow only {format_size(self.overflow)} past the "
                                     f"budget to host memory (overflow=, scheduler.overflow)",
                                     refused.smallest_bytes) from None
        self.margin, self._overflow_settled = min(self.margin, max(-excess, 0)), True
        if excess <= 0:
            log.warning("planner: no plan fits the %s budget with its margin; margin cut to %s, what the plan that "
                        "keeps least leaves. A step that needs more overflows to host memory (slower)",
                        format_size(self.budget), format_size(self.margin))
        else:
            log.warning("planner: even the plan that keeps least (every block recomputed, activations in host "
                        "memory) needs %s more than the %s budget holds: steps run plans that need no more, their "
                        "excess in host memory the GPU reaches over the link (slower), up to the %s of overflow "
                        "allowed. A budget of %s would hold it", format_size(excess), format_size(self.budget),
                        format_size(self.overflow), format_size(cal.smallest_budget(0)))
        return self._within_least(cal, allowed - {Decision.CHAINED})

    def _within_least(self, cal: Calibration, allowed: frozenset[Decision]) -> Plan:
        """The fastest plan whose predicted peak is no more than the plan that keeps least's, the
        budget counted as at least that large: past the budget such plans overflow no more than it
        does (ResNet-50's peak is in its first blocks' backward, where later blocks' inputs, kept
        or not, are gone). The plan that keeps least where the grid's rounding leaves none."""
        budget = max(self.budget, cal.smallest_budget(self.margin))
        try:
            plan = self._best(cal, allowed, budget)
        except PlanInfeasible:
            return self._least(cal)
        return replace(plan, budget_bytes=self.budget, made="the model's fastest within the least plan's peak")

    def _least(self, cal: Calibration) -> Plan:
        """The plan that keeps least: the safe mode's decisions, whose peak the safe steps measured."""
        least = tuple(SAFE[u.kind] for u in cal.units)
        return replace(evaluate(cal, least, self.budget, margin_bytes=self.margin), made="the plan that keeps least")

    def _least_chained(self, cal: Calibration, least: Plan) -> Plan | None:
        """The plan that keeps least, its gaps rerun in chains where they may be (gaps_chained),
        where that needs no more than half the overflow the plan that keeps least leaves: at the
        budget's edge, the plan a link-paced step gains most from (ResNet-50 at batch 704 under
        8 GiB, one H200: 676 ms a step against the plan that keeps least's 782 ms)."""
        if Decision.CHAINED not in self.allowed:
            return None
        decisions = gaps_chained(cal, least.decisions)
        if decisions == least.decisions:
            return None
        plan = evaluate(cal, decisions, self.budget, margin_bytes=self.margin)
        room = max(self.overflow - max(cal.smallest_budget(0) - self.budget, 0), 0) // 2
        if plan.predicted_peak_bytes > least.predicted_peak_bytes + room:
            return None
        return replace(plan, made="the plan that keeps least, its gaps rerun in chains")

    def _make_or_none(self, cal: Calibration, allowed: frozenset[Decision]) -> Plan | None:
        try:
            return self._best(cal, allowed)
        except PlanInfeasible:
            return None

    def _best(self, cal: Calibration, allowed: frozenset[Decision], budget: int | None = None) -> Plan:
        """The fastest plan of `allowed` within the budget (or `budget`), less the margin (make_plan)."""
        return make_plan(cal, budget or self.budget, margin_bytes=self.margin, hide_fraction=self.hide_fraction,
                         allowed=allowed)

    def on_out_of_memory(self) -> None:
        """A planned step ran out of memory: keep less from now on (a larger margin), plan again."""
        grown = max(256 << 20, self.budget // 16)
        self.margin += grown
        # A loop that does not run the step again ends with the error; run again, the planner
        # would start from its default margin and plan the same step.
        log.warning("planner: a step ran out of memory; margin now %s, planning again. A training loop that "
                    "does not run the step again stops here: then a budget %s lower plans with this margin "
                    "from the first step", format_size(self.margin), format_size(grown))
        self._plan_again()

    def on_overflow(self, nbytes: int) -> None:
        """A planned step needed `nbytes` more than the budget held, which the pool put in host
        memory (the step ran, slower): keep that much less from now on, plan again. Where even the
        plan that keeps least cannot leave that much room, plans no larger than it run from now on
        with their excess in host memory (the model's fastest, tried against the plan that keeps
        least: _plan_shape), and steps that overflow again change nothing."""
        self.overflowed_steps += 1
        if self._overflow_settled:
            log.debug("planner: a step overflowed %s to host memory", format_size(nbytes))
            return
        wanted = self.margin + nbytes + OVERFLOW_SLACK
        most = self._largest_margin()
        self.margin = min(wanted, most)
        self._lay_out_anew = True
        if wanted <= most:
            log.warning("planner: a step needed %s more than the %s budget holds, which it reached in host memory "
                        "(that step ran slower); margin now %s, planning again", format_size(nbytes),
                        format_size(self.budget), format_size(self.margin))
        else:
            self._overflow_settled = True
            log.warning("planner: a step needed %s more than the %s budget holds, and no plan leaves that much room: "
                        "from now on steps run plans no larger than the one that keeps least (the model's fastest "
                        "and that one, tried), what passes the budget in host memory the GPU reaches over the link "
                        "(slower). A budget about %s larger would hold it",
                        format_size(nbytes), format_size(self.budget), format_size(wanted - most))
        self._plan_again()

    def _largest_margin(self) -> int:
        """The most margin with which every measured input's safe mode still fits the budget."""
        smallest = max((s.calibration.smallest_budget(0) for s in self._shapes.values() if s.calibration is not None),
                       default=0)
        return max(self.budget - smallest, 0)

    def _plan_again(self) -> None:
        for shape in self._shapes.values():
            if shape.calibration is not None:
                self._plan_shape(shape)

    def force(self, decisions) -> Plan:
        """Runs `decisions` instead of the plan for the input shape seen last, from its next step
        on, and returns what the cost model predicts for them: an ablation, or a check of the
        model against the measured step. `decisions` has one entry per unit and one for what is
        saved outside them (Decision or its name; see ``calibration.units``), or is a single name
        for every block, the gaps kept. Planning again (an out-of-memory step, or a step that
        begins with more memory in use than measured) replaces it."""
        shape = self._current_shape()
        if shape is None:
            raise RuntimeError("BlockPlanner.force: no plan yet; the first steps of an input shape measure")
        units = shape.calibration.units
        if isinstance(decisions, (str, Decision)):
            every = _decision(decisions, BLOCK_DECISIONS)
            decisions = [every if u.kind == "block" else Decision.KEEP for u in units]
        forced = replace(evaluate(shape.calibration, _forced(decisions, units), self.budget, margin_bytes=self.margin),
                         made="forced")
        if forced.predicted_peak_bytes > forced.limit_bytes:
            raise ValueError(f"BlockPlanner.force: these decisions are predicted to peak at "
                             f"{format_size(forced.predicted_peak_bytes)}, over the {format_size(forced.limit_bytes)} "
                             f"the budget of {format_size(self.budget)} leaves; keep less")
        shape.plan = self._current = forced
        shape.trials = None
        return forced

    # -- what users read --

    @property
    def plan(self) -> Plan | None:
        """The plan of the input shape seen last (None while calibrating)."""
        return self._current

    def measured_step_s(self) -> float | None:
        """Median time of the last planned steps of the current plan, start to start (synchronizes)."""
        if len(self._starts) < 2 or self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        current = self._starts[-1][0]
        times = [a[1].elapsed_time(b[1]) / 1e3 for a, b in zip(self._starts, self._starts[1:])
                 if a[0] is current and b[0] is current]
        return statistics.median(times) if times else None

    def table(self) -> str:
        if not self.plan:
            return "planner: no plan yet (the first steps measure)"
        trials = self._current_trials()
        shape = self._current_shape()
        sighting = ("\nmeasured in the step that first saw this input: its one-time work (memory from the driver, "
                    "pinned buffers) is in the predicted step") if shape is not None and shape.first_sighting else ""
        overflowed = (f"\nmeasured in a step that overflowed {format_size(shape.measured_overflow)} to host memory: "
                      "its kernels' reads of it over the link are in the predicted step, which plans that fit do "
                      "not pay") if shape is not None and shape.measured_overflow else ""
        return (self.plan.table() + (f"\n{trials.summary()}" if trials else "") + sighting + overflowed
                + self._borrowed_line())

    def _borrowed_line(self) -> str:
        borrower = self._borrowing
        if borrower is None or borrower.lender is None:
            return ""
        return (f"\ninput {_shape_text(borrower.signature)} runs the plan of input "
                f"{_shape_text(borrower.lender.signature)}, which holds it (the figures above are that input's; "
                "no rebuilds)")

    def to_dict(self) -> dict:
        out = {"strategy": self.strategy, "budget_bytes": self.budget, "margin_bytes": self.margin,
               "overflow_bytes": self.overflow, "overflowed_steps": self.overflowed_steps,
               "units": len(self.units), "blocks": sum(u.kind == "block" for u in self.units),
               "safe_steps": self.safe_steps, "inputs": self._inputs()}
        if self._runtime.lean_loss is not None:
            out["lean_loss_calls"] = self._runtime.lean_loss.calls
            out["lean_loss_upcasts"] = self._runtime.lean_loss.upcast_calls
            out["lean_loss_projected"] = self._runtime.lean_loss.projected_calls
        if self.plan:
            shape = self._current_shape()
            out.update(plan=self.plan.to_dict(), measured_step_s=self.measured_step_s(),
                       measuring_step_overflow_bytes=shape.measured_overflow if shape else 0)
            trials = self._current_trials()
            if trials:
                out["trials"] = trials.to_list()
        calibration = self.calibration
        if calibration is not None:
            out["calibration"] = calibration_to_dict(calibration)
        return out

    def _inputs(self) -> dict:
        """How many input shapes have a plan of their own, run another's, or are being measured."""
        shapes = list(self._shapes.values())
        own = sum(s.plan is not None for s in shapes)
        borrowing = sum(s.plan is None and s.lender is not None for s in shapes)
        out = {"planned": own, "borrowing": borrowing, "measuring": len(shapes) - own - borrowing}
        if self._borrowing is not None and self._borrowing.lender is not None:
            out["last_step_ran_plan_of"] = _shape_text(self._borrowing.lender.signature)
        return out

    @property
    def calibration(self) -> Calibration | None:
        """What the plan of the input shape seen last was made from: plan it again at another budget
        with ``make_plan(planner.calibration, budget)``."""
        shape = self._current_shape()
        return shape.calibration if shape else None

    def _current_shape(self) -> _Shape | None:
        """The input whose plan (or whose plan as another input borrows it) ran last."""
        current = self._current
        return next((s for s in self._shapes.values() if s.plan is not None
                     and (s.plan is current or (s.lent is not None and s.lent[1] is current))), None)

    def _current_trials(self) -> PlanTrials | None:
        shape = self._current_shape()
        return shape.trials if shape else None

    def remove(self) -> None:
        """Detaches from the model: its units run as they did before."""
        self._runtime.detach()
        if _ATTACHED.get(self._runtime.model) is self:
            del _ATTACHED[self._runtime.model]

    def begin_forward(self, args: tuple, kwargs: dict | None = None) -> None:
        """Begins a step for the model's forward already under way. For a planner attached from
        inside that forward's global hooks (um_alloc run's), whose own hooks run from the next call.
        `kwargs` None: not known (PyTorch's global pre-hooks see only positional arguments); the
        step then counts for the input of the next step (see _shape)."""
        self._runtime.begin_step(input_signature(args, kwargs or {}), partial=kwargs is None)

    def _note_start(self, current: Plan) -> None:
        if self.device.type != "cuda":
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._starts = self._starts[-_KEEP_STARTS + 1:] + [(current, event)]


def plan(model: nn.Module, budget: int | str | None = None, **options) -> BlockPlanner:
    """Attaches a BlockPlanner to `model` (see BlockPlanner for the options); returns it."""
    return BlockPlanner(model, budget, **options)


def planner_of(model: nn.Module) -> BlockPlanner | None:
    """The planner attached to `model` (or to what it wraps), or None."""
    return _ATTACHED.get(unwrap_model(model))


# Measured in the first calibration step only (it runs the probes, which slow it down); the time
# and the bytes of everything else come from the second.
_FIRST_STEP_FIGURES = ("selective_bytes", "matmul_s", "rebuildable_bytes", "rebuild_s", "rebuild_cpu_s",
                       "rebuild_forward_cpu_s", "alone_forward_s", "alone_backward_s", "alone_forward_cpu_s")
# A gap's rerun, which only the probed step times (chain.py): the safe step moves gaps.
_FIRST_STEP_GAP_FIGURES = ("recompute_s", "recompute_cpu_s", "input_bytes")


def _first_step_figures(unit: UnitCost) -> tuple[str, ...]:
    return _FIRST_STEP_FIGURES + (_FIRST_STEP_GAP_FIGURES if unit.kind == "gap" else ())


def _lighter_hint() -> str:
    """What would make a step that does not fit lighter, leaving out what the policy already does."""
    if is_installed() and host_mapped(installation().policy.tags["optimizer_state"]):
        return "lower the batch"
    return "lower the batch or " + HOST_OPTIMIZER_HINT


def calibration_link(copied: tuple[float, float] | None, shared: bool, probe: Callable[[], float]) -> float:
    """The link's rate a plan is costed at: as the measured step's copies found it (through the
    stages, beside the step's kernels, the slower direction). Where nothing was copied, or the
    step's kernels `shared` the link, `probe`'s copy out and back of one buffer. Kernels reading
    memory the step overflowed to the host leave the copies a fraction of the link (3.2 GB/s in a
    step of BART that overflowed on an H100), and a plan that fits the budget does not share it
    with them. Kernels writing a spilled head's logits to host memory for the first time
    (um_alloc.spill) did the same to the measuring step's copies: BERT-Large's batch 160 at 8 GiB
    on an H200 measured them at 6.6 GB/s, while its planned steps moved 8.3 GiB each way in
    1.33 s (bench/results/scale_8GiB/logits_made_again)."""
    if copied and not shared:
        return min(copied)
    return probe()


def _input_shapes(recorder: StepRecorder) -> list:
    """The shapes of every recomputed call's tensor inputs, unit by unit: in the safe mode, every block's."""
    return [u.input_shapes for u in recorder.units]


def _with_first_step(cal: Calibration, first: dict) -> Calibration:
    """The second step's figures, with what only the first measured: the ops a selective
    recompute keeps, and what a kept unit can rebuild."""
    units = tuple(replace(u, **first.get(j, {})) for j, u in enumerate(cal.units))
    units = tuple(replace(u, rebuildable_bytes=min(u.rebuildable_bytes, u.saved_bytes)) for u in units)
    return replace(cal, units=units)


def _at(argument: str) -> At:
    return At("BlockPlanner", argument)


def _decisions(names) -> frozenset[Decision]:
    names = DEFAULT_DECISIONS if names is None else names
    allowed = {d.value: d for d in Decision}
    # A string is iterable too: "keep" would read as the decisions k, e, e, p.
    if isinstance(names, str) or not isinstance(names, (list, tuple, set, frozenset)) or not names \
            or any(n not in allowed for n in names):
        raise _at("decisions").error("not a non-empty list of decisions", allowed=", ".join(allowed),
                                     received=names)
    return frozenset(allowed[n] for n in names)


def _decision(value, allowed: tuple[Decision, ...]) -> Decision:
    names = [d.value for d in allowed]
    if value in names:  # a name, or a Decision (a str)
        return Decision(value)
    raise _at("force").error("not a decision this unit can take", allowed=", ".join(names), received=value)


def _forced(decisions, units) -> tuple[Decision, ...]:
    """Forced decisions, one a unit, each one its kind allows."""
    if isinstance(decisions, str) or not isinstance(decisions, (list, tuple)) or len(decisions) != len(units):
        raise _at("force").error(f"not a list of {len(units)} decisions (one a unit and one for what is saved "
                                 "outside them), nor one decision for every block", received=decisions)
    forced = tuple(_decision(d, u.allowed()) for d, u in zip(decisions, units))
    for j, d in enumerate(forced):
        if d is Decision.CHAINED and (j == 0 or not forced[j - 1].leads_chain):
            raise _at("force").error(f"{units[j].name} chained after a unit that is not rerun (chained needs the unit "
                                     "before it recomputed or chained)", received=forced[j - 1].value if j else None)
    return forced


def _block_classes(names) -> list[str] | None:
    """The block classes asked for: the argument, else the installed policy's, else None (the search)."""
    if names is None:
        named = installation().policy.scheduler.block_classes if is_installed() else ()
        return list(named) or None
    if isinstance(names, str) or not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise _at("block_classes").error("not a list of class names", allowed='None, or a list like ["BertLayer"]',
                                         received=names)
    return list(names)


def default_margin(budget: int) -> int:
    """Room left under the budget for what a plan's predicted peak misses, by default: a thirty-
    second of the budget, at most 512 MiB. It can be small because a planned step that needs more
    overflows to host memory (default_overflow) instead of failing, and the margin then grows."""
    return min(MAX_MARGIN, budget // 32)


def default_overflow(budget: int) -> int:
    """Host memory a step may overflow to, by default: a quarter of the budget, at least 1 GiB."""
    return max(MIN_OVERFLOW, budget // 4)


def _overflow(value, budget: int) -> int:
    """The argument, else the installed policy's scheduler.overflow, else default_overflow."""
    if value is not None:
        return arguments.size(value, _at("overflow"))
    chosen = installation().policy.scheduler.overflow if is_installed() else None
    return default_overflow(budget) if chosen is None else chosen


def default_window(budget: int) -> int:
    """The copies back in flight ahead of backward, by default: 512 MiB, or a sixteenth of a budget
    under 8 GiB. On an H200, MobileNetV3-Large at batch 256 under 2.75 GiB ran its safe step out of
    memory with 512 MiB of copies ahead, and through with 128 MiB."""
    return min(MAX_WINDOW, budget // 16)


def _budget(value) -> int:
    if value is not None:
        return arguments.size(value, _at("budget"), minimum=1)
    if is_installed() and installation().budget:
        return installation().budget
    raise ValueError("BlockPlanner: no budget: pass budget='16GiB', or install um_alloc with a policy "
                     "that sets scheduler.budget (or install(budget=...))")


def _switch(value, key: str, default: bool = True) -> bool:
    """An on/off option: the argument, else the installed policy's scheduler.<key>, else `default`."""
    if value is not None:
        return arguments.flag(value, _at(key))
    return getattr(installation().policy.scheduler, key) if is_installed() else default


def _device_of(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _holds(larger: tuple, smaller: tuple) -> bool:
    """Whether input `larger` holds `smaller`: the same tensors, dtypes and ranks, no dimension smaller."""
    return larger != smaller and len(larger) == len(smaller) and all(
        dtype == other_dtype and len(shape) == len(other) and all(a >= b for a, b in zip(shape, other))
        for (shape, dtype), (other, other_dtype) in zip(larger, smaller))


def _elements(signature: tuple) -> int:
    return sum(math.prod(shape) for shape, _ in signature)


def _shape_text(signature: tuple) -> str:
    return ", ".join("x".join(map(str, shape)) for shape, _ in signature) or "(no tensors)"
