"""How the pool's chunk and arena sizes change what fits under a memory limit.

Trains BERT-Large with --micro-batch auto under --memory-limit for each (chunk_size,
arena_size) pair and reports the micro-batch that fit, throughput and the pool's peak live
and reserved bytes. Writes bench/results/pool_sweep.json, one run_id across its rows.

    python bench/pool_sweep.py --limit 16GiB --mini-batch 256 --steps 5
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from harness import Run, new_run_id, run_train, write_policy, write_result

VARIANTS = (("2MiB", "1GiB"), ("2MiB", "256MiB"), ("2MiB", "64MiB"), ("1MiB", "64MiB"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", default="16GiB")
    p.add_argument("--mini-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    run_id, rows = new_run_id("pool_sweep"), []
    with tempfile.TemporaryDirectory() as tmp:
        for chunk, arena in VARIANTS:
            name = f"chunk{chunk}_arena{arena}"
            policy = write_policy(Path(tmp), name, {"pool": {"chunk_size": chunk, "arena_size": arena}}, name)
            s, _, _ = run_train(Run(name, "", ["--allocator", "um", "--policy", str(policy), "--memory-limit",
                                                args.limit, "--micro-batch", "auto", "--batch-size",
                                                str(args.mini_batch), "--steps", str(args.steps),
                                                "--warmup-steps", "2"]), 900)
            if s is None:
                continue
            m = s["memory_stats"]
            rows.append({"chunk_size": chunk, "arena_size": arena, "micro_batch": s["micro_batch"],
                         "samples_per_s": s["samples_per_s"], "peak_live_bytes": m["peak_live_bytes"],
                         "peak_reserved_bytes": m["peak_reserved_bytes"], "arenas": m["arenas"],
                         "device": s["device"], "date": s["date"], "run_id": run_id, "limit": args.limit})
            print(f"  micro {s['micro_batch']}, {s['samples_per_s']:.1f} samples/s, peak live "
                  f"{m['peak_live_bytes'] / 2**30:.2f} GiB, peak reserved {m['peak_reserved_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    write_result("pool_sweep", rows)


if __name__ == "__main__":
    main()
