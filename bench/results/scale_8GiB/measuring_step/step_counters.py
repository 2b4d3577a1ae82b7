"""bert_example/train.py with the pool's counters read around every step: its wall time (synchronized),
and what the pool prefetched to the GPU, advised, reserved, released and overflowed in it.

    python bench/results/scale_8GiB/measuring_step/step_counters.py --model large --seq-len 512 \\
        --allocator um --policy large_batch.yaml --budget 8GiB --batch-size 160 --dropout 0 --steps 10

Each step prints a STEPSTAT line on stderr. With UM_POOL_TRACE=PREFIX set as well, the pool writes
the trace replay_placements.py reads. The process exits with train.py's summary as its message.
"""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import bert_example.train as train  # noqa: E402

COUNTERS = ("prefetch_bytes", "prefetch_calls", "advise_calls", "arena_reserves", "arena_releases", "overflow_bytes")
build_step = train.build_step


def counted_build_step(*args, **kwargs):
    step_fn, *rest = build_step(*args, **kwargs)
    from um_alloc.pool import ChunkPool
    pool = ChunkPool.for_device(0)

    def counted(*step_args, **step_kwargs):
        before, start = pool.raw_stats(), time.perf_counter()
        out = step_fn(*step_args, **step_kwargs)
        torch.cuda.synchronize()
        after = pool.raw_stats()
        delta = {name: after.get(name, 0) - before.get(name, 0) for name in COUNTERS}
        delta["prefetch_GiB"] = round(delta.pop("prefetch_bytes") / 2**30, 2)
        print("STEPSTAT", round(time.perf_counter() - start, 3), delta, file=sys.stderr, flush=True)
        return out
    return (counted, *rest)


train.build_step = counted_build_step
sys.argv = ["train.py", *sys.argv[1:]]
sys.exit(train.main())
