"""Plan: from what calibration measured to a decision per unit, minimising the predicted step time
with the predicted peak within the budget.

Pure data in, data out: no torch, no GPU, so every choice can be tested on synthetic figures.

The model. Calibration ran a step in the *safe* mode (every block recomputed with its inputs in
host memory, every gap's saved tensors in host memory) and measured, per unit, the bytes each
choice keeps on the GPU and the time it costs, and, per stretch of the step between two hook
points (a *segment*), the GPU's live peak and which units' activations were held across it.
Choosing a decision for unit j adds ``delta_j = retained_j(decision) - retained_j(safe) >= 0``
bytes to every segment that holds unit j, so

    predicted peak = max over segments s of (peak_s - relief_s + sum of delta_j over the units s holds)

In backward the safe step's peaks also hold its copies back ahead of use (up to the transfer
window): ``ahead_s``, the fewest such bytes on the GPU all through segment s. A plan that moves
less has fewer to copy back: at most the bytes it moves of the units s holds (M_s), so
``relief_s = max(ahead_s - M_s, 0)``. Without it, a plan that keeps what the safe step moved would
be charged twice in backward, for the bytes it keeps and for the safe step's window.

and the predicted step time is the safe step's time less its recomputation plus what the chosen
decisions cost. Moves cost no time as long as the link carries them behind compute: a unit may
move only bytes the link can copy out in the forward left after it and back in the backward
before it, and the plan as a whole no more than the link carries in the shorter of forward and
backward (``hide_fraction`` of it). Within that, a dynamic programme over units in execution
order (state: bytes added so far, bytes moved so far, whether the last unit reruns) finds the
cheapest plan.

A chain (chain.py: a unit that reruns from its inputs, and the chained units after it, each rerun
from the rerun of the one before) holds nothing between its units until backward reaches its last
one; from there it holds every unit's saved tensors at once (_rerun_together), which no prefix of
the programme sees: a plan whose chains pass the budget there has them cut to what fits, and is
made again (_chains_over).
"""
from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..sizes import format_size, size_text

__all__ = ["Decision", "UnitCost", "Segment", "Calibration", "Plan", "PlanInfeasible", "make_plan",
           "checkpointing_plan", "chains", "gaps_chained", "BLOCK_DECISIONS", "GAP_DECISIONS", "pool_repeats"]


class Decision(str, enum.Enum):
    """How a unit's activations survive until backward."""
    KEEP = "keep"                          # saved tensors stay on the GPU
    REBUILD = "rebuild"                    # the same, less what backward rebuilds cheaply (casts, GELU)
    MOVE = "move"                          # saved tensors go to host memory, back ahead of backward
    SELECTIVE = "selective"                # keep matmul/conv/attention outputs, recompute the rest
    SELECTIVE_MOVED = "selective_moved"    # the same, its inputs in host memory
    RECOMPUTE = "recompute"                # keep only its inputs, rerun its forward in backward
    RECOMPUTE_MOVED = "recompute_moved"    # the same, its inputs in host memory
    CHAINED = "chained"                    # hold nothing: rerun from the rerun of the unit before it

    @property
    def recomputes(self) -> bool:
        return self in (Decision.SELECTIVE, Decision.SELECTIVE_MOVED, Decision.RECOMPUTE,
                        Decision.RECOMPUTE_MOVED, Decision.CHAINED)

    @property
    def leads_chain(self) -> bool:
        """Whether the unit after one with this decision may be rerun from its rerun (chained)."""
        return self in CHAIN_LINKS

    @property
    def moves_inputs(self) -> bool:
        return self in (Decision.SELECTIVE_MOVED, Decision.RECOMPUTE_MOVED)


CHAIN_LINKS = frozenset({Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED, Decision.CHAINED})
BLOCK_DECISIONS = tuple(Decision)
# A gap's calls are the model's own, not a container's the plan could rerun; one whose rerun the
# probed step timed (a layer of a chain: chain.py) may rerun alone or in its chain.
GAP_DECISIONS = (Decision.KEEP, Decision.MOVE)
GAP_RERUNS = (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED, Decision.CHAINED)
SAFE = {"block": Decision.RECOMPUTE_MOVED, "gap": Decision.MOVE}
BUDGET_GRAIN = 256 << 20  # a budget to ask for, in the infeasible plan's message: one a user writes
# The forward a plan's copies out hide under: none. Measured plans that moved anything in forward
# were slower by about the link's time for those bytes (BERT-Large on an H100: 20 inputs of 64 MiB
# moved, one a block, cost 1-1.5 ms each beside a 2.5 ms forward), since compute that reuses the
# memory a copy reads waits for it. A plan moves only what it cannot fit otherwise.
COPY_OUT_LEAD_S = 0.0


