"""Compiles a trace into a swap schedule with the adaptive window (Hayakawa & Narihira §3).

Sliding a window of `window` bytes over the variable-sequence, at each function f_i:
  (a) swap in every swapped-out variable that enters the window;
  (b) while planned residency exceeds the budget, complete the oldest reserved swap-outs;
  (c) after f_i, reserve swap-out of the variables f_i used, except (d) those never used again
      (freed instead), those used again inside the window, and those below min_swap_size.
Planning is offline, so a reservation costs nothing until (b) needs its room: only then is its
swap-out written into the plan, right after the variable's last use, where it overlaps the most
compute. A budget that holds everything moves no bytes.
The result is checked by an independent replay (check_plan): residency never above the budget,
every use preceded by its variable being on the GPU.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .trace import Trace

SWAP_IN, SWAP_OUT, WAIT_OUT = "swap_in", "swap_out", "wait_out"


class PlanError(ValueError):
    """No schedule fits: says which function, and how many bytes it needs against the budget."""


@dataclass(frozen=True)
class Op:
    kind: str  # SWAP_IN before a function, WAIT_OUT before a function, SWAP_OUT after one
    var: int


@dataclass
class Plan:
    budget: int
    window: int
    before: list[list[Op]] = field(default_factory=list)  # per function: ops issued before it runs
    after: list[list[Op]] = field(default_factory=list)   # per function: ops issued after it ran
    peak_bytes: int = 0
    swap_in_bytes: int = 0
    swap_out_bytes: int = 0


class _Planner:
    def __init__(self, trace: Trace, budget: int, window: int, min_swap_size: int, swappable_tags):
        self.trace, self.budget, self.window = trace, budget, window
        self.v = trace.variable_sequence()
        self.size = {vid: var.bytes for vid, var in trace.variables.items()}
        self.swappable = {vid for vid, var in trace.variables.items()
                          if var.bytes >= min_swap_size and (swappable_tags is None or var.tag in swappable_tags)}
        self.next_pos = self._next_positions()
        self.first_pos = [None] * len(trace.functions)  # first position of each function in v
        for p, (i, _) in enumerate(self.v):
            if self.first_pos[i] is None:
                self.first_pos[i] = p
        # absent = not created yet; gpu; reserved (may be swapped out after reserved_at); host; dead
        self.loc: dict[int, str] = {}
        self.pending: deque[int] = deque()  # reserved variables, oldest first
        self.reserved_at: dict[int, int] = {}
        self.resident = 0
        self.window_end = -1  # last position inside the window so far
        self.plan = Plan(budget, window)

    def _next_positions(self) -> list[int | None]:
        nxt, seen = [None] * len(self.v), {}
        for p in range(len(self.v) - 1, -1, -1):
            vid = self.v[p][1]
            nxt[p] = seen.get(vid)
            seen[vid] = p
        return nxt

    def run(self) -> Plan:
        n = len(self.trace.functions)
        self.plan.before = [[] for _ in range(n)]
        self.plan.after = [[] for _ in range(n)]
        for i in range(n):
            if self.first_pos[i] is not None:
                self._window_swap_ins(i, self.plan.before[i])
                self._make_room(i, self.plan.before[i])
                self.plan.peak_bytes = max(self.plan.peak_bytes, self.resident)
                self._after(i)
        return self.plan

    def _window_end(self, i: int) -> int:
        """Last position of the window starting at f_i; it always covers f_i's own uses."""
        p = self.first_pos[i]
        total = self.size[self.v[p][1]]
        while p + 1 < len(self.v) and (self.v[p + 1][0] == i or total + self.size[self.v[p + 1][1]] <= self.window):
            p += 1
            total += self.size[self.v[p][1]]
        return p

    # (a) swap in what enters the window; f_i's own variables are created or brought in here too
    def _window_swap_ins(self, i: int, before: list[Op]) -> None:
        end = self._window_end(i)
        for p in range(self.first_pos[i], end + 1):
            vid = self.v[p][1]
            state = self.loc.get(vid)
            if state is None and self.v[p][0] == i:  # created by f_i
                self.loc[vid] = "gpu"
                self.resident += self.size[vid]
            elif state == "reserved" and (p > self.window_end or self.v[p][0] == i):
                self.pending.remove(vid)  # needed again before anyone needed its room: it stays
                self.loc[vid] = "gpu"
            elif state == "host" and (p > self.window_end or self.v[p][0] == i):
                before.append(Op(SWAP_IN, vid))
                self.loc[vid] = "gpu"
                self.resident += self.size[vid]
                self.plan.swap_in_bytes += self.size[vid]
        self.window_end = max(self.window_end, end)

    # (b) complete the oldest reserved swap-outs until the plan fits the budget
    def _make_room(self, i: int, before: list[Op]) -> None:
        while self.resident > self.budget and self.pending:
            self._wait(self.pending[0], before)
        if self.resident > self.budget:
            need = sum(self.size[v] for v in set(self.trace.functions[i].uses))
            raise PlanError(
                f"function {i} ({self.trace.functions[i].name}) would run with {self.resident} bytes on the "
                f"GPU, over the budget of {self.budget} bytes (its own variables: {need} bytes); raise the "
                f"budget, lower the window ({self.window} bytes) or min_swap_size")

    def _wait(self, vid: int, ops: list[Op]) -> None:
        self.pending.remove(vid)
        self.plan.after[self.reserved_at[vid]].append(Op(SWAP_OUT, vid))  # starts after its last use
        ops.append(Op(WAIT_OUT, vid))
        self.loc[vid] = "host"
        self.resident -= self.size[vid]
        self.plan.swap_out_bytes += self.size[vid]

    # (c)+(d) after f_i: free dead variables, reserve swap-out of the rest unless needed soon
    def _after(self, i: int) -> None:
        last_pos = {}
        for p in range(self.first_pos[i], len(self.v)):
            if self.v[p][0] != i:
                break
            last_pos[self.v[p][1]] = p
        for vid, p in last_pos.items():
            nxt = self.next_pos[p]
            if nxt is None:
                self.loc[vid] = "dead"
                self.resident -= self.size[vid]
            elif nxt > self.window_end and vid in self.swappable:
                self.loc[vid] = "reserved"
                self.pending.append(vid)
                self.reserved_at[vid] = i


