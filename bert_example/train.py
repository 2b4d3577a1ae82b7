"""BERT masked-LM pretraining on um_alloc, or on PyTorch's stock allocator for comparison.

    UM_POLICY=best.yaml python bert_example/train.py                  # BERT-Large, batch 8, seq 512
    python bert_example/train.py --batch-size 256 --micro-batch 14 --policy host_optimizer.yaml --budget 16GiB
    python bert_example/train.py --device cpu --allocator stock --model tiny --seq-len 32

The model is transformers' BertForMaskedLM built from a BertConfig (no weights are downloaded);
the data is synthetic unless --data names a local text file (see data.py). bf16 autocast is on by
default on CUDA; on CPU training runs in float32. ``main(argv)`` returns the run's summary dict.
The command line and its checks are in options.py, checkpoints in checkpoints.py, the summary in
summary.py, and what --phase-times, --link-rates and --trace measure in measure.py. Ctrl-C ends a
run with status 130 and says which checkpoint --resume continues from; out of GPU memory, status 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.append(str(Path(__file__).resolve().parents[1]))

from bert_example.checkpoints import (CHECKPOINT, PREVIOUS, Progress, checkpoint_state,  # noqa: E402,F401
                                      load_checkpoint, restore)
from bert_example.data import IGNORE, SyntheticTokens, TextTokens, make_source  # noqa: E402
from bert_example.measure import PhaseClock, link_rates, trace_last_step  # noqa: E402
from bert_example.summary import device_used, print_summary, summarize  # noqa: E402,F401
from um_alloc.floor import BudgetBelowFloor  # noqa: E402
from um_alloc.planner import PlanInfeasible  # noqa: E402
from bert_example.options import (MAX_SEQ_LEN, MODELS, budget_value, build_parser, check_args,  # noqa: E402,F401
                                  check_parallel, check_policy, memory_limit_bytes, size_bytes, warmup_steps)
from bert_example.parallel import Parallel, device_of_rank  # noqa: E402

if TYPE_CHECKING:
    from um_alloc.profile.training import TrainingProfiler

EXIT_OOM = 3           # exit status when the GPU runs out of memory (bench scripts test for it)
EXIT_INTERRUPTED = 130  # exit status after Ctrl-C (SIGINT): 128 + 2, as a shell reports a run it ended
RETRIES = 3  # a planned step that runs out of memory is run again this many times, each keeping less


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) during training; its text says how many steps were done and which
    checkpoint --resume continues from."""


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
        from um_alloc.device_info import device_memory

        if device_memory(device.index or 0) is None:  # NVML: asks nothing of CUDA
            parser.error(f"--device {args.device}: no NVIDIA GPU visible (NVML found none); um_alloc needs one. "
                         "Without a GPU use --device cpu --allocator stock")
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


def build_model(args: argparse.Namespace, vocab_size: int) -> torch.nn.Module:
    """Initialised on the CPU: the same weights on every device for a seed."""
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=vocab_size, max_position_embeddings=MAX_SEQ_LEN,
                        hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                        **MODELS[args.model])
    torch.manual_seed(args.seed)
    return BertForMaskedLM(config).train()


def check_budget_floor(model: torch.nn.Module) -> None:
    """Under um_alloc, refuses a budget below the model's parameters, gradients and AdamW's
    moments while the model is still on the CPU: on the GPU, the parameters alone could already
    pass it. Raises um_alloc.floor.BudgetBelowFloor."""
    from um_alloc.floor import check_budget

    check_budget(model, torch.optim.AdamW(model.parameters()))  # AdamW's state, as the fused one's


def _tag_context(args: argparse.Namespace, name: str):
    if args.allocator == "um":
        import um_alloc

        return um_alloc.tag(name)
    from contextlib import nullcontext

    return nullcontext()


# --- training ----------------------------------------------------------------------------------

