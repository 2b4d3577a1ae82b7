"""train.py under torchrun: one process per GPU, each training its share of the global batch, the
model wrapped in PyTorch's DistributedDataParallel (--parallel ddp) or sharded with FSDP2's
fully_shard (--parallel fsdp). um_alloc installs in each process on that process's GPU
(LOCAL_RANK) with the budget per GPU; the wrapping and the communication are PyTorch's own.

    torchrun --nproc-per-node 2 bert_example/train.py --parallel ddp --batch-size 32 --policy best.yaml --budget 16GiB

--batch-size is per process; the global batch is world x batch. Every process draws the same
global batch and takes its own rows, so N processes see the data that one process sees with
--batch-size N x batch. The masked-LM loss is a mean over masked tokens, and the ranks hold
different numbers of them: each rank's loss is weighted by its share of the global batch's
targets, so that DDP's mean over the ranks (FSDP2's too) is the global batch's mean loss, and its
gradients those of one process on the whole batch.

On the CPU (--device cpu) the processes talk through gloo, which is how the tests run it.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from bert_example.data import IGNORE

KINDS = ("ddp", "fsdp")


def world_from_environment() -> int | None:
    """torchrun's WORLD_SIZE, or None outside torchrun (then --parallel is refused)."""
    text = os.environ.get("WORLD_SIZE")
    return int(text) if text and text.isdigit() and int(text) >= 1 else None


def device_of_rank(device_text: str) -> str:
    """--device under torchrun: "cuda" means this process's GPU, cuda:LOCAL_RANK."""
    if device_text != "cuda":
        return device_text
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


@dataclass
class Parallel:
    """This process's place among the ranks, and what training under DDP or FSDP2 needs of it."""
    kind: str
    rank: int
    world: int
    global_targets: int = 0  # the masked tokens of the current global batch, over every rank

    @classmethod
    @contextlib.contextmanager
    def joined(cls, kind: str | None, device: torch.device) -> Iterator[Parallel | None]:
        """In the process group (NCCL on a GPU, gloo on the CPU, from torchrun's variables) for
        the block; None, and no group, without --parallel."""
        if kind is None:
            yield None
            return
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)
        try:
            yield cls(kind, dist.get_rank(), dist.get_world_size())
        except BaseException:
            dist.destroy_process_group()  # no barrier: the other ranks may never reach it
            raise
        # The ranks leave together, with no collective of theirs still in flight: a rank that
        # took its group down while gloo's threads still held work could abort the process.
        dist.barrier()
        dist.destroy_process_group()

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # --- the model ---------------------------------------------------------------------------

    def shard(self, model: torch.nn.Module, device: torch.device, cpu_offload: bool) -> torch.nn.Module:
        """FSDP2: every encoder layer and then the whole model sharded over the ranks (parameters,
        gradients and optimizer state 1/world each), gathered a layer at a time. cpu_offload:
        FSDP2's CPUOffloadPolicy, the shards in pinned host memory and the optimizer step on the CPU."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (self.world,))
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
        for layer in model.bert.encoder.layer:
            fully_shard(layer, mesh=mesh, offload_policy=offload)
        fully_shard(model, mesh=mesh, offload_policy=offload)
        return model

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """DDP around the model (after the planner attached: it plans the model DDP runs); FSDP2's
        model is already sharded. The gradients are views of DDP's buckets: otherwise the buckets
        hold a second copy of every gradient (1.3 GiB of float32 for BERT-Large), which a budget
        would have to find room for."""
        if self.kind != "ddp":
            return model
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                       gradient_as_bucket_view=True)

    # --- a step ------------------------------------------------------------------------------

    def local_batch(self, global_batch: dict) -> dict:
        """This rank's rows of the global batch; notes the global batch's number of targets."""
        self.global_targets = int((global_batch["labels"] != IGNORE).sum())
        return {key: value.chunk(self.world)[self.rank] for key, value in global_batch.items()}

    def loss(self, model, batch: dict) -> torch.Tensor:
        """This rank's mean loss weighted by its share of the global batch's targets (x world:
        DDP and FSDP2 average the ranks' gradients)."""
        targets = (batch["labels"] != IGNORE).sum()
        return model(**batch).loss * targets * (self.world / self.global_targets)

    def step(self, step_fn):
        """step_fn on this rank's rows of each global batch; returns the global batch's mean loss."""
        def step(global_batch: dict) -> float:
            return self.mean(step_fn(self.local_batch(global_batch)))
        return step

    # --- figures over the ranks --------------------------------------------------------------

    def mean(self, value: float) -> float:
        return self._reduced(value, dist.ReduceOp.SUM) / self.world

    def largest(self, value: float | None) -> float | None:
        return None if value is None else self._reduced(value, dist.ReduceOp.MAX)

    def _reduced(self, value: float, op) -> float:
        backend_device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.tensor([float(value)], dtype=torch.float64, device=backend_device)
        dist.all_reduce(tensor, op=op)
        return tensor.item()

    def summarize(self, summary: dict) -> dict:
        """The job's figures in place of this rank's: the global batch, its samples per second at
        the slowest rank's median step, and the largest peak over the ranks."""
        per_rank = summary["batch"]
        step_s = self.largest(summary["step_s_median"])
        summary.update(batch=per_rank * self.world, step_s_median=step_s,
                       samples_per_s=per_rank * self.world / step_s,
                       peak_bytes=self.largest(summary.get("peak_bytes")),
                       peak_reserved_bytes=self.largest(summary.get("peak_reserved_bytes")),
                       parallel={"kind": self.kind, "world": self.world, "batch_per_rank": per_rank,
                                 "backend": dist.get_backend()})
        return summary
