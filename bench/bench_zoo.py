"""The block planner on models no other benchmark names, against checkpointing, at budgets between
everything in memory and everything checkpointed: each model in one invocation.

    python bench/bench_zoo.py --models llama,t5,vit            # budgets at 0.6x stock's peak
    python bench/bench_zoo.py --models vit --fractions 0.4,0.7
    python bench/bench_zoo.py --models llama --lengths 256:1024   # a length per step (dynamic padding)

    python bench/bench_zoo.py --models gpt2 --batch 2 --accumulate 4   # loops as users write them
    python bench/bench_zoo.py --models encoder --fp16                    # (zoo_train.py's options)

For each model (bench/zoo_train.py: a plain loop with no um_alloc line, each run a process of its own):
  stock          PyTorch's allocator, everything in memory: the reference of every ratio; its peak
                 of allocated bytes times each of --fractions is a budget (rounded to 256 MiB)
  checkpointing  PyTorch's allocator capped at the budget, every layer checkpointed
  frontier       the same, the first k layers checkpointed, k the smallest that fits (searched
                 from a guess: memory falls about linearly with k), the strongest peer where
                 it fits
  save_on_cpu    PyTorch's allocator capped at the budget, every saved activation in pinned host
                 memory (torch.autograd.graph.save_on_cpu); a model without blocks (vgg) has only
                 this peer
  planner        python -m um_alloc run --budget B bench/zoo_train.py: the script unchanged

With --ablations, what the planner's step is made of, each also under the launcher:
  um_in_memory       no budget: um_alloc's allocator, everything in memory (right after each of
                     stock's runs)
  um_checkpointing   no budget, every layer checkpointed by Hugging Face: the peer on um_alloc
  planner_recompute  the budget, the planner told to recompute every block (strategy: checkpoint)

With --plain-loss, also planner_plain_loss: the planner with its chunked cross-entropy off
(scheduler.lean_loss: false), the model's loss left to PyTorch (a loss the loop takes, as with
zoo_train.py --loop-loss, is PyTorch's either way).

With --remade-logits, also planner_remade_logits: the planner with scheduler.recompute_logits on,
its chunked cross-entropy making a linear head's logits again from the head's input in backward.

Records (the protocol's fields, with the model, the peers' k, the planner's plan, predicted step
time and calibration, each method's ratio to the fastest peer that fits, and the GPU's clocks as its
first run's timed steps began and ended) share one run_id and go to
bench/results/RUN_ID/zoo_<model>.json. A method that does not fit is recorded with its status.

With --repeats N (default 2) the timed methods at each budget (checkpointing, the frontier's k,
the planner, and the ablations) run N times, alternated, and stock N times at the end of its
model: the host and the GPU's clocks move a run's median by up to 10% on these machines. A
record's samples/s is the median of its runs' (each run's own is the median of its steps after
--warmup), its high-water the highest, its other figures the first run's; every run's samples/s
is in samples_per_s_runs.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import tempfile
from pathlib import Path

from harness import (PLANNER_SETTLING_STEPS, REMADE_LOGITS, RESULTS, ROOT, Run, new_run_id, planner_fields, pooled,
                     protocol_record, ratio, raw_policy, refuse_bad_counts, run_train, smallest_fitting, with_scheduler,
                     write_policy, write_result)

from um_alloc.sizes import format_size

ZOO_TRAIN = ROOT / "bench" / "zoo_train.py"
GRAIN = 256 << 20          # budgets are rounded to this
GiB = 1 << 30


def budgets_from(peak: int, fractions: list[float]) -> list[int]:
    """Each fraction of stock's peak, rounded to the nearest GRAIN (at least one GRAIN)."""
    return [max(GRAIN, round(peak * f / GRAIN) * GRAIN) for f in fractions]


def frontier_guess(stock_peak: int | None, all_peak: int | None, layers: int, budget: int) -> int:
    """The k whose first-k checkpointing should just fit, if memory falls linearly from stock's
    peak (k = 0) to every layer checkpointed (k = layers), with 8% of the budget kept spare for
    what the allocator holds beyond its live bytes."""
    if not stock_peak or not all_peak or stock_peak <= all_peak:
        return layers
    per_layer = (stock_peak - all_peak) / layers
    return min(layers, max(0, math.ceil((stock_peak - 0.92 * budget) / per_layer)))


