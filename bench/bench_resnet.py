"""The largest ResNet-50 batch a GPU budget trains: stock PyTorch and its checkpointing against
the block planner.

    python bench/bench_resnet.py --budget 8GiB

A plain loop (torchvision's ResNet-50, 224x224, bf16 autocast, SGD with momentum, synthetic
images), each batch a process of its own:

  stock       stock PyTorch limited to the budget (a memory fraction); its largest batch is
              searched (doubling from --start, then bisection)
  planner     um_alloc with policies/planner.yaml under the budget, the planner attached with one
              call (um_alloc.planner.plan); every batch of --planner-batches is trained, from
              stock's largest up, so that a batch that fails between two that train shows
  checkpoint  the strongest peer past stock's largest batch: stock PyTorch under the same memory
              fraction with every bottleneck checkpointed (torch.utils.checkpoint, non-reentrant),
              at each of the planner's batches (--no-checkpointing leaves it out)

All records share one run_id and go to bench/results/RUN_ID/resnet50_<budget>.json, each with its
batch, samples/s, the ratio to stock's samples/s at stock's largest batch, the NVML high-water and,
for the planner, its plan and predicted step time and its ratio to checkpointing at the same batch
where checkpointing trained it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from harness import (PLANNER_SETTLING_STEPS, RESULTS, child_env, new_run_id, planner_fields, ratio,
                     refuse_bad_counts, write_result)

from um_alloc.sizes import format_size, parse_size

WORKLOAD = "resnet50-224-bf16-sgd"
MARKER = "RESULT "
PEERS = ("stock", "checkpoint")  # stock PyTorch under a memory fraction of the budget
RETRIES = 3  # as bert_example/train.py: a step that runs out of memory runs again this many times


def train(method: str, batch: int, budget: int, steps: int, warmup: int) -> dict:
    """One run in this process: the record of its timed steps, or raises torch.OutOfMemoryError."""
    import torch
    import torchvision

    planner = None
    if method == "planner":
        import um_alloc
        um_alloc.install("planner.yaml", budget=budget)
    device = torch.device("cuda")
    if method in PEERS:
        torch.cuda.set_per_process_memory_fraction(budget / torch.cuda.get_device_properties(device).total_memory)
    free, total = torch.cuda.mem_get_info(device)
    used_before = total - free
    model = torchvision.models.resnet50().to(device)
    if method == "checkpoint":
        checkpoint_every_block(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if method == "planner":
        import um_alloc.planner
        um_alloc.tag_training(model, optimizer)
        planner = um_alloc.planner.plan(model, budget)
    images = torch.randn(batch, 3, 224, 224, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    seconds, losses, arenas = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = _step(model, optimizer, images, labels, retry=planner is not None)
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        arenas.append(_arena_calls(method))
    free, total = torch.cuda.mem_get_info(device)
    step_s = statistics.median(seconds[warmup:])
    record = {"device": torch.cuda.get_device_name(device), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "workload": WORKLOAD, "method": method, "batch": batch, "budget_bytes": budget, "step_s_median": step_s,
              "samples_per_s": batch / step_s, "highwater_bytes": total - free - used_before,
              "loss_first": losses[0], "loss_last": losses[-1]}
    if planner is not None:
        record.update(planner_fields(planner.to_dict()))
        timed = steps - warmup  # cudaMallocManaged and cudaFree (which syncs the device) in a timed step
        record.update({f"{name}_per_step": (arenas[-1][i] - arenas[warmup - 1][i]) / timed
                       for i, name in enumerate(("arena_reserves", "arena_releases"))})
    return record


def checkpoint_every_block(model) -> int:
    """Wraps every block of a torchvision ResNet's four stages so that PyTorch's checkpointing
    recomputes its activations in backward (the peer users would reach for); the blocks wrapped."""
    import torch.nn as nn
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(nn.Module):
        def __init__(self, block: nn.Module):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpoint(self.block, x, use_reentrant=False)

    wrapped = 0
    for stage in (model.layer1, model.layer2, model.layer3, model.layer4):
        for i, block in enumerate(stage):
            stage[i] = Checkpointed(block)
            wrapped += 1
    return wrapped


def _arena_calls(method: str) -> tuple[int, int]:
    if method != "planner":
        return 0, 0
    import um_alloc

    stats = um_alloc.memory_stats()
    return stats["arena_reserves"], stats["arena_releases"]


def _step(model, optimizer, images, labels, retry: bool) -> float:
    """One training step; under the planner, a step that runs out of memory runs again (the
    planner keeps less from then on), as train.py does."""
    import torch

    for attempt in range(RETRIES + 1):
        try:
            return _train_step(model, optimizer, images, labels)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            if not retry or attempt == RETRIES:
                raise
        # Here the failed attempt's frame, and with it its loss and every activation its autograd
        # graph still saves, is gone: the next attempt does not start with them in memory.
    raise AssertionError("unreachable")


def _train_step(model, optimizer, images, labels) -> float:
    import torch
    import torch.nn.functional as F

    with torch.autocast(images.device.type, dtype=torch.bfloat16):
        loss = F.cross_entropy(model(images), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def probe(method: str, batch: int, args) -> dict | None:
    """Runs one batch in a child process; its record, or None when it ran out of memory."""
    command = [sys.executable, __file__, "--child", method, "--batch", str(batch), "--budget", args.budget,
               "--steps", str(args.steps), "--warmup", str(args.warmup)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=child_env())
    except subprocess.TimeoutExpired:
        print(f"[{method} b{batch}] timed out after {args.timeout:.0f} s", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"[{method} b{batch}] failed: {last[:600]}", flush=True)
        return None
    record = json.loads(lines[-1][len(MARKER):])
    print(f"[{method} b{batch}] {record['samples_per_s']:.0f} img/s, high-water {format_size(record['highwater_bytes'])}",
          flush=True)
    return record


def runs(method: str, batches: list[int], budget: int, run_id: str, args, probe=probe) -> list[dict]:
    """A record for each batch of `method`, each run in a process of its own. The planner tries
    every batch, so that one failing between two that train shows; checkpointing's memory grows
    with the batch, so past the first it cannot train none is tried."""
    out, failed_at = [], None
    for batch in batches:
        if failed_at is not None and method != "planner":
            out.append(_not_trained(method, batch, budget, run_id, f"skipped: batch {failed_at} failed"))
            continue
        record = probe(method, batch, args)
        if record is None:
            failed_at = failed_at or batch
            out.append(_not_trained(method, batch, budget, run_id, "failed"))
        else:
            out.append({**record, "run_id": run_id})
    return out


def _not_trained(method: str, batch: int, budget: int, run_id: str, status: str) -> dict:
    return {"run_id": run_id, "workload": WORKLOAD, "method": method, "batch": batch, "budget_bytes": budget,
            "samples_per_s": None, "status": status}


def largest_stock_batch(args) -> tuple[int | None, dict | None]:
    """Doubling from --start, then bisection between the last batch that trained and the first that did not."""
    fits, fails, best = None, None, None
    batch = args.start
    while fails is None and batch <= args.max_batch:
        record = probe("stock", batch, args)
        if record is None:
            fails = batch
        else:
            fits, best, batch = batch, record, 2 * batch
    if fits is None:
        return None, None
    while fails is not None and fails - fits > args.resolution:
        middle = (fits + fails) // 2
        record = probe("stock", middle, args)
        if record is None:
            fails = middle
        else:
            fits, best = middle, record
    return fits, best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="8GiB")
    p.add_argument("--steps", type=int, default=PLANNER_SETTLING_STEPS + 8,
                   help="steps per run, the planner's calibration and trials included")
    p.add_argument("--warmup", type=int, default=PLANNER_SETTLING_STEPS,
                   help="first steps left out of the timing (the planner's calibration and trials)")
    p.add_argument("--start", type=int, default=64, help="stock's first batch")
    p.add_argument("--max-batch", type=int, default=1024, help="stock's largest probe")
    p.add_argument("--resolution", type=int, default=16, help="stock's search stops this close to the boundary")
    p.add_argument("--planner-batches", default="1,1.5,2,3,4,5,6",
                   help="the planner's batches, as multiples of stock's largest")
    p.add_argument("--no-checkpointing", action="store_true",
                   help="leave out the peer with every bottleneck checkpointed")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", choices=PEERS + ("planner",), help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    budget = parse_size(args.budget, key="--budget", source="command line")
    refuse_bad_counts(p, args)
    if args.child:
        print(MARKER + json.dumps(train(args.child, args.batch, budget, args.steps, args.warmup)), flush=True)
        return 0
    multiples = [float(m) for m in args.planner_batches.split(",")]
    run_id = new_run_id("resnet50")
    stock_batch, stock = largest_stock_batch(args)
    if stock is None:
        p.error(f"stock PyTorch trains no batch from {args.start} at {args.budget}")
    records = [{**stock, "run_id": run_id, "largest": True}]
    batches = [int(round(multiple * stock_batch / 8)) * 8 for multiple in multiples]
    methods = ("planner",) if args.no_checkpointing else ("planner", "checkpoint")
    for method in methods:
        records += runs(method, batches, budget, run_id, args)
    checkpointed = {r["batch"]: r.get("samples_per_s") for r in records if r["method"] == "checkpoint"}
    for r in records:
        r["ratio_vs_stock"] = ratio(r.get("samples_per_s"), stock["samples_per_s"])
        r["batch_vs_stock"] = r["batch"] / stock_batch
        if r["method"] == "planner" and not args.no_checkpointing:
            r["ratio_vs_checkpoint"] = ratio(r.get("samples_per_s"), checkpointed.get(r["batch"]))
    write_result(f"resnet50_{args.budget}", records, args.out or RESULTS / run_id)
    _report(records, budget, run_id)
    return 0


def _report(records: list[dict], budget: int, run_id: str) -> None:
    print(f"\nResNet-50 at {format_size(budget)}, run {run_id}")
    print(f"{'method':<11}{'batch':>7}{'x stock':>9}{'img/s':>9}{'vs stock':>10}{'vs ckpt':>9}{'high-water':>12}  plan")
    for r in records:
        rate = "failed" if r.get("samples_per_s") is None else f"{r['samples_per_s']:.0f}"
        vs = "" if r.get("ratio_vs_stock") is None else f"{r['ratio_vs_stock']:.2f}"
        vs_checkpoint = "" if r.get("ratio_vs_checkpoint") is None else f"{r['ratio_vs_checkpoint']:.2f}"
        water = "" if r.get("highwater_bytes") is None else format_size(r["highwater_bytes"])
        plan = r.get("plan") or {}
        note = ", ".join(f"{n} {k}" for k, n in (plan.get("decisions") or {}).items())
        print(f"{r['method']:<11}{r['batch']:>7}{r['batch_vs_stock']:>9.1f}{rate:>9}{vs:>10}{vs_checkpoint:>9}"
              f"{water:>12}  {note}")


if __name__ == "__main__":
    sys.exit(main())