def make_step_fn(args, model, optimizer, device: torch.device, autocast_dtype, clock: PhaseClock | None = None,
                 loss_fn=None):
    """Returns step(host_batch) -> loss (float): plain, or streamed in micro-batches. A clock
    (plain steps only) is marked around forward, backward and the optimizer step."""
    loss_fn = loss_fn or (lambda m, batch: m(**batch).loss)  # mean over masked tokens
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
        mark()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_fn(model, batch)
        mark()
        loss.backward()
        mark()
        optimizer.step()
        mark()
        loss = loss.item()  # waits for the step's kernels: the clock's events have completed
        if clock is not None:
            clock.end_step()
        return loss

    mark = clock.mark if clock is not None else lambda: None
    return step, None


def make_offload(args, device: torch.device, limit: int | None, window: int | None):
    """The ActivationOffload of this run, or None: the policy's under um_alloc (None unless it
    offloads activations under a budget), --offload activations' over stock PyTorch (sized to
    --memory-limit; without one it keeps nothing back, as save_on_cpu)."""
    tuning = {**({"window": window} if window is not None else {}), **({"rebuild": False} if args.no_rebuild else {})}
    if args.allocator == "um":
        from um_alloc.offload import from_policy

        return from_policy(**tuning)
    if args.offload != "activations":
        return None
    from um_alloc.offload import ActivationOffload

    return ActivationOffload(limit, device=device, **tuning)


def offload_activations(step_fn, offload):
    """Forward and backward under um_alloc's ActivationOffload."""
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


def train_loop(args, step_fn, source, first_step: int, on_step_done, retry=None,
               show_progress: bool = True) -> tuple[list[float], list[float]]:
    """Runs steps first_step..args.steps-1 with a progress bar; returns (losses, step seconds).
    With `retry` (a planner is attached), a step that runs out of memory is run again, after
    retry() has thrown away its partial gradients; the planner keeps less from then on."""
    from tqdm import tqdm

    losses, seconds = [], []
    bar = tqdm(range(first_step, args.steps), initial=first_step, total=args.steps, desc="train", unit="step",
               disable=not show_progress)
    for step in bar:
        batch = source.batch(step)
        start = time.perf_counter()
        for attempt in range(RETRIES + 1):
            try:
                loss = step_fn(batch)  # returns a Python float: the GPU has finished the step
                break
            except torch.OutOfMemoryError as error:
                if retry is None or attempt == RETRIES:
                    raise
                reason = (str(error).strip().splitlines() or ["no message"])[0][:300]
                tqdm.write(f"train.py: step {step} ran out of memory ({reason}); running it again, the "
                           f"planner keeping less ({attempt + 1} of {RETRIES})", file=sys.stderr)
                retry()
        seconds.append(time.perf_counter() - start)
        losses.append(loss)
        bar.set_postfix(step_s=f"{seconds[-1]:.3f}", samples_s=f"{args.batch_size / seconds[-1]:.1f}",
                        loss=f"{loss:.4f}")
        on_step_done(step + 1)
    return losses, seconds


def resume_point(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
    """The checkpoint --resume continues from, or None without --resume."""
    if not args.resume:
        return None
    checkpoint = load_checkpoint(args.checkpoint)
    if checkpoint is None:
        parser.error(f"--resume: no checkpoint in {args.checkpoint} (looked for {CHECKPOINT}, {PREVIOUS})")
    if checkpoint["step"] >= args.steps:
        parser.error(f"--resume: the checkpoint is at step {checkpoint['step']}; --steps {args.steps} leaves nothing to do")
    args.warmup_steps = warmup_steps(parser, args, args.steps - checkpoint["step"])
    return checkpoint


def build_training(args, vocab_size: int, device: torch.device, parallel: Parallel | None = None):
    """(the model the step runs, fused AdamW, the block planner when the policy asks for one or
    None); tagged for um_alloc when it is the allocator. Under --parallel the model the step runs
    is DDP's or FSDP2's."""
    model = build_model(args, vocab_size)
    sharded = parallel is not None and parallel.kind == "fsdp"
    if args.allocator == "um" and not sharded:  # FSDP2's floor is its shards': checked once sharded
        check_budget_floor(model)
    if args.checkpointing is not None:
        checkpoint_layers(model, args.checkpointing)
    with _tag_context(args, "parameter"):
        model = parallel.shard(model, device, args.fsdp_cpu_offload) if sharded else model.to(device)
    # Fused: one kernel reads and writes each moment once per step (foreach reads them up to three
    # times), which matters when a policy keeps optimizer state in host memory. FSDP2's sharded
    # parameters take PyTorch's default (foreach on the GPU, a loop on the CPU with its offload).
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01,
                                  fused=device.type == "cuda" and not sharded)
    planner = None
    if args.allocator == "um":
        import um_alloc

        um_alloc.tag_training(model, optimizer)
        if um_alloc.installation().policy.scheduler.spill_min_size:  # large_batch.yaml, say
            um_alloc.spill_from(model.cls)  # the MLM head and the loss: logits grow with the vocabulary
        planner = attach_planner(model)
    return (parallel.wrap(model, device) if parallel else model), optimizer, planner


