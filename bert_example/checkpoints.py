"""Checkpoints of the BERT example: written atomically, read back with the previous one as fallback.

A checkpoint holds the step, the model's and AdamW's state, the data source's state and the RNG
states, so a resumed run computes the same losses as an uninterrupted one.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CHECKPOINT, PREVIOUS = "checkpoint.pt", "checkpoint.prev.pt"


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


@dataclass
class Progress:
    """How far a run got, for what an interrupted run says: the steps done, the checkpoint being
    written, and the last one whose write completed (the one --resume continues from)."""
    steps: int                    # --steps
    directory: str | None         # --checkpoint DIR
    done: int                     # steps finished, counted from 0 also after --resume
    saved: int | None = None      # the step of the last complete checkpoint in DIR
    writing: int | None = None    # the step of the checkpoint being written

    def save(self, state: dict) -> None:
        """save_checkpoint(DIR, state), counted as complete only once it returned."""
        self.writing = state["step"]
        save_checkpoint(self.directory, state)
        self.saved, self.writing = self.writing, None

    def interrupted_text(self) -> str:
        """What an interrupted run tells its user: where it stopped, and where --resume continues."""
        text = f"train.py: interrupted with {self.done} of {self.steps} steps done"
        if self.writing is not None:
            text += f", while writing the checkpoint at step {self.writing} (not kept)"
        if self.directory is None:
            return text + ". Without --checkpoint DIR nothing was kept: a new run starts from step 0."
        if self.saved is None:
            return text + f". This run completed no checkpoint in {self.directory}."
        return (text + f". The last complete checkpoint, at step {self.saved}, is in {self.directory}: "
                "the same command with --resume continues from it.")


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
