"""Command line: ``python -m um_alloc check FILE...``, ``python -m um_alloc info`` and
``python -m um_alloc run [--policy P] [--budget SIZE] [--device N] [--json OUT] [--profile] script.py ARGS``
(also ``-m module ARGS``; installed as the ``um-alloc`` command too).

Exit status: 0 all good, 1 a policy failed or no GPU for ``info``, 2 usage error (argparse);
``run`` leaves with the script's own status (um_alloc.integrations.launcher).
``check`` and ``info`` neither install the allocator nor touch torch; ``run`` imports it only
once its flags are checked.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from . import arguments
from .device_info import device_memory, unified_memory_capabilities
from .errors import At, PolicyError
from .policy import Policy, TagAdvice, load_policy, validate_for_device
from .sizes import format_size, size_text


def describe(policy: Policy) -> str:
    """One line: pool shape, budget and the advice of every tag that has any."""
    pool, budget = policy.pool, policy.scheduler.budget
    cap = "auto" if pool.max_reserved is None else format_size(pool.max_reserved)
    if budget is None:
        budget_text = "none"
    elif isinstance(budget, float):
        budget_text = f"{budget:g} of device"
    else:
        budget_text = format_size(budget)
    budget_text += f" ({_budget_mode(policy.scheduler)})"
    advice = [f"{tag}={_advice_text(a)}" for tag, a in policy.tags.items() if a != TagAdvice()]
    return (f"chunk {format_size(pool.chunk_size)}, arena {format_size(pool.arena_size)}, "
            f"max_reserved {cap}{' (oversubscribe)' if pool.oversubscribe else ''}, "
            f"budget {budget_text}, advice: {', '.join(advice) or 'none'}")


def _budget_mode(scheduler) -> str:
    """What a budget does under this policy (shown even without one: it says what --budget would do):
    hard unless the policy asks for evict_live: true."""
    if scheduler.evict_live:
        return "reactive"
    mode = {"offload": "hard, offload activations", "auto": "hard, block planner",
            "checkpoint": "hard, every block recomputed"}.get(scheduler.strategy, "hard")
    if scheduler.strategy not in ("auto", "checkpoint"):
        return mode
    if not scheduler.one_node_recompute:
        mode += " through torch.utils.checkpoint"
    if not scheduler.chains:
        mode += ", no chains"
    if not scheduler.lean_loss:
        mode += ", the model's own loss"
    elif scheduler.recompute_logits:
        mode += ", logits made again in backward"
    if scheduler.block_classes:
        mode += f", blocks: {', '.join(scheduler.block_classes)}"
    return mode


def _advice_text(advice: TagAdvice) -> str:
    parts = [] if advice.preferred_location == "none" else [advice.preferred_location]
    parts += ["read_mostly"] if advice.read_mostly else []
    parts += [f"by:{'+'.join(advice.accessed_by)}"] if advice.accessed_by else []
    parts += ["prefetch"] if advice.prefetch else []
    return "/".join(parts)


def _device_total(args: argparse.Namespace) -> tuple[int | None, str]:
    """Bytes to check budgets against: --device-memory, else NVML's device 0, else none."""
    if args.device_memory is not None:
        return args.device_memory, f"--device-memory {size_text(args.device_memory)}"
    memory = device_memory(0)
    if memory is None:
        return None, ""
    return memory.total_bytes, f"{memory.name}, {format_size(memory.total_bytes)}"


