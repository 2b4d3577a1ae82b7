"""um_alloc in Hugging Face's Trainer: one callback, no subclass.

    from um_alloc.integrations.huggingface import UMAllocCallback

    callback = UMAllocCallback(budget="12GiB")   # first: TrainingArguments picks the device and starts CUDA
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()

The callback installs um_alloc when it is made. When training begins it tags the model's
parameters, the gradients and the optimizer's state (through accelerate's wrapper), and under a
budget attaches the block planner to the model (um_alloc.integrations.attach gives the rules:
not with ``gradient_checkpointing=True``, which recomputes already). When training ends it
prints the memory summary and the plan to stderr, writes ``json_path``, and takes its hooks off.
"""
from __future__ import annotations

import os

from transformers import TrainerCallback

from .attach import Attached, install_for_callback

__all__ = ["UMAllocCallback"]

TOO_LATE = ("Create UMAllocCallback before TrainingArguments (which picks the device and starts CUDA) and before "
            "moving any model to the GPU.")


class UMAllocCallback(TrainerCallback):
    """um_alloc for ``transformers.Trainer``: pass it in ``callbacks=[...]``.

    Args:
        budget: GPU memory for the whole training (bytes, "12GiB", or a fraction of the device such
            as 0.5); None: the policy's. With a budget and no policy, the policy is planner.yaml.
        policy: a policy file or shipped name; None: UM_POLICY, else as above.
        json_path: where to write the memory statistics and the plan when training ends (rank 0).
        device: the CUDA device to install on; default LOCAL_RANK, else 0.
        **planner_options: for um_alloc.plan (margin, block_classes, ...).

    Raises:
        PolicyError: a bad policy or budget (before any CUDA work).
        RuntimeError: CUDA had started already, or no GPU is visible.
    """

    def __init__(self, budget=None, policy=None, *, json_path: str | os.PathLike | None = None,
                 device: int | None = None, **planner_options):
        self.installation = install_for_callback(budget, policy, device, TOO_LATE)
        self.json_path, self.planner_options = json_path, planner_options
        self.attached: Attached | None = None
        self.report: dict | None = None

    @property
    def planner(self):
        return self.attached.planner if self.attached else None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.attached = Attached(model, [optimizer], **self.planner_options)

    def on_train_end(self, args, state, control, **kwargs):
        if self.attached is None:
            return
        first = state.is_world_process_zero
        self.report = self.attached.finish(self.json_path if first else None, print_summary=first,
                                           global_step=state.global_step)
