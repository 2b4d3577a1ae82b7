"""Record: what one calibration step measures, as plain data for the planner.

A step is a sequence of *marks*: the forward's start and end, each unit's forward (before and
after), each unit's backward (when the gradient reaches its output), each recomputation (enter
and exit) and the backward's end. Each mark takes the time (a CUDA event, read once the step is
over, so nothing waits) and the GPU's live bytes with their peak since the mark before. From the
marks come each unit's forward and recompute time, the bytes a recompute rebuilt (what the unit
saves when kept), the segments between marks with their peaks and the units they hold, and the
time under which each unit's copies can hide.
"""
from __future__ import annotations

import contextlib

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..install import is_installed
from ..pool import ChunkPool
from .alone import AloneCalls
from .planning import Calibration, Segment, UnitCost
from .rebuild_probe import RebuildProbe

__all__ = ["MemoryProbe", "StepRecorder", "link_rate"]


class MemoryProbe:
    """GPU live bytes and their peak since the last look: the pool's count of tags kept in GPU
    memory under um_alloc, the caching allocator's otherwise; zeros on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pool = ChunkPool.for_device(device.index) if device.type == "cuda" and is_installed() else None
        self._backed_start = 0                       # the pool's GPU-backed bytes as the step began
        self._held_peak = 0                          # and the peak of those it held, this step
        self._spills_start = 0                       # the pool's allocations tagged spill, as it began

    def begin_step(self) -> None:
        """A measured step begins: what the pool holds backed from here on is this step's."""
        if self._pool is not None:
            self._pool.reset_device_peak()
            self._backed_start = self._pool.device_backed()[0]
            self._held_peak = self._pool.device_held()[1]
            self._spills_start = self._spills()

    def spilled(self) -> bool:
        """Whether the step put allocations in host memory for its kernels to reach (um_alloc.spill)."""
        return self._pool is not None and self._spills() > self._spills_start

    def _spills(self) -> int:
        return self._pool.raw_stats()["tags"]["spill"]["allocations"]

    def live(self) -> int:
        """GPU live bytes now; the peak is left as it is."""
        if self._pool is not None:
            return self._pool.device_live()[0]
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return 0

    def look(self) -> tuple[int, int]:
        """(live now, peak since the previous look); the peak starts over."""
        if self._pool is not None:
            live, peak = self._pool.device_live()
            self._held_peak = max(self._held_peak, self._pool.device_held()[1])
            self._pool.reset_device_peak()
            return live, peak
        if self.device.type == "cuda":
            live, peak = torch.cuda.memory_allocated(self.device), torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return live, peak
        return 0, 0

    def held_beyond_live(self, live_peak: int) -> int:
        """What the allocator held on the GPU beyond live bytes, at most: chunks the pool backs
        but does not fill, or the caching allocator's cached blocks. The pool's are this step's,
        and only those in arenas a live allocation holds (ChunkPool.device_held): a wholly free
        arena's backing is returned when the budget needs it. Its peak beyond the live peak, or
        beyond what the pool had backed when the step began, which the step's allocations reuse
        (after a larger batch ran out of memory, the pool may hold more than the next, smaller one
        fills; the planner gives such arenas back before a step it measures, arenas.py)."""
        if self._pool is not None:
            return max(self._held_peak - max(live_peak, self._backed_start), 0)
        if self.device.type == "cuda":
            return max(torch.cuda.max_memory_reserved(self.device) - live_peak, 0)
        return 0

    def out_of_memory_count(self) -> int:
        if self._pool is not None:
            return self._pool.raw_stats()["num_ooms"]
        if self.device.type == "cuda":
            return torch.cuda.memory_stats(self.device).get("num_ooms", 0)
        return 0


@dataclass
class _Mark:
    label: str
    unit: int | None
    clock: object             # torch.cuda.Event (the GPU's time) or a perf_counter float
    cpu: float                # perf_counter: the host's time, which leads the GPU's while it queues work
    live: int
    peak: int                 # since the previous mark
    ahead: int = 0            # the fewest bytes of copies back ahead of use since the previous mark


@dataclass
class _UnitSeen:
    posts: list[int] = field(default_factory=list)       # mark indices
    backwards: list[int] = field(default_factory=list)
    forward_s: float = 0.0
    recompute_s: float = 0.0
    forward_cpu_s: float = 0.0
    recompute_cpu_s: float = 0.0
    backward_s: float = 0.0
    backward_cpu_s: float = 0.0
    rebuilt_bytes: int = 0    # live bytes a recompute added: what the unit saves when kept
    moved_bytes: int = 0      # saved bytes it sent to host memory in forward (a moved unit)
    input_bytes: int = 0
    input_shapes: list = field(default_factory=list)  # per recomputed call: its tensor inputs' shapes
    selective_bytes: int = 0
    matmul_s: float = 0.0
    rebuilt: RebuildProbe | None = None  # what its recomputations found backward could rebuild
    links: list[bool] = field(default_factory=list)  # per call: did it take the unit before's output (chain.py)
    changes_input: bool = False   # a call changed its argument in place
    reruns: list[tuple] = field(default_factory=list)  # (start, end, host seconds, GPU time's scale) of reruns alone


