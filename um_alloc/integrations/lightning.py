"""um_alloc in Lightning: one callback, no subclass.

    from um_alloc.integrations.lightning import UMAllocCallback

    trainer = lightning.Trainer(callbacks=[UMAllocCallback(budget="12GiB")], max_steps=100)
    trainer.fit(LitModel(), train_loader)

The callback installs um_alloc when it is made (before the Trainer moves the model to the GPU).
When training starts it watches the LightningModule: the module whose forward the training step
runs first with gradients enabled (the LightningModule itself, or the model it holds) is tagged
and, under a budget, planned per block (um_alloc.integrations.model_finder and attach give the
rules); gradients and optimizer state are tagged at each optimizer's first step. When training
ends it prints the memory summary and the plan to stderr, writes ``json_path``, and takes its hooks off.
Works with ``lightning`` and with the older ``pytorch_lightning`` package.
"""
from __future__ import annotations

import os
import sys

try:
    from lightning.pytorch import Callback
except ImportError:
    try:
        from pytorch_lightning import Callback
    except ImportError as missing:
        raise ImportError("um_alloc.integrations.lightning needs Lightning: pip install lightning") from missing

from .attach import install_for_callback, report, summary_text, write_json

__all__ = ["UMAllocCallback"]

TOO_LATE = "Create UMAllocCallback before the Trainer runs and before moving any model to the GPU."


class UMAllocCallback(Callback):
    """um_alloc for ``lightning.Trainer``: pass it in ``callbacks=[...]``.

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
        self.auto = None
        self.report: dict | None = None

    @property
    def planner(self):
        return self.auto.planner if self.auto else None

    def on_train_start(self, trainer, pl_module) -> None:
        from .auto import AutoAttach

        self.auto = AutoAttach(within=pl_module, **self.planner_options)

    def on_train_end(self, trainer, pl_module) -> None:
        if self.auto is None:
            return
        first = trainer.is_global_zero
        model = type(self.auto.model).__name__ if self.auto.model is not None else None
        self.report = report(self.auto.planner, model=model, global_step=trainer.global_step)
        if first:
            print(summary_text(self.auto.planner), file=sys.stderr)
            if self.json_path:
                write_json(self.json_path, self.report)
        self.auto.remove()
