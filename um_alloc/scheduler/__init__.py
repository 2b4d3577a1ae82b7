"""The out-of-core scheduler: record one step (trace), compile a swap schedule (plan), replay it.

trace.py and plan.py are plain Python over plain data, so schedules are built and checked on any
machine from a saved trace. Replaying a plan on the GPU (execute) is not built yet.
"""
from .plan import Op, Plan, PlanError, auto_window, make_plan
from .trace import Function, Trace, TraceRecorder, Variable

__all__ = ["Trace", "Function", "Variable", "TraceRecorder", "Plan", "Op", "PlanError", "make_plan",
           "auto_window"]
