"""Soak: thousands of training steps of a small BERT under a GPU budget, with the block planner or
the activation offload on, and the memory that could creep sampled after every step.

    python bench/bench_soak.py                                # both modes, 2,000 steps each
    python bench/bench_soak.py --modes planner --out DIR
    python bench/bench_soak.py --device cpu --steps 8 --warmup 4 --batch-size 2 --seq-len 16   # the loop on the CPU

The model: BertForMaskedLM, 4 layers of hidden size 256 (vocabulary 8192), batch 16 of 128
tokens, bf16 autocast, fused AdamW, dropout 0.1, random tokens. Each mode runs in a process of its
own (um_alloc installs before CUDA starts), under --budget (1.5 GiB) and --max-reserved (4 GiB):

  planner  policies/planner.yaml; the block planner allowed only its safe decisions, so every
           step recomputes every block from inputs kept in host memory and moves what lies
           between blocks to host memory and back: the most work its replay does
  offload  policies/offload.yaml; the activation offload told there is no room (its peak_fn reports
           the budget), so every saved tensor of 1 MiB or more goes to pinned host memory and
           back, every step

After every step (it ends with loss.item(): the GPU has finished it) the record takes the pool's
live, GPU-backed and reserved bytes, the process's resident host memory (RSS), the pinned host
memory PyTorch's host allocator holds (the copies' buffers), and every --nvml-every steps the
device memory NVML counts in use. After --warmup steps, each must stay within its tolerance
(max - min, FLAT_TOLERANCES). Records with every sample go to DIR/soak_<mode>.json (default
bench/results/soak/); the exit status is 1 if a mode was not flat or did not finish.
With --device cpu the same loop runs without um_alloc: only host RSS is sampled.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from harness import RESULTS, child_env, refuse_bad_counts, write_result

import torch

MiB = 1 << 20
MODES = ("planner", "offload")
POLICIES = {"planner": "planner.yaml", "offload": "offload.yaml"}
# max - min after warm-up, in bytes, and why that much. Over 1,800 steps a tolerance of T lets
# through a leak of at most T / 1,800 a step: 580 bytes for live bytes, 37 KiB for host memory.
FLAT_TOLERANCES = {
    "live_bytes": 1 * MiB,           # tensors held between steps (parameters, AdamW state): the same every step
    "gpu_backed_bytes": 32 * MiB,    # chunks the driver backs; they grow only if reuse stops finding backed runs
    "reserved_bytes": 0,             # whole arenas (1 GiB): any change is a new one
    "host_rss_bytes": 64 * MiB,      # Python's and the C library's heaps move a little from step to step
    "pinned_host_bytes": 64 * MiB,   # cached pinned blocks, free again once each step's copies are done
    "nvml_used_bytes": 64 * MiB,     # the whole device as the driver counts it: pool, context, copy stages
}
POOL_SERIES = ("live_bytes", "gpu_backed_bytes", "reserved_bytes")


# --- what is sampled -----------------------------------------------------------------------------

def host_rss_bytes() -> int | None:
    """Resident memory of this process (Linux's /proc/self/statm); None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def pinned_host_bytes() -> int | None:
    """Pinned host memory PyTorch's host allocator holds, in use or cached; None where it does not
    say. Versions name the figure differently: the largest of those given is the memory held."""
    host_memory_stats = getattr(torch.cuda.memory, "host_memory_stats", None)  # absent from older PyTorch
    stats = host_memory_stats() if host_memory_stats else {}
    held = [stats[key] for key in ("allocated_bytes.current", "reserved_bytes.current") if key in stats]
    return max(held) if held else None


class Sampler:
    """The figures after each step: one list per series, None where a series has no figure."""

    def __init__(self, device: torch.device, nvml_every: int):
        from um_alloc.pool import ChunkPool

        self.cuda, self.nvml_every = device.type == "cuda", nvml_every
        self.device_index = device.index if device.index is not None else 0
        self.pool = ChunkPool.for_device(self.device_index) if self.cuda else None
        self.samples: dict[str, list] = {"step": [], **{name: [] for name in FLAT_TOLERANCES}}

    def take(self, step: int) -> None:
        from um_alloc.stats import public_stats

        pool = public_stats(self.pool.raw_stats()) if self.pool else {}
        figures = {name: pool.get(name) for name in POOL_SERIES}
        figures.update(host_rss_bytes=host_rss_bytes(), pinned_host_bytes=pinned_host_bytes() if self.cuda else None,
                       nvml_used_bytes=self._nvml_used() if self.cuda and step % self.nvml_every == 0 else None)
        self.samples["step"].append(step)
        for name, value in figures.items():
            self.samples[name].append(value)

    def _nvml_used(self) -> int | None:
        from um_alloc.device_info import device_memory

        memory = device_memory(self.device_index)
        return None if memory is None else memory.used_bytes


def flatness(samples: dict, warmup: int, tolerances: dict = FLAT_TOLERANCES) -> dict:
    """Per series, its figures from step `warmup` on (min, max, range = max - min, first, last)
    against its tolerance; flat when every series with figures is within its own. Series without
    any (no pool on the CPU) are listed as missing."""
    series, missing = {}, []
    for name, tolerance in tolerances.items():
        values = [v for step, v in zip(samples["step"], samples[name]) if step >= warmup and v is not None]
        if not values:
            missing.append(name)
            continue
        spread = max(values) - min(values)
        series[name] = {"min": min(values), "max": max(values), "range": spread, "tolerance": tolerance,
                        "first": values[0], "last": values[-1], "samples": len(values), "flat": spread <= tolerance}
    return {"flat": all(s["flat"] for s in series.values()), "from_step": warmup, "series": series,
            "missing": missing}


# --- the training ---------------------------------------------------------------------------------

def set_up(mode: str, args) -> torch.device:
    """um_alloc under the budget and the cap on CUDA (before any CUDA work); the CPU as it is."""
    device = torch.device(args.device)
    if device.type == "cuda":
        import um_alloc

        chosen = um_alloc.install(POLICIES[mode], budget=args.budget, max_reserved=args.max_reserved,
                                  device=device.index or 0)
        device = torch.device("cuda", chosen.device)
    return device


def build(args, device: torch.device):
    from transformers import BertConfig, BertForMaskedLM

    import um_alloc

    torch.manual_seed(0)
    config = BertConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=max(args.seq_len, 128))
    with um_alloc.tag("parameter") if device.type == "cuda" else contextlib.nullcontext():
        model = BertForMaskedLM(config).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    if device.type == "cuda":
        um_alloc.tag_training(model, optimizer)  # also refuses a budget below parameters + gradients + state
    return model, optimizer


