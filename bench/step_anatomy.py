"""Where a training step's time goes, one method per process: the step on both clocks, and from a
torch.profiler trace of two steps the GPU's busy time, its idle gaps, and the kernels and host
calls that take the most. Two methods' records side by side say what one adds to the other.

    python bench/step_anatomy.py --model gpt2 --method um_budget_checkpointing --budget 12GiB --out a.jsonl
    python bench/step_anatomy.py --model gpt2 --method planner_recompute --budget 12GiB --out a.jsonl
    python bench/step_anatomy.py --compare a.jsonl gpt2 um_budget_checkpointing planner_recompute

Methods (a plain loop: bf16 autocast, fused AdamW, batch 8 of 1024 tokens, the loss read each step):
  stock_checkpointing       PyTorch's allocator, Hugging Face's checkpointing of every layer
                            (--checkpoint-layers K: of the first K)
  um_checkpointing          um_alloc (best.yaml), no budget, the same checkpointing
  um_budget_checkpointing   um_alloc under --budget, the same checkpointing
  stock_planner_recompute   PyTorch's allocator, the planner told to recompute every block
  planner_recompute         um_alloc (planner.yaml) under --budget, the same
  planner_recompute_checkpoint   the same, every recomputation through torch.utils.checkpoint
                            (one_node_recompute=False)
  planner_recompute_plain_loss   the same without the lean loss
  planner                   um_alloc under --budget, the planner's own plan
  planner_selective         the same, with the selective decisions allowed too
--force DECISION makes a planner method run DECISION for every block once the planner has
measured (BlockPlanner.force; gaps kept), to time one decision against another.

Models: gpt2 (GPT-2-medium, 24 layers, vocabulary 50,257) and llama (bench/zoo_train.py's).
Each run appends one JSON line to --out: the median step of steps --warmup to --steps on the
host's clock and on CUDA events, and, from the two profiled steps after them, per step: the span
from the first GPU activity to the last, the GPU's busy time (the union of kernels, copies and
memsets), its gaps longer than 50 us, and the 40 kernels and 40 host calls that take the longest.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from profile_offload import busy_and_gaps, gpu_events

METHODS = ("stock_checkpointing", "um_checkpointing", "um_budget_checkpointing", "stock_planner_recompute",
           "planner_recompute", "planner_recompute_checkpoint", "planner_recompute_plain_loss", "planner",
           "planner_selective")
FORCED = ("keep", "rebuild", "recompute", "selective")
MODELS = ("gpt2", "llama")
PROFILED_STEPS = 2
GAP_US = 50        # idle stretches of the GPU shorter than this are launch latency, not waiting
TOP = 40


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS)
    p.add_argument("--method", choices=METHODS)
    p.add_argument("--budget", help="the GPU budget of the um_alloc methods, e.g. 12GiB")
    p.add_argument("--checkpoint-layers", default="all", metavar="K|all",
                   help="the checkpointing methods: the first K layers (default all)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=18, help="steps left out of the median (the planner measures "
                   "and tries plans in its first steps)")
    p.add_argument("--force", choices=FORCED, help="planner methods: every block this decision, from the "
                   "step after the planner's measuring steps")
    p.add_argument("--eager-rebuilds", action="store_true", help="planner methods: rebuild trees of elementwise "
                   "calls call by call, not as one kernel each (um_alloc.planner.fused_tree)")
    p.add_argument("--out", help="append the record to this JSON-lines file")
    p.add_argument("--trace", help="also keep the profiler's trace, in this folder")
    p.add_argument("--compare", nargs=4, metavar=("JSONL", "MODEL", "METHOD_A", "METHOD_B"),
                   help="print what METHOD_B's kernels and host calls take beyond METHOD_A's, from records")
    args = p.parse_args(argv)
    if args.compare:
        return args
    if args.model is None or args.method is None:
        p.error("--model and --method are required (or --compare)")
    if args.method.startswith(("um_budget", "planner")) and args.budget is None:
        p.error(f"--method {args.method} needs --budget")
    for flag, given in (("--force", args.force), ("--eager-rebuilds", args.eager_rebuilds)):
        if given and not args.method.startswith("planner"):
            p.error(f"{flag} applies to the planner methods, not --method {args.method}")
    if args.checkpoint_layers != "all" and not args.checkpoint_layers.isdigit():
        p.error(f"--checkpoint-layers must be a number of layers or 'all'; got {args.checkpoint_layers!r}")
    if not 0 <= args.warmup < args.steps:
        p.error(f"--warmup must be at least 0 and below --steps ({args.steps}); got {args.warmup}")
    return args


# -- the trace --

def totals(events: list[dict], categories: tuple[str, ...], width: int) -> dict[str, list]:
    """Name -> [calls, microseconds] over the events of these categories."""
    out: dict[str, list] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in categories:
            seen = out.setdefault(e["name"][:width], [0, 0.0])
            seen[0] += 1
            seen[1] += e["dur"]
    return out


def summarize(trace: dict, steps: int = PROFILED_STEPS) -> dict:
    """Per step, in milliseconds: the GPU's span, busy time and gaps; the kernels and host calls
    that take the longest ([name, calls, ms])."""
    events = trace["traceEvents"]
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu_events(trace))
    if not intervals:
        raise ValueError("the trace holds no GPU activity: was CUDA profiled?")
    busy, gaps = busy_and_gaps(intervals)
    gaps = sorted((length for _, length in gaps), reverse=True)

    def top(found: dict) -> list:
        rows = [[name, calls // steps, round(us / 1e3 / steps, 3)] for name, (calls, us) in found.items()]
        return sorted(rows, key=lambda r: -r[2])[:TOP]

    return {"span_ms": (intervals[-1][1] - intervals[0][0]) / 1e3 / steps, "busy_ms": busy / 1e3 / steps,
            "gaps_ms": sum(g for g in gaps if g > GAP_US) / 1e3 / steps,
            "longest_gaps_ms": [round(g / 1e3, 2) for g in gaps[:12]],
            "kernels": len(intervals) // steps,
            "gpu_top": top(totals(events, ("kernel", "gpu_memcpy", "gpu_memset"), 90)),
            "host_top": top(totals(events, ("cpu_op", "cuda_runtime", "cuda_driver"), 80))}


def compare(records: list[dict], model: str, a: str, b: str) -> str:
    """What b's kernels and host calls take beyond a's, largest first."""
    found = {r["method"]: r for r in records if r["model"] == model}
    missing = [m for m in (a, b) if m not in found or "profile" not in found[m]]
    if missing:
        raise SystemExit(f"step_anatomy.py --compare: no profiled record of {', '.join(missing)} for {model}")
    lines = [f"{model}: {b} against {a}, per step (ms)",
             f"  step {found[a]['step_ms']} -> {found[b]['step_ms']}; GPU busy "
             f"{found[a]['profile']['busy_ms']:.1f} -> {found[b]['profile']['busy_ms']:.1f}"]
    for key, label in (("gpu_top", "kernels"), ("host_top", "host calls")):
        mine = {r[0]: r[2] for r in found[a]["profile"][key]}
        theirs = {r[0]: r[2] for r in found[b]["profile"][key]}
        rows = sorted(set(mine) | set(theirs), key=lambda n: -(theirs.get(n, 0) - mine.get(n, 0)))
        lines.append(f"  {label}:")
        lines += [f"    {theirs.get(n, 0) - mine.get(n, 0):+8.3f}  {n}" for n in rows[:10]]
    return "\n".join(lines)


# -- the run --

def build(model_name: str):
    if model_name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        return GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, use_cache=False))
    sys.path.insert(0, str(Path(__file__).parent))
    import zoo_train
    return zoo_train.MODELS[model_name].build(False)


def prepare(args):
    """um_alloc installed as the method asks (before CUDA starts), the model, its optimizer and
    what the method attaches; (model, optimizer, planner or None)."""
    import torch
    budget = None
    if args.method.startswith("um") or args.method.startswith("planner"):
        import um_alloc
        from um_alloc.sizes import parse_size
        budget = parse_size(args.budget, key="--budget", source="command line") if args.budget else None
        um_alloc.install("planner.yaml" if "planner" in args.method else "best.yaml",
                         budget=budget if args.method != "um_checkpointing" else None)
    torch.manual_seed(0)
    model = build(args.model).cuda().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if budget is not None or args.method == "um_checkpointing":
        import um_alloc
        um_alloc.tag_training(model, optimizer)
    planner = None
    if args.method.endswith("checkpointing"):
        sys.path.insert(0, str(Path(__file__).parent))
        import zoo_train
        zoo_train.checkpointed_layers(model, args.checkpoint_layers)
    else:
        import um_alloc.planner as planning
        if args.eager_rebuilds:
            from um_alloc.planner import fused_tree
            fused_tree.DEVICE_TYPES = ()  # no device gets one kernel per tree
        every = list(planning.Decision) if args.method == "planner_selective" else None
        planner = planning.plan(model, budget or 40 << 30,
                                strategy="auto" if args.method in ("planner", "planner_selective") else "checkpoint",
                                lean_loss=args.method != "planner_recompute_plain_loss",
                                one_node_recompute=args.method != "planner_recompute_checkpoint",
                                decisions=[d.value for d in every] if every else None)
    return model, optimizer, planner


def run(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from um_alloc.planner.director import CALIBRATION_STEPS

    model, optimizer, planner = prepare(args)
    vocab = 50257 if args.model == "gpt2" else 32000
    ids = torch.randint(0, vocab, (8, 1024), generator=torch.Generator().manual_seed(0)).pin_memory()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    host, gpu, profiler = [], [], None
    for step in range(args.steps + PROFILED_STEPS):
        if step == args.steps:
            profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            profiler.start()
        if args.force and step == CALIBRATION_STEPS + 1:  # the plan is made as the step after them begins
            planner.force(args.force)
        begun = time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        x = ids.cuda(non_blocking=True)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        loss.item()  # waits for the step, as a loop that logs its loss does
        host.append(time.perf_counter() - begun)
        gpu.append(start.elapsed_time(end) / 1e3)
    profiler.stop()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(args.trace or folder) / f"trace_{args.model}_{args.method}.json"
        trace.parent.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(trace))
        traced = json.loads(trace.read_text())
    timed = slice(args.warmup, args.steps)
    record = {"model": args.model, "method": args.method, "budget": args.budget,
              "device": torch.cuda.get_device_name(),
              **({"forced": args.force} if args.force else {}),
              **({"eager_rebuilds": True} if args.eager_rebuilds else {}),
              **({"checkpoint_layers": args.checkpoint_layers} if args.method.endswith("checkpointing") else {}),
              "step_ms": round(1e3 * statistics.median(host[timed]), 2),
              "gpu_step_ms": round(1e3 * statistics.median(gpu[timed]), 2),
              "step_ms_each": [round(1e3 * s, 1) for s in host], "profile": summarize(traced)}
    if planner is not None and planner.plan is not None:
        summary = planner.to_dict()
        record.update(plan=summary["plan"]["decisions"], predicted_ms=1e3 * summary["plan"]["predicted_step_s"],
                      trials=summary.get("trials"), units=summary["plan"]["units"],
                      calibration=summary.get("calibration"))
    return record


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        path, model, a, b = args.compare
        print(compare([json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()], model, a, b))
        return 0
    record = run(args)
    if args.out:
        with open(args.out, "a") as out:
            out.write(json.dumps(record) + "\n")
    profile_ = record["profile"]
    print(f"{args.model} {args.method}: step {record['step_ms']} ms, GPU busy {profile_['busy_ms']:.1f} ms, "
          f"{profile_['kernels']} kernels, plan {record.get('plan')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
