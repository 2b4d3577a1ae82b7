"""Do kernels run while the copy engine moves a tensor to or from pinned host memory?

    python bench/copy_overlap.py        (writes bench/results/copy_overlap.json)

Times 150 bf16 4096x4096 matmuls alone, a 1 GiB pinned copy alone (each way), and both together
(the copy on a side stream), for the tensor in three kinds of memory, each in its own process:
  cudamalloc       PyTorch's own allocator
  managed          um_alloc's pool (cudaMallocManaged), copied directly
  managed_staged   um_alloc's pool, copied through a DeviceStage (um_alloc.staging), as
                   ActivationOffload does when um_alloc is installed
overlap = (matmuls + copy - both) / min(matmuls, copy): 1 when the copy hides under the kernels,
0 when the two run one after the other.
"""
from __future__ import annotations

import datetime
import json
import sys

from harness import new_run_id, run_child, write_result

MODES = ("cudamalloc", "managed", "managed_staged")
GiB = 1 << 30


def measure(mode: str) -> dict:
    import torch

    if mode != "cudamalloc":
        import um_alloc

        um_alloc.install("none.yaml")
    from um_alloc.byte_views import byte_view
    from um_alloc.staging import DeviceStage

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    tensor = torch.ones(GiB, dtype=torch.uint8, device="cuda")
    host = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    stage = DeviceStage(64 << 20, torch.device("cuda")) if mode == "managed_staged" else None
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def matmuls(n=150):
        for _ in range(n):
            torch.mm(a, a)

    def start_copy(direction):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if stage is None:
                (host.copy_(tensor, non_blocking=True) if direction == "d2h"
                 else tensor.copy_(host, non_blocking=True))
            elif direction == "d2h":
                stage.to_host(byte_view(tensor), host)
            else:
                stage.from_host(host, byte_view(tensor))

    def timed(*work):
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for w in work:
            w()
        main.wait_stream(side)
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end)

    for _ in range(2):  # warm-up: kernels chosen, pages placed
        timed(lambda: matmuls(20), lambda: start_copy("d2h"), lambda: start_copy("h2d"))
    out = {"mode": mode, "matmuls_ms": timed(matmuls)}
    for direction in ("d2h", "h2d"):
        copy_ms = timed(lambda: start_copy(direction))
        both_ms = timed(lambda: start_copy(direction), matmuls)
        out[direction] = {"copy_ms": copy_ms, "both_ms": both_ms, "copy_GBps": GiB / copy_ms / 1e6,
                          "overlap": (out["matmuls_ms"] + copy_ms - both_ms) / min(out["matmuls_ms"], copy_ms)}
    out["device"] = torch.cuda.get_device_name()
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2])))
        return
    run_id, runs = new_run_id("copy_overlap"), []
    for mode in MODES:
        try:
            runs.append(run_child([__file__, "--child", mode], timeout=300))
        except RuntimeError as error:
            sys.exit(str(error))
        r = runs[-1]
        print(f"{mode:15s} matmuls {r['matmuls_ms']:6.1f} ms | " + " | ".join(
            f"{d}: copy {r[d]['copy_ms']:5.1f} ms ({r[d]['copy_GBps']:4.1f} GB/s), both {r[d]['both_ms']:5.1f} ms, "
            f"overlap {r[d]['overlap']:.2f}" for d in ("d2h", "h2d")), flush=True)
    record = {"device": runs[0]["device"], "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "run_id": run_id,
              "what": "150 bf16 4096^2 matmuls beside a 1 GiB pinned copy on a side stream", "runs": runs}
    print("wrote", write_result("copy_overlap", record))


if __name__ == "__main__":
    main()
