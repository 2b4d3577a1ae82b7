"""Micro-batch streaming on um_alloc vs the largest batch stock PyTorch fits, at one memory limit.

    python bench/bench_microbatch.py                 # BERT-Large, seq 512, bf16, 16 GiB, mini-batch 256
    python bench/bench_microbatch.py --quick         # fewer steps, mini-batch 64

(a) stock PyTorch under set_per_process_memory_fraction(limit): the largest batch that trains is
    searched, each probe a subprocess of bert_example/train.py (2 steps, so AdamW's state is
    resident), so an out-of-memory never poisons the next probe; then that batch is timed.
(b) um_alloc, --micro-batch auto at the mini-batch size, with the limit as a hard GPU residency
    budget (--budget) under policies/host_optimizer.yaml: AdamW's moments stay in host memory,
    read and written over the link by the optimizer step, so the micro-batches get their room.
    --cap-policy adds a run that uses the limit as the pool's reserve cap instead (all resident).
Both run here, one after the other on the same GPU; each writes a JSON into bench/results/ with
the fields of DESIGN.md's benchmark protocol, one run_id across them. The external check is NVML's
device memory in use, end minus start: a high-water mark of what each process held on the GPU.
"""

from __future__ import annotations

import argparse
from datetime import datetime, timezone
from pathlib import Path

from harness import RESULTS, ROOT, Run, largest_batch, new_run_id, protocol_record, run_train, write_result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory-limit", default="16GiB", help="GPU memory limit for both methods (default 16GiB)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--mini-batch", type=int, default=None, help="um_alloc's mini-batch (default 256; --quick 64)")
    p.add_argument("--steps", type=int, default=None, help="timed run length, warm-up included (default 10; --quick 4)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--stock-start", type=int, default=8, help="first batch the stock search tries (default 8)")
    p.add_argument("--stock-max", type=int, default=512, help="largest batch the stock search tries")
    p.add_argument("--policy", default="host_optimizer.yaml",
                   help="um_alloc policy for the budget run (default host_optimizer.yaml)")
    p.add_argument("--cap-policy", help="also run um_alloc with this policy and the limit as reserve cap")
    p.add_argument("--micro-batch", default="auto",
                   help="um_alloc micro-batch sizes to run, comma-separated: auto and/or numbers (default auto)")
    p.add_argument("--quick", action="store_true", help="a short run to check the set-up")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    args.mini_batch = args.mini_batch or (64 if args.quick else 256)
    args.steps = args.steps or (4 if args.quick else 10)
    args.warmup_steps = min(args.warmup_steps, args.steps - 1)
    args.micro_batch = [m.strip() for m in args.micro_batch.split(",") if m.strip()]
    bad = [m for m in args.micro_batch if m != "auto" and not (m.isdigit() and int(m) > 0)]
    if bad or not args.micro_batch:
        p.error(f"--micro-batch: 'auto' or whole numbers > 0, comma-separated; got {bad or args.micro_batch}")
    return args


def train(args, allocator: str, batch: int, steps: int, warmup: int, extra=(), label: str | None = None
          ) -> dict | None:
    """One train.py run in a subprocess; its summary, or None if it ran out of memory.
    `extra` carries the limit for um_alloc runs; stock runs get --memory-limit. `label` names the
    run in the log (default: the allocator)."""
    limit = ["--memory-limit", args.memory_limit] if allocator == "stock" else []
    train_args = ["--model", "large", "--seq-len", str(args.seq_len), "--allocator", allocator, *limit,
                  "--batch-size", str(batch), "--steps", str(steps), "--warmup-steps", str(warmup), *extra]
    summary, status, note = run_train(Run(f"{label or allocator} b{batch}", "", train_args), 1800)
    if status not in ("ok", "oom"):
        raise RuntimeError(f"train.py {' '.join(train_args)}: {status}: {note}")
    return summary


def _line(label: str, summary: dict | None) -> str:
    if summary is None:
        return f"{label}: out of memory"
    gib = lambda n: f"{(n or 0) / 2**30:.2f} GiB"  # noqa: E731
    return (f"{label}: {summary['samples_per_s']:.1f} samples/s, {summary['step_s_median']:.3f} s/step, "
            f"peak reserved {gib(summary['peak_reserved_bytes'])}, device high-water "
            f"{gib(summary['device_used_delta_bytes'])}, loss {summary['loss_first']:.3f} -> {summary['loss_last']:.3f}")