def zoo_run(name: str, model: str, args, *extra: str, launch: tuple[str, ...] = ()) -> Run:
    train_args = ["--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup), *extra]
    if args.batch:
        train_args += ["--batch", str(args.batch)]
    if args.lengths:
        train_args += ["--lengths", args.lengths, "--pad-to", str(args.pad_to)]
    train_args += loop_args(args)
    return Run(name, f"bench/zoo_train.py {' '.join(train_args)}", train_args, script=ZOO_TRAIN, launch=launch)


def loop_args(args) -> list[str]:
    """How the script's loop trains (zoo_train.py --accumulate, --fp16, --freeze-layers, --loop-loss,
    --pairs)."""
    out = ["--accumulate", str(args.accumulate)] if args.accumulate > 1 else []
    out += ["--fp16"] if args.fp16 else []
    out += ["--freeze-layers", str(args.freeze_layers)] if args.freeze_layers else []
    out += ["--pairs"] if args.pairs else []
    return out + (["--loop-loss"] if args.loop_loss else [])


def peer_run(model: str, args, budget: int, layers: str) -> tuple[dict | None, str, str]:
    name = "checkpointing" if layers == "all" else f"frontier_k{layers}"
    return run_train(zoo_run(name, model, args, "--checkpoint-layers", layers, "--memory-limit", f"{budget}B"),
                     args.timeout)


def save_on_cpu_run(model: str, args, budget: int) -> tuple[dict | None, str, str]:
    return run_train(zoo_run("save_on_cpu", model, args, "--save-on-cpu", "--memory-limit", f"{budget}B"),
                     args.timeout)


NO_BLOCKS = (None, "no blocks", "the model has no blocks to checkpoint")
PEERS = ("checkpointing", "frontier", "save_on_cpu")  # the methods the planner is set against


def launched_run(name: str, model: str, args, *extra: str, budget: int | None = None,
                 policy: Path | None = None) -> tuple[dict | None, str, str, dict]:
    """The script under the launcher; its result, status, note, and the launcher's report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        launch = ("-m", "um_alloc", "run", *(["--budget", str(budget)] if budget else []),
                  *(["--policy", str(policy)] if policy else []), "--json", str(report))
        summary, status, note = run_train(zoo_run(name, model, args, *extra, launch=launch), args.timeout)
        extra_report = json.loads(report.read_text()) if report.exists() else {}
    return summary, status, note, extra_report


def planner_record(launched: tuple, method: str, **common) -> dict:
    summary, status, note, report = launched
    planner = report.get("planner") or {}
    return record(summary, status, note, method=method, plan_table=report.get("plan_table"), **planner_fields(planner),
                  # steps run in the safe mode to measure, and input shapes planned or borrowing a plan
                  safe_steps=planner.get("safe_steps"), inputs=planner.get("inputs"),
                  # cross-entropies computed in chunks (a model's loss inside its forward)
                  lean_loss_calls=planner.get("lean_loss_calls"),
                  # over the whole run: cudaMallocManaged and cudaFree calls (cudaFree waits for the
                  # device), and requests that overflowed to host memory
                  pool_calls={key: (report.get("memory_stats") or {}).get(key)
                              for key in ("arena_reserves", "arena_releases", "overflow_allocations")},
                  **common)


def record(summary: dict | None, status: str, note: str, *, method: str, model: str, run_id: str,
           stock_rate: float | None, budget: int | None, **fields) -> dict:
    out = protocol_record(None if summary is None else {**summary, "method": method}, run_id=run_id,
                          stock_samples_per_s=stock_rate, budget_bytes=budget, method=method)
    out.update(model=model, status=status, note=note, budget_bytes=budget,
               checkpointed_layers=(summary or {}).get("checkpointed_layers"),
               peak_bytes=(summary or {}).get("peak_bytes"),
               # --lengths: each step's sequence length, and the mean step that samples/s is made of
               lengths=(summary or {}).get("lengths"), step_s_mean=(summary or {}).get("step_s_mean"),
               step_seconds=(summary or {}).get("step_seconds"),  # the first run's, every step
               gpu_clocks=(summary or {}).get("gpu_clocks"),  # the first run's, as its timed steps began and at its end
               samples_per_s_runs=(summary or {}).get("samples_per_s_runs"), **fields)
    return out


def frontier_at(model: str, args, budget: int, stock_peak: int | None, every: tuple) -> tuple[tuple, list[int]]:
    """The fastest first-k checkpointing that fits the budget, as run_train's (summary, status,
    note), and every k tried; `every` is the run with every layer checkpointed."""
    if every[0] is None:  # fewer layers checkpointed hold more: none fits
        return (None, every[1], "every layer checkpointed does not fit"), []
    layers = every[0]["checkpointed_layers"]
    runs = {layers: every}

    def fits(k: int) -> dict | None:
        if k not in runs:
            runs[k] = peer_run(model, args, budget, str(k))
        return runs[k][0]

    guess = frontier_guess(stock_peak, every[0].get("peak_bytes"), layers, budget)
    k, _, tried = smallest_fitting(fits, guess, layers, known={layers: every[0]})
    return runs[k], tried


def compare_at(model: str, args, budget: int, run_id: str, stock_peak: int | None) -> list[dict]:
    """Every peer and the planner at one budget, as records (their ratios to stock come later)."""
    from zoo_train import MODELS

    if MODELS[model].checkpointable:
        every = peer_run(model, args, budget, "all")
        frontier, tried = frontier_at(model, args, budget, stock_peak, every)
    else:
        every, frontier, tried = NO_BLOCKS, NO_BLOCKS, []
    runs = {"checkpointing": [every], "frontier": [frontier], "save_on_cpu": [], "planner": []}
    again = {}  # method -> one more run of it
    if every[0] is not None:  # where none fits, once is enough
        again["checkpointing"] = lambda: peer_run(model, args, budget, "all")
        k = frontier[0]["checkpointed_layers"]
        if k != every[0]["checkpointed_layers"]:
            again["frontier"] = lambda: peer_run(model, args, budget, str(k))
    again["save_on_cpu"] = lambda: save_on_cpu_run(model, args, budget)
    again["planner"] = lambda: launched_run("planner", model, args, budget=budget)
    variants = {}  # planner runs under another policy: method -> (scheduler keys, what the policy is)
    if args.ablations:
        variants["planner_recompute"] = ({"strategy": "checkpoint"}, "planner.yaml, every block recomputed")
    if args.plain_loss:
        variants["planner_plain_loss"] = ({"lean_loss": False}, "planner.yaml, the loss left to PyTorch")
    if args.remade_logits:
        variants["planner_remade_logits"] = REMADE_LOGITS
    for method, (keys, what) in variants.items():
        policy = write_policy(args.out_dir / "policies", method, with_scheduler(raw_policy("planner"), **keys), what)
        runs[method] = []
        again[method] = functools.partial(launched_run, method, model, args, budget=budget, policy=policy)
    for repeat in range(args.repeats):
        for method, run_one in again.items():
            if repeat or not runs[method]:  # the peers' first runs are the search's
                runs[method].append(run_one())
    if "frontier" not in again and every[0] is not None:  # its k is every layer: the same runs
        runs["frontier"] = runs["checkpointing"]
    common = dict(model=model, run_id=run_id, stock_rate=None, budget=budget)
    records = [record(*pooled(runs["checkpointing"]), method="checkpointing", **common),
               record(*pooled(runs["frontier"]), method="frontier", frontier_tried=tried, **common),
               record(*pooled(runs["save_on_cpu"]), method="save_on_cpu", **common),
               planner_record(pooled(runs["planner"]), "planner", **common)]
    records += [planner_record(pooled(runs[method]), method, **common) for method in variants]
    peers = [r["samples_per_s"] for r in records if r["method"] in PEERS and r["samples_per_s"]]
    for r in records:
        r["ratio_vs_fastest_peer"] = ratio(r["samples_per_s"], max(peers) if peers else None)
    planned = next(r for r in records if r["method"] == "planner")
    if planned["highwater_bytes"] is not None:
        planned["highwater_within_budget_plus_1GiB"] = planned["highwater_bytes"] <= budget + GiB
    return records


def compare_model(model: str, args, run_id: str) -> list[dict]:
    """Stock, then every budget, then stock's other runs; every ratio to stock against its
    pooled runs. With --ablations, um_alloc in memory runs right after each of stock's runs, so
    that the two meet the host in the same state."""
    stock = [run_train(zoo_run("stock", model, args), args.timeout)]
    records = []
    if stock[0][0] is not None:
        peak = stock[0][0]["peak_bytes"]
        in_memory = []
        if args.ablations:
            common = dict(model=model, run_id=run_id, stock_rate=None, budget=None)
            in_memory.append(launched_run("um_in_memory", model, args))
            records.append(planner_record(launched_run("um_checkpointing", model, args, "--checkpoint-layers", "all"),
                                          "um_checkpointing", **common))
        for budget in budgets_from(peak, args.fractions):
            print(f"[{model}] budget {format_size(budget)}", flush=True)
            records += compare_at(model, args, budget, run_id, peak)
        for _ in range(args.repeats - 1):
            stock.append(run_train(zoo_run("stock", model, args), args.timeout))
            if args.ablations:
                in_memory.append(launched_run("um_in_memory", model, args))
        if in_memory:
            records.insert(0, planner_record(pooled(in_memory), "um_in_memory", **common))
    stock_record = record(*pooled(stock), method="stock", model=model, run_id=run_id, stock_rate=None, budget=None)
    for r in [stock_record, *records]:
        r["ratio_vs_stock"] = ratio(r["samples_per_s"], stock_record["samples_per_s"])
    return [stock_record, *records]


def loop_suffix(args) -> str:
    """_accumulate4_fp16_freeze12: the loop's options in a result file's name."""
    parts = [f"accumulate{args.accumulate}"] if args.accumulate > 1 else []
    parts += ["fp16"] if args.fp16 else []
    parts += [f"freeze{args.freeze_layers}"] if args.freeze_layers else []
    parts += ["looploss"] if args.loop_loss else []
    parts += ["pairs"] if args.pairs else []
    return "".join(f"_{p}" for p in parts)


def print_table(model: str, records: list[dict]) -> None:
    print(f"\n{model}: run {records[0]['run_id']}")
    print(f"{'method':<15}{'budget':>10}{'k':>4}{'samples/s':>11}{'vs stock':>10}{'vs peer':>9}{'NVML':>11}  status")
    for r in records:
        rate = "" if r["samples_per_s"] is None else f"{r['samples_per_s']:.1f}"
        vs = "" if r["ratio_vs_stock"] is None else f"{r['ratio_vs_stock']:.3f}"
        vp = "" if r.get("ratio_vs_fastest_peer") is None else f"{r['ratio_vs_fastest_peer']:.3f}"
        budget = "" if r["budget_bytes"] is None else format_size(r["budget_bytes"])
        nvml = "" if r["highwater_bytes"] is None else format_size(r["highwater_bytes"])
        k = "" if r["checkpointed_layers"] is None else str(r["checkpointed_layers"])
        print(f"{r['method']:<15}{budget:>10}{k:>4}{rate:>11}{vs:>10}{vp:>9}{nvml:>11}  {r['status']}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama,t5,vit", help="comma-separated, of bench/zoo_train.py's MODELS")
    p.add_argument("--fractions", default="0.6", help="budgets as fractions of stock's peak, comma-separated")
    p.add_argument("--batch", type=int, help="every model's batch (default: each model's own)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--warmup", type=int, default=PLANNER_SETTLING_STEPS,
                   help="first steps left out of the median (the planner calibrates in the first two, then "
                        "tries up to four plans, three steps at a time, in turn and back)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each timed method, alternated (see above)")
    p.add_argument("--lengths", metavar="MIN:MAX", help="a sequence length per step, drawn from MIN to MAX "
                   "(bench/zoo_train.py --lengths; llama and t5): samples/s is then the mean after --warmup")
    p.add_argument("--pad-to", type=int, default=8, help="--lengths: each rounded up to a multiple of this")
    p.add_argument("--accumulate", type=int, default=1, metavar="N", help="zoo_train.py --accumulate: "
                   "gradients of N micro-batches a step")
    p.add_argument("--fp16", action="store_true", help="zoo_train.py --fp16: float16 with a GradScaler")
    p.add_argument("--freeze-layers", type=int, default=0, metavar="K", help="zoo_train.py --freeze-layers")
    p.add_argument("--loop-loss", action="store_true", help="zoo_train.py --loop-loss: the decoders' loss taken "
                   "in the loop from their logits")
    p.add_argument("--pairs", action="store_true", help="zoo_train.py --pairs: two forwards, of two batches, "
                   "before each backward")
    p.add_argument("--timeout", type=float, default=300, help="seconds per run (default 300)")
    p.add_argument("--ablations", action="store_true", help="also the runs that say what the planner's step "
                   "costs (see above)")
    p.add_argument("--plain-loss", action="store_true", help="also the planner with its chunked cross-entropy off "
                   "(see above)")
    p.add_argument("--remade-logits", action="store_true", help="also the planner with the head's logits made "
                   "again in backward (see above)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(ZOO_TRAIN.parent))
    from zoo_train import MODELS

    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown or not args.models:
        p.error(f"--models: unknown {', '.join(unknown) or 'none given'}; allowed: {', '.join(sorted(MODELS))}")
    try:
        args.fractions = [float(f) for f in args.fractions.split(",")]
    except ValueError:
        p.error(f"--fractions must be numbers between 0 and 1, comma-separated; got {args.fractions!r}")
    if not all(0 < f < 1 for f in args.fractions):
        p.error(f"--fractions must lie between 0 and 1 (budgets below stock's peak); got {args.fractions}")
    if args.pad_to < 1:
        p.error(f"--pad-to must be at least 1; got {args.pad_to}")
    if args.accumulate < 1 or args.freeze_layers < 0:
        p.error(f"--accumulate must be at least 1 and --freeze-layers at least 0; got {args.accumulate} and "
                f"{args.freeze_layers}")
    refuse_bad_counts(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    run_id = new_run_id("zoo")
    out = args.out_dir = args.out or RESULTS / run_id  # policies of the ablations go there too
    for model in args.models:
        records = compare_model(model, args, run_id)
        print_table(model, records)
        print(f"wrote {write_result(f'zoo_{model}{loop_suffix(args)}', records, out)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