@dataclass(frozen=True)
class UnitCost:
    """What calibration measured for one unit, summed over its calls in one step."""
    name: str
    kind: str                    # "block" or "gap"
    forward_s: float             # its forward
    recompute_s: float = 0.0     # rerunning its forward in backward (blocks)
    matmul_s: float = 0.0        # the part of recompute_s a selective recompute does not redo
    saved_bytes: int = 0         # what autograd saves for its backward
    selective_bytes: int = 0     # what a selective recompute keeps: matmul/conv/attention outputs
    input_bytes: int = 0         # its inputs, which a recompute keeps or moves
    hide_s: float = 0.0          # compute that can hide its copies: min(forward after it, backward before it)
    forward_cpu_s: float = 0.0   # the host's time for its forward (the GPU's may be less: it waits for work)
    recompute_cpu_s: float = 0.0  # the host's time for its recomputation
    backward_s: float = 0.0      # its own backward, without the recomputation
    backward_cpu_s: float = 0.0  # the host's time for it
    rebuildable_bytes: int = 0   # of saved_bytes, what backward can rebuild from the rest (casts, GELU, ...)
    rebuild_s: float = 0.0       # the GPU's time to rebuild it (its kernels, timed with the GPU busy)
    rebuild_cpu_s: float = 0.0   # the host's
    rebuild_forward_cpu_s: float = 0.0  # the host's time, in forward, of finding what to rebuild
    follows: bool = False        # each call's one argument was the output of the unit before it (chain.py)
    changes_input: bool = False  # its forward changed its argument in place (an in-place ReLU)
    alone_forward_s: float = 0.0   # its forward run by itself after the probed step (alone.py); 0: not run
    alone_backward_s: float = 0.0  # and its backward
    alone_forward_cpu_s: float = 0.0  # the host's time of issuing that forward; 0: not read

    @property
    def backward_reaches(self) -> bool:
        """False for a block the safe step's backward never reran: its parameters frozen and its
        input needing no gradient (the first layers of a partial fine-tune). Autograd saves
        nothing for it and nothing holds its input, so no decision keeps, moves or reruns anything."""
        return self.kind != "block" or self.recompute_s > 0

    def retained(self, decision: Decision) -> int:
        """Bytes this unit holds on the GPU from its forward to its backward."""
        if not self.backward_reaches:
            return 0
        held = self._held_input_bytes()
        return {
            Decision.KEEP: self.saved_bytes + held,
            Decision.REBUILD: self.saved_bytes - self.rebuildable_bytes + held,
            Decision.MOVE: 0,
            Decision.SELECTIVE: self.selective_bytes + self.input_bytes,
            Decision.SELECTIVE_MOVED: self.selective_bytes,
            Decision.RECOMPUTE: self.input_bytes,
            Decision.RECOMPUTE_MOVED: 0,
            Decision.CHAINED: 0,
        }[decision]

    def moved(self, decision: Decision) -> int:
        """Bytes this unit sends over the link each way."""
        if not self.backward_reaches:
            return 0
        if decision is Decision.MOVE:
            return self.saved_bytes + self._held_input_bytes()
        return self.input_bytes if decision.moves_inputs else 0

    def _held_input_bytes(self) -> int:
        """The inputs a kept or moved unit holds besides what it saves: a block's, which a plan
        counts as its own; a gap's, whose inputs are the unit before's output, none."""
        return self.input_bytes if self.kind == "block" else 0

    def cost_s(self, decision: Decision, rate: float = math.inf, hide_scale: float = 1.0,
               lead_s: float = math.inf) -> float:
        """Time this decision adds to a step in which everything stays on the GPU. Copies back cost
        what the link takes beyond the compute around the unit (hide_s, scaled to the planned step's
        pace). Copies out must also keep up with the forward close by (lead_s: this unit's and the
        next one's): the memory they read is needed again soon, and compute that reuses it waits for
        them. A move the link hides costs a microsecond a gigabyte (the copies through the stage),
        which also breaks a tie between keeping and moving in favour of keeping."""
        moved = self.moved(decision)
        link = moved / rate
        around = hide_scale * self.hide_s
        moving = moved * 1e-15 + max(link - around, 0.0) + max(link - min(lead_s, around), 0.0)
        gpu = min(self.forward_s, self.recompute_s)
        if decision in CHAIN_LINKS:
            return self.rerun_s(gpu) + moving
        if decision in (Decision.SELECTIVE, Decision.SELECTIVE_MOVED):
            # The GPU skips the kept ops; the host still issues every op (through a dispatch mode).
            return self.rerun_s(max(gpu - self.matmul_s, 0.2 * gpu)) + moving
        if decision is Decision.REBUILD and self.rebuildable_bytes > 0:
            return self.rebuild_added_s()
        return moving

    def rebuild_added_s(self) -> float:
        """What rebuilding adds to a step: the host's time of finding, at each save in forward,
        whether a recipe stands in for it, and the rebuilds' GPU time in backward.

        The first lands on the step only beyond what the host has to spare in the unit's kept
        forward: in a loop that waits for each step's result (a loss read with .item(), Hugging
        Face Trainer's check of the loss for nan, a progress bar) the host cannot run ahead of
        the step, but within it a forward the GPU takes longer over than the host leaves the
        host ahead. On one H200 (bench/results/host_pace), GPT-2-medium with every block rebuilt
        took the host 37 ms of forward against the GPU's 49, and the step 0.45 ms a block more
        than kept: the rebuilds' kernels alone. BERT-Large with every block rebuilt, on another
        H200 (bench/results/decision_costs), took the host 41.6 ms of forward, where the GPU's
        kept forward took 35.3, and its forward ran 10 ms longer than kept.

        The rebuilds' host time in backward hides: a kept unit's backward runs no Python but
        theirs, and leaves the host ahead of the GPU, unlike the safe step's recomputed backward
        that backward_cpu_s measures."""
        return self.added_to_forward_s(self.rebuild_forward_cpu_s) + self.rebuild_s

    def added_to_forward_s(self, cpu_s: float) -> float:
        """What `cpu_s` more of the host's time adds to this unit's kept forward: its time on the
        slower clock, less what that clock already spent, as the unit run by itself measured both
        (alone.py: the GPU's from when the host began issuing it). All of it where that run did
        not read the host's clock: the safe step's forward runs checkpoint's hooks and the
        recorder's, whose host time a kept forward does not have."""
        if self.alone_forward_cpu_s <= 0 or self.alone_forward_s <= 0:
            return cpu_s
        return _added_on_slower_clock(self.alone_forward_cpu_s, self.alone_forward_s, cpu_s, 0.0)

    def rerun_s(self, gpu_s: float) -> float:
        """What a recomputation adds to its unit's backward. The GPU runs the forward again, and the
        host issues it again, through Python; where the host already sets the backward's pace
        (little GPU time to spare over the host's), the host's part lands on the step: on an H100,
        a BERT-Large block recomputes in 1.2 ms of GPU time and 2.0 ms of host time, beside a
        backward of 2.9 and 2.8 ms, and 15 recomputed blocks made the step 31 ms longer."""
        if self.recompute_cpu_s <= 0:  # not measured (a calibration without the host's clock)
            return gpu_s
        return self.added_to_backward_s(gpu_s, self.recompute_cpu_s)

    def added_to_backward_s(self, gpu_s: float, cpu_s: float) -> float:
        """What work of `gpu_s` on the GPU and `cpu_s` on the host adds to this unit's backward:
        its time on the slower clock, less what that clock already spent."""
        return _added_on_slower_clock(self.backward_cpu_s, self.backward_s, cpu_s, gpu_s)

    def allowed(self) -> tuple[Decision, ...]:
        """A block's decisions, or a gap's: keep or move, and rerun where the probed step timed
        its rerun. Chained only where its calls follow the unit before it (which a plan must then
        rerun too)."""
        if self.kind == "block":
            found = BLOCK_DECISIONS
        elif self.recompute_s <= 0:
            found = GAP_DECISIONS
        else:  # one that changes its argument in place would change its rerun's: it may only be chained
            found = GAP_DECISIONS + (GAP_RERUNS if not self.changes_input else (Decision.CHAINED,))
        return found if self.follows else tuple(d for d in found if d is not Decision.CHAINED)

    def worth_planning(self) -> tuple[Decision, ...]:
        """The decisions a plan chooses from: a unit backward never reaches runs as it is."""
        return self.allowed() if self.backward_reaches else (Decision.KEEP,)


