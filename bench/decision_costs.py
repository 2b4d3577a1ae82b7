"""What each of the planner's decisions costs a block, measured, against what the cost model predicts.

    python bench/decision_costs.py --budget 40GiB --batch 32
    python bench/decision_costs.py --model gpt2 --sync

BERT-Large MLM (bf16 autocast, fused AdamW, dropout 0; batch 32 of 512 tokens unless told), or
with --model gpt2 GPT-2-medium (24 layers, dropout 0.1, batch 8 of 1,024 random tokens, its own
loss), under um_alloc with the block planner, at a budget that holds every activation (the device
must have it free). After the planner's two measuring steps, its plan is forced in turn to: every
block kept, every block rebuilt, every block recomputed (the gaps kept throughout), then the
planner's own plan; each runs --steps steps after one to settle, and its median step is set
beside the model's prediction for it. --sync reads
each step's loss, as most training loops do: the host then waits for every step. Per block, the
difference between two forced plans is what one decision costs against the other: the figure
the planner's cost model (um_alloc.planner.planning.UnitCost.cost_s) has to predict.

--host-lead MS times each plan's phases (forward, backward, optimizer step) on the GPU's clock and
the host's, and again over as many steps with MS milliseconds of GPU sleep queued before forward
and before backward: the host has then issued the phase before the GPU starts it, so the GPU's
time is its own work. The difference is the time the GPU waited for the host in that phase (where
it is large, the host sets the step's pace, and what the host does there is what costs).
--decisions chooses the decisions forced on every block in turn (default keep, rebuild, recompute;
move and recompute_moved, say, too).

One process, one JSON record (bench/results/RUN_ID/decision_costs.json unless --out): the
forced plans' measured and predicted step times, the per-block costs both ways, and the
calibration the predictions came from.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from harness import RESULTS, new_run_id, write_result

import torch

FORCED = ("keep", "rebuild", "recompute")
BATCH_SHAPES = {"bert": (32, 512), "gpt2": (8, 1024)}  # each model's batch and sequence length unless told
PHASES = ("forward", "backward", "optimizer")


def build(args):
    """The model, its optimizer and one batch on the GPU, under um_alloc with the planner attached."""
    import um_alloc

    um_alloc.install("planner.yaml", budget=args.budget)
    torch.manual_seed(0)
    model, batch = (gpt2 if args.model == "gpt2" else bert_large)(args)
    with um_alloc.tag("parameter"):
        model = model.train().cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    um_alloc.tag_training(model, optimizer)
    planner = um_alloc.plan(model)
    return model, optimizer, planner, batch


def bert_large(args):
    """BERT-Large MLM on the CPU and one batch of synthetic tokens."""
    from transformers import BertConfig, BertForMaskedLM

    from bert_example.data import SyntheticTokens
    from bert_example.options import MAX_SEQ_LEN, MODELS

    config = BertConfig(vocab_size=30522, max_position_embeddings=MAX_SEQ_LEN, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, **MODELS["large"])
    return BertForMaskedLM(config), SyntheticTokens(args.batch, args.seq_len, seed=0).batch(0)


def gpt2(args):
    """GPT-2-medium on the CPU and one batch of random tokens, its labels the tokens."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=args.seq_len, use_cache=False)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), {"input_ids": ids, "labels": ids}


def timed_steps(step, n: int) -> float:
    """The median of n steps, start to start on the GPU's clock."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for event in events[1:]:
        step()
        event.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:]))


def sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep's cycles per millisecond on this GPU (its clock), measured once."""
    cycles = 20_000_000
    torch.cuda._sleep(cycles)  # warm
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


class PhaseClock:
    """Per step: each phase's time on the GPU's clock (CUDA events around it) and the forward's and
    backward's on the host's. With `lead` cycles, a GPU sleep is queued before forward and before
    backward, outside the phases' events, so that the host runs ahead of the GPU."""

    def __init__(self, lead: int = 0):
        self.lead, self.steps = lead, []
        self._events: list = []
        self._host: list[float] = []

    def mark(self, boundary: int) -> None:
        """Boundary 0: before forward, 1: after forward, 2: after backward, 3: after the optimizer."""
        if self.lead and boundary in (0, 1):
            if boundary == 1:
                self._events.append(torch.cuda.Event(enable_timing=True))
                self._events[-1].record()
            torch.cuda._sleep(self.lead)
        if boundary == 0:
            self._events, self._host = [], []
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._events.append(event)
        self._host.append(time.perf_counter())
        if boundary == 3:
            self.steps.append((self._events, self._host))

    def medians_ms(self) -> dict:
        """Each phase's median milliseconds on the GPU, and forward's and backward's on the host."""
        torch.cuda.synchronize()
        rows = []
        for events, host in self.steps:
            pairs = list(zip(events, events[1:]))
            if self.lead:  # [start, forward's end, backward's start, backward's end, optimizer's end]
                pairs = [pairs[0], pairs[2], pairs[3]]
            rows.append([a.elapsed_time(b) for a, b in pairs] + [1e3 * (host[1] - host[0]), 1e3 * (host[2] - host[1])])
        keys = [f"{p}_gpu_ms" for p in PHASES] + ["forward_host_ms", "backward_host_ms"]
        return {k: round(statistics.median(r[i] for r in rows), 3) for i, k in enumerate(keys)}


def waits_for_host(phases: dict, ahead: dict) -> dict:
    """Milliseconds the GPU waited for the host in forward and backward: each phase's time less
    its time with the host ahead."""
    return {f"{p}_waits_ms": round(phases[f"{p}_gpu_ms"] - ahead[f"{p}_gpu_ms"], 3) for p in PHASES[:2]}


