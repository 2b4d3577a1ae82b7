"""``python -m um_alloc run``: a training script under um_alloc, unchanged.

    python -m um_alloc run [--policy P] [--budget SIZE] [--device N] [--json OUT] [--profile] script.py ARGS...
    python -m um_alloc run [...] -m package.module ARGS...
    torchrun --nproc-per-node 2 -m um_alloc run --budget 12GiB train.py ARGS...

In order: the launcher's own flags and torchrun's RANK and LOCAL_RANK are checked (the policy's
errors, exit status 2); the unified-memory counters start (--profile); um_alloc installs on
--device, else the device of ``LOCAL_RANK`` (0 without torchrun), with the budget for that GPU
alone; the script runs as ``python script.py ARGS`` would run it (``__main__``,
``sys.argv``, ``sys.path[0]``), with the model and optimizer found, tagged and planned through
global hooks (auto.py); at the end the memory summary and the plan go to stderr, so the script's
stdout stays its own, and --json writes them. The exit status is the script's; its traceback is
printed without the launcher's frames.
"""
from __future__ import annotations

import gc
import importlib.util
import os
import re
import runpy
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import At, PolicyError
from ..policy import Policy
from ..ranks import ChosenDevice, choose_device, global_rank
from .attach import choose_policy, install_before_cuda, report, summary_text, write_json

__all__ = ["Target", "LaunchError", "check", "launch", "run_target"]

EXIT_USAGE = 2          # as argparse: the launcher's flags are wrong
EXIT_FAILED = 1         # as Python: an uncaught exception, or um_alloc could not install
EXIT_INTERRUPTED = 130  # as a shell reports Ctrl-C
PROG = "um_alloc run"
_NUMBER = re.compile(r"\d+(\.\d*)?|\.\d+")
TOO_LATE = ("Something ran before the script and started CUDA: a sitecustomize or .pth file, or PYTHONSTARTUP. "
            "Remove it, or call um_alloc.install() at the top of the script instead of using the launcher.")


class LaunchError(Exception):
    """The launcher cannot start the script; `status` is the exit status to leave with."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, and its arguments (without argv[0])."""
    script: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.script if self.script is not None else f"-m {self.module}"


def budget_value(text: str | None):
    """--budget as install() takes it: bytes from digits, a fraction from a decimal, else a size."""
    if text is None or not _NUMBER.fullmatch(text.strip()):
        return text
    return float(text) if "." in text else int(text)


@dataclass(frozen=True)
class Launch:
    """What the checks settled: the policy, this process's GPU and its rank (for the report's name)."""
    policy: Policy
    device: ChosenDevice
    rank: int


def check(target: Target, policy: str | None, budget: str | None, json_path: str | None,
          device: int | None = None) -> Launch:
    """Everything about the flags and torchrun's variables that can be wrong, before any CUDA
    work; raises LaunchError."""
    if target.script is not None and not Path(target.script).is_file():
        raise LaunchError(f"{PROG}: can't open file {target.script!r}: no such file", EXIT_USAGE)
    if json_path is not None and Path(json_path).is_dir():
        raise LaunchError(f"{PROG}: --json {json_path}: is a directory; give a file name", EXIT_USAGE)
    try:
        chosen = choose_policy(policy, budget_value(budget), source="--budget")
        return Launch(chosen, choose_device(device, At("command line", "--device")), global_rank())
    except PolicyError as error:
        raise LaunchError(f"{PROG}: {error}", EXIT_USAGE) from None