def checkpoint_layers(model, first: int) -> None:
    """Hugging Face's own per-layer checkpointing, on every encoder layer (first < 0) or the first
    `first`: the peers a budget planner is compared with."""
    # transformers 5 renamed gradient_checkpointing_enable
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})
    if first >= 0:
        for layer in model.bert.encoder.layer[first:]:
            layer.gradient_checkpointing = False


def checkpointing_text(layers: int | None):
    """--checkpointing as the summary gives it: false, "all", or the number of first layers."""
    return False if layers is None else ("all" if layers < 0 else layers)


def attach_planner(model):
    """The block planner, when the policy asks for it (scheduler.strategy auto or checkpoint) and
    there is a budget; None otherwise. It attaches to the model: the step runs as it is."""
    import um_alloc

    chosen = um_alloc.installation()
    strategy = chosen.policy.scheduler.strategy
    if strategy not in ("auto", "checkpoint") or not chosen.budget:
        return None
    return um_alloc.plan(model, strategy=strategy)


def build_step(args, model, optimizer, device: torch.device, limit: int | None, window: int | None,
               parallel: Parallel | None = None):
    """(step_fn, micro-batch streamer or None, ActivationOffload or None, PhaseClock or None).
    Under --parallel, step_fn takes the global batch and returns its mean loss over the ranks."""
    autocast_dtype = torch.bfloat16 if device.type == "cuda" and not args.no_bf16 else None
    clock = PhaseClock(device) if args.phase_times else None
    step_fn, streamer = make_step_fn(args, model, optimizer, device, autocast_dtype, clock,
                                     loss_fn=parallel.loss if parallel else None)
    step_fn = save_on_cpu(step_fn, device) if args.offload == "save_on_cpu" else step_fn
    offload = make_offload(args, device, limit, window)
    step_fn = offload_activations(step_fn, offload) if offload else step_fn
    step_fn = parallel.step(step_fn) if parallel else step_fn
    return step_fn, streamer, offload, clock


def write_summary(summary: dict, args, profiler, parallel: Parallel | None = None) -> dict:
    """Prints the summary and writes --json; under --parallel, the first rank alone."""
    if parallel is not None and not parallel.is_first:
        return summary
    print_summary(summary, args.allocator)
    profiler.report(summary)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    world = check_parallel(parser, args)
    if args.parallel:
        args.device = device_of_rank(args.device)
    limit = memory_limit_bytes(parser, args)
    window = size_bytes(parser, args.offload_window, "--offload-window")
    checkpoint = resume_point(parser, args)
    try:
        source = make_source(args.data, args.batch_size * world, args.seq_len, args.seed,
                             checkpoint["data"] if checkpoint else None)
    except (OSError, ValueError) as error:
        parser.error(str(error))

    from um_alloc.profile.training import TrainingProfiler

    profiler = TrainingProfiler.from_args(args, torch.device(args.device).index or 0)  # before CUDA work
    device = setup_device(parser, args, limit)  # from here on: CUDA work
    used_before = device_used(device)
    job = Job(parser, args, source, checkpoint, profiler, device, limit, window, used_before)
    del checkpoint  # the job holds it until the model has it
    with Parallel.joined(args.parallel, device) as parallel:  # None without --parallel
        # A function of its own: the model and the optimizer are freed when it returns, before
        # the process group is taken down, not at the interpreter's exit.
        return train_job(job, parallel)


