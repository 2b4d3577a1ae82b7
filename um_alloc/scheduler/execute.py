"""Replays a plan on the GPU while a step runs (the scheduler's third part).

The executor sees the step exactly as the recorder did (same hooks, so variables get the same
ids), and at each function boundary issues the plan's transfers:
  - swap-out after f_j: the out stream waits for f_j's kernels (an event), then the variable's
    chunks are prefetched to the host;
  - wait before f_i: the compute stream waits for that swap-out, so the budget holds when f_i runs;
  - swap-in before f_i: the in stream waits for the variable's swap-out, prefetches it back, and
    the compute stream waits for it only before the first function that uses it.
The Python thread never blocks on a transfer. Transfers go through the pool (ChunkPool.migrate)
so its residency stays true. A step that does not match the trace (other shapes, other modules)
stops replaying at the first difference: unified memory keeps the data right, and page faults
bring back whatever the plan would have.
"""
from __future__ import annotations

import logging

import torch

from ..pool import ChunkPool
from .plan import SWAP_IN, WAIT_OUT, Plan, make_plan
from .trace import Trace, TraceRecorder

log = logging.getLogger("um_alloc.scheduler")


class PlanExecutor(TraceRecorder):
    def __init__(self, model, expected: Trace, plan: Plan, device: torch.device):
        super().__init__(model)
        self.expected, self.plan, self.device = expected, plan, device
        self.pool = ChunkPool.for_device(device.index or 0)
        self.out_stream = torch.cuda.Stream(device)
        self.in_stream = torch.cuda.Stream(device)
        self._ptr: dict[int, int] = {}
        self._out_done: dict[int, torch.cuda.Event] = {}
        self._in_done: dict[int, torch.cuda.Event] = {}
        self.diverged: str | None = None
        self.bytes_out = self.bytes_in = 0

    def _use(self, tensor):
        vid = super()._use(tensor)
        if vid is None or self.diverged:
            return vid
        self._ptr.setdefault(vid, tensor.untyped_storage().data_ptr())
        want = self.expected.variables.get(vid)
        if want is None or want.bytes != self.trace.variables[vid].bytes:
            self._diverge(f"variable {vid} is {self.trace.variables[vid].bytes} bytes, the trace has "
                          f"{want.bytes if want else 'no such variable'}")
        return vid

    def _diverge(self, why: str) -> None:
        self.diverged = why
        log.warning("um_alloc scheduler: this step differs from the traced one (%s); replay stops and "
                    "page faults take over until the next trace", why)

    def _before_function(self, i: int) -> None:
        if self.diverged:
            return
        if i >= len(self.plan.before) or self._name != self.expected.functions[i].name:
            return self._diverge(f"function {i} is {self._name}")
        compute = torch.cuda.current_stream(self.device)
        for op in self.plan.before[i]:
            if op.kind == WAIT_OUT and op.var in self._out_done:
                compute.wait_event(self._out_done[op.var])
            elif op.kind == SWAP_IN and op.var in self._ptr:
                done_out = self._out_done.pop(op.var, None)
                if done_out is not None:
                    self.in_stream.wait_event(done_out)
                self.bytes_in += self.pool.migrate(self._ptr[op.var], True, self.in_stream.cuda_stream)
                self._in_done[op.var] = self.in_stream.record_event()
        for vid in self.expected.functions[i].uses:
            arrived = self._in_done.pop(vid, None)
            if arrived is not None:
                compute.wait_event(arrived)

    def _after_function(self, j: int) -> None:
        if self.diverged or j >= len(self.plan.after) or not self.plan.after[j]:
            return
        produced = torch.cuda.current_stream(self.device).record_event()
        for op in self.plan.after[j]:  # all swap-outs
            if op.var not in self._ptr:
                continue
            self.out_stream.wait_event(produced)
            self.bytes_out += self.pool.migrate(self._ptr[op.var], False, self.out_stream.cuda_stream)
            self._out_done[op.var] = self.out_stream.record_event()


class OutOfCoreScheduler:
    """Plans and replays swaps for a model under a GPU budget.

        scheduler = OutOfCoreScheduler(model, budget=16 << 30)
        for batch in loader:
            with scheduler.step():
                loss = model(**batch).loss
                loss.backward()
            optimizer.step()

    The first step is recorded (and runs under the pool's reactive budget); every later step
    replays the plan made from it. `reserve` is the part of the budget kept for what the trace
    does not see: gradients, optimizer state, temporaries and workspaces.
    """

    def __init__(self, model, budget: int, *, window: int | str = "auto", min_swap_size: int = 1 << 20,
                 reserve: float = 0.25, link_bytes_per_s: float | None = 15e9, device=None):
        if not 0 <= reserve < 1:
            raise ValueError(f"reserve must be in [0, 1), got {reserve}")
        self.model, self.budget, self.window = model, budget, window
        self.min_swap_size, self.reserve, self.link = min_swap_size, reserve, link_bytes_per_s
        self.device = torch.device(device or "cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.trace: Trace | None = None
        self.plan: Plan | None = None
        self.last: PlanExecutor | TraceRecorder | None = None

    def step(self):
        if self.plan is None:
            self.last = _Tracing(self)
        else:
            self.last = PlanExecutor(self.model, self.trace, self.plan, self.device)
        return self.last

    def _planned(self, trace: Trace) -> None:
        self.trace = trace
        self.plan = make_plan(trace, int(self.budget * (1 - self.reserve)), self.window,
                              min_swap_size=self.min_swap_size, link_bytes_per_s=self.link)
        log.info("um_alloc scheduler: %d functions, %d variables; plan moves %d bytes out and %d in per "
                 "step, peak %d of %d bytes", len(trace.functions), len(trace.variables),
                 self.plan.swap_out_bytes, self.plan.swap_in_bytes, self.plan.peak_bytes, self.plan.budget)


class _Tracing(TraceRecorder):
    def __init__(self, scheduler: OutOfCoreScheduler):
        from ..pool import ChunkPool

        pool = ChunkPool.for_device(scheduler.device.index or 0)
        super().__init__(scheduler.model, tag_of=lambda ptr: (pool.block_at(ptr) or _NoBlock).tag)
        self._scheduler = scheduler

    def __exit__(self, *exc):
        super().__exit__(*exc)
        if exc[0] is None:
            self._scheduler._planned(self.trace)


class _NoBlock:
    tag = "activation"
