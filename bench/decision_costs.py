"""What each of the planner's decisions costs a block, measured, against what the cost model predicts.

    python bench/decision_costs.py --budget 40GiB --batch 32

BERT-Large MLM (bf16 autocast, fused AdamW, dropout 0) under um_alloc with the block planner, at
a budget that holds every activation (the device must have it free). After the planner's two
measuring steps, its plan is forced in turn to: every block kept, every block rebuilt, every block
recomputed (the gaps kept throughout), then the planner's own plan; each runs --steps steps after
one to settle, and its median step is set beside the model's prediction for it. --sync reads
each step's loss, as most training loops do: the host then waits for every step. Per block, the
difference between two forced plans is what one decision costs against the other: the figure
the planner's cost model (um_alloc.planner.planning.UnitCost.cost_s) has to predict.

One process, one JSON record (bench/results/RUN_ID/decision_costs.json unless --out): the
forced plans' measured and predicted step times, the per-block costs both ways, and the
calibration the predictions came from.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness import RESULTS, new_run_id, write_result

import torch

FORCED = ("keep", "rebuild", "recompute")


def build(args):
    """The model, its optimizer and one batch on the GPU, under um_alloc with the planner attached."""
    from transformers import BertConfig, BertForMaskedLM

    import um_alloc
    from bert_example.data import SyntheticTokens
    from bert_example.options import MAX_SEQ_LEN, MODELS

    um_alloc.install("planner.yaml", budget=args.budget)
    config = BertConfig(vocab_size=30522, max_position_embeddings=MAX_SEQ_LEN, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **MODELS["large"])
    torch.manual_seed(0)
    with um_alloc.tag("parameter"):
        model = BertForMaskedLM(config).train().cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    um_alloc.tag_training(model, optimizer)
    planner = um_alloc.plan(model)
    batch = {k: v.cuda() for k, v in SyntheticTokens(args.batch, args.seq_len, seed=0).batch(0).items()}
    return model, optimizer, planner, batch


def timed_steps(step, n: int) -> float:
    """The median of n steps, start to start on the GPU's clock."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for event in events[1:]:
        step()
        event.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:]))


def per_block_costs(rows: dict, blocks: int) -> dict:
    """Per block, what rebuilding and recomputing cost against keeping, measured and predicted
    (where every block kept fit the budget)."""
    keep = rows["every block keep"]
    out = {}
    for d in FORCED[1:]:
        row = rows[f"every block {d}"]
        if keep["status"] != "ok" or row["status"] != "ok":
            continue
        out[d] = {"measured_ms": 1e3 * (row["measured_step_s"] - keep["measured_step_s"]) / blocks,
                  "predicted_ms": 1e3 * (row["predicted_step_s"] - keep["predicted_step_s"]) / blocks}
        print(f"a block's {d} against keep: measured {out[d]['measured_ms']:.2f} ms, "
              f"predicted {out[d]['predicted_ms']:.2f} ms")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", default="40GiB", help="large enough to keep every activation (BERT-Large b32 "
                                                     "peaks near 26 GiB)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=10, help="timed steps per forced plan")
    p.add_argument("--sync", action="store_true", help="read each step's loss (loss.item()), as train.py, Hugging "
                                                       "Face Trainer and progress bars do: the host waits for "
                                                       "every step and cannot run ahead")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    model, optimizer, planner, batch = build(args)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        if args.sync:
            loss.item()

    for _ in range(3):  # two measuring steps, then the plan
        step()
    own = planner.plan.decisions
    rows = {}
    for name, decisions in [*((f"every block {d}", d) for d in FORCED), ("the planner's plan", list(own))]:
        try:
            forced = planner.force(decisions)
        except ValueError as refused:  # over the budget: recorded, not run
            rows[name] = {"status": "does not fit", "reason": str(refused)}
            print(f"{name:<26} does not fit the budget", flush=True)
            continue
        step()  # settles: the first step of a plan allocates what the last one freed
        measured = timed_steps(step, args.steps)
        rows[name] = {"status": "ok", "decisions": forced.counts(), "predicted_step_s": forced.predicted_step_s,
                      "measured_step_s": measured, "predicted_peak_bytes": forced.predicted_peak_bytes,
                      "costs_s": list(forced.costs)}
        print(f"{name:<26} measured {1e3 * measured:7.1f} ms  predicted {1e3 * forced.predicted_step_s:7.1f} ms  "
              f"{forced.counts()}", flush=True)
    per_block = per_block_costs(rows, sum(u.kind == "block" for u in planner.calibration.units))
    run_id = new_run_id("decision_costs")
    record = {"run_id": run_id, "device": torch.cuda.get_device_name(), "workload": "bert-large-mlm",
              "batch": args.batch, "seq_len": args.seq_len, "budget": args.budget, "steps": args.steps,
              "sync": args.sync,
              "forced": rows, "per_block": per_block, "planner": planner.to_dict()}
    path = write_result("decision_costs", record, args.out or RESULTS / run_id)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
