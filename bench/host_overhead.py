"""What recomputing or rebuilding every block costs the host: one training step of a small Hugging
Face model (kernels cost next to nothing, so the step's time is the host's), each method in this
process, one after another, the same weights and batch.

    python bench/host_overhead.py --model gpt2 --out bench/results/host_overhead
    python bench/host_overhead.py --model llama --device cuda --layers 24

Methods:
  plain                   everything kept
  checkpointing           every layer under torch.utils.checkpoint (non-reentrant), as Hugging
                          Face's gradient checkpointing runs it
  planner_checkpoint      the planner told to recompute every block (strategy "checkpoint"), each
                          recomputation through torch.utils.checkpoint (one_node_recompute=False)
  planner_one_node        the same, each block recomputed as one node of the graph (the default)
  planner_rebuild         every block rebuilt (forced once the planner has measured): the checks
                          at each save in forward, the rebuilds in backward. The planner leaves
                          tensors under 1 MiB alone; here every tensor counts, as a large
                          model's would

Per method: the median step on the host's clock over --steps steps after --warmup (the planner
measures in its first steps), taken --repeats times with the methods in turn and the least kept
(a shared host's other work only ever adds), the step less plain's (what recomputing adds), and
whether its loss and gradients equal plain's. One JSON record per invocation, with one run_id.
"""
from __future__ import annotations

import argparse
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import new_run_id, write_result  # noqa: E402

METHODS = ("plain", "checkpointing", "planner_checkpoint", "planner_one_node", "planner_rebuild")
MODELS = ("gpt2", "llama", "bert")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=MODELS, default="gpt2")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=64, help="hidden size: small, so that the host sets the pace")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every method in turn (default 3)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the host's own pace)")
    p.add_argument("--out", type=Path, help="folder for the JSON record (default: print only)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 4:
        p.error(f"--steps must be >= 1 and --warmup >= 4 (the planner measures in its first steps); "
                f"got --steps {args.steps}, --warmup {args.warmup}")
    for flag in ("layers", "hidden", "batch", "seq_len", "threads", "repeats"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    return args


def build(args):
    import transformers

    common = dict(vocab_size=512, num_hidden_layers=args.layers, num_attention_heads=2)
    if args.model == "gpt2":
        config = transformers.GPT2Config(vocab_size=512, n_embd=args.hidden, n_layer=args.layers, n_head=2,
                                         n_positions=max(64, args.seq_len), resid_pdrop=0, embd_pdrop=0,
                                         attn_pdrop=0)
        return transformers.GPT2LMHeadModel(config)
    if args.model == "llama":
        config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                          num_key_value_heads=1, **common)
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                                     hidden_dropout_prob=0, attention_probs_dropout_prob=0, **common)
    return transformers.BertForMaskedLM(config)


def prepare(method: str, base, device):
    model = copy.deepcopy(base).to(device).train()
    planner = None
    if method == "checkpointing":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif method == "planner_rebuild":
        from um_alloc.planner import plan
        planner = plan(model, 1 << 40, lean_loss=False)
        planner._runtime.min_bytes = 1  # a small model's tensors all count, as a large one's do
    elif method.startswith("planner"):
        from um_alloc.planner import plan
        planner = plan(model, 1 << 40, strategy="checkpoint", lean_loss=False,
                       one_node_recompute=method == "planner_one_node")
    return model, planner


def step(model, ids, device) -> tuple:
    import torch

    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    loss = loss.detach().cpu()  # the host waits for the step, as a loop that reads its loss does
    return loss, [p.grad for p in model.parameters()]


def measure(method: str, base, ids, args, device) -> tuple[dict, tuple]:
    from um_alloc.planner.director import CALIBRATION_STEPS

    model, planner = prepare(method, base, device)
    seconds, result = [], None
    try:
        for k in range(args.warmup + args.steps):
            if method == "planner_rebuild" and k == CALIBRATION_STEPS + 1:  # measured, and its plan made
                planner.force("rebuild")
            begun = time.perf_counter()
            result = step(model, ids, device)
            if k >= args.warmup:
                seconds.append(time.perf_counter() - begun)
        decisions = planner.plan.counts() if planner is not None and planner.plan is not None else None
    finally:
        if planner is not None:
            planner.remove()
    return {"method": method, "step_ms": 1e3 * statistics.median(seconds), "decisions": decisions}, result


def same(a, b) -> bool:
    import torch

    return torch.equal(a[0], b[0]) and all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a[1], b[1]))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)  # a caller in this process (a test) keeps its own


def run(args) -> int:
    import torch

    device = torch.device(args.device)
    torch.manual_seed(0)
    base = build(args)
    vocab = base.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1)).to(device)
    run_id = new_run_id("host_overhead")
    rows = {method: {"method": method, "step_ms": float("inf"), "rounds_ms": [], "equal_to_plain": True,
                     "decisions": None} for method in METHODS}
    reference = None
    for _ in range(args.repeats):
        for method in METHODS:
            timed, result = measure(method, base, ids, args, device)
            reference = result if method == "plain" else reference
            row = rows[method]
            row["rounds_ms"].append(timed["step_ms"])
            row["step_ms"] = min(row["step_ms"], timed["step_ms"])
            row["equal_to_plain"] = row["equal_to_plain"] and same(result, reference)
            row["decisions"] = timed["decisions"]  # the planner's, as the last round ran them
    rows = list(rows.values())
    plain = rows[0]["step_ms"]
    for row in rows:
        row["added_ms"] = row["step_ms"] - plain
        row["added_ms_per_layer"] = row["added_ms"] / args.layers
    record = {"run_id": run_id, "benchmark": "host_overhead", "model": args.model, "device": args.device,
              "host": platform.processor() or platform.machine(), "torch": torch.__version__,
              "threads": args.threads, "layers": args.layers, "hidden": args.hidden, "batch": args.batch,
              "seq_len": args.seq_len, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
              "methods": rows}
    print(f"{'method':<22}{'step ms':>9}{'added ms':>10}{'per layer':>11}  equal to plain")
    for row in rows:
        print(f"{row['method']:<22}{row['step_ms']:>9.2f}{row['added_ms']:>10.2f}{row['added_ms_per_layer']:>11.3f}"
              f"  {row['equal_to_plain']}")
    if args.out:
        path = write_result(f"{run_id}-{args.model}-{args.device}", record, args.out)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
