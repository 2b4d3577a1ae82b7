"""Per step of a pool trace (UM_POOL_TRACE), replayed on the host backend by bench/pool_trace.py:
the bytes the pool prefetched to the GPU for each tag, and the spilled loss's bytes: those placed
in an arena made for them (pages no one has touched yet) and those in arenas that existed.

    python bench/results/scale_8GiB/measuring_step/replay_placements.py \
        bench/results/scale_8GiB/measuring_step/pool_trace_5081c4d_h200.gz

Steps are the replay's: each time step arenas are switched on (a step's forward, or the units the
planner runs by themselves between steps) a new one begins; step 0 is the set-up before them.
"""
import collections
import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import pool_trace  # noqa: E402

from um_alloc import _lib  # noqa: E402
from um_alloc.tags import TAGS  # noqa: E402


class Placements(pool_trace.Replay):
    def __init__(self):
        super().__init__()
        self.prefetched = collections.defaultdict(collections.Counter)  # step -> tag -> bytes
        self.spilled = collections.defaultdict(collections.Counter)     # step -> where -> bytes

    def _stats(self):
        stats = _lib.StatsC()
        self.lib.um_pool_stats(self.pool, ctypes.byref(stats))
        return stats.prefetch_bytes, stats.arena_reserves

    def _event_a(self, place, size, tag, step_arenas, stream):
        prefetched, reserved = self._stats()
        super()._event_a(place, size, tag, step_arenas, stream)
        prefetched_after, reserved_after = self._stats()
        step, name = len(self.steps), TAGS[int(tag)]
        self.prefetched[step][name] += prefetched_after - prefetched
        if name == "spill" and place in self.places:
            where = "in a new arena" if reserved_after > reserved else "in arenas that existed"
            self.spilled[step][where] += int(size)


def gib(counter) -> dict:
    return {key: round(value / 2**30, 2) for key, value in counter.items() if value}


if __name__ == "__main__":
    replay = Placements()
    replay.run(pool_trace.read_lines(Path(sys.argv[1])))
    for step in range(len(replay.steps) + 1):
        print(f"step {step}: prefetched to the GPU {gib(replay.prefetched[step])}; spilled {gib(replay.spilled[step])}")