def _added_on_slower_clock(host_s: float, gpu_s: float, more_host_s: float, more_gpu_s: float) -> float:
    """What more work on each clock adds to a stretch the host and the GPU spent `host_s` and
    `gpu_s` over: its time on the slower clock, less what that clock already spent."""
    return max(host_s + more_host_s, gpu_s + more_gpu_s) - max(host_s, gpu_s)


@dataclass(frozen=True)
class Segment:
    """A stretch of the calibration step between two hook points."""
    label: str
    peak_bytes: int              # GPU-live peak within it
    held: tuple[int, ...] = ()   # indices of the units whose activations were held across it
    seconds: float = 0.0         # on the GPU's clock
    cpu_seconds: float = 0.0     # on the host's
    ahead_bytes: int = 0         # of peak_bytes, copies back ahead of use, at least, all through it
    in_backward: bool = False    # it lies after backward began

    def relief(self, moved_held: float) -> float:
        """What a plan that moves `moved_held` bytes of the units this segment holds has fewer on
        the GPU here than the safe step: the copies back it cannot have."""
        return max(self.ahead_bytes - moved_held, 0)


@dataclass(frozen=True)
class Calibration:
    """Everything the planner knows about one input shape, from a measured step."""
    units: tuple[UnitCost, ...]
    segments: tuple[Segment, ...]
    step_s: float                # the safe step, from its forward to the next one's
    link_bytes_per_s: float      # pinned host <-> device copies, the slower direction
    fragmentation_bytes: int = 0  # what the allocator held beyond live bytes at the peak
    reserved_bytes: int = 0      # device memory outside the budget's view (copy stages)
    start_live_bytes: int = 0    # live as the measured step began: parameters, optimizer state, ...
    copy_stalls_s: float = 0.0   # the GPU's time waiting for copies back in the measured step (0: none timed)

    def with_more_in_use(self, extra_bytes: int) -> "Calibration":
        """This calibration where `extra_bytes` more are in use all through the step: memory that
        outlasts steps and grew after the measured one (the optimizer's state, made at its first
        step; gradients accumulated over micro-batches)."""
        segments = tuple(replace(s, peak_bytes=s.peak_bytes + extra_bytes) for s in self.segments)
        return replace(self, segments=segments, start_live_bytes=self.start_live_bytes + extra_bytes)

    def needing(self, pool_bytes: int) -> "Calibration":
        """This calibration where its step was seen to need `pool_bytes` of the pool at once: a
        step the budget overflowed needed all of the budget backed and what went to host memory
        besides, which live bytes alone understate where the budget's backed chunks were free
        but scattered. What the allocator held beyond live bytes is at least the difference."""
        return replace(self, fragmentation_bytes=max(self.fragmentation_bytes, pool_bytes - self.smallest_peak()))

    def base_step_s(self) -> float:
        """The step with everything kept. In the safe step each block ran its forward twice: once
        with the safe mode's copies and checkpoint's bookkeeping around it (forward_s), once in
        backward (recompute_s). Kept, it runs once, as fast as its kept forward (kept_forward_s).
        The safe step's own copies out are taken as hidden under the forward close by (leads()).
        What else a unit spent waiting for its copies is taken off as the link's time beyond
        the compute around it; a unit timed by itself after the probed step (alone.py) gives
        up what its forward and backward took in the safe step beyond that, where that is more.
        What the GPU stood waiting for copies back (copy_stalls_s) is recorded beside it, not
        taken off: on one H200, Swin's safe step waited 1.7 ms of its 121 (the base, 74 ms, was
        1.17 times stock's step), so the waits are not what makes the base longer than stock's."""
        kept = self.kept_forward_s()
        rerun = sum(u.forward_s + u.recompute_s - k for u, k in zip(self.units, kept) if u.kind == "block")
        beyond = sum(max(self._waited_s(u, lead), self._beyond_alone_s(u, k))
                     for u, k, lead in zip(self.units, kept, self.leads(1.0)))
        return max(self.step_s - rerun - beyond, 0.0)

    def _waited_s(self, unit: UnitCost, lead_s: float) -> float:
        """What the unit's copies in the safe mode held the step up, by the link's rate."""
        safe = SAFE[unit.kind]
        return max(unit.cost_s(safe, self.link_bytes_per_s, lead_s=lead_s) - unit.cost_s(safe),
                   self._stalled_on_copies_s(unit))

    @staticmethod
    def _beyond_alone_s(unit: UnitCost, kept_forward_s: float) -> float:
        """What a unit's kept forward and its backward took in the safe step beyond the same
        unit run by itself: the safe mode's waits and its bookkeeping. 0 where it was not run."""
        alone = unit.alone_forward_s + unit.alone_backward_s
        if alone <= 0:
            return 0.0
        return max(kept_forward_s + unit.backward_s - alone, 0.0)

    def _stalled_on_copies_s(self, unit: UnitCost) -> float:
        """What a gap's forward in the safe step spent on its copies out: the GPU's time beyond the
        host's, up to the link's for the bytes it moved. The host issued the forward in its own
        time; the GPU, done later by up to a copy's length, waited for the copy or ran beside it
        (kernels beside a copy of managed memory run slower). Not for a host-bound forward, whose
        copies hid under the host's time. A kept gap has no copies."""
        if unit.kind != "gap" or unit.forward_cpu_s <= 0 or self.link_bytes_per_s <= 0:
            return 0.0
        link = unit.moved(SAFE["gap"]) / self.link_bytes_per_s
        return min(link, max(unit.forward_s - unit.forward_cpu_s, 0.0))

    def kept_forward_s(self) -> list[float]:
        """Per unit, its forward in a step that keeps it. A block the safe step recomputed ran its
        forward twice, and the faster run is the kept one. A block backward never reached ran
        once, inside the safe mode's wrapper (checkpoint's bookkeeping, a copy of its input) that a
        kept block runs without: its forward is scaled as the recomputed blocks' kept forwards are
        to their wrapped ones. A gap's is the forward it ran."""
        reached = [u for u in self.units if u.kind == "block" and u.backward_reaches]
        wrapped = sum(u.forward_s for u in reached)
        unwrapped_share = sum(min(u.forward_s, u.recompute_s) for u in reached) / wrapped if wrapped > 0 else 1.0
        return [u.forward_s if u.kind != "block" else
                min(u.forward_s, u.recompute_s) if u.backward_reaches else unwrapped_share * u.forward_s
                for u in self.units]

    def hide_scale(self) -> float:
        """How much shorter a kept forward is than the safe step's: compute the copies of a plan
        hide under is this share of what calibration saw around them."""
        safe = sum(u.forward_s for u in self.units)
        return sum(self.kept_forward_s()) / safe if safe > 0 else 1.0

    def leads(self, scale: float | None = None) -> list[float]:
        """Per unit, the kept forward of it and of the next unit: what its copies out hide under.
        A block's is kept_forward_s's; a gap's, its forward at the planned step's pace (`scale`,
        default hide_scale())."""
        scale = self.hide_scale() if scale is None else scale
        kept = [k if u.kind == "block" else scale * u.forward_s for u, k in zip(self.units, self.kept_forward_s())]
        return [a + b for a, b in zip(kept, kept[1:] + [0.0])]

    def smallest_peak(self) -> int:
        return max((s.peak_bytes for s in self.segments), default=0)

    def smallest_budget(self, margin_bytes: int) -> int:
        """The least budget any plan fits in: the safe mode's peak and what comes with it."""
        return self.smallest_peak() + self.fragmentation_bytes + self.reserved_bytes + margin_bytes


