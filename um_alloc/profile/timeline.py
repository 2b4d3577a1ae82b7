"""Bytes per tag over one training step, sampled at module hooks, with the step's GPU faults.

    with StepTimeline(model, optimizer, counters=counters, step=k) as timeline:
        loss = train_step(batch)
    timeline.save("step.png")            # and step.json beside it

Samples are taken on the CPU: before and after each leaf module's forward, when autograd
reaches each leaf module's output in backward, and around optimizer.step(). Each reads
um_alloc.memory_stats() per tag: "resident_bytes" where the allocator reports it, else
"live_bytes". Fault times are CUPTI's GPU timestamps on the same
clock; the GPU runs behind the CPU, so faults appear later than the module that caused them.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from ..install import installation, is_installed
from ..stats import memory_stats
from ..tag_names import TAGS
from .charts import timeline_chart

Sampler = Callable[[], dict]


class StepTimeline:
    def __init__(self, model, optimizer=None, *, counters=None, step: int = 0,
                 sampler: tuple[Sampler, str] | None = None, budget: tuple[int | None, str | None] | None = None):
        self.model, self.optimizer, self.counters, self.step = model, optimizer, counters, step
        self.sample_fn, self.source = sampler or default_sampler()
        self.budget_bytes, self.budget_label = budget if budget is not None else default_budget()
        self.samples: list[dict] = []
        self.t0_ns = self.t1_ns = 0
        self._handles: list = []
        self._phase = "forward"

    def now(self) -> int:
        if self.counters is not None:
            return self.counters.now()
        return time.perf_counter_ns()

    def sample(self, label: str, phase: str | None = None) -> None:
        self.samples.append({"t_ns": self.now(), "label": label, "phase": phase or self._phase,
                             "bytes": dict(self.sample_fn())})

    # --- arming ---------------------------------------------------------------------------

    def __enter__(self) -> "StepTimeline":
        if self.counters is not None:
            self.counters.keep_records(True)
        self.t0_ns = self.now()
        self._attach()
        self.sample("step begin", "forward")
        return self

    def __exit__(self, *exc) -> None:
        self.sample("step end")
        self.t1_ns = self.now()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self.counters is not None:
            self.counters.keep_records(False)

    def _attach(self) -> None:
        for name, module in self.model.named_modules():
            if next(module.children(), None) is None:  # leaf modules: one sample per kernel group
                self._handles.append(module.register_forward_pre_hook(self._forward_pre(name)))
                self._handles.append(module.register_forward_hook(self._forward_post(name)))
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_hook("optimizer.step begin")))
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_hook("optimizer.step end")))

    def _forward_pre(self, name: str):
        def hook(module, args):
            self.sample(f"{name} forward", self._forward_phase())
        return hook

    def _forward_post(self, name: str):
        def hook(module, args, output):
            self.sample(f"{name} forward done", self._forward_phase())
            tensor = _first_tensor(output)
            if tensor is not None and tensor.grad_fn is not None:
                # A node pre-hook sees backward reach this module without wrapping its output,
                # so in-place ops downstream (HF models have some) keep working.
                self._handles.append(tensor.grad_fn.register_prehook(self._backward(name)))
        return hook

    def _forward_phase(self) -> str:
        # Activation checkpointing runs forwards again inside backward: call those recompute.
        return "recompute" if self._phase == "backward" else "forward"

    def _backward(self, name: str):
        def hook(grad_outputs):
            self._phase = "backward"
            self.sample(f"{name} backward", "backward")
        return hook

    def _optimizer_hook(self, label: str):
        def hook(optimizer, args, kwargs):
            self._phase = "optimizer"
            self.sample(label, "optimizer")
        return hook

    # --- result ---------------------------------------------------------------------------

    def result(self) -> dict:
        faults = None
        if self.counters is not None and self.counters.available:
            faults = [r["start"] for r in self.counters.records(self.t0_ns, self.t1_ns)
                      if r["kind"] == "GPU_PAGE_FAULT"]
        tags = sorted({tag for s in self.samples for tag in s["bytes"]}, key=_tag_order)
        return {"step": self.step, "t0_ns": self.t0_ns, "t1_ns": self.t1_ns, "source": self.source,
                "tags": tags, "budget_bytes": self.budget_bytes, "budget_label": self.budget_label,
                "faults_ns": faults, "samples": self.samples}

    def save(self, png_path: str | Path) -> dict:
        """Writes a JSON of the data beside the PNG, then the PNG; returns both paths. Without
        matplotlib the JSON is still written and "error" says why there is no picture."""
        data = self.result()
        json_path = Path(png_path).with_suffix(".json")
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data) + "\n")
        info = {"png": None, "json": str(json_path), "step": self.step, "samples": len(self.samples),
                "gpu_fault_records": None if data["faults_ns"] is None else len(data["faults_ns"])}
        try:
            info["png"] = str(timeline_chart(data, png_path))
        except RuntimeError as error:  # no matplotlib: keep the data, say what is missing
            info["error"] = str(error)
        return info


def default_sampler() -> tuple[Sampler, str]:
    """um_alloc's bytes per tag; the stock allocator's total; or nothing (CPU)."""
    if is_installed():
        first = memory_stats()["tags"]
        key = "resident_bytes" if all("resident_bytes" in v for v in first.values()) else "live_bytes"
        return (lambda: {t: v[key] for t, v in memory_stats()["tags"].items()}), key
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return (lambda: {"all": torch.cuda.memory_allocated()}), "torch.cuda.memory_allocated"
    return (lambda: {}), "no GPU memory statistics"


def default_budget() -> tuple[int | None, str | None]:
    """The GPU budget (installation().budget) when there is one, else a pool cap that was asked for
    (--memory-limit, pool.max_reserved); the automatic cap (free memory - margin) says nothing."""
    if not is_installed():
        return None, None
    inst = installation()
    budget = inst.budget
    if budget:
        return budget, "scheduler.budget"
    automatic = inst.device_free_at_install - inst.policy.pool.reserve_margin
    if inst.max_reserved < 2**63 and inst.max_reserved != automatic:
        return inst.max_reserved, "pool.max_reserved (the memory limit)"
    return None, None


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (list, tuple)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _tag_order(tag: str) -> tuple[int, str]:
    return (TAGS.index(tag) if tag in TAGS else len(TAGS), tag)
