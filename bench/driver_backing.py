"""Does the driver give GPU memory back when managed pages leave the GPU?

    python bench/driver_backing.py        # about 10 s; needs 16 GiB of free GPU memory

Touches 4 GiB ranges of one managed pool on the GPU, moves some to the host (cudaMemPrefetchAsync)
or discards them (cudaMemDiscardBatchAsync), touches new ranges, and prints NVML's device memory
in use (minus the start) after each step. Measured on an H200 (driver 580, 2026-11-22,
bench/results/logs/driver_backing_h200_2026-11-22.log): 4, 4, 8, 8, 12, 12.07, 16.07, 0.07 GiB,
i.e. a range keeps its GPU memory after its pages leave, a new range gets new GPU memory, and only
cudaFree returns it. That is why a hard budget counts GPU-backed chunks, not resident ones.
"""
import json
import time

import pynvml
import torch
from cuda.bindings import runtime as rt

import harness  # noqa: F401  (this checkout's um_alloc first on sys.path, run from anywhere)
from um_alloc.byte_views import device_bytes
from um_alloc.pool import ChunkPool

GiB = 1 << 30
RANGE = 4 * GiB


def main() -> dict:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    used = lambda: pynvml.nvmlDeviceGetMemoryInfo(handle).used  # noqa: E731
    torch.zeros(1, device="cuda")  # the CUDA context, before the baseline
    torch.cuda.synchronize()
    base, out = used(), {}

    def touch(ptr: int) -> None:
        device_bytes(ptr, RANGE).fill_(1)

    def mark(what: str) -> None:
        torch.cuda.synchronize()
        time.sleep(0.2)
        out[what] = round((used() - base) / GiB, 2)
        print(f"{what}: {out[what]} GiB", flush=True)

    pool = ChunkPool.managed(0, arena_size=1 * GiB)
    a = pool.malloc(RANGE); touch(a); mark("A touched (4 GiB)")
    pool.migrate(a, False, 0); mark("A migrated to host")
    b = pool.malloc(RANGE); touch(b); mark("B touched (new range)")
    pool.migrate(b, False, 0); pool.migrate(a, True, 0); mark("B out, A back")
    c = pool.malloc(RANGE); touch(c); mark("C touched")
    side = torch.cuda.Stream()
    (err,) = rt.cudaMemDiscardBatchAsync([c], [RANGE], 1, 0, side.cuda_stream)
    assert err == rt.cudaError_t.cudaSuccess, err
    side.synchronize(); mark("C discarded")
    d = pool.malloc(RANGE); touch(d); mark("D touched after C's discard")
    for ptr in (a, b, c, d):
        pool.free(ptr)
    pool.empty_cache(); mark("all freed + empty_cache")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