class PlanInfeasible(ValueError):
    """No plan fits the budget; `smallest_bytes` is the least budget one would fit."""

    def __init__(self, message: str, smallest_bytes: int):
        super().__init__(message)
        self.smallest_bytes = smallest_bytes


@dataclass(frozen=True)
class Plan:
    """A decision per unit, and what the model predicts for it."""
    decisions: tuple[Decision, ...]
    units: tuple[UnitCost, ...] = field(repr=False)
    budget_bytes: int
    limit_bytes: int             # the live bytes the plan may reach: budget less margins
    predicted_step_s: float
    predicted_peak_bytes: int
    moved_bytes: int
    costs: tuple[float, ...] = ()  # seconds each decision adds: recomputation and waits for the link
    made: str = "given decisions"  # how it was chosen: what the trials' lines and to_dict() call it

    def rows(self) -> list[dict]:
        costs = self.costs or tuple(u.cost_s(d) for u, d in zip(self.units, self.decisions))
        return [{"unit": u.name, "kind": u.kind, "decision": d.value, "retained_bytes": u.retained(d),
                 "moved_bytes": u.moved(d), "forward_ms": 1e3 * u.forward_s, "cost_ms": 1e3 * cost}
                for u, d, cost in zip(self.units, self.decisions, costs)]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for d in self.decisions:
            out[d.value] = out.get(d.value, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"made": self.made, "budget_bytes": self.budget_bytes, "limit_bytes": self.limit_bytes,
                "predicted_step_s": self.predicted_step_s, "predicted_peak_bytes": self.predicted_peak_bytes,
                "moved_bytes": self.moved_bytes, "decisions": self.counts(), "units": self.rows()}

    def _peak_text(self) -> str:
        """The predicted peak against the limit the plan was made for (the budget less the margin and
        what the allocator held beyond live bytes); a plan run past the budget passes it."""
        peak, limit = format_size(self.predicted_peak_bytes), format_size(self.limit_bytes)
        budget = format_size(self.budget_bytes)
        if self.predicted_peak_bytes <= self.limit_bytes:
            return f"{peak} of {limit} (budget {budget})"
        over = format_size(self.predicted_peak_bytes - self.limit_bytes)
        return f"{peak}, {over} past its limit of {limit} (budget {budget})"

    def table(self) -> str:
        """One row per unit: decision, bytes kept and moved, predicted ms; then the totals."""
        head = f"{'unit':<34}{'decision':<17}{'kept':>11}{'moved':>11}{'fwd ms':>8}{'+ms':>7}"
        lines = [head, "-" * len(head)]
        for r in self.rows():
            lines.append(f"{r['unit'][-33:]:<34}{r['decision']:<17}{format_size(r['retained_bytes']):>11}"
                         f"{format_size(r['moved_bytes']):>11}{r['forward_ms']:>8.2f}{r['cost_ms']:>7.2f}")
        lines.append("-" * len(head))
        lines.append(f"predicted step {1e3 * self.predicted_step_s:.1f} ms, peak {self._peak_text()}, moved "
                     f"{format_size(self.moved_bytes)} each way; "
                     + ", ".join(f"{n} {k}" for k, n in self.counts().items()))
        return "\n".join(lines)


