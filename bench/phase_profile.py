"""One training step of a bench/zoo_train.py model traced, per phase (forward, backward,
optimizer): the GPU's span, its kernels' busy time (their union), its idle time, the kernels and
copies launched in the phase. Kernels are assigned to the phase whose host range launched them.
What it tells apart is GPU work from the GPU waiting, which the planner's CUDA events cannot.

    python bench/phase_profile.py --model t5 --label stock --step 4            # a kept step
    python -m um_alloc run --budget 21GiB bench/phase_profile.py --model t5 --label safe --step 1
    python -m um_alloc run --budget 21GiB bench/phase_profile.py --model t5 --label planned --step 8

Under the launcher with a budget, steps 0 and 1 are the planner's safe steps (blocks recomputed,
inputs and the rest moved) and later ones run the plan. The profiler slows the host: compare
kernel busy times across runs, and spans only within one. Appends one JSON line to --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import zoo_train  # noqa: E402
from profile_offload import busy_and_gaps  # noqa: E402

PHASES = ("forward", "backward", "optimizer")
GAP_US = 50  # shorter idle stretches are launch latency


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(zoo_train.MODELS), required=True)
    p.add_argument("--label", required=True, help="the record's name for this run, e.g. stock or safe")
    p.add_argument("--step", type=int, default=4, help="the step traced, counted from 0 (default 4)")
    p.add_argument("--batch", type=int, help="default: the model's (zoo_train.MODELS)")
    p.add_argument("--out", type=Path, default=Path("phase_profile.jsonl"))
    args = p.parse_args(argv)
    if args.step < 0:
        p.error(f"--step must be at least 0; got {args.step}")
    return args


def phase_figures(trace_events: list[dict]) -> dict:
    """Per phase: host ms, GPU span, kernel busy and idle ms, kernels, copies and their ms."""
    ranges = [(e["name"], e["ts"], e["ts"] + e["dur"]) for e in trace_events
              if e.get("cat") == "user_annotation" and e["name"] in PHASES]
    launched = {e["args"]["correlation"]: e["ts"] for e in trace_events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    gpu = [e for e in trace_events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    figures = {}
    for name, start, end in ranges:
        mine = [e for e in gpu if start <= launched.get(e["args"].get("correlation"), -1) <= end]
        kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == "kernel")
        copies = [e for e in mine if e["cat"] == "gpu_memcpy"]
        if not kernels:
            continue
        busy, gaps = busy_and_gaps(kernels)
        span = max(e for _, e in kernels) - kernels[0][0]
        figures[name] = {"host_ms": (end - start) / 1e3, "gpu_span_ms": span / 1e3, "kernel_busy_ms": busy / 1e3,
                         "idle_ms": (span - busy) / 1e3, "idle_over_50us_ms": sum(g for _, g in gaps if g > GAP_US) / 1e3,
                         "kernels": len(kernels), "copies": len(copies),
                         "copy_ms": sum(e["dur"] for e in copies) / 1e3}
    return figures


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("phase_profile.py: needs a CUDA device")
    zoo = zoo_train.MODELS[args.model]
    torch.manual_seed(0)
    model = zoo.build(False).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    batches = [{k: v.pin_memory() for k, v in zoo.make_batch(args.batch or zoo.batch, False, generator).items()}
               for _ in range(2)]
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)

    def step(number: int) -> float:
        """One training step in the phases' host ranges; its host seconds."""
        begun = time.perf_counter()
        inputs = {k: v.cuda(non_blocking=True) for k, v in batches[number % 2].items()}
        with torch.profiler.record_function("forward"), autocast:
            loss = model(**inputs).loss
        with torch.profiler.record_function("backward"):
            loss.backward()
        with torch.profiler.record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # waits for the step, as a loop that logs its loss does
        return time.perf_counter() - begun

    for number in range(args.step):
        step(number)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        host_s = step(args.step)
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    result = {"model": args.model, "label": args.label, "step": args.step, "host_step_ms": host_s * 1e3,
              **phase_figures(events)}
    with args.out.open("a") as f:
        f.write(json.dumps(result) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