def make_plan(trace: Trace, budget: int, window: int | str = "auto", *, min_swap_size: int = 1 << 20,
              link_bytes_per_s: float | None = None, swappable_tags=None) -> Plan:
    """A checked swap schedule for `trace` under `budget` bytes. Raises PlanError if none fits."""
    if budget <= 0:
        raise ValueError(f"budget must be > 0 bytes, got {budget}")
    trace.validate()
    if window == "auto":
        window = auto_window(trace, budget, link_bytes_per_s)
    if not isinstance(window, int) or window <= 0:
        raise ValueError(f"window must be 'auto' or a size in bytes > 0, got {window!r}")
    plan = _Planner(trace, budget, window, min_swap_size, swappable_tags).run()
    check_plan(trace, plan)
    return plan


def auto_window(trace: Trace, budget: int, link_bytes_per_s: float | None = None) -> int:
    """The window in bytes: far enough ahead that a function's swap-ins arrive in time.

    With A = bytes the step touches per second of compute and R = the link rate, a window of W
    bytes is W / A seconds of compute ahead; the largest function's working set B takes B / R to
    bring in, so W = A * B / R. Without timings, budget / 8. Clamped to [B, budget / 2]: never
    smaller than one function's needs, never so large that prefetching crowds out the budget.
    """
    per_function = [sum(trace.variables[v].bytes for v in set(f.uses)) for f in trace.functions] or [0]
    largest = max(per_function)
    if trace.compute_s and link_bytes_per_s:
        touched = sum(trace.variables[v].bytes for _, v in trace.variable_sequence())
        window = int(touched / trace.compute_s * largest / link_bytes_per_s)
    else:
        window = budget // 8
    return max(largest, min(window, budget // 2), 1)


def check_plan(trace: Trace, plan: Plan) -> None:
    """Replays `plan` on its own bookkeeping; raises PlanError at the first broken invariant."""
    size = {vid: var.bytes for vid, var in trace.variables.items()}
    v = trace.variable_sequence()
    last = {vid: i for i, vid in v}
    loc, resident = {}, 0
    for i, f in enumerate(trace.functions):
        for op in plan.before[i]:
            if op.kind == WAIT_OUT and loc.get(op.var) == "out":
                loc[op.var], resident = "host", resident - size[op.var]
            elif op.kind == SWAP_IN and loc.get(op.var) == "host":
                loc[op.var], resident = "gpu", resident + size[op.var]
            else:
                raise PlanError(f"function {i}: {op.kind} of variable {op.var} in state {loc.get(op.var)}")
        for vid in dict.fromkeys(f.uses):
            if vid not in loc:
                loc[vid], resident = "gpu", resident + size[vid]
            elif loc[vid] != "gpu":
                raise PlanError(f"function {i} ({f.name}) uses variable {vid} while it is {loc[vid]}")
        if resident > plan.budget:
            raise PlanError(f"function {i} ({f.name}) runs with {resident} bytes, over the budget {plan.budget}")
        for op in plan.after[i]:
            if op.kind != SWAP_OUT or loc.get(op.var) != "gpu":
                raise PlanError(f"after function {i}: {op.kind} of variable {op.var} in state {loc.get(op.var)}")
            loc[op.var] = "out"
        for vid in dict.fromkeys(f.uses):
            if last[vid] == i and loc[vid] in ("gpu", "out"):
                resident -= size[vid]
                loc[vid] = "dead"