def make_plan(cal: Calibration, budget_bytes: int, *, margin_bytes: int = 512 << 20,
              allowed: frozenset[Decision] | None = None, hide_fraction: float = 0.7,
              unit_bytes: int = 8 << 20, link_unit_bytes: int = 32 << 20) -> Plan:
    """The fastest plan whose predicted peak stays within the budget.

    `allowed` narrows the decisions (ablations); `hide_fraction` is the share of the link's time
    under compute that moves may use. Raises PlanInfeasible (with the smallest budget that would
    fit) when even the safe mode does not fit.
    """
    limit = budget_bytes - margin_bytes - cal.fragmentation_bytes - cal.reserved_bytes
    floor = cal.smallest_peak()
    if floor > limit:
        smallest = cal.smallest_budget(margin_bytes)
        raise PlanInfeasible(
            f"budget {format_size(budget_bytes)} is too small for this model and batch: even with every "
            f"block recomputed and every movable activation in host memory the step peaks at "
            f"{format_size(floor)} on the GPU, and {format_size(smallest - floor)} more is needed beside it "
            f"({format_size(margin_bytes)} of margin, {format_size(cal.fragmentation_bytes)} the allocator held "
            f"beyond live bytes as it measured, {format_size(cal.reserved_bytes)} of copy stages); the smallest "
            f"budget that fits is {format_size(smallest)}: "
            f"ask for {size_text(_round_up(smallest, BUDGET_GRAIN))} or more", smallest)
    scale = cal.hide_scale()
    link_room = _link_room(cal, hide_fraction)
    lowest = min((s.peak_bytes - s.ahead_bytes for s in cal.segments), default=0)  # where a prefix has the most room
    grid = _Grid(limit - lowest, link_room, cal.link_bytes_per_s, unit_bytes, link_unit_bytes)
    unchained: set[int] = set()  # units a chain's rerun in backward has no room for
    while True:
        options = [_options(u, allowed, hide_fraction, cal.link_bytes_per_s, scale, COPY_OUT_LEAD_S,
                            chained=j not in unchained) for j, u in enumerate(cal.units)]
        choice = _cheapest(cal, options, limit, grid)
        decisions = tuple(options[j][i][0] for j, i in enumerate(choice))
        plan = _evaluate(cal, decisions, budget_bytes, limit, link_room)
        over = _chains_over(cal, decisions, limit)
        if not over:
            return replace(plan, made="the model's fastest")
        unchained |= over  # each chain too large cut to what fits of it, and the plan made again