@dataclasses.dataclass
class Job:
    """What main() readies before any CUDA work: the checked arguments, the data, the resume point."""
    parser: argparse.ArgumentParser
    args: argparse.Namespace
    source: SyntheticTokens | TextTokens
    checkpoint: dict | None
    profiler: TrainingProfiler
    device: torch.device
    limit: int | None
    window: int | None
    used_before: int | None

    def take_checkpoint(self) -> dict | None:
        """The resume point, given up by the job: its tensors live no longer than the restore."""
        checkpoint, self.checkpoint = self.checkpoint, None
        return checkpoint


def train_job(job: Job, parallel: Parallel | None) -> dict:
    """Builds the model, trains it and returns the run's summary (written by the first rank)."""
    parser, args, source, profiler, device = job.parser, job.args, job.source, job.profiler, job.device
    limit, window, used_before = job.limit, job.window, job.used_before
    checkpoint = job.take_checkpoint()
    try:
        model, optimizer, planner = build_training(args, source.vocab_size, device, parallel)
    except BudgetBelowFloor as error:
        parser.error(str(error))
    first_step = restore(parser, checkpoint, model, optimizer, device, args) if checkpoint else 0
    del checkpoint
    progress = Progress(args.steps, args.checkpoint, done=first_step, saved=first_step if args.resume else None)

    def on_step_done(done: int) -> None:
        progress.done = done
        if args.checkpoint and (done % args.checkpoint_every == 0 or done == args.steps):
            progress.save(checkpoint_state(done, model, optimizer, source, device, args))

    step_fn, streamer, offload, clock = build_step(args, model, optimizer, device, limit, window, parallel)
    rates = link_rates(device) if args.link_rates else None  # before the profiler: set-up, not a step
    step_fn = profiler.wrap(step_fn, model, optimizer, steps=args.steps - first_step)
    step_fn = trace_last_step(step_fn, args.trace, args.steps - first_step) if args.trace else step_fn
    # Under --parallel a rank that ran out of memory cannot run its step again alone: the others
    # are inside that step's collectives. Its error ends the run, and torchrun ends the others.
    retry = (lambda: optimizer.zero_grad(set_to_none=True)) if planner and not parallel else None
    try:
        losses, seconds = train_loop(args, step_fn, source, first_step, on_step_done, retry,
                                     show_progress=parallel is None or parallel.is_first)
    except KeyboardInterrupt as interrupt:
        raise TrainingInterrupted(progress.interrupted_text()) from interrupt
    summary = summarize(args, device, first_step, losses, seconds, streamer, limit, used_before)
    summary.update(offload=args.offload, checkpointing=checkpointing_text(args.checkpointing),
                   **profiler.finish(args.warmup_steps))
    if planner is not None:
        summary["planner"] = planner.to_dict()
        summary["plan_table"] = planner.table()
    if offload is not None:
        summary["activation_offload"] = {"budget_bytes": offload.budget, "window_bytes": offload.window,
                                         **dataclasses.asdict(offload.stats)}
    summary.update(clock.summary(args.warmup_steps) if clock else {})
    if rates:
        summary["link_rates"] = rates
    if args.trace:
        summary["trace"] = args.trace
    if parallel is not None:
        parallel.summarize(summary)
    return write_summary(summary, args, profiler, parallel)


def cli(argv: list[str] | None = None) -> int:
    """The command line: main(), and for a run that ends early an exit status and one message
    on stderr instead of a traceback (EXIT_OOM, EXIT_INTERRUPTED)."""
    try:
        main(argv)
    except torch.OutOfMemoryError as error:
        print(f"train.py: out of GPU memory: {error}\nhint: lower --batch-size, raise --memory-limit, stream "
              "micro-batches with --micro-batch auto, or under a --budget try --policy large_batch.yaml",
              file=sys.stderr)
        return EXIT_OOM
    except PlanInfeasible as error:  # the planner's safe mode does not fit this batch at this budget
        print(f"train.py: out of GPU memory: {error}", file=sys.stderr)
        return EXIT_OOM
    except KeyboardInterrupt as interrupt:  # a bare one came before the first step or after the last
        print(f"\n{interrupt}" if isinstance(interrupt, TrainingInterrupted)
              else "\ntrain.py: interrupted before the first step or after the last", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.exit(cli())
