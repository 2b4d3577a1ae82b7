"""Replays a pool's trace on the host backend: where a training step's GPU-held bytes outgrow its
live bytes, and which requests made the pool back new chunks. No GPU: the host backend runs the
pool's placement as the GPU's pool ran it, from the same calls in the same order.

    UM_POOL_TRACE=/tmp/pool python -m um_alloc run --budget 6GiB train.py   # writes /tmp/pool.<pid>.<n>
    python bench/pool_trace.py /tmp/pool.12345.0
    python bench/pool_trace.py /tmp/pool.12345.0 --growth 3                  # step 3's new backing

A step runs from the planner switching step arenas on (its forward begins) to the next step's
forward, the optimizer's work included, as the planner measures it. Per step: the live peak and the held peak (GPU-backed bytes in arenas a live
allocation holds, what a hard budget counts and cannot give back), their difference (what the
planner sets aside as the pool's excess over live bytes), and, where the trace holds the GPU's
own readings, those to compare. --growth lists each request of one step that raised the held
bytes: its size, and how many held bytes were free when it came (free, but in runs too short or
not backed where it needed them).
"""
from __future__ import annotations

import argparse
import ctypes
import gzip
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from um_alloc import _lib  # noqa: E402
from um_alloc.sizes import format_size  # noqa: E402


@dataclass
class StepPeaks:
    """One step's peaks in the replay, and the GPU's where the trace has its readings (else 0)."""
    step: int
    live_peak: int = 0
    held_peak: int = 0
    gpu_live_peak: int = 0
    gpu_held_peak: int = 0
    growth: list = field(default_factory=list)  # (request bytes, held before, held after, live before)

    @property
    def excess(self) -> int:
        return self.held_peak - self.live_peak


class Replay:
    """A host pool driven by a trace's events (the letters csrc/pool_trace.hpp's callers write)."""

    def __init__(self, growth_of: int | None = None):
        self.lib = _lib.load()
        self.pool = None
        self.places: dict[str, int] = {}   # the traced address -> the replay's
        self.streams: dict[str, int] = {}  # the traced stream -> a small number (0: the default)
        self.steps: list[StepPeaks] = []
        self.refused = 0                   # requests the replay refused that the GPU's pool met
        self._growth_of = growth_of
        self._step: StepPeaks | None = None

    def run(self, lines) -> list[StepPeaks]:
        for number, line in enumerate(lines, 1):
            fields = line.split()
            if not fields:
                continue
            handler = getattr(self, f"_event_{fields[0]}", None)
            if handler is None:
                raise SystemExit(f"pool_trace: line {number}: unknown event {fields[0]!r}")
            if self.pool is None and fields[0] != "c":
                raise SystemExit(f"pool_trace: line {number}: the trace does not start with the pool's "
                                 "configuration ('c'); is it a UM_POOL_TRACE file?")
            handler(*fields[1:])
        self._close_step()
        if self.pool is not None:
            self.lib.um_pool_destroy(self.pool)
            self.pool = None
        return self.steps

    def _read(self, function) -> tuple[int, int]:
        now, peak = ctypes.c_uint64(), ctypes.c_uint64()
        function(self.pool, ctypes.byref(now), ctypes.byref(peak))
        return now.value, peak.value

    def _stream(self, text: str) -> int:
        if text in ("(nil)", "0x0", "0"):
            return 0
        return self.streams.setdefault(text, len(self.streams) + 1)

    # ---- events ---------------------------------------------------------------------------------

    def _event_c(self, chunk, arena, max_reserved):
        self.pool = self.lib.um_pool_create_host(int(chunk), int(arena), int(max_reserved))

    def _event_P(self, tag, preferred, read_mostly, by_gpu, by_cpu, prefetch):
        policy = _lib.TagPolicyC(int(preferred), int(read_mostly), int(by_gpu), int(by_cpu), int(prefetch))
        self.lib.um_pool_set_tag_policy(self.pool, int(tag), policy)

    def _event_b(self, budget, min_swap, enabled, evict_live):
        self.lib.um_pool_set_budget(self.pool, int(budget), int(min_swap), int(enabled), int(evict_live))

    def _event_O(self, limit):
        self.lib.um_pool_set_overflow(self.pool, int(limit))

    def _event_s(self, on):
        self.lib.um_pool_set_step_arenas(self.pool, int(on))
        if int(on):  # a step's forward begins: the last one ends here, its optimizer's work included
            self._close_step()
            self.lib.um_pool_reset_device_peak(self.pool)
            self._step = StepPeaks(len(self.steps) + 1)
            self.steps.append(self._step)

    def _close_step(self):
        if self._step is not None:
            self._step.live_peak = self._read(self.lib.um_pool_device_live)[1]
            self._step.held_peak = self._read(self.lib.um_pool_device_held)[1]
            self._step = None

    def _event_a(self, place, size, tag, step_arenas, stream):
        watching = self._step is not None and self._step.step == self._growth_of
        if watching:
            held_before, live_before = self._read(self.lib.um_pool_device_held)[0], self._read(self.lib.um_pool_device_live)[0]
        self.lib.um_pool_set_step_arenas(self.pool, int(step_arenas))
        replayed = self.lib.um_pool_malloc(self.pool, int(size), self._stream(stream), int(tag))
        if not replayed:
            self.refused += 1
            return
        self.places[place] = replayed
        if watching:
            held_after = self._read(self.lib.um_pool_device_held)[0]
            if held_after > held_before:
                self._step.growth.append((int(size), held_before, held_after, live_before))

    def _event_o(self, size, tag, step_arenas, stream):
        pass  # refused on the GPU too: nothing was placed

    def _event_f(self, place):
        replayed = self.places.pop(place, None)
        if replayed:
            self.lib.um_pool_free(self.pool, replayed)

    def _event_t(self, place, tag, stream):
        if place in self.places:
            self.lib.um_pool_retag(self.pool, self.places[place], int(tag), self._stream(stream))

    def _event_m(self, place, to_gpu, stream):
        if place in self.places:
            self.lib.um_pool_migrate(self.pool, self.places[place], int(to_gpu), self._stream(stream))

    def _event_r(self, place, stream):
        if place in self.places:
            self.lib.um_pool_record_stream(self.pool, self.places[place], self._stream(stream))

    def _event_e(self):
        self.lib.um_pool_empty_cache(self.pool)

    def _event_p(self, live, live_peak, backed, backed_peak, held, held_peak):
        # The GPU's peaks since the pool's last reset (the planner resets around each unit of the
        # steps it measures, and as the next forward begins): their largest are the step's own.
        if self._step is not None:
            self._step.gpu_live_peak = max(self._step.gpu_live_peak, int(live_peak))
            self._step.gpu_held_peak = max(self._step.gpu_held_peak, int(held_peak))