def evaluate(cal: Calibration, decisions: tuple[Decision, ...], budget_bytes: int, *,
             margin_bytes: int = 512 << 20) -> Plan:
    """The prediction for given decisions (a forced ablation, or a plan to check)."""
    limit = budget_bytes - margin_bytes - cal.fragmentation_bytes - cal.reserved_bytes
    return _evaluate(cal, tuple(decisions), budget_bytes, limit, _link_room(cal, 0.7))


def checkpointing_plan(cal: Calibration, budget_bytes: int, *, margin_bytes: int = 512 << 20) -> Plan | None:
    """What a user of activation checkpointing would run: the first k blocks recomputed, k the
    fewest whose predicted peak fits, everything else kept; None where even every block
    recomputed does not fit (the budget needs moves). Recomputing a block instead of keeping it
    adds no bytes anywhere, so the peak never rises with k, and k is found by bisection."""
    reached = [j for j, u in enumerate(cal.units) if u.kind == "block" and u.backward_reaches]

    def first_recomputed(k: int) -> Plan:
        recomputed = set(reached[:k])
        decisions = tuple(Decision.RECOMPUTE if j in recomputed else Decision.KEEP for j in range(len(cal.units)))
        return replace(evaluate(cal, decisions, budget_bytes, margin_bytes=margin_bytes),
                       made=f"checkpointing's: the first {k} blocks recomputed")

    every = first_recomputed(len(reached))
    if every.predicted_peak_bytes > every.limit_bytes:
        return None
    low, high = 0, len(reached)
    while low < high:  # the fewest k that fits lies in [low, high]
        middle = (low + high) // 2
        plan = first_recomputed(middle)
        if plan.predicted_peak_bytes <= plan.limit_bytes:
            high = middle
        else:
            low = middle + 1
    return first_recomputed(low)


def gaps_chained(cal: Calibration, decisions: tuple[Decision, ...]) -> tuple[Decision, ...]:
    """`decisions` with each run of gaps that may rerun one from another (their calls follow one
    another, and the probed step timed their reruns) rerun as a chain from the first one's inputs,
    kept: a convolutional network's stem, which a plan that moves it sends over the link whole."""
    out, units, j = list(decisions), cal.units, 0
    while j < len(units) - 1:
        k = j + 1
        while k < len(units) and units[k].kind == "gap" and Decision.CHAINED in units[k].allowed():
            k += 1
        if units[j].kind == "gap" and Decision.RECOMPUTE in units[j].allowed() and k > j + 1:
            out[j:k] = [Decision.RECOMPUTE] + [Decision.CHAINED] * (k - j - 1)
        j = k
    return tuple(out)


def _evaluate(cal: Calibration, decisions: tuple[Decision, ...], budget_bytes: int, limit: int,
              link_room: int) -> Plan:
    reruns = chains(decisions)
    peak = max((held + _rerun_together(cal, s, reruns)
                for s, held in zip(cal.segments, _segment_bytes(cal, decisions))), default=0)
    moved = sum(u.moved(d) for u, d in zip(cal.units, decisions))
    rate, scale = cal.link_bytes_per_s, cal.hide_scale()
    costs = tuple(u.cost_s(d, rate, scale, COPY_OUT_LEAD_S) for u, d in zip(cal.units, decisions))
    step = cal.base_step_s() + sum(costs) + _stall_s(moved, link_room, cal.link_bytes_per_s)
    return Plan(decisions, cal.units, budget_bytes, limit, step, peak, moved, costs)


def _segment_bytes(cal: Calibration, decisions: tuple[Decision, ...]) -> list[int]:
    """Per segment, what it holds under `decisions`, chains' reruns aside: its peak in the safe
    step, less the copies back a plan that moves less does not have, plus what the decisions
    keep over the safe mode's of the units it holds."""
    safe = [u.retained(SAFE[u.kind]) for u in cal.units]
    delta = [u.retained(d) - s for u, d, s in zip(cal.units, decisions, safe)]
    moves = [u.moved(d) for u, d in zip(cal.units, decisions)]
    return [s.peak_bytes - s.relief(sum(moves[j] for j in s.held)) + sum(delta[j] for j in s.held)
            for s in cal.segments]


def chains(decisions: tuple[Decision, ...]) -> list[tuple[int, int]]:
    """(first, last) of each run of two or more units rerun one from another: a unit that reruns
    from its inputs, and the chained units after it."""
    found, first = [], None
    for j, d in enumerate(decisions):
        if d is Decision.CHAINED and first is not None:
            continue
        if first is not None and j - 1 > first:
            found.append((first, j - 1))
        first = j if d in (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED) else None
    if first is not None and len(decisions) - 1 > first:
        found.append((first, len(decisions) - 1))
    return found