class StepRecorder:
    """Collects the marks of one step; ``calibration()`` turns them into the planner's data."""

    def __init__(self, device: torch.device, probe: MemoryProbe, n_units: int,
                 ahead: Callable[[], int] | None = None):
        """`ahead`: the transfer engine's low-water of copies back on the GPU ahead of use since
        it was last asked (ActivationOffload.ahead_low_water); None where nothing moves."""
        self.device, self.probe, self._ahead = device, probe, ahead
        self.marks: list[_Mark] = []
        self.units = [_UnitSeen() for _ in range(n_units)]
        self._pairs: list[tuple[str, int, int, int]] = []  # (kind, unit, start mark, end mark)
        self._ops: list[tuple[int, object, object]] = []   # (unit, start, end) of kept ops
        self.overflowed_bytes = 0  # the most the pool put in host memory at once, where the budget refused it
        self.alone = AloneCalls(device, self._clock, self._seconds)  # the probed step's distinct unit calls
        self.probe.begin_step()
        self.start_live = self.probe.look()[0]

    def mark(self, label: str, unit: int | None = None) -> int:
        live, peak = self.probe.look()
        ahead = self._ahead() if self._ahead is not None else 0
        self.marks.append(_Mark(label, unit, self._clock(), time.perf_counter(), live, peak, ahead))
        index = len(self.marks) - 1
        if unit is not None and label == "post":
            self.units[unit].posts.append(index)
        elif unit is not None and label == "backward":
            self.units[unit].backwards.append(index)
        return index

    def pair(self, kind: str, unit: int, start: int, end: int, not_saved: int = 0) -> None:
        """A unit's forward ("forward") or recomputation ("recompute") ran between two marks;
        `not_saved`: of what a recomputation left live, its outputs that backward does not keep
        (a rerun as one node still holds them where the recomputation's end is marked, and lets them
        go before its gradients are taken)."""
        self._pairs.append((kind, unit, start, end))
        if kind == "recompute":
            self.units[unit].rebuilt_bytes += max(self.marks[end].live - self.marks[start].live - not_saved, 0)

    def kept_op(self, unit: int):
        """A matmul, convolution or attention op starts in a recomputation; call what this returns
        with its output's bytes when it is done."""
        start = self._clock()

        def done(out_bytes: int) -> None:
            self.units[unit].selective_bytes += out_bytes
            self._ops.append((unit, start, self._clock()))
        return done

    @contextlib.contextmanager
    def rerun_alone(self, unit: int, input_bytes: int, scale: float = 1.0):
        """A unit's forward run again by itself, timed: what rerunning a gap costs, which the safe
        step (where gaps move) never does. `input_bytes`: what recomputing it would keep; `scale`:
        the GPU time's factor, for a rerun on a part of the batch."""
        seen = self.units[unit]
        start, cpu = self._clock(), time.perf_counter()
        yield
        seen.reruns.append((start, self._clock(), time.perf_counter() - cpu, scale))
        seen.input_bytes = max(seen.input_bytes, input_bytes)

    def rebuild_probe(self, unit: int, min_bytes: int) -> RebuildProbe:
        """The probe of what `unit` saves that backward could rebuild (one for all its calls)."""
        seen = self.units[unit]
        if seen.rebuilt is None:
            seen.rebuilt = RebuildProbe(self.device, min_bytes, self._clock)
        return seen.rebuilt

    def _clock(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _seconds(self, start, end) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    def calibration(self, names: list[tuple[str, str]], next_start, link_bytes_per_s: float,
                    reserved_bytes: int) -> Calibration:
        """The planner's data; `names` are the units' (name, kind), the last of them what is saved
        outside every unit; `next_start` the clock of the next step's forward (the step ends there),
        after a synchronize."""
        self._place_rest()
        for kind, unit, start, end in self._pairs:
            seconds = self._seconds(self.marks[start].clock, self.marks[end].clock)
            cpu = self.marks[end].cpu - self.marks[start].cpu
            seen = self.units[unit]
            if kind == "forward":
                seen.forward_s += seconds
                seen.forward_cpu_s += cpu
            else:
                seen.recompute_s += seconds
                seen.recompute_cpu_s += cpu
        for unit, start, end in self._ops:
            self.units[unit].matmul_s += self._seconds(start, end)
        for seen in self.units:
            for start, end, cpu, scale in seen.reruns:
                seen.recompute_s += scale * self._seconds(start, end)
                seen.recompute_cpu_s += cpu
        self._time_backwards()
        hide = self._hide_times()
        units = tuple(UnitCost(name, kind, s.forward_s, s.recompute_s, s.matmul_s,
                               s.rebuilt_bytes if kind == "block" else s.moved_bytes,
                               s.selective_bytes, s.input_bytes, hide[j], s.forward_cpu_s, s.recompute_cpu_s,
                               s.backward_s, s.backward_cpu_s, **self._rebuild_figures(s),
                               follows=bool(s.links) and all(s.links), changes_input=s.changes_input)
                      for j, ((name, kind), s) in enumerate(zip(names, self.units)))
        live_peak = max((m.peak for m in self.marks), default=0)
        return Calibration(units, self._segments(), self._seconds(self.marks[0].clock, next_start),
                           link_bytes_per_s, self.probe.held_beyond_live(live_peak), reserved_bytes,
                           self.start_live)

    def _rebuild_figures(self, seen: _UnitSeen) -> dict:
        probe = seen.rebuilt
        if probe is None:
            return {}
        return {"rebuildable_bytes": probe.rebuilt_bytes,
                "rebuild_s": sum(self._seconds(start, end) for start, end, _ in probe.timings),
                "rebuild_cpu_s": sum(cpu for _, _, cpu in probe.timings),
                "rebuild_forward_cpu_s": probe.forward_cpu_s}

    def recipes(self) -> dict:
        """Per unit: its UnitRecipes, the places among its saves where a recipe rebuilt equal
        (RebuiltSaves reads them)."""
        return {j: s.rebuilt.recipes for j, s in enumerate(self.units)
                if s.rebuilt is not None and s.rebuilt.recipes is not None}

    def _time_backwards(self) -> None:
        """Each unit's own backward, on both clocks: from the gradient reaching it to the gradient
        reaching the unit before it (or backward's end), less its recomputation in between."""
        later = [k for k, m in enumerate(self.marks) if m.label in ("backward", "backward end")]
        for seen in self.units:
            for b in seen.backwards:
                end = next((k for k in later if k > b), None)
                if end is None:
                    continue
                seen.backward_s += self._seconds(self.marks[b].clock, self.marks[end].clock)
                seen.backward_cpu_s += self.marks[end].cpu - self.marks[b].cpu
            seen.backward_s = max(seen.backward_s - seen.recompute_s, 0.0)
            seen.backward_cpu_s = max(seen.backward_cpu_s - seen.recompute_cpu_s, 0.0)

    def _place_rest(self) -> None:
        """What is saved outside the units (a loss inside the model's forward, mostly) is held from
        the forward's end until backward begins: from there it is being used, as a unit's saved
        tensors are in its own backward (the calibration's peaks hold it then, moved or not)."""
        labels = [m.label for m in self.marks]
        rest = self.units[-1]
        if "forward end" in labels and not rest.posts:
            rest.posts.append(labels.index("forward end"))
            begun = [k for k, label in enumerate(labels) if label in ("backward start", "backward")]
            if begun:
                rest.backwards.append(begun[0])

    def _segments(self) -> tuple[Segment, ...]:
        spans = []
        for j, seen in enumerate(self.units):
            if seen.posts:
                spans.append((j, seen.posts[0], max(seen.backwards) if seen.backwards else len(self.marks)))
        backward = next((k for k, m in enumerate(self.marks) if m.label in ("backward", "backward start")),
                        len(self.marks))
        out = []
        for k in range(1, len(self.marks)):
            held = tuple(j for j, first, last in spans if first <= k - 1 and last >= k)
            label = f"{self._name(k - 1)} -> {self._name(k)}"
            before, after = self.marks[k - 1], self.marks[k]
            seconds = self._seconds(before.clock, after.clock)
            out.append(Segment(label, after.peak, held, seconds, after.cpu - before.cpu, after.ahead,
                               in_backward=k - 1 >= backward))
        return tuple(out)

    def _name(self, k: int) -> str:
        m = self.marks[k]
        return m.label if m.unit is None else f"{m.label} {m.unit}"

    def _hide_times(self) -> list[float]:
        """Per unit: min(compute after its forward until backward begins, backward before its own),
        the time its copies out and back have to hide under."""
        starts = [k for k, m in enumerate(self.marks) if m.label in ("backward", "backward start")]
        if not starts:
            return [0.0] * len(self.units)
        first_backward = self.marks[min(starts)].clock
        out = []
        for seen in self.units:
            if not seen.posts or not seen.backwards:
                out.append(0.0)
                continue
            after = self._seconds(self.marks[seen.posts[-1]].clock, first_backward)
            before = self._seconds(first_backward, self.marks[max(seen.backwards)].clock)
            out.append(max(min(after, before), 0.0))
        return out


def link_rate(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes per second of pinned-host copies to and from device memory, the slower direction.
    A CPU device has no link: infinity."""
    if device.type != "cuda":
        return float("inf")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rates = []
    for copy in (lambda: host.copy_(gpu, non_blocking=True), lambda: gpu.copy_(host, non_blocking=True)):
        copy()  # the first copy pays for mapping the pinned pages
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            copy()
        end.record()
        end.synchronize()
        rates.append(3 * nbytes / (start.elapsed_time(end) / 1e3))
    return min(rates)