def cmd_check(args: argparse.Namespace) -> int:
    total, against = _device_total(args)
    if total is not None:
        print(f"checking against device memory: {against}")
    failed = 0
    for file in args.files:
        try:
            policy = load_policy(file)
            if total is not None:
                validate_for_device(policy, total)
        except PolicyError as exc:
            print(f"FAIL  {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"ok  {file}  ({describe(policy)})")
    if failed:
        print(f"{failed} of {len(args.files)} policies failed", file=sys.stderr)
    return 1 if failed else 0


def cmd_info(args: argparse.Namespace) -> int:
    try:
        caps = unified_memory_capabilities(args.device)
    except RuntimeError as exc:
        print(f"um_alloc info: {exc}", file=sys.stderr)
        return 1
    width = max(len(key) for key in caps)
    for key, value in caps.items():
        if key.endswith("_bytes"):
            value = f"{format_size(value)} ({value} bytes)"
        elif isinstance(value, list):  # held_back_by: the names, or nothing holds the clocks back
            value = ", ".join(value) or "nothing"
        print(f"{key + ':':<{width + 1}} {value}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .integrations.launcher import EXIT_USAGE, Target, launch

    module, script = args.module, args.script[1:] if args.script[:1] == ["--"] else args.script
    if module is not None and not module:
        print("um_alloc run: error: argument -m: expected a module name", file=sys.stderr)
        return EXIT_USAGE
    if module is None and not script:
        print("um_alloc run: error: give a script (run [options] script.py ARGS) or a module (-m module ARGS)",
              file=sys.stderr)
        return EXIT_USAGE
    target = (Target(None, module[0], tuple(module[1:])) if module is not None
              else Target(script[0], None, tuple(script[1:])))
    return launch(target, policy=args.policy, budget=args.budget, json_path=args.json, profile=args.profile,
                  device=args.device)


def _device_memory(text: str) -> int:
    try:
        return arguments.size(int(text) if text.isdigit() else text, At("command line", "--device-memory"),
                              minimum=1)
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device_index(text: str) -> int:
    try:
        return arguments.whole_number(int(text) if text.lstrip("-").isdigit() else text,
                                      At("command line", "--device"))
    except PolicyError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m um_alloc", description="um_alloc: policies and device checks.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    check = commands.add_parser(
        "check", help="validate policy files",
        description="Validate policy files (paths, or names of packaged policies such as "
                    "'best'). Budgets are also checked against device memory when NVML "
                    "reports a GPU or --device-memory is given.")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.add_argument("--device-memory", type=_device_memory, metavar="SIZE",
                       help="check against a device of this size (e.g. 24GiB) instead of GPU 0")
    check.set_defaults(run=cmd_check)
    info = commands.add_parser("info", help="print the GPU's unified-memory capabilities")
    info.add_argument("--device", type=_device_index, default=0, metavar="N", help="CUDA device index (>= 0)")
    info.set_defaults(run=cmd_info)
    _add_run(commands)
    return parser


def _add_run(commands) -> None:
    run = commands.add_parser(
        "run", help="run a training script under um_alloc, unchanged",
        usage="%(prog)s [--policy P] [--budget SIZE] [--device N] [--json OUT] [--profile] (script.py | -m module) "
              "ARGS...",
        description="Install um_alloc, then run the script as `python script.py ARGS` would: its model, "
                    "gradients and optimizer state are tagged, and under a budget its model gets the block "
                    "planner, with no change to the script. The memory summary and the plan go to stderr at "
                    "the end. The exit status is the script's.")
    run.add_argument("--policy", metavar="P",
                     help="a policy file or shipped name (default: $UM_POLICY, else planner with --budget, "
                          "none without)")
    run.add_argument("--budget", metavar="SIZE",
                     help="GPU memory for the whole training: 12GiB, bytes, or a fraction of the device (0.5); "
                          "under torchrun, for each process's GPU")
    run.add_argument("--device", type=_device_index, metavar="N",
                     help="CUDA device to install on (default: LOCAL_RANK, as torchrun sets it, else 0)")
    run.add_argument("--json", metavar="OUT", help="write the memory statistics and the plan here at the end")
    run.add_argument("--profile", action="store_true",
                     help="count unified-memory faults and migrations per step (needs cupti-python)")
    run.add_argument("-m", dest="module", nargs=argparse.REMAINDER, metavar="module ARGS",
                     help="run a module, as python -m does")
    run.add_argument("script", nargs=argparse.REMAINDER, metavar="script.py ARGS", help="the script and its arguments")
    run.set_defaults(run=cmd_run)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def main_exit() -> None:
    """The ``um-alloc`` console script: main() as the process's exit status."""
    sys.exit(main())


if __name__ == "__main__":
    main_exit()
