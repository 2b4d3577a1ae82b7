"""Trying the runners-up: a few steps of each plan the cost model cannot tell apart, the fastest kept.

The cost model prices a decision from one measured step. Two of its prices depend on the host more
than calibration can see: a rebuild's Python work in forward and backward, and copies whose hiding
depends on how far the host runs ahead of the GPU. On one H200 host, in two rounds each
(bench/results/zoo_planner_trials/forced_decisions), a Llama-style block rebuilt took 1.25 and
1.37 ms more than kept where the calibrations of those runs predicted 0.34 and 2.3 ms, and a
ViT-B/16 block 0.53 and 0.54 ms where they predicted 1.2 and 0.6 ms.

So where the plan uses either, the best plan without it is a candidate too, if predicted within
ALTERNATIVE_WITHIN of the plan (the safe mode's own decisions stay allowed: "without moves" is
the plan with the fewest moves that fits). The candidates run STEPS_PER_VISIT steps at a time, in
order and then in reverse (A B C C B A), and the one with the least median step time stays. The
reverse round is there because the host drifts: on one H200 a BERT-Large trial run A then B
measured A at 130.7 ms a step and B at 143.2, and A then ran at 145.3 (bench/results/alone_base).
Visited in mirrored order, each candidate's steps sit on average at the trial's middle, so a drift
steady over the trial moves each one's measure alike. Every candidate is predicted to fit the
budget: a trial costs time, never memory.

A step's time is measured from its start to the next one's (CUDA events on the GPU, read once the
trial is over, so the trial never waits for the GPU; the host's clock on the CPU). A candidate's
first step after another candidate's is left out: it meets the allocator's state the other plan
left. So is an interval in which a step of another input shape ran (its own plan, not this one);
a candidate left with no interval is not chosen, and where none has one, the plan stays.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import torch

from .planning import Decision, Plan

__all__ = ["PlanTrials", "UNCERTAIN", "ALTERNATIVE_WITHIN", "STEPS_PER_VISIT", "STEPS_PER_CANDIDATE",
           "MOST_CANDIDATES"]

# The decisions whose cost the model is least sure of, each family tried away as a whole, by name.
UNCERTAIN = {
    "rebuilds": frozenset({Decision.REBUILD}),
    "moves": frozenset({Decision.MOVE, Decision.RECOMPUTE_MOVED, Decision.SELECTIVE_MOVED}),
}
ALTERNATIVE_WITHIN = 1.25    # a runner-up predicted this much slower than the plan, at most, is tried
STEPS_PER_VISIT = 3          # steps a candidate runs at a time; the first after another's is left out
STEPS_PER_CANDIDATE = 2 * STEPS_PER_VISIT  # two visits each: in order, then in reverse
MOST_CANDIDATES = 1 + len(UNCERTAIN) + 1  # the plan, the best without each uncertain family, checkpointing's


@dataclass
class Tried:
    plan: Plan
    measured_step_s: float | None = None   # median of its measured intervals; None: not run yet


class _Clock:
    """Marks of step starts: CUDA events on a GPU (read once the trial is over), else the host's."""

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._device = device

    def mark(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self._device))
        return event

    def seconds(self, start, end) -> float:
        if not self._cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def visiting_order(candidates: int, steps: int) -> list[int]:
    """Which candidate each trial step runs: `steps` at a time, in order, then in reverse."""
    forward = list(range(candidates))
    return [c for c in forward + forward[::-1] for _ in range(steps)]