def launch(target: Target, *, policy: str | None = None, budget: str | None = None, json_path: str | None = None,
           profile: bool = False, device: int | None = None) -> int:
    """Checks, installs, runs the target, reports; returns the exit status (the script's)."""
    try:
        checked = check(target, policy, budget, json_path, device)
    except LaunchError as error:
        print(error, file=sys.stderr)
        return error.status
    rank = checked.rank
    counters = _start_counters(checked.device.index) if profile else None
    try:  # install() resolves LOCAL_RANK again, the same way, and its errors name where the device came from
        install_before_cuda(checked.policy, device=device, installed_by="python -m um_alloc run",
                            too_late_hint=TOO_LATE)
    except (RuntimeError, PolicyError) as error:
        print(f"{PROG}: um_alloc could not install: {error}", file=sys.stderr)
        return EXIT_FAILED
    from .auto import AutoAttach  # torch's hooks: only once um_alloc is PyTorch's allocator

    auto = AutoAttach()
    status, uncaught = run_target(target)
    auto.remove()
    _report(auto, target, status, json_path, rank)
    if counters is not None:
        _stop_counters(*counters, json_path, rank)
    if uncaught is not None:  # last, as Python prints it: the error is what a reader looks for
        sys.excepthook(type(uncaught), uncaught, uncaught.__traceback__)
    # The script's objects (its model, the process group DDP holds, the globals runpy leaves in a
    # cycle) are freed now, while Python is whole: freed in its finalization, a tensor that a
    # gloo or NCCL thread still holds aborts the process after the work is done.
    del auto, uncaught
    gc.collect()
    return status


def run_target(target: Target) -> tuple[int, BaseException | None]:
    """Runs the script or module as ``__main__``. Returns its exit status and the exception it
    left uncaught (None if none), whose traceback then starts at the script's own frames."""
    try:
        if target.script is not None:
            sys.argv = [target.script, *target.args]
            sys.path.insert(0, str(Path(target.script).resolve().parent))  # as `python script.py` does
            runpy.run_path(target.script, run_name="__main__")
        else:
            sys.argv = [target.module, *target.args]  # runpy puts the module's file in argv[0]
            sys.path.insert(0, os.getcwd())            # as `python -m` does
            _require_module(target.module)
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    except SystemExit as exit_:
        return _exit_status(exit_.code), None
    except LaunchError as error:
        print(error, file=sys.stderr)
        return error.status, None
    except BaseException as error:  # noqa: BLE001  the script's own, printed by launch() as Python would
        error = error.with_traceback(_without_launcher_frames(error.__traceback__))
        return (EXIT_INTERRUPTED if isinstance(error, KeyboardInterrupt) else EXIT_FAILED), error
    return 0, None


def _require_module(name: str) -> None:
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError) as error:
        raise LaunchError(f"{PROG}: error while finding module specification for {name!r}: {error}",
                          EXIT_FAILED) from None
    if found is None:
        raise LaunchError(f"{PROG}: no module named {name!r}", EXIT_FAILED)


def _exit_status(code) -> int:
    """SystemExit's code as the process's status, the way Python turns it into one."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints the message and exits 1
    return 1


def _without_launcher_frames(tb):
    skipped = {__name__, runpy.__name__}  # by module: runpy's frames may be frozen, without a file
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in skipped:
        tb = tb.tb_next
    return tb


def _report(auto, target: Target, status: int, json_path: str | None, rank: int) -> None:
    """The memory summary and the plan to stderr, and --json; a failure here never hides the
    script's exit status."""
    header = f"\n{PROG}: {target.name} exited with status {status}" + (f" (rank {rank})" if rank else "")
    try:
        text, data = summary_text(auto.planner), report(auto.planner, exit_status=status, target=target.name,
                                                        model=type(auto.model).__name__ if auto.model else None,
                                                        rank=rank)
    except Exception as error:  # noqa: BLE001  e.g. the GPU is gone after the script's own failure
        print(f"{header}; no memory report: {type(error).__name__}: {error}", file=sys.stderr)
        return
    print(f"{header}\n{text}", file=sys.stderr)
    if json_path:
        write_json(_per_rank(json_path, rank), data)
        print(f"{PROG}: wrote {_per_rank(json_path, rank)}", file=sys.stderr)


def _per_rank(path: str, rank: int) -> str:
    """out.json for rank 0, out.rank3.json for rank 3: torchrun's processes write side by side."""
    if not rank:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def _start_counters(device: int):
    from ..profile.__main__ import mark_on_optimizer_steps
    from ..profile.um_counters import UMCounters

    counters = UMCounters(device).start()  # CUPTI first: it must see CUDA start
    return counters, mark_on_optimizer_steps(counters)


def _stop_counters(counters, hook, json_path: str | None, rank: int) -> None:
    from ..profile.__main__ import report as counters_report

    hook.remove()
    counters.stop()
    path = _per_rank(json_path, rank) if json_path else None
    counters_report(counters, path and str(Path(path).with_suffix(".counters.json")))