def _rerun_together(cal: Calibration, segment: Segment, reruns: list[tuple[int, int]]) -> int:
    """What a segment holds of chains rerun at once. A chain reruns whole when backward reaches its
    last unit, and each unit's saved tensors stay until its own backward: from there until
    backward reaches the first, a segment holds those of the units whose backward is still to
    come, besides what the safe step held (the last unit's own, recomputed or copied back). While
    the rerun runs (every unit before the last still held), the last unit's output is made beside
    them (each earlier unit's is what the next one saves)."""
    if not segment.in_backward:
        return 0
    held = set(segment.held)
    total = 0
    for first, last in reruns:
        if last in held or first not in held:
            continue
        total += sum(cal.units[j].saved_bytes for j in range(first, last) if j in held)
        if all(j in held for j in range(first, last)):
            total += _output_bytes(cal, first, last)
    return total


def _output_bytes(cal: Calibration, first: int, last: int) -> int:
    """The output of a chain's last unit: the input of the unit after it, where that one follows
    it; else, at most, the largest output the chain's units pass on."""
    after = last + 1
    if after < len(cal.units) and cal.units[after].follows and cal.units[after].input_bytes > 0:
        return cal.units[after].input_bytes
    return max(cal.units[j].input_bytes for j in range(first + 1, last + 1))


def _chains_over(cal: Calibration, decisions: tuple[Decision, ...], limit: int) -> set[int]:
    """The chained units to leave out so that each chain's rerun fits under `limit` in its
    backward: the tail of each chain past the longest part of it that fits, with the others."""
    reruns = chains(decisions)
    if not reruns:
        return set()
    held = _segment_bytes(cal, decisions)

    def fits(chosen: list[tuple[int, int]]) -> bool:
        return all(h + _rerun_together(cal, s, chosen) <= limit for s, h in zip(cal.segments, held))

    if fits(reruns):
        return set()
    cut: set[int] = set()
    for k, (first, last) in enumerate(reruns):
        others = reruns[:k] + reruns[k + 1:]
        end = last
        while end > first and not fits(others + [(first, end)]):
            end -= 1
        cut |= set(range(end + 1, last + 1))
    return cut