class PlanTrials:
    """Runs the candidate plans `steps` steps at a time, in order and then in reverse, then keeps
    the fastest measured. Call ``begin_step()`` at each step's start; it returns the plan that
    step runs."""

    def __init__(self, candidates: list[Plan], device: torch.device, steps: int = STEPS_PER_VISIT,
                 clock=None):
        if len(candidates) < 2:
            raise ValueError(f"PlanTrials: {len(candidates)} candidate(s); a trial needs at least 2")
        if steps < 2:
            raise ValueError(f"PlanTrials: steps={steps}; at least 2 (the first of each visit is left out)")
        self.tried = [Tried(plan) for plan in candidates]
        self.steps = steps
        self._order = visiting_order(len(candidates), steps)
        self._clock = clock or _Clock(device)
        self._marks: list = []       # (mark, follows) at each trial step's start, and the first after
        self.chosen: Plan | None = None

    @property
    def total_steps(self) -> int:
        return len(self._order)

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def begin_step(self, follows: bool = True) -> Plan:
        """`follows`: the step before this one was of the same input (its interval counts)."""
        if self.done:
            return self.chosen
        self._marks.append((self._clock.mark(), follows))
        if len(self._marks) > len(self._order):  # the last trial step has ended
            self._choose()
            return self.chosen
        return self.tried[self._order[len(self._marks) - 1]].plan

    def _measured_intervals(self) -> dict[int, list[float]]:
        """Each candidate's step times: step k's interval runs from its mark to the next, and
        counts where step k-1 ran the same candidate and no other input's step came between."""
        intervals: dict[int, list[float]] = {}
        for k in range(1, len(self._order)):
            (start, _), (end, follows) = self._marks[k], self._marks[k + 1]
            if follows and self._order[k - 1] == self._order[k]:
                intervals.setdefault(self._order[k], []).append(self._clock.seconds(start, end))
        return intervals

    def _choose(self) -> None:
        for j, seconds in self._measured_intervals().items():
            self.tried[j].measured_step_s = statistics.median(seconds)
        measured = [t for t in self.tried if t.measured_step_s is not None]
        self.chosen = min(measured, key=lambda t: t.measured_step_s).plan if measured else self.tried[0].plan

    def summary(self) -> str:
        """One line: each candidate's decisions, predicted and measured step, and which stayed."""
        parts = []
        for t in self.tried:
            counts = ", ".join(f"{n} {k}" for k, n in t.plan.counts().items())
            measured = "not measured" if t.measured_step_s is None else f"measured {1e3 * t.measured_step_s:.1f} ms"
            kept = " (kept)" if t.plan is self.chosen else ""
            parts.append(f"[{t.plan.made}, {counts}: predicted {1e3 * t.plan.predicted_step_s:.1f} ms, "
                         f"{measured}{kept}]")
        return "tried " + " ".join(parts)

    def to_list(self) -> list[dict]:
        return [{"made": t.plan.made, "decisions": t.plan.counts(), "predicted_step_s": t.plan.predicted_step_s,
                 "measured_step_s": t.measured_step_s, "kept": t.plan is self.chosen} for t in self.tried]


def runners_up(best: Plan, make, allowed: frozenset[Decision], checkpointing: Plan | None = None) -> list[Plan]:
    """The candidates beside `best`: for each UNCERTAIN family `best` uses, the plan `make(allowed)`
    returns without that family; and `checkpointing`, the first blocks recomputed and the rest
    kept (planning.checkpointing_plan), where keeping and recomputing are allowed. Each is skipped
    where none fits, where it is a plan already listed, or where it is predicted more than
    ALTERNATIVE_WITHIN slower than `best`. A runner-up that is checkpointing's plan as well (the
    best without rebuilds often is) is named both ways.

    Checkpointing's plan is there because what a recomputation adds depends on whether the host or
    the GPU sets the backward's pace, which the safe step, paced by its own reruns, does not show.
    On an H200, EfficientNetV2-S's safe step took its last stages at the host's pace and its first
    at the GPU's; PyTorch recomputing its first 22 of 40 blocks ran 1.06x stock's step, while the
    plan the model chose (25 blocks recomputed from every stage, each costed at its measured rerun)
    ran 1.39x (bench/results/zoo_fraction_0.5_vision)."""
    out: list[Plan] = [best]

    def offer(alternative: Plan | None) -> None:
        if alternative is None:
            return
        same = next((j for j, p in enumerate(out) if p.decisions == alternative.decisions), None)
        if same is not None:
            if same > 0 and alternative is checkpointing:  # the trial's line says it is checkpointing's too
                out[same] = replace(out[same], made=f"{out[same].made}, which is {checkpointing.made}")
            return
        if alternative.predicted_step_s <= ALTERNATIVE_WITHIN * best.predicted_step_s:
            out.append(alternative)

    for name, family in UNCERTAIN.items():
        if family & set(best.decisions):
            alternative = make(allowed - family)
            if alternative is not None:
                offer(replace(alternative, made=f"the model's fastest without {name}"))
    if {Decision.RECOMPUTE, Decision.KEEP} <= allowed:  # the decisions it is made of
        offer(checkpointing)
    return out
