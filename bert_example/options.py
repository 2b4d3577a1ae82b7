"""train.py's command line: the parser, and every check of it that needs no GPU (errors say what
is allowed), so that a mistake ends the run before any CUDA work.
"""
from __future__ import annotations

import argparse
import math

import torch

DESCRIPTION = "BERT masked-LM pretraining on um_alloc, or on PyTorch's stock allocator for comparison."
MODELS = {  # BertConfig sizes; everything else is BERT's default
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
}
MIN_SEQ_LEN, MAX_SEQ_LEN = 8, 512  # 512: BERT's position embeddings
WARMUP_STEPS = 2                   # --warmup-steps' default, lowered where a run has fewer steps


def _micro_batch(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1 or 'auto', got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train.py", description=DESCRIPTION)
    p.add_argument("--model", choices=sorted(MODELS), default="large", help="BERT size (default large)")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="mini-batch size in sequences (default 8)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help=f"tokens per sequence, {MIN_SEQ_LEN}..{MAX_SEQ_LEN} (default 512)")
    p.add_argument("--steps", type=int, default=20, metavar="N",
                   help="total optimizer steps, counted from step 0 also with --resume (default 20)")
    p.add_argument("--warmup-steps", type=int, metavar="N",
                   help=f"first steps of this run left out of the timing, fewer than the run's steps (default "
                        f"{WARMUP_STEPS}, or one less than a shorter run's steps)")
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
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument("--checkpoint", metavar="DIR", help="save checkpoints in DIR")
    p.add_argument("--checkpoint-every", type=int, default=10, metavar="N", help="steps between checkpoints (default 10)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint DIR")
    _add_parallel(p.add_argument_group("several GPUs (under torchrun)"))
    _add_memory_savers(p.add_argument_group("memory savers"))
    _add_measurements(p.add_argument_group("measurements"))
    return p


def _add_parallel(p) -> None:
    p.add_argument("--parallel", choices=("ddp", "fsdp"),
                   help="one process per GPU under torchrun: DistributedDataParallel, or FSDP2 (fully_shard on every "
                        "encoder layer); --batch-size is per process, --budget and --memory-limit per GPU")
    p.add_argument("--fsdp-cpu-offload", action="store_true",
                   help="with --parallel fsdp: FSDP2's CPUOffloadPolicy (shards in pinned host memory, the optimizer "
                        "step on the CPU)")


def check_parallel(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """--parallel's checks; returns the number of processes (1 without --parallel)."""
    from bert_example.parallel import world_from_environment

    if args.fsdp_cpu_offload and args.parallel != "fsdp":
        parser.error("--fsdp-cpu-offload applies to --parallel fsdp only")
    if args.parallel is None:
        return 1
    world = world_from_environment()
    if world is None:
        parser.error(f"--parallel {args.parallel} runs one process per GPU under torchrun, which sets WORLD_SIZE; "
                     f"start it as: torchrun --nproc-per-node N bert_example/train.py --parallel {args.parallel} ...")
    clash = [flag for flag, given in (("--micro-batch", args.micro_batch is not None),
                                      ("--checkpoint", args.checkpoint is not None)) if given]
    if clash:
        parser.error(f"--parallel does not combine with {', '.join(clash)}: train.py streams micro-batches and "
                     "writes checkpoints for one process only")
    return world


def _add_memory_savers(p) -> None:
    p.add_argument("--micro-batch", type=_micro_batch, metavar="N|auto",
                   help="stream micro-batches of N sequences (auto: the largest that fits)")
    p.add_argument("--offload", choices=("save_on_cpu", "activations"),
                   help="save_on_cpu: keep saved activations in (pinned) host memory; activations (stock only): "
                        "um_alloc's ActivationOffload sized to --memory-limit: keeps what fits, copies the rest "
                        "out and back on side streams, rebuilds in backward what it can (under um_alloc a policy "
                        "with scheduler.offload_activations: true, such as offload.yaml, does this)")
    p.add_argument("--offload-window", metavar="SIZE",
                   help="activation offload: bytes of copies back in flight ahead of backward "
                        "(default: the policy's scheduler.schedule_window, else 1GiB)")
    p.add_argument("--no-rebuild", action="store_true",
                   help="activation offload: move every saved tensor, rebuild nothing in backward "
                        "(what rebuilding saves, by comparison)")
    p.add_argument("--checkpointing", nargs="?", type=_layers, const=-1, default=None, metavar="N",
                   help="activation checkpointing (Hugging Face's own, per layer): recompute in backward; with N, "
                        "only the first N encoder layers (the partial-checkpointing frontier)")


def _add_measurements(p) -> None:
    p.add_argument("--profile", action="store_true", help="CUPTI unified-memory counters per step (or UM_PROFILE=1)")
    p.add_argument("--timeline", metavar="PNG", help="draw memory per tag and GPU faults over the last step")
    p.add_argument("--phase-times", action="store_true",
                   help="time forward, backward and the optimizer step of every step (CUDA events; the wall "
                        "clock on the CPU); summary fields phase_s and phase_s_median")
    p.add_argument("--link-rates", action="store_true",
                   help="CUDA only: before training, time pinned-host copies each way to and from memory of this "
                        "run's allocator; summary field link_rates (GB/s)")
    p.add_argument("--trace", metavar="PATH",
                   help="write a torch.profiler Chrome trace of the last step to PATH (gzip'd if it ends in .gz)")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every check that needs no GPU; errors say what is allowed."""
    ranges = [("--batch-size", args.batch_size, 1, None), ("--seq-len", args.seq_len, MIN_SEQ_LEN, MAX_SEQ_LEN),
              ("--steps", args.steps, 1, None), ("--warmup-steps", args.warmup_steps, 0, None),
              ("--checkpoint-every", args.checkpoint_every, 1, None)]
    for name, value, low, high in ranges:
        if value is not None and (value < low or (high is not None and value > high)):
            allowed = f"between {low} and {high}" if high is not None else f">= {low}"
            parser.error(f"{name} must be {allowed}, got {value}")
    args.warmup_steps = warmup_steps(parser, args, args.steps)
    if isinstance(args.micro_batch, int) and args.micro_batch > args.batch_size:
        parser.error(f"--micro-batch {args.micro_batch} is larger than --batch-size {args.batch_size}; "
                     f"allowed: 1 to {args.batch_size}, or auto")
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
    check_measurements(parser, args, device)
    check_offload(parser, args)
    if args.allocator == "um":
        check_policy(parser, args)


def warmup_steps(parser: argparse.ArgumentParser, args: argparse.Namespace, run_steps: int) -> int:
    """--warmup-steps for a run of `run_steps` steps: given, fewer than those (else no step would be
    timed); not given, WARMUP_STEPS or fewer, so that at least one step is timed."""
    given = getattr(args, "warmup_given", args.warmup_steps)
    args.warmup_given = given
    if given is None:
        return min(WARMUP_STEPS, run_steps - 1)
    if given >= run_steps:
        parser.error(f"--warmup-steps {given} leaves none of this run's {run_steps} steps timed; "
                     f"allowed: 0 to {run_steps - 1}")
    return given


def check_measurements(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device) -> None:
    if args.phase_times and args.micro_batch is not None:
        parser.error("--phase-times times one forward and one backward a step; it does not combine with --micro-batch")
    if args.link_rates and device.type != "cuda":
        parser.error("--link-rates times copies between pinned host memory and a GPU: it needs a CUDA device")
    if args.trace and (args.profile or args.timeline):
        parser.error("--trace does not combine with --profile or --timeline: CUPTI serves one profiler per process")


def _offload_tuning(args: argparse.Namespace) -> list[str]:
    return [flag for flag, given in (("--offload-window", args.offload_window is not None),
                                     ("--no-rebuild", args.no_rebuild)) if given]


def _layers(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a number of layers >= 0, got {text!r}")
    return int(text)


def _offload_clash(args: argparse.Namespace, *, with_offload: bool) -> list[str]:
    """The memory savers given that an activation offload does not combine with."""
    return [flag for flag, given in (("--micro-batch", args.micro_batch is not None),
                                     ("--offload", with_offload and args.offload is not None),
                                     ("--checkpointing", args.checkpointing is not None)) if given]


def check_offload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--offload activations and its tuning flags (a policy's offload is checked in check_policy)."""
    if args.offload != "activations":
        if args.allocator == "stock" and _offload_tuning(args):
            parser.error(f"{', '.join(_offload_tuning(args))}: applies to an activation offload: --offload "
                         "activations, or under um_alloc a policy with scheduler.offload_activations: true")
        return
    if args.allocator == "um":
        parser.error("--offload activations is for --allocator stock; under um_alloc use a policy with "
                     "scheduler.offload_activations: true, such as offload.yaml, and a --budget")
    clash = _offload_clash(args, with_offload=False)
    if clash:
        parser.error(f"--offload activations does not combine with {', '.join(clash)}")


def check_policy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The policy loads, and what it asks of the run combines with the other options."""
    from um_alloc.errors import PolicyError
    from um_alloc.policy import load_policy

    from um_alloc.policy import with_budget, with_max_reserved

    try:
        policy = load_policy(args.policy)
        if args.budget is not None:  # checked as the keys they replace, naming the flags
            with_budget(policy, budget_value(args.budget), source="command line", key="--budget")
        if args.memory_limit is not None:
            with_max_reserved(policy, budget_value(args.memory_limit), source="command line", key="--memory-limit")
    except PolicyError as error:
        parser.error(str(error))
    if policy.scheduler.strategy in ("auto", "checkpoint"):
        clash = _offload_clash(args, with_offload=True) + _offload_tuning(args)
        if clash:
            parser.error(f"policy {policy.name!r} plans activations per block (scheduler.strategy: "
                         f"{policy.scheduler.strategy}), which does not combine with {', '.join(clash)}; "
                         "use a policy without it, such as host_optimizer.yaml, or drop the flag")
        return
    if not policy.scheduler.offload_activations:
        if _offload_tuning(args):
            parser.error(f"{', '.join(_offload_tuning(args))}: policy {policy.name!r} does not offload activations "
                         "(scheduler.offload_activations: false); use one that does, such as offload.yaml")
        return
    clash = _offload_clash(args, with_offload=True)
    if clash:
        parser.error(f"policy {policy.name!r} offloads activations (scheduler.offload_activations: true), "
                     f"which does not combine with {', '.join(clash)}; use a policy without it, such as "
                     "host_optimizer.yaml, or drop the flag")


def size_bytes(parser: argparse.ArgumentParser, text: str | None, flag: str) -> int | None:
    """A size option in bytes (None if not given); a bare number on the command line is bytes."""
    if text is None:
        return None
    from um_alloc.sizes import parse_size

    try:
        size = parse_size(int(text) if text.isdigit() else text, key=flag, source="command line")
    except ValueError as error:
        parser.error(str(error))
    if size <= 0:
        parser.error(f"{flag} must be more than 0 bytes, got {text!r}")
    return size


def memory_limit_bytes(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int | None:
    return size_bytes(parser, args.memory_limit, "--memory-limit")


def budget_value(text: str | None) -> int | float | str | None:
    """--budget (or --memory-limit) as install() takes it: "0.5" a fraction of the device (refused
    as a cap), "123" bytes, "16GiB" a size."""
    if text is None or not text.replace(".", "", 1).isdigit():
        return text
    return float(text) if "." in text else int(text)