def _round_up(n: int, grain: int) -> int:
    return -(-n // grain) * grain


def _stall_s(moved: int, link_room: int, rate: float) -> float:
    """Bytes beyond what hides under compute wait for the link, out in forward and back in backward."""
    return 2 * max(moved - link_room, 0) / rate if rate > 0 else 0.0


def _options(unit: UnitCost, allowed, hide_fraction: float, rate: float, scale: float, lead_s: float,
             chained: bool = True) -> list[tuple[Decision, int, int, float]]:
    """(decision, bytes added over the safe mode, bytes moved, seconds added) for each choice that
    is allowed and whose moves the link can hide behind the compute around this unit. The safe
    choice is always there: it is what calibration ran, so it keeps the budget whatever it costs.
    `chained`: whether the chained rerun is among them."""
    safe_decision = SAFE[unit.kind]
    safe = unit.retained(safe_decision)
    out = []
    for d in unit.worth_planning():
        if allowed is not None and d not in allowed and d is not safe_decision:
            continue
        if d is Decision.CHAINED and not chained:
            continue
        if d is not safe_decision and unit.moved(d) > hide_fraction * rate * scale * unit.hide_s:
            continue
        out.append((d, unit.retained(d) - safe, unit.moved(d), unit.cost_s(d, rate, scale, lead_s)))
    return out


def _link_room(cal: Calibration, hide_fraction: float) -> int:
    """Bytes the link may carry each way in a step: both directions must hide under compute, and
    the planned forward is the kept one, shorter than the safe step's (hide_scale)."""
    forward = sum(u.forward_s for u in cal.units) * cal.hide_scale()
    backward = max(cal.base_step_s() - forward, 0.0)
    hidden_s = hide_fraction * min(forward, backward)
    if hidden_s <= 0:  # nothing hides copies: none, also over an unmeasured (infinite) link
        return 0
    return int(min(hidden_s * cal.link_bytes_per_s, 2.0**62))


def _caps(cal: Calibration, limit: int, n: int, moved_cols: np.ndarray) -> np.ndarray:
    """cap[k, c]: the most bytes the first k units may add when they move at most moved_cols[c]
    bytes, from the segments whose held units all come before k (a segment holding any of units
    0..k-1 is bounded by the prefix through its last). The prefix's moves bound those of the
    units a segment holds from above, so its relief from below."""
    caps = np.full((n + 1, len(moved_cols)), np.inf)
    for s in cal.segments:
        k = max(s.held) + 1 if s.held else 0
        relief = np.maximum(s.ahead_bytes - moved_cols, 0)
        caps[k] = np.minimum(caps[k], limit - s.peak_bytes + relief)
    return caps


@dataclass(frozen=True)
class _Grid:
    """The programme's state space: bytes added (rows) and bytes moved (columns), in whole units
    rounded up, so that a plan found on it keeps the budget it was found for."""
    room: int                   # the most bytes any prefix of the units may add over the safe mode
    link_room: int              # bytes the link hides each way
    rate: float                 # link bytes per second
    unit: int
    link_unit: int

    def rows(self, options) -> int:
        most = sum(max(-(-o[1] // self.unit) for o in opts) for opts in options)
        return min(self.room // self.unit, most) + 1

    def cols(self, options) -> int:
        safe_moves = sum(-(-max(o[2] for o in opts) // self.link_unit) for opts in options)
        return min(3 * self.link_room // self.link_unit, safe_moves) + 1

    def stall_s(self, cols: int) -> np.ndarray:
        moved = np.arange(cols) * self.link_unit
        return np.array([_stall_s(int(m), self.link_room, self.rate) for m in moved])


def _cheapest(cal: Calibration, options, limit: int, grid: _Grid) -> list[int]:
    """The dynamic programme: the option index per unit with the least total cost.

    A prefix's added bytes are bounded by every segment whose held units all lie in that prefix
    (conservative for a segment that holds fewer of them). Moves beyond what hides cost the wait
    for the link, added at the end from the bytes moved. A chained rerun needs the unit before
    it rerun too: the state also says whether the last unit's decision reruns (CHAIN_LINKS).
    """
    rows, cols = grid.rows(options), grid.cols(options)
    caps = _caps(cal, limit, len(options), np.arange(cols, dtype=np.float64) * grid.link_unit)
    row_index = np.arange(rows)[:, None]
    states = 2 if any(o[0] is Decision.CHAINED for opts in options for o in opts) else 1
    cost = np.full((states, rows, cols), np.inf)
    cost[0, 0, 0] = 0.0 if caps[0, 0] >= 0 else np.inf
    picks = []
    for k, opts in enumerate(options):
        best = np.full((states, rows, cols), np.inf)
        pick = np.full((states, rows, cols), -1, dtype=np.int16)
        came = np.zeros((states, rows, cols), dtype=np.int8)  # the state it came from
        for i, (decision, added, moved, seconds) in enumerate(opts):
            a, m = -(-added // grid.unit), -(-moved // grid.link_unit)
            if a >= rows or m >= cols:
                continue
            to = int(decision.leads_chain) if states == 2 else 0
            for since in ((1,) if decision is Decision.CHAINED else range(states)):
                shifted = np.full((rows, cols), np.inf)
                shifted[a:, m:] = cost[since, :rows - a, :cols - m] + seconds
                better = shifted < best[to]
                best[to][better], pick[to][better], came[to][better] = shifted[better], i, since
        best[:, row_index > np.floor(caps[k + 1] / grid.unit)[None, :]] = np.inf
        cost = best
        picks.append((pick, came))
    total = cost + grid.stall_s(cols)[None, None, :]
    if not np.isfinite(total).any():
        raise PlanInfeasible("no plan fits: at some point of the step the measured peak leaves no room for "
                             "what that point holds", cal.smallest_budget(0))
    f, r, c = np.unravel_index(np.argmin(total), total.shape)
    return _backtrack(options, picks, int(f), int(r), int(c), grid.unit, grid.link_unit)


def _backtrack(options, picks, f, r, c, unit_bytes, link_unit_bytes) -> list[int]:
    chosen = []
    for k in range(len(options) - 1, -1, -1):
        pick, came = picks[k]
        i = int(pick[f, r, c])
        chosen.append(i)
        _, added, moved, _ = options[k][i]
        f = int(came[f, r, c])
        r -= -(-added // unit_bytes)
        c -= -(-moved // link_unit_bytes)
    return chosen[::-1]


# What a unit's computation takes, as against where it sits in the step (hide_s) or what it holds.
COMPUTE_FIGURES = ("forward_s", "recompute_s", "matmul_s", "forward_cpu_s", "recompute_cpu_s", "backward_s",
                   "backward_cpu_s", "rebuild_s", "rebuild_cpu_s", "rebuild_forward_cpu_s", "alone_forward_s",
                   "alone_backward_s", "alone_forward_cpu_s")


def pool_repeats(cal: Calibration, groups: list) -> Calibration:
    """Units of one group (`groups`: a label per unit, None for none) that save and take the same
    bytes run the same computation: where there are at least three of them, each gets the median
    of their times. One step measures each unit once, and a hiccup of the host inside one of them
    (the cycle collector, another process) would otherwise decide that unit's plan: on an H100 one
    BERT-Large block's recomputation once took 10 ms of host time against 1.2 ms for its 23 twins."""
    members: dict[tuple, list[int]] = {}
    for j, (unit, group) in enumerate(zip(cal.units, groups)):
        if group is not None:
            members.setdefault((group, unit.kind, unit.saved_bytes, unit.input_bytes), []).append(j)
    units = list(cal.units)
    for indices in members.values():
        if len(indices) < 3:
            continue
        medians = {name: float(np.median([getattr(cal.units[j], name) for j in indices])) for name in COMPUTE_FIGURES}
        for j in indices:
            units[j] = replace(units[j], **medians)
    return replace(cal, units=tuple(units))


def calibration_to_dict(cal: Calibration) -> dict:
    return asdict(cal)


def calibration_from_dict(data: dict) -> Calibration:
    return Calibration(units=tuple(UnitCost(**u) for u in data["units"]),
                       segments=tuple(Segment(**{**s, "held": tuple(s["held"])}) for s in data["segments"]),
                       **{k: v for k, v in data.items() if k not in ("units", "segments")})
