"""Where a step of ViT-B/16 (batch 128, bf16 autocast, fused AdamW) spends its time, eager or
through torch.compile: each phase on both clocks, dynamo's counters, and a profile of three steps
(the host's top ops and the GPU's top kernels).

    python bench/compile_profile.py --compile --trace trace.json          # stock, in memory
    python -m um_alloc run --budget 7784628224 bench/compile_profile.py --compile
    ... --bf16-math-attention   # PyTorch's math attention in bf16, not fp32

Under um_alloc run the block planner plans the step; the first 15 steps (its measuring steps, and
compiling) are left out of the phase times.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

STEPS, TIMED_FROM = 30, 15
PHASES = ("forward", "backward", "optimizer", "step")


def vit() -> torch.nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       image_size=224, patch_size=16, num_labels=1000)
    return ViTForImageClassification(config).cuda().train()


def timed_step(call, optimizer, images, labels) -> dict:
    """One step; per phase, (host ms, GPU ms)."""
    events = [torch.cuda.Event(enable_timing=True) for _ in PHASES]
    clocks = [time.perf_counter()]
    events[0].record()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = call(pixel_values=images.cuda(non_blocking=True), labels=labels.cuda(non_blocking=True)).loss
    clocks.append(time.perf_counter())
    events[1].record()
    loss.backward()
    clocks.append(time.perf_counter())
    events[2].record()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    events[3].record()
    loss.item()  # waits for the step, as a loop that logs its loss does
    clocks.append(time.perf_counter())
    gpu = [a.elapsed_time(b) for a, b in zip(events, events[1:])] + [events[0].elapsed_time(events[3])]
    host = [1e3 * (b - a) for a, b in zip(clocks, clocks[1:])] + [1e3 * (clocks[-1] - clocks[0])]
    return {phase: (h, g) for phase, h, g in zip(PHASES, host, gpu)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true", help="call the model through torch.compile (its defaults)")
    p.add_argument("--bf16-math-attention", action="store_true",
                   help="torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)")
    p.add_argument("--trace", default=None, help="write the profiled steps' Chrome trace here")
    args = p.parse_args()
    if args.bf16_math_attention:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    model = vit()
    call = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(128, 3, 224, 224, generator=generator).pin_memory()
    labels = torch.randint(0, 1000, (128,), generator=generator)
    steps = [timed_step(call, optimizer, images, labels) for _ in range(STEPS)][TIMED_FROM:]
    medians = {phase: [round(statistics.median(s[phase][clock] for s in steps), 2) for clock in (0, 1)]
               for phase in PHASES}
    print(f"{'compiled' if args.compile else 'eager'}: host/GPU ms medians {medians}", flush=True)
    from torch._dynamo.utils import counters
    print("dynamo counters", {k: dict(v) for k, v in counters.items() if v}, flush=True)
    profile(call, optimizer, images, labels, args.trace)


def profile(call, optimizer, images, labels, trace: str | None) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    with profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            timed_step(call, optimizer, images, labels)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))
    print(averages.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    if trace:
        prof.export_chrome_trace(trace)


if __name__ == "__main__":
    main()
