"""What train.py measures on request, beyond whole steps: the time of each phase of a step
(--phase-times), the pinned-host link rates (--link-rates) and a torch.profiler trace of the
last step (--trace). Each is off unless its flag asks, so a plain run times whole steps only.

bench/bench_budget.py reads the phases of a stock run (compute alone) and the link rates to bound
an offloading run's step time by the bytes the link must carry.
"""
from __future__ import annotations

import statistics
import time

import torch

PHASES = ("forward", "backward", "optimizer")


class PhaseClock:
    """Times forward, backward and the optimizer step of every step.

    On CUDA the marks are events on the compute stream, read once the step's last one has
    completed (train.py's steps end in loss.item(), which waits for the stream anyway); on the
    CPU, where the work is synchronous, they are the wall clock. Call mark() before forward and
    after each phase, then end_step().
    """

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        self._marks: list = []
        self.steps: list[list[float]] = []  # seconds per phase, one list per step

    def mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter())

    def end_step(self) -> None:
        marks, self._marks = self._marks, []
        if len(marks) != len(PHASES) + 1:
            raise RuntimeError(f"PhaseClock: a step needs {len(PHASES) + 1} marks, got {len(marks)}")
        if self._cuda:
            marks[-1].synchronize()
            seconds = [start.elapsed_time(end) / 1e3 for start, end in zip(marks, marks[1:])]
        else:
            seconds = [end - start for start, end in zip(marks, marks[1:])]
        self.steps.append(seconds)

    def summary(self, warmup_steps: int) -> dict:
        """phase_s (every step) and phase_s_median (the timed steps, as step_s_median)."""
        timed = self.steps[warmup_steps:] or self.steps
        medians = {name: statistics.median(step[i] for step in timed) for i, name in enumerate(PHASES)}
        return {"phase_s": self.steps, "phase_s_median": medians}


def link_rates(device: torch.device, nbytes: int = 256 << 20, repeats: int = 4) -> dict:
    """GB/s of pinned-host copies each way, to and from memory of this run's allocator (which,
    under um_alloc, is managed memory: the rate a copy of an activation gets)."""
    host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=device)
    rates = {"bytes": nbytes}
    for name, copy in (("d2h", lambda: host.copy_(gpu, non_blocking=True)),
                       ("h2d", lambda: gpu.copy_(host, non_blocking=True))):
        copy()  # first touch: pages placed, copy engine warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            copy()
        end.record()
        end.synchronize()
        rates[f"{name}_GBps"] = repeats * nbytes / (start.elapsed_time(end) / 1e3) / 1e9
    return rates


def trace_last_step(step_fn, path: str, steps: int):
    """step_fn that records its `steps`-th call with torch.profiler (CPU and CUDA activity) and
    writes a Chrome trace to `path` (gzip'd when it ends in .gz). The traced step runs slower
    than the others; it is one of the timed steps, which the median step time shrugs off."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    calls = 0

    def step(batch):
        nonlocal calls
        calls += 1
        if calls != steps:
            return step_fn(batch)
        with profile(activities=activities) as recorded:
            loss = step_fn(batch)
        recorded.export_chrome_trace(path)
        return loss

    return step
