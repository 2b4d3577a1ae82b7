"""Where a planned ResNet-50 step's time goes: the GPU's kernels, copies out and copies back, in
10 ms stretches of one traced step.

    python bench/resnet_timeline.py --batch 704 --budget 8GiB

The workload is bench_resnet.py's (torchvision's ResNet-50, 224x224, bf16 autocast, SGD with
momentum, a plain loop) under um_alloc with policies/planner.yaml and the planner attached. After
--steps steps (the planner's measuring steps and trials among them), one step is traced with
torch.profiler. Per stretch: the share of it the GPU spent in kernels, in copies to host memory
and in copies back. A stretch where one runs and the others wait shows what the step waits for:
the link in forward where the copies out outlast the kernels, or copies back and kernels taking
turns in backward. Prints the table and writes one JSON line to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from profile_offload import gpu_events, kind_of

BUCKET_US = 10_000.0
SHOWN = {"kernel": "kernel", "DtoH": "out", "HtoD": "back"}  # profile_offload's kinds, as the table names them


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--budget", default="8GiB")
    p.add_argument("--steps", type=int, default=22, help="steps before the traced one (default 22)")
    p.add_argument("--window", help="the planner's window of copies back (default: its own)")
    p.add_argument("--out", type=Path, default=Path("resnet_timeline.jsonl"))
    args = p.parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        p.error(f"--batch and --steps must be at least 1, not {args.batch} and {args.steps}")
    return args


def stretches(events: list[dict]) -> dict:
    """Per 10 ms stretch of the traced span, the busy time of each kind, and their totals (ms)."""
    gpu = gpu_events({"traceEvents": events})
    start = min(e["ts"] for e in gpu)
    span = max(e["ts"] + e["dur"] for e in gpu) - start
    busy = {k: [0.0] * (int(span // BUCKET_US) + 1) for k in ("kernel", "out", "back", "other")}
    for e in gpu:
        at, end, row = e["ts"] - start, e["ts"] - start + e["dur"], busy[SHOWN.get(kind_of(e), "other")]
        while at < end:
            cut = min(end, (int(at // BUCKET_US) + 1) * BUCKET_US)
            row[int(at // BUCKET_US)] += cut - at
            at = cut
    return {"span_ms": span / 1e3, "busy_ms": {k: sum(v) / 1e3 for k, v in busy.items()},
            "stretches": [{k: round(busy[k][i] / BUCKET_US, 3) for k in busy} for i in range(len(busy["kernel"]))]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.nn.functional as F
    import torchvision

    import um_alloc
    import um_alloc.planner
    from um_alloc.sizes import parse_size

    budget = parse_size(args.budget, key="--budget", source="the command line")
    um_alloc.install("planner.yaml", budget=budget)
    device = torch.device("cuda")
    model = torchvision.models.resnet50().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    um_alloc.tag_training(model, optimizer)
    planner = um_alloc.planner.plan(model, budget, **({"window": args.window} if args.window else {}))
    images = torch.randn(args.batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (args.batch,), device=device)

    def step() -> float:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    seconds = []
    for _ in range(args.steps):
        began = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - began)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as trace:
        step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        trace.export_chrome_trace(str(path))
        found = stretches(json.loads(path.read_text())["traceEvents"])
    plan = planner.to_dict().get("plan") or {}
    record = {"batch": args.batch, "budget_bytes": budget, "window": args.window,
              "step_ms_median_last6": statistics.median(seconds[-6:]) * 1e3,
              "made": plan.get("made"), "decisions": plan.get("decisions"), "moved_bytes": plan.get("moved_bytes"),
              "predicted_step_s": plan.get("predicted_step_s"), **found}
    print(f"batch {args.batch} at {args.budget}: step {record['step_ms_median_last6']:.1f} ms (median of the last 6), "
          f"plan {record['made']} {record['decisions']}; traced span {found['span_ms']:.1f} ms, busy "
          + ", ".join(f"{k} {v:.1f} ms" for k, v in found["busy_ms"].items()))
    print("  ms   kernel%   out%  back%")
    for i, s in enumerate(found["stretches"]):
        print(f"{i * 10:5d} {s['kernel'] * 100:7.0f} {s['out'] * 100:6.0f} {s['back'] * 100:6.0f}")
    with args.out.open("a") as out:
        out.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