def per_block_costs(rows: dict, blocks: int) -> dict:
    """Per block, what each other forced decision costs against keeping, measured and predicted
    (where every block kept, and every block of that decision, ran)."""
    keep = rows.get("every block keep")
    out = {}
    for name, row in rows.items():
        d = name.removeprefix("every block ")
        if d == name or d == "keep" or keep is None or keep["status"] != "ok" or row["status"] != "ok":
            continue
        out[d] = {"measured_ms": 1e3 * (row["measured_step_s"] - keep["measured_step_s"]) / blocks,
                  "predicted_ms": 1e3 * (row["predicted_step_s"] - keep["predicted_step_s"]) / blocks}
        print(f"a block's {d} against keep: measured {out[d]['measured_ms']:.2f} ms, "
              f"predicted {out[d]['predicted_ms']:.2f} ms")
    return out


def parse_args(argv=None) -> argparse.Namespace:
    """The options, checked before any GPU work; args.forced: the block decisions forced in turn."""
    from um_alloc.planner import Decision

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=BATCH_SHAPES, default="bert")
    p.add_argument("--budget", default="40GiB", help="large enough to keep every activation (BERT-Large b32 "
                                                     "peaks near 26 GiB, GPT-2-medium b8 near 27 GiB)")
    p.add_argument("--batch", type=int, default=None, help="default 32 (bert), 8 (gpt2)")
    p.add_argument("--seq-len", type=int, default=None, help="default 512 (bert), 1024 (gpt2)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per forced plan")
    p.add_argument("--sync", action="store_true", help="read each step's loss (loss.item()), as train.py, Hugging "
                                                       "Face Trainer and progress bars do: the host waits for "
                                                       "every step and cannot run ahead")
    p.add_argument("--host-lead", type=float, default=0.0, metavar="MS",
                   help="also time each plan's phases with MS ms of GPU sleep before forward and before backward "
                        "(the host ahead), and say how long the GPU waited for the host (default 0: not timed)")
    p.add_argument("--decisions", default=",".join(FORCED),
                   help=f"block decisions forced in turn, comma-separated (default {','.join(FORCED)})")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    batch, seq_len = BATCH_SHAPES[args.model]
    args.batch = batch if args.batch is None else args.batch
    args.seq_len = seq_len if args.seq_len is None else args.seq_len
    if args.batch < 1 or args.seq_len < 1:
        p.error(f"--batch and --seq-len must be 1 or more, got {args.batch} and {args.seq_len}")
    if args.model == "bert" and args.seq_len > 512:
        p.error(f"--seq-len {args.seq_len}: BERT's positions end at 512")
    args.forced = [d.strip() for d in args.decisions.split(",") if d.strip()]
    known = [d.value for d in Decision]
    unknown = [d for d in args.forced if d not in known]
    if unknown:
        p.error(f"--decisions: {', '.join(unknown)} not among {', '.join(known)}")
    if args.host_lead < 0:
        p.error(f"--host-lead must be 0 or more milliseconds, got {args.host_lead}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    model, optimizer, planner, batch = build(args)
    clock = None

    def step():
        if clock:
            clock.mark(0)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(**batch).loss
        if clock:
            clock.mark(1)
        loss.backward()
        if clock:
            clock.mark(2)
        optimizer.step()
        if clock:
            clock.mark(3)
        if args.sync:
            loss.item()

    for _ in range(3):  # two measuring steps, then the plan
        step()
    own = planner.plan.decisions
    rows = {}
    lead = round(args.host_lead * sleep_cycles_per_ms()) if args.host_lead else 0
    for name, decisions in [*((f"every block {d}", d) for d in args.forced), ("the planner's plan", list(own))]:
        try:
            forced = planner.force(decisions)
        except ValueError as refused:  # over the budget: recorded, not run
            rows[name] = {"status": "does not fit", "reason": str(refused)}
            print(f"{name:<26} does not fit the budget", flush=True)
            continue
        step()  # settles: the first step of a plan allocates what the last one freed
        clock = PhaseClock() if lead else None
        measured = timed_steps(step, args.steps)
        rows[name] = {"status": "ok", "decisions": forced.counts(), "predicted_step_s": forced.predicted_step_s,
                      "measured_step_s": measured, "predicted_peak_bytes": forced.predicted_peak_bytes,
                      "costs_s": list(forced.costs)}
        print(f"{name:<26} measured {1e3 * measured:7.1f} ms  predicted {1e3 * forced.predicted_step_s:7.1f} ms  "
              f"{forced.counts()}", flush=True)
        if lead:
            phases = clock.medians_ms()
            clock = PhaseClock(lead)
            for _ in range(args.steps):
                step()
            ahead = clock.medians_ms()
            clock = None
            rows[name].update(phases=phases, host_ahead=ahead, **waits_for_host(phases, ahead))
            print(f"{'':<26} forward {phases['forward_gpu_ms']:.1f} ms on the GPU, "
                  f"{phases['forward_host_ms']:.1f} on the host, {ahead['forward_gpu_ms']:.1f} with the host ahead; "
                  f"backward {phases['backward_gpu_ms']:.1f}, {phases['backward_host_ms']:.1f}, "
                  f"{ahead['backward_gpu_ms']:.1f}", flush=True)
    per_block = per_block_costs(rows, sum(u.kind == "block" for u in planner.calibration.units))
    run_id = new_run_id("decision_costs")
    record = {"run_id": run_id, "device": torch.cuda.get_device_name(), "workload": "gpt2-medium" if args.model == "gpt2" else "bert-large-mlm",
              "batch": args.batch, "seq_len": args.seq_len, "budget": args.budget, "steps": args.steps,
              "sync": args.sync, "host_lead_ms": args.host_lead,
              "forced": rows, "per_block": per_block, "planner": planner.to_dict()}
    path = write_result("decision_costs", record, args.out or RESULTS / run_id)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
