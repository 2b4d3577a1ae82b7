"""CUPTI's unified-memory counters on a real GPU, in a fresh process (CUPTI is per process).

    python tests/gpu_scripts/counters_check.py [--records PATH]

Three steps over 64 MiB of managed memory that the CPU wrote first (so it lives on the host):
  0. a GPU kernel touches it: expect GPU page faults and HtoD bytes;
  1. the CPU touches it again (back to the host), then cudaMemPrefetchAsync moves it to the GPU;
  2. the same GPU kernel again: expect no GPU page faults.
Prints one JSON line; tests/test_gpu_counters.py asserts on it. Prints {"skip": reason} if
cupti-python cannot be imported. --records writes the raw records (a fixture for CPU tests).
"""
import argparse
import ctypes
import json
import sys

MiB = 1 << 20
SIZE = 64 * MiB


def ok(result, what: str):
    from cuda.bindings import runtime as rt

    err, *rest = result
    if err != rt.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err.name} ({int(err)})")
    return rest[0] if len(rest) == 1 else rest


def prefetch_to_gpu(ptr: int, nbytes: int, device: int = 0) -> None:
    from cuda.bindings import runtime as rt

    location = rt.cudaMemLocation()
    location.type = rt.cudaMemLocationType.cudaMemLocationTypeDevice
    location.id = device
    ok(rt.cudaMemPrefetchAsync(ptr, nbytes, location, 0, 0), "cudaMemPrefetchAsync")  # CUDA 13 form
    ok(rt.cudaDeviceSynchronize(), "cudaDeviceSynchronize")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", help="write the raw records here as JSON")
    args = parser.parse_args()
    try:
        import cupti  # noqa: F401
    except ImportError as error:
        print(json.dumps({"skip": f"cupti-python is not importable: {error}"}))
        return

    from um_alloc.profile import UMCounters

    counters = UMCounters(0, keep_records=True, required=True).start()  # before the CUDA context
    import numpy as np
    import torch
    from cuda.bindings import runtime as rt

    from um_alloc.byte_views import device_bytes

    ptr = ok(rt.cudaMallocManaged(SIZE, rt.cudaMemAttachGlobal), "cudaMallocManaged")
    host = np.ctypeslib.as_array((ctypes.c_uint8 * SIZE).from_address(ptr))
    host[:] = 1                                   # first touch on the CPU: the pages live on the host
    device = device_bytes(ptr, SIZE, "cuda")     # torch runs kernels over the managed pages
    counters.start_steps()

    device.add_(1)                                # step 0: the GPU faults the pages in
    torch.cuda.synchronize()
    counters.mark_step()
    host[:] += 1                                  # step 1: back to the host, then prefetched
    prefetch_to_gpu(ptr, SIZE)
    counters.mark_step()
    device.add_(1)                                # step 2: already resident, no faults
    torch.cuda.synchronize()
    counters.mark_step()
    value = int(host[0])                          # 1 + 1 + 1 + 1, read back on the CPU
    counters.stop()

    steps = counters.per_step()
    if args.records:
        with open(args.records, "w") as file:
            json.dump({"marks": [s["end_ns"] for s in steps], "origin_ns": steps[0]["start_ns"],
                       "records": counters.records()}, file)
    ok(rt.cudaFree(ptr), "cudaFree")
    print(json.dumps({"available": counters.available, "dropped_records": counters.dropped_records,
                      "callback_errors": counters.callback_errors, "value": value, "size": SIZE,
                      "steps": steps, "totals": counters.totals()}))


if __name__ == "__main__":
    main()
    sys.stdout.flush()