def attach(mode: str, model, device: torch.device, budget: str):
    """(the offload each step runs under, or None; a function giving the mode's own figures)."""
    if mode == "planner":
        import um_alloc

        # Only the safe decisions allowed: the plan is the calibration's safe mode, every step. The
        # margin absorbs a plan's misprediction; this plan is what calibration measured, so less will do.
        planner = um_alloc.plan(model, budget=budget, decisions=["recompute_moved"], margin="256MiB")
        return None, planner.to_dict
    import dataclasses

    from um_alloc.offload import ActivationOffload, from_policy

    budget_bytes = _bytes(budget)
    no_room = lambda: budget_bytes  # noqa: E731  the peak reported as the budget: every eligible tensor moves
    offload = from_policy(peak_fn=no_room) if device.type == "cuda" else \
        ActivationOffload(budget_bytes, device="cpu", peak_fn=no_room)
    return offload, lambda: dataclasses.asdict(offload.stats)


def batches(args, device: torch.device, vocab_size: int = 8192):
    """Random tokens, 15% of them targets, from a seeded generator: batch k is the same in every run."""
    generator = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(5, vocab_size, (args.batch_size, args.seq_len), generator=generator)
        labels = torch.where(torch.rand(ids.shape, generator=generator) < 0.15, ids, -100)
        batch = {"input_ids": ids.to(device), "labels": labels.to(device)}
        if device.type == "cuda":
            import um_alloc

            um_alloc.retag(batch, "input")
        yield batch


def train_step(model, optimizer, batch: dict, offload, device: torch.device) -> float:
    with offload.step() if offload is not None else contextlib.nullcontext():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(**batch).loss
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()  # waits for the step: the figures sampled next are the step's end


def soak(mode: str, args) -> dict:
    """One mode's steps in this process; its record, samples and verdict included."""
    device = set_up(mode, args)
    model, optimizer = build(args, device)
    offload, mode_figures = attach(mode, model, device, args.budget)
    sampler = Sampler(device, args.nvml_every)
    losses, seconds, data = [], [], batches(args, device)
    started = time.perf_counter()
    for step in range(args.steps):
        begin = time.perf_counter()
        losses.append(train_step(model, optimizer, next(data), offload, device))
        seconds.append(time.perf_counter() - begin)
        sampler.take(step)
    record = describe(mode, args, device, time.perf_counter() - started, losses, seconds)
    record.update(mode_figures=mode_figures(), samples=sampler.samples,
                  verdict=flatness(sampler.samples, args.warmup))
    if device.type == "cuda":
        import um_alloc

        record["memory_stats"] = um_alloc.memory_stats()
    return record