def read_lines(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        yield from file


def report(steps: list[StepPeaks], refused: int) -> str:
    head = f"{'step':>5}{'live peak':>12}{'held peak':>12}{'excess':>11}{'GPU live':>12}{'GPU held':>12}"
    lines = [head, "-" * len(head)]
    for s in steps:
        gpu = (f"{format_size(s.gpu_live_peak):>12}{format_size(s.gpu_held_peak):>12}" if s.gpu_held_peak
               else f"{'-':>12}{'-':>12}")
        lines.append(f"{s.step:>5}{format_size(s.live_peak):>12}{format_size(s.held_peak):>12}"
                     f"{format_size(s.excess):>11}{gpu}")
    if refused:
        lines.append(f"{refused} requests the GPU's pool met were refused here: the replay departs from the "
                     "trace after the first")
    return "\n".join(lines)


def growth_report(step: StepPeaks) -> str:
    lines = [f"step {step.step}: requests that made the pool hold more GPU memory"]
    for size, before, after, live in step.growth:
        lines.append(f"  {format_size(size):>11}: held {format_size(before)} -> {format_size(after)}, "
                     f"live {format_size(live)}, held and free when it came {format_size(before - live)}")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", type=Path, help="a file UM_POOL_TRACE wrote (.gz too)")
    p.add_argument("--growth", type=int, metavar="STEP", help="list the requests that raised step STEP's held bytes")
    args = p.parse_args(argv)
    if not args.trace.is_file():
        p.error(f"no trace at {args.trace}")
    if args.growth is not None and args.growth < 1:
        p.error(f"--growth is a step number from 1; got {args.growth}")
    replay = Replay(growth_of=args.growth)
    steps = replay.run(read_lines(args.trace))
    print(report(steps, replay.refused))
    if args.growth is not None:
        if args.growth > len(steps):
            p.error(f"--growth {args.growth}: the trace has {len(steps)} steps")
        print(growth_report(steps[args.growth - 1]))


if __name__ == "__main__":
    main()
