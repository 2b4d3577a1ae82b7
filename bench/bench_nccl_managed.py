"""NCCL's all-reduce and all-gather bandwidth on buffers from um_alloc's pool (managed memory)
against buffers from PyTorch's own allocator (cudaMalloc), on the GPUs of one host.

    python bench/bench_nccl_managed.py                  # 2 GPUs, 1 MiB to 1 GiB
    python bench/bench_nccl_managed.py --gpus 4 --quick # 4 GPUs, three sizes, fewer iterations
    python bench/bench_nccl_managed.py --repeats 3      # the two allocators alternating, 3 times each

Each allocator runs in processes of its own (torchrun, one per GPU: PyTorch takes a new allocator
only before CUDA starts); um_alloc installs with none.yaml on each process's GPU. NCCL's settings,
NVLink multicast (NCCL_NVLS_ENABLE) included, stay as the machine sets them. Bandwidths as
nccl-tests reports them: algbw = bytes / time; busbw = algbw x 2(n-1)/n for all-reduce and
x (n-1)/n for all-gather (the bytes each link carries); with --repeats, the median over the
repeats. Sizes below 16 MiB are called more often, since a 1 MiB all-reduce takes tens of
microseconds: with --iterations 20, 80 calls at 4 MiB and 320 at 1 MiB. Writes
bench/results/nccl_managed.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

from harness import new_run_id, run_child, write_result

MODES = ("cudamalloc", "managed")
MiB = 1 << 20
SIZES = tuple(MiB << k for k in range(0, 11, 2))  # 1 MiB to 1 GiB
QUICK_SIZES = (MiB, 64 * MiB, 1024 * MiB)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=1, help="runs of each allocator, alternating")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)  # one rank of one mode, under torchrun
    args = p.parse_args()
    for flag, value in (("--gpus", args.gpus), ("--iterations", args.iterations), ("--repeats", args.repeats)):
        if value < 1:
            p.error(f"{flag}: {value} is not a positive whole number")
    return args


def measure(mode: str, sizes: tuple[int, ...], iterations: int) -> dict | None:
    """This rank's timings of both collectives at every size; rank 0 returns them, the others None."""
    import torch
    import torch.distributed as dist

    if mode == "managed":
        import um_alloc

        um_alloc.install("none.yaml")  # on LOCAL_RANK's GPU
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = [_timed(size, world, max(iterations, iterations * (64 * MiB // size) // 4)) for size in sizes]
    result = {"mode": mode, "world": world, "device": torch.cuda.get_device_name(), "rows": rows}
    dist.destroy_process_group()
    return result if rank == 0 else None


def _timed(size: int, world: int, iterations: int) -> dict:
    import torch
    import torch.distributed as dist

    buffer = torch.ones(size // 4, dtype=torch.float32, device="cuda")
    gathered = torch.empty(world * buffer.numel(), dtype=torch.float32, device="cuda")
    calls = {"all_reduce": lambda: dist.all_reduce(buffer),
             "all_gather": lambda: dist.all_gather_into_tensor(gathered, buffer)}
    factor = {"all_reduce": 2 * (world - 1) / world, "all_gather": (world - 1) / world}
    row = {"bytes": size}
    for name, call in calls.items():
        seconds = _seconds_per_call(call, iterations)
        moved = size if name == "all_reduce" else size * world  # nccl-tests: the output's bytes for all-gather
        algbw = moved / seconds / 1e9
        row[name] = {"s": seconds, "algbw_GBps": algbw, "busbw_GBps": algbw * factor[name]}
    return row


def _seconds_per_call(call, iterations: int) -> float:
    import torch

    for _ in range(3):  # warm-up: NCCL's channels set up, pages placed
        call()
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iterations):
        call()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / 1e3 / iterations


def compare(runs: dict) -> list[dict]:
    """Per size and collective: managed's bus bandwidth over cudaMalloc's, each the median over
    the repeats (runs[mode] is a list of rank 0's results, one a repeat)."""
    out = []
    for k, size in enumerate(row["bytes"] for row in runs["cudamalloc"][0]["rows"]):
        for name in ("all_reduce", "all_gather"):
            plain, managed = (statistics.median(r["rows"][k][name]["busbw_GBps"] for r in runs[mode]) for mode in MODES)
            ratio = managed / plain
            out.append({"bytes": size, "collective": name, "repeats": len(runs["managed"]),
                        "cudamalloc_busbw_GBps": plain, "managed_busbw_GBps": managed, "ratio": ratio,
                        "within_5_percent": ratio >= 0.95})
    return out


def main() -> None:
    args = parse_args()
    sizes = QUICK_SIZES if args.quick else SIZES
    iterations = 5 if args.quick else args.iterations
    if args.child:
        result = measure(args.child, sizes, iterations)
        if result is not None:
            print(json.dumps(result))
        return
    run_id, runs = new_run_id("nccl_managed"), {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES:  # alternating, so that a drift of the machine touches both alike
            flags = ["--child", mode, "--iterations", str(args.iterations)] + (["--quick"] if args.quick else [])
            print(f"[{mode}] repeat {repeat + 1} of {args.repeats}", flush=True)
            try:
                runs[mode].append(run_child(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                             str(args.gpus), __file__, *flags], timeout=600))
            except RuntimeError as error:
                sys.exit(str(error))
    rows = compare(runs)
    for r in rows:
        print(f"{r['collective']:<11}{r['bytes'] / MiB:>7.0f} MiB  cudaMalloc {r['cudamalloc_busbw_GBps']:7.1f} GB/s  "
              f"managed {r['managed_busbw_GBps']:7.1f} GB/s  ratio {r['ratio']:.3f}", flush=True)
    record = {"device": runs["cudamalloc"][0]["device"], "gpus": args.gpus, "repeats": args.repeats,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "run_id": run_id,
              "what": "NCCL all-reduce and all-gather, float32 buffers, bus bandwidth as nccl-tests reports it",
              "rows": rows, "runs": runs}
    print("wrote", write_result("nccl_managed", record))


if __name__ == "__main__":
    main()