def search(args, allocator: str, start: int, limit: int, probe_steps: int = 2, extra=(),
           label: str | None = None) -> int:
    """The largest batch that trains `probe_steps` steps (harness.largest_batch: each probe a run
    of its own, so an out-of-memory never poisons the next probe)."""
    label = label or allocator

    def probe(batch: int) -> bool:
        summary = train(args, allocator, batch, steps=probe_steps, warmup=probe_steps - 1, extra=extra, label=label)
        print(_line(f"[{label} probe] batch {batch}", summary), flush=True)
        return summary is not None

    fits = largest_batch(probe, start, limit)
    if fits == 0:
        raise RuntimeError(f"{label} cannot train even batch 1 in {args.memory_limit}")
    return fits


def timed_run(args, allocator: str, batch: int, extra=(), label: str | None = None) -> dict:
    """The timed run of `batch`, the largest a probe fitted; a longer run can still fail right at
    the edge, so it steps down until one fits."""
    label = label or allocator
    while batch > 0:
        summary = train(args, allocator, batch, args.steps, args.warmup_steps, extra, label=label)
        print(_line(f"[{label}] batch {batch}, {args.steps} steps", summary), flush=True)
        if summary is not None:
            return summary
        batch -= 1
    raise RuntimeError(f"{label}: a probe fitted but no {args.steps}-step run did")


def run_stock(args) -> dict:
    return timed_run(args, "stock", search(args, "stock", args.stock_start, args.stock_max))


def run_um(args, policy: str, limit_as: str, micro: str) -> dict | None:
    """limit_as: "budget" (the hard GPU budget) or "cap" (the pool's reserve cap). None: out of memory."""
    limit = ["--budget", args.memory_limit] if limit_as == "budget" else ["--memory-limit", args.memory_limit]
    extra = ["--micro-batch", micro, "--policy", policy, *limit]
    summary = train(args, "um", args.mini_batch, args.steps, args.warmup_steps, extra)
    if summary is None:
        print(f"[um_alloc {policy}, limit as {limit_as}] micro-batch {micro}: out of memory", flush=True)
        return None
    summary["limit_as"] = limit_as
    print(_line(f"[um_alloc {policy}, limit as {limit_as}] mini-batch {args.mini_batch} in micro-batches of "
                f"{summary['micro_batch']}", summary), flush=True)
    return summary


def result(summary: dict, stock_samples_per_s: float, run_id: str) -> dict:
    """A summary of train.py in DESIGN.md's benchmark-protocol form."""
    return protocol_record(
        summary, run_id=run_id, stock_samples_per_s=stock_samples_per_s,
        budget_bytes=summary["memory_limit_bytes"] or summary.get("budget_bytes"),
        method=summary["method"] + ("+microbatch" if summary["micro_batch"] else ""),
        micro_batch=summary["micro_batch"], limit_as=summary.get("limit_as", "memory_fraction"),
        peak_reserved_bytes=summary["peak_reserved_bytes"],
        pool_peak_gpu_backed_bytes=(summary.get("memory_stats") or {}).get("peak_gpu_backed_bytes"),
        steps=summary["steps"])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    run_id = new_run_id("bench_microbatch")
    print(f"micro-batch bench: BERT-Large seq {args.seq_len} bf16, limit {args.memory_limit}, "
          f"{args.steps} steps ({args.warmup_steps} warm-up)", flush=True)
    stock = run_stock(args)
    ums = [run_um(args, args.policy, "budget", micro) for micro in args.micro_batch]
    if args.cap_policy:
        ums.append(run_um(args, args.cap_policy, "cap", "auto"))
    ums = [summary for summary in ums if summary is not None]
    results = [result(s, stock["samples_per_s"], run_id) for s in (stock, *ums)]
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    for entry in results:
        method = entry["method"].replace("+", "_")  # file names that travel: letters, digits, . _ -
        if entry["policy"]:
            method += f"-{Path(entry['policy']).stem}-{entry['limit_as']}-micro{entry['micro_batch']}"
        path = write_result(f"microbatch-{method}-{stamp}", entry, args.out)
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    print(f"\n{'method':<22}{'policy':<22}{'limit as':<16}{'batch':>7}{'micro':>7}{'samples/s':>11}"
          f"{'vs stock':>10}{'high-water':>12}")
    for entry in results:
        print(f"{entry['method']:<22}{str(entry['policy'] or '-'):<22}{entry['limit_as']:<16}{entry['batch']:>7}"
              f"{str(entry['micro_batch'] or '-'):>7}{entry['samples_per_s']:>11.1f}{entry['ratio_vs_stock']:>10.2f}"
              f"{(entry['highwater_bytes'] or 0) / 2**30:>10.2f} G")
    print(f"on {stock['device']}, {stock['date']}, run_id {run_id}")
    return results


if __name__ == "__main__":
    main()
