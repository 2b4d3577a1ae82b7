"""How the pool's chunk and arena sizes change what fits under a memory limit.

Trains BERT-Large with --micro-batch auto under --memory-limit for each (chunk_size,
arena_size) pair and reports the micro-batch that fit, throughput and the pool's peak live
and reserved bytes. Writes bench/results/pool_sweep.json.

    python bench/pool_sweep.py --limit 16GiB --mini-batch 256 --steps 5
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import yaml
from common import RESULTS, run_train

VARIANTS = (("2MiB", "1GiB"), ("2MiB", "256MiB"), ("2MiB", "64MiB"), ("1MiB", "64MiB"))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--limit", default="16GiB")
    p.add_argument("--mini-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for chunk, arena in VARIANTS:
            policy = Path(tmp) / f"chunk{chunk}_arena{arena}.yaml"
            policy.write_text(yaml.safe_dump({"pool": {"chunk_size": chunk, "arena_size": arena}}))
            print(f"chunk {chunk}, arena {arena}", flush=True)
            s = run_train(["--allocator", "um", "--policy", str(policy), "--memory-limit", args.limit,
                           "--micro-batch", "auto", "--batch-size", str(args.mini_batch),
                           "--steps", str(args.steps), "--warmup-steps", "2"])
            if s is None:
                continue
            m = s["memory_stats"]
            rows.append({"chunk_size": chunk, "arena_size": arena, "micro_batch": s["micro_batch"],
                         "samples_per_s": s["samples_per_s"], "peak_live_bytes": m["peak_live_bytes"],
                         "peak_reserved_bytes": m["peak_reserved_bytes"], "arenas": m["arenas"],
                         "device": s["device"], "date": s["date"], "limit": args.limit})
            print(f"  micro {s['micro_batch']}, {s['samples_per_s']:.1f} samples/s, peak live "
                  f"{m['peak_live_bytes'] / 2**30:.2f} GiB, peak reserved {m['peak_reserved_bytes'] / 2**30:.2f} GiB",
                  flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pool_sweep.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
