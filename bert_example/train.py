"""BERT masked-LM pretraining on um_alloc, or on PyTorch's stock allocator for comparison.

    UM_POLICY=best.yaml python bert_example/train.py                  # BERT-Large, batch 8, seq 512
    python bert_example/train.py --batch-size 256 --micro-batch 14 --policy host_optimizer.yaml --budget 16GiB
    python bert_example/train.py --device cpu --allocator stock --model tiny --seq-len 32

The model is transformers' BertForMaskedLM built from a BertConfig (no weights are downloaded);
the data is synthetic unless --data names a local text file (see data.py). bf16 autocast is on by
default on CUDA; on CPU training runs in float32. ``main(argv)`` returns the run's summary dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bert_example.data import IGNORE, make_source  # noqa: E402

MODELS = {  # BertConfig sizes; everything else is BERT's default
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}
MIN_SEQ_LEN, MAX_SEQ_LEN = 8, 512  # 512: BERT's position embeddings
CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"
EXIT_OOM = 3  # exit status when the GPU runs out of memory (bench scripts test for it)


# --- arguments ---------------------------------------------------------------------------------

def _micro_batch(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="large", help="BERT size (default large)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="mini-batch size in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help=f"tokens per sequence, {MIN_SEQ_LEN}..{MAX_SEQ_LEN} (default 512)")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="total optimizer steps, counted from step 0 also with --resume (default 20)")
    p.add_argument("--warmup-steps", type=int, default=2, metavar="N",
                   help="first steps of this run left out of the timing (default 2)")
    p.add_argument("--lr", type=float, default=1e-4, metavar="LR", help="AdamW learning rate (default 1e-4)")
    p.add_argument("--dropout", type=float, default=0.1, metavar="P", help="BERT's dropout probabilities (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="model init, data and dropout seed (default 0)")
    p.add_argument("--no-bf16", action="store_true", help="train in float32 (bf16 autocast is CUDA-only anyway)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels only (torch.use_deterministic_algorithms), so runs can be compared "
                        "loss for loss; slower")
    p.add_argument("--data", metavar="FILE", help="local text file (a WordPiece tokenizer is trained on it)")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--allocator", choices=("um", "stock"), default="um", help="um_alloc or PyTorch's own")
    p.add_argument("--policy", metavar="POLICY", help="um_alloc policy (path or bare name); overrides UM_POLICY")
    p.add_argument("--memory-limit", metavar="SIZE",
                   help="GPU memory limit, e.g. 16GiB (stock: a memory fraction; um: the pool's reserve cap)")
    p.add_argument("--budget", metavar="SIZE",
                   help="um only: GPU residency budget, e.g. 16GiB or 0.5 (overrides the policy's scheduler.budget)")
    p.add_argument("--micro-batch", type=_micro_batch, metavar="N|auto",
                   help="stream micro-batches of N sequences (auto: the largest that fits)")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--checkpoint", metavar="DIR", help="save checkpoints in DIR")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="steps between checkpoints (default 10)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint DIR")
    p.add_argument("--offload", choices=("save_on_cpu",), help="keep saved activations in (pinned) host memory")
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing: recompute in backward")
    p.add_argument("--profile", action="store_true", help="CUPTI unified-memory counters per step (or UM_PROFILE=1)")
    p.add_argument("--timeline", metavar="PNG", help="draw memory per tag and GPU faults over the last step")
    return p


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no GPU; errors say what is allowed."""
    ranges = [("--batch-size", args.batch_size, 1, None), ("--seq-len", args.seq_len, MIN_SEQ_LEN, MAX_SEQ_LEN),
              ("--steps", args.steps, 1, None), ("--warmup-steps", args.warmup_steps, 0, None),
              ("--checkpoint-every", args.checkpoint_every, 1, None)]
    for name, value, low, high in ranges:
        if value < low or (high is not None and value > high):
            allowed = f"between {low} and {high}" if high is not None else f">= {low}"
            parser.error(f"{name} must be {allowed}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        parser.error(f"--lr must be a finite number > 0, got {args.lr}")
    if not 0 <= args.dropout < 1:
        parser.error(f"--dropout must be in [0, 1), got {args.dropout}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.allocator == "um" and device.type != "cuda":
        parser.error("--allocator um needs a CUDA device; on the CPU use --allocator stock")
    if args.policy is not None and args.allocator != "um":
        parser.error("--policy applies to --allocator um only")
    if args.memory_limit is not None and device.type != "cuda":
        parser.error("--memory-limit applies to CUDA devices only")
    if args.budget is not None and args.allocator != "um":
        parser.error("--budget applies to --allocator um only (for stock PyTorch use --memory-limit)")
    if args.resume and args.checkpoint is None:
        parser.error("--resume needs --checkpoint DIR")
    if args.allocator == "um":
        check_policy(parser, args)


def check_policy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The policy loads, and what it asks of the run combines with the other options."""
    from um_alloc.policy import PolicyError, load_policy

    try:
        policy = load_policy(args.policy)
    except PolicyError as error:
        parser.error(str(error))
    if not policy.scheduler.offload_activations:
        return
    clash = [flag for flag, given in (("--micro-batch", args.micro_batch is not None),
                                      ("--offload", args.offload is not None),
                                      ("--checkpointing", args.checkpointing)) if given]
    if clash:
        parser.error(f"policy {policy.name!r} offloads activations (scheduler.offload_activations: true), "
                     f"which does not combine with {', '.join(clash)}; use a policy without it, such as "
                     "host_optimizer.yaml, or drop the flag")


def memory_limit_bytes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    if args.memory_limit is None:
        return None
    from um_alloc.policy import parse_size

    try:
        text = args.memory_limit  # a bare number on the command line is bytes
        limit = parse_size(int(text) if text.isdigit() else text, key="--memory-limit", source="command line")
    except ValueError as error:
        parser.error(str(error))
    if limit <= 0:
        parser.error(f"--memory-limit must be more than 0 bytes, got {args.memory_limit!r}")
    return limit


def budget_value(text: str | None) -> int | float | str | None:
    """--budget as install() takes it: "0.5" a fraction of the device, "123" bytes, "16GiB" a size."""
    if text is None or not text.replace(".", "", 1).isdigit():
        return text
    return float(text) if "." in text else int(text)


# --- setup -------------------------------------------------------------------------------------

def setup_device(parser: argparse.ArgumentParser, args: argparse.Namespace, limit: int | None) -> torch.device:
    """Installs um_alloc (before any CUDA work) or limits the stock allocator."""
    device = torch.device(args.device)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before CUDA work
        torch.use_deterministic_algorithms(True)
    if device.type == "cpu":
        return device
    if args.allocator == "um":
        import um_alloc

        try:
            um_alloc.install(args.policy, max_reserved=limit, budget=budget_value(args.budget),
                             device=device.index or 0)
        except (RuntimeError, ValueError) as error:
            parser.error(f"um_alloc.install failed: {error}")
    if not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device is available (use --device cpu --allocator stock)")
    device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if args.allocator == "stock" and limit is not None:
        total = torch.cuda.get_device_properties(device).total_memory
        if limit > total:
            parser.error(f"--memory-limit {args.memory_limit} exceeds the device's {total} bytes")
        torch.cuda.set_per_process_memory_fraction(limit / total, device)
    return device


def build_model(args: argparse.Namespace, vocab_size: int, device: torch.device) -> torch.nn.Module:
    """Initialised on the CPU (the same weights on every device for a seed), then moved."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=MAX_SEQ_LEN,
                        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                        **MODELS[args.model])
    torch.manual_seed(args.seed)
    return BertForMaskedLM(config).to(device).train()


def _tag_context(args: argparse.Namespace, name: str):
    if args.allocator == "um":
        import um_alloc

        return um_alloc.tag(name)
    from contextlib import nullcontext

    return nullcontext()


def _device_used(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


# --- checkpoints -------------------------------------------------------------------------------

def save_checkpoint(directory: str | Path, state: dict) -> Path:
    """Writes DIR/checkpoint.pt atomically: a temporary file in DIR, fsync'd, then os.replace; the
    previous checkpoint becomes checkpoint.prev.pt. A crash leaves no half-written checkpoint."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".checkpoint-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        if (directory / CHECKPOINT).exists():
            os.replace(directory / CHECKPOINT, directory / PREVIOUS)
        os.replace(temporary, directory / CHECKPOINT)
        descriptor = os.open(directory, os.O_RDONLY)  # make the renames durable too
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return directory / CHECKPOINT


def load_checkpoint(directory: str | Path) -> dict | None:
    """The latest checkpoint in DIR (checkpoint.pt, else checkpoint.prev.pt: a crash between the
    two renames of save_checkpoint leaves only that), or None."""
    for name in (CHECKPOINT, PREVIOUS):
        if (Path(directory) / name).is_file():
            return torch.load(Path(directory) / name, map_location="cpu", weights_only=True)
    return None


def checkpoint_state(step: int, model, optimizer, source, device: torch.device, args) -> dict:
    state = {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "data": source.state(), "model_size": args.model, "cpu_rng": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    return state


def restore(parser, checkpoint: dict, model, optimizer, device: torch.device, args) -> int:
    if checkpoint["model_size"] != args.model:
        parser.error(f"--resume: the checkpoint is of --model {checkpoint['model_size']}, not {args.model}")
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    torch.set_rng_state(checkpoint["cpu_rng"])
    if device.type == "cuda" and "cuda_rng" in checkpoint:
        torch.cuda.set_rng_state(checkpoint["cuda_rng"], device)
    return checkpoint["step"]


# --- training ----------------------------------------------------------------------------------

def make_step_fn(args, model, optimizer, device: torch.device, autocast_dtype):
    """Returns step(host_batch) -> loss (float): plain, or streamed in micro-batches."""
    loss_fn = lambda m, batch: m(**batch).loss  # noqa: E731  mean over masked tokens
    if args.micro_batch is not None:
        from um_alloc.microbatch import MicroBatchStreamer

        streamer = MicroBatchStreamer(model, optimizer, loss_fn, micro_batch_size=args.micro_batch,
                                      device=device, autocast_dtype=autocast_dtype,
                                      count_fn=lambda batch: int((batch["labels"] != IGNORE).sum()))
        return streamer.step, streamer

    def step(batch):
        batch = {key: value.to(device, non_blocking=True) for key, value in batch.items()}
        if args.allocator == "um":
            import um_alloc

            um_alloc.retag(batch, "input")
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step, None


def offload_activations(step_fn, offload):
    """Forward and backward under um_alloc's ActivationOffload (the policy asked for it)."""
    def step(batch):
        with offload.step():
            return step_fn(batch)
    return step


def save_on_cpu(step_fn, device: torch.device):
    """Saved activations go to host memory (pinned on CUDA) in forward and return in backward."""
    def step(batch):
        with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
            return step_fn(batch)
    return step


def train_loop(args, step_fn, source, first_step: int, on_step_done) -> tuple[list[float], list[float]]:
    """Runs steps first_step..args.steps-1 with a progress bar; returns (losses, step seconds)."""
    from tqdm import tqdm

    losses, seconds = [], []
    bar = tqdm(range(first_step, args.steps), initial=first_step, total=args.steps, desc="train", unit="step")
    for step in bar:
        batch = source.batch(step)
        start = time.perf_counter()
        loss = step_fn(batch)  # returns a Python float: the GPU has finished the step
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(step_s=f"{seconds[-1]:.3f}", samples_s=f"{args.batch_size / seconds[-1]:.1f}",
                        loss=f"{loss:.4f}")
        on_step_done(step + 1)
    return losses, seconds


def memory_report(args, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_bytes": None, "peak_reserved_bytes": None}
    if args.allocator == "um":
        import um_alloc

        stats = um_alloc.memory_stats()
        return {"peak_bytes": stats["peak_live_bytes"], "peak_reserved_bytes": stats["peak_reserved_bytes"],
                "budget_bytes": stats.get("budget_bytes") or None, "memory_stats": stats}
    return {"peak_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def summarize(args, device, first_step, losses, seconds, streamer, limit, used_before) -> dict:
    timed = seconds[args.warmup_steps:] or seconds  # a run shorter than the warm-up times every step
    step_s = statistics.median(timed)
    bf16 = device.type == "cuda" and not args.no_bf16
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": f"bert-{args.model}-mlm-seq{args.seq_len}-{'bf16' if bf16 else 'fp32'}"
                    + ("-text" if args.data else "-synthetic"),
        "method": "um_alloc" if args.allocator == "um" else "stock",
        "policy": (args.policy or os.environ.get("UM_POLICY") or "none.yaml") if args.allocator == "um" else None,
        "batch": args.batch_size,
        "micro_batch": streamer.last_micro_batch_size if streamer is not None else None,
        "seq_len": args.seq_len, "bf16": bf16, "memory_limit_bytes": limit,
        "first_step": first_step, "steps": len(losses), "timed_steps": len(timed), "step_s": seconds,
        "step_s_median": step_s, "samples_per_s": args.batch_size / step_s,
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
    }
    summary.update(memory_report(args, device))
    used_after = _device_used(device)
    summary["device_used_delta_bytes"] = used_after - used_before if used_before is not None else None
    return summary


def print_summary(summary: dict, allocator: str) -> None:
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    micro = f" in micro-batches of {summary['micro_batch']}" if summary["micro_batch"] else ""
    print(f"\n{summary['workload']} on {summary['device']} ({summary['method']}), batch {summary['batch']}{micro}")
    print(f"  steps {summary['first_step']}..{summary['first_step'] + summary['steps'] - 1} "
          f"({summary['timed_steps']} timed): median step {summary['step_s_median']:.3f} s, "
          f"{summary['samples_per_s']:.1f} samples/s")
    print(f"  loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}")
    print(f"  peak memory {gib(summary['peak_bytes'])} live, {gib(summary['peak_reserved_bytes'])} reserved")
    offload = summary.get("activation_offload")
    if offload:
        print(f"  activation offload (last step): saved {gib(offload['saved_bytes'])}, kept "
              f"{gib(offload['kept_bytes'])} on the GPU, rebuilt {gib(offload['rebuilt_bytes'])} in backward, "
              f"moved {gib(offload['out_bytes'])} each way")
    if allocator == "um" and summary["peak_bytes"] is not None:
        import um_alloc

        print(um_alloc.memory_summary())


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    limit = memory_limit_bytes(parser, args)
    checkpoint = None
    if args.resume:
        checkpoint = load_checkpoint(args.checkpoint)
        if checkpoint is None:
            parser.error(f"--resume: no checkpoint in {args.checkpoint} (looked for {CHECKPOINT}, {PREVIOUS})")
        if checkpoint["step"] >= args.steps:
            parser.error(f"--resume: the checkpoint is at step {checkpoint['step']}; --steps {args.steps} leaves nothing to do")
    try:
        source = make_source(args.data, args.batch_size, args.seq_len, args.seed,
                             checkpoint["data"] if checkpoint else None)
    except (OSError, ValueError) as error:
        parser.error(str(error))

    from um_alloc.profile.training import TrainingProfiler

    profiler = TrainingProfiler.from_args(args, torch.device(args.device).index or 0)  # before CUDA work
    device = setup_device(parser, args, limit)  # from here on: CUDA work
    used_before = _device_used(device)
    with _tag_context(args, "parameter"):
        model = build_model(args, source.vocab_size, device)
    if args.checkpointing:  # per layer; transformers 5 renamed gradient_checkpointing_enable
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    # Fused: one kernel reads and writes each moment once per step (foreach reads them up to three
    # times), which matters when a policy keeps optimizer state in host memory.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  fused=device.type == "cuda")
    if args.allocator == "um":
        import um_alloc

        um_alloc.tag_training(model, optimizer)
        if um_alloc.installation().policy.scheduler.spill_min_size:  # large_batch.yaml, say
            um_alloc.spill_from(model.cls)  # the MLM head and the loss: logits grow with the vocabulary
    first_step = restore(parser, checkpoint, model, optimizer, device, args) if checkpoint else 0
    del checkpoint

    def on_step_done(done: int) -> None:
        if args.checkpoint and (done % args.checkpoint_every == 0 or done == args.steps):
            save_checkpoint(args.checkpoint, checkpoint_state(done, model, optimizer, source, device, args))

    autocast_dtype = torch.bfloat16 if device.type == "cuda" and not args.no_bf16 else None
    step_fn, streamer = make_step_fn(args, model, optimizer, device, autocast_dtype)
    step_fn = save_on_cpu(step_fn, device) if args.offload == "save_on_cpu" else step_fn
    offload = None
    if args.allocator == "um":
        from um_alloc.offload import from_policy

        offload = from_policy()  # None unless the policy offloads activations under a budget
        step_fn = offload_activations(step_fn, offload) if offload else step_fn
    step_fn = profiler.wrap(step_fn, model, optimizer, steps=args.steps - first_step)
    losses, seconds = train_loop(args, step_fn, source, first_step, on_step_done)
    summary = summarize(args, device, first_step, losses, seconds, streamer, limit, used_before)
    summary.update(offload=args.offload, checkpointing=args.checkpointing, **profiler.finish(args.warmup_steps))
    if offload is not None:
        summary["activation_offload"] = {"budget_bytes": offload.budget, "window_bytes": offload.window,
                                         **dataclasses.asdict(offload.stats)}
    print_summary(summary, args.allocator)
    profiler.report(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        main()
    except torch.OutOfMemoryError as error:
        print(f"train.py: out of GPU memory: {error}\nhint: lower --batch-size, raise --memory-limit, stream "
              "micro-batches with --micro-batch auto, or under a --budget try --policy large_batch.yaml",
              file=sys.stderr)
        sys.exit(EXIT_OOM)
