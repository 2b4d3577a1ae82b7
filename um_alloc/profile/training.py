"""What bert_example/train.py's --profile (or UM_PROFILE=1) and --timeline do, kept out of it.

    profiler = TrainingProfiler.from_args(args)           # before any CUDA work
    step_fn = profiler.wrap(step_fn, model, optimizer, steps=n)   # right before the loop
    ...
    summary.update(profiler.finish(warmup_steps))          # after the loop
    profiler.report(summary)

Steps are marked after step_fn returns; train.py's steps end with loss.item(), so the GPU has
finished the step. The timeline records the run's last step, so the warm-up is over and the
sampling slows one timed step out of many (the median ignores it).
"""
from __future__ import annotations

from . import aggregate
from .tables import counts_line
from .timeline import StepTimeline
from .um_counters import UMCounters, env_enabled

PROTOCOL_COUNTERS = ("gpu_page_faults", "cpu_page_faults", "htod_bytes", "dtoh_bytes")


class TrainingProfiler:
    def __init__(self, counters: UMCounters | None, timeline_path: str | None):
        self.counters = counters
        self.timeline_path = timeline_path
        self.timeline_info: dict | None = None
        self._timeline = None

    @classmethod
    def from_args(cls, args, device: int = 0) -> "TrainingProfiler":
        """Counters when --profile, --timeline or UM_PROFILE=1 asks; a no-op otherwise."""
        wanted = getattr(args, "profile", False) or getattr(args, "timeline", None) or env_enabled()
        counters = UMCounters(device).start() if wanted else None
        return cls(counters, getattr(args, "timeline", None))

    def wrap(self, step_fn, model, optimizer, steps: int):
        """step_fn that marks each step, and draws the timeline of the last of `steps` steps."""
        if self.counters is None and self.timeline_path is None:
            return step_fn
        if self.counters is not None:
            self.counters.start_steps()  # model building and loading so far count as set-up
        calls = 0

        def step(batch):
            nonlocal calls
            calls += 1
            if self.timeline_path and calls == steps:
                with StepTimeline(model, optimizer, counters=self.counters, step=calls - 1) as timeline:
                    loss = step_fn(batch)
                self._timeline = timeline
            else:
                loss = step_fn(batch)
            if self.counters is not None:
                self.counters.mark_step()
            return loss

        return step

    def finish(self, warmup_steps: int) -> dict:
        """Stops the counters; returns the keys train.py adds to its summary."""
        if self.counters is None:
            return {}
        self.counters.stop()
        counters = self.counters.summary()
        steps = counters["per_step"]
        timed = steps[warmup_steps:] or steps
        counters["timed_steps"] = len(timed)
        counters["timed_mean"] = aggregate.mean(timed)
        counters["steps_total"] = aggregate.merge(steps) if self.counters.available else None
        out = {"um_counters": counters}
        # The benchmark protocol's fields: this run's training steps, set-up left out; null = not measured.
        total = counters["steps_total"] or {}
        out.update({key: total.get(key) for key in PROTOCOL_COUNTERS})
        if self._timeline is not None:
            self.timeline_info = self._timeline.save(self.timeline_path)
            out["timeline"] = self.timeline_info
        return out

    def report(self, summary: dict) -> None:
        counters = summary.get("um_counters")
        if counters is None:
            return
        if not counters["available"]:
            print(f"  UM counters: CUPTI unavailable: {counters['reason']}; ran without counters")
        else:
            print(f"  UM counters per timed step (mean of {counters['timed_steps']}): "
                  f"{counts_line(counters['timed_mean'])}")
            print(f"  UM counters, all {len(counters['per_step'])} steps: {counts_line(counters['steps_total'])}")
            print(f"  UM counters, set-up before step 0: {counts_line(counters['setup'])}")
            if counters["dropped_records"]:
                print(f"  warning: CUPTI dropped {counters['dropped_records']} records; counts are low")
        timeline = summary.get("timeline")
        if timeline:
            where = timeline["png"] or f"{timeline['json']} (no picture: {timeline.get('error')})"
            print(f"  memory timeline of step {timeline['step']}: {where}")
