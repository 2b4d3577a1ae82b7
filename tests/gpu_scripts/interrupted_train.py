"""bert_example/train.py stopped by SIGINT at a chosen point: inside a step's forward, or halfway
through writing a checkpoint. Runs on the GPU or the CPU, as train.py's own flags say.

    python tests/gpu_scripts/interrupted_train.py --at step:5 --losses L.jsonl -- --steps 12 --checkpoint DIR ...
    python tests/gpu_scripts/interrupted_train.py --at checkpoint:8 --paused P -- ...

--at step:N        pauses in the forward of step N (counted from 0, as --steps counts), a few modules in
--at checkpoint:N  pauses with half the bytes of the checkpoint at step N in its temporary file
--paused FILE      at the pause, writes FILE and waits for SIGINT from outside (a test sends it);
                   without it, the script sends SIGINT to itself
--losses FILE      appends each finished step's loss as a JSON line {"step": i, "loss": x}

Exits with train.py's status: 130 once interrupted. The pause waits in time.sleep on the main
thread, where Python delivers signals; a signal that comes during backward is handled only once
autograd's threads hand back, so the forward is where an interrupt lands at once.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the checkout's train.py and um_alloc
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

WAIT_S = 300              # how long a pause waits for SIGINT before giving up
MODULE_CALLS_BEFORE = 12  # module calls into the step's forward before the pause: inside the encoder


def pause_for_signal(paused: Path | None):
    """The pause: SIGINT, from outside (`paused` written first) or sent here; KeyboardInterrupt
    comes out of the sleep, raised by Python's default handler."""
    def pause(where: str) -> None:
        if paused is None:
            signal.raise_signal(signal.SIGINT)
        else:
            temporary = paused.with_name(paused.name + ".tmp")
            temporary.write_text(where)
            temporary.replace(paused)  # whole, or not there: the test polls for it
        time.sleep(WAIT_S)
        raise SystemExit(f"interrupted_train.py: no SIGINT came within {WAIT_S} s of the pause at {where}")
    return pause


@contextlib.contextmanager
def pause_in_forward(pause, where: str):
    """Calls pause(where) in the forward of the model, after MODULE_CALLS_BEFORE module calls."""
    calls = itertools.count()

    def hook(module, args):
        if next(calls) == MODULE_CALLS_BEFORE:
            pause(where)

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def half_written_save(save, step: int, pause):
    """torch.save that, for the checkpoint at `step` only, writes half its bytes, flushes them
    and pauses before the rest: an interrupt in the middle of the write."""
    def patched(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and obj.get("step") == step and hasattr(f, "write")):
            return save(obj, f, *args, **kwargs)
        whole = io.BytesIO()
        save(obj, whole, *args, **kwargs)
        data = whole.getvalue()
        f.write(data[:len(data) // 2])
        f.flush()
        pause(f"checkpoint:{step}")
        f.write(data[len(data) // 2:])
    return patched


def with_losses(train_loop, at: tuple[str, int], pause, on_loss):
    """train.py's train_loop, each step's loss handed to on_loss(step, loss), and the pause in
    the forward of step N when `at` is ("step", N)."""
    def loop(args, step_fn, source, first_step, on_step_done, retry=None, **options):
        next_step = [first_step]  # a step that ran out of memory and is retried keeps its number

        def step(batch):
            pausing = at == ("step", next_step[0])
            with pause_in_forward(pause, f"step:{next_step[0]}") if pausing else contextlib.nullcontext():
                loss = step_fn(batch)
            on_loss(next_step[0], loss)
            next_step[0] += 1
            return loss
        return train_loop(args, step, source, first_step, on_step_done, retry, **options)
    return loop


@contextlib.contextmanager
def interruption(at: str, pause, on_loss=lambda step, loss: None):
    """train.py patched, for what runs inside, to call pause() at `at` (step:N or checkpoint:N)."""
    from bert_example import train

    where = parse_at(at)
    original_loop, original_save = train.train_loop, torch.save
    train.train_loop = with_losses(original_loop, where, pause, on_loss)
    if where[0] == "checkpoint":
        torch.save = half_written_save(original_save, where[1], pause)
    try:
        yield
    finally:
        train.train_loop, torch.save = original_loop, original_save


def parse_at(text: str) -> tuple[str, int]:
    kind, _, number = text.partition(":")
    if kind not in ("step", "checkpoint") or not number.isdigit():
        raise ValueError(f"--at: expected step:N or checkpoint:N with N >= 0, got {text!r}")
    return kind, int(number)


def loss_writer(path: Path | None):
    def write(step: int, loss: float) -> None:
        if path is not None:
            with path.open("a") as f:  # a line per step, on disk before the next: the interrupt keeps them
                f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    return write


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", required=True, help="step:N or checkpoint:N")
    parser.add_argument("--paused", type=Path, help="written at the pause; then SIGINT is awaited from outside")
    parser.add_argument("--losses", type=Path, help="each step's loss, one JSON line each")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then train.py's arguments")
    options = parser.parse_args(argv)
    try:
        parse_at(options.at)
    except ValueError as error:
        parser.error(str(error))
    train_args = options.train_args[1:] if options.train_args[:1] == ["--"] else options.train_args
    # A shell starts background jobs with SIGINT ignored, and Python then keeps it ignored; a user
    # at a terminal gets Python's handler, so this run does too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from bert_example import train

    with interruption(options.at, pause_for_signal(options.paused), loss_writer(options.losses)):
        return train.cli(train_args)


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    sys.exit(main())