def describe(mode: str, args, device: torch.device, wall_s: float, losses: list, seconds: list) -> dict:
    cuda = device.type == "cuda"
    return {
        "benchmark": "soak", "mode": mode, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "torch": torch.__version__,
        "command": "python bench/bench_soak.py " + " ".join(sys.argv[1:]),
        "workload": f"bert-4x256-v8192-b{args.batch_size}-s{args.seq_len}-{'bf16' if cuda else 'fp32'}",
        "policy": POLICIES[mode] if cuda else None, "budget_bytes": _bytes(args.budget),
        "max_reserved_bytes": _bytes(args.max_reserved) if cuda else None,
        "steps": len(losses), "warmup_steps": args.warmup, "wall_s": wall_s,
        "step_s_median": statistics.median(seconds), "step_s_max": max(seconds),
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
    }


def _bytes(size: str) -> int:
    from um_alloc.sizes import parse_size

    return parse_size(size, key="size", source="bench_soak.py")


# --- the benchmark -------------------------------------------------------------------------------

def run_child(mode: str, args) -> dict | None:
    """One mode in a process of its own: its record, or None (the reason printed) if it failed."""
    command = [sys.executable, str(Path(__file__).resolve()), "--child", mode, *forwarded(args)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=child_env())
    except subprocess.TimeoutExpired:
        print(f"[{mode}] did not finish within {args.timeout:.0f} s", flush=True)
        return None
    if done.returncode != 0:
        print(f"[{mode}] failed with status {done.returncode}:\n{done.stderr[-3000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def forwarded(args) -> list[str]:
    return ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--budget", args.budget, "--max-reserved", args.max_reserved,
            "--device", args.device, "--nvml-every", str(args.nvml_every)]


def report(record: dict) -> str:
    verdict = record["verdict"]
    lines = [f"[{record['mode']}] {record['steps']} steps in {record['wall_s']:.0f} s (median step "
             f"{1e3 * record['step_s_median']:.1f} ms), loss {record['loss_first']:.3f} -> {record['loss_last']:.3f}; "
             f"from step {verdict['from_step']}: {'flat' if verdict['flat'] else 'NOT FLAT'}"]
    for name, s in verdict["series"].items():
        lines.append(f"    {name:<18} {s['min'] / MiB:10.1f} .. {s['max'] / MiB:10.1f} MiB, range "
                     f"{s['range'] / MiB:7.2f} MiB (tolerance {s['tolerance'] / MiB:.0f} MiB) "
                     f"{'ok' if s['flat'] else 'NOT FLAT'}")
    if verdict["missing"]:
        lines.append(f"    not sampled here: {', '.join(verdict['missing'])}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200, help="first steps left out of the verdict (default 200)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--budget", default="1536MiB", help="GPU budget (scheduler.budget), default 1536MiB")
    p.add_argument("--max-reserved", default="4GiB", help="the pool's reserve cap (pool.max_reserved), default 4GiB")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (the loop without um_alloc)")
    p.add_argument("--nvml-every", type=int, default=50,
                   help="steps between NVML readings, each of which starts and stops NVML (default 50)")
    p.add_argument("--timeout", type=float, default=900, help="seconds a mode may take (default 900)")
    p.add_argument("--out", type=Path, default=RESULTS / "soak")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.modes = args.modes.split(",")
    if not set(args.modes) <= set(MODES):
        p.error(f"--modes: expected some of {', '.join(MODES)}, got {','.join(args.modes)}")
    refuse_bad_counts(p, args)
    if min(args.batch_size, args.seq_len, args.nvml_every) < 1:
        p.error("--batch-size, --seq-len and --nvml-every must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(soak(args.child, args), default=str), flush=True)
        return 0
    all_flat = True
    for mode in args.modes:
        record = run_child(mode, args)
        if record is None:
            all_flat = False
            continue
        record["command"] = "python bench/bench_soak.py " + " ".join(sys.argv[1:] if argv is None else argv)
        path = write_result(f"soak_{mode}", record, args.out)
        print(report(record) + f"\n    record: {path}", flush=True)
        all_flat = all_flat and record["verdict"]["flat"]
    return 0 if all_flat else 1


if __name__ == "__main__":
    sys.exit(main())
