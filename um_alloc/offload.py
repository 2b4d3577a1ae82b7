"""Saved activations to host memory during forward, back to the GPU ahead of backward (vDNN,
seeds/004_*), sized to a GPU budget.

    offload = ActivationOffload(budget="16GiB")
    for batch in loader:
        with offload.step():
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()

Like ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, tensors autograd saves for backward go
to pinned host memory and come back when backward unpacks them. Three things differ:

- **Only what does not fit moves.** The first step offloads every eligible tensor and measures the
  step's GPU peak with them gone. Later steps keep the *last* saved tensors (the first that
  backward needs) on the GPU, as many bytes as ``budget - peak - margin`` allows, and offload the
  rest. A step whose saved tensors differ from the first step's (other shapes) offloads everything
  again: never a plan that passes the budget.
- **Transfers overlap compute.** Copies out run on a side stream after an event, so forward never
  waits for them; the memory they read goes back to the pool ordered after the copy. In backward,
  copies in run on another side stream, ``window`` bytes ahead of use in reverse save order,
  starting at backward's first unpack (while backward still works on what stayed), and compute
  waits on an event only for the tensor it needs now. A copy back lands in memory taken on the
  compute stream, so freeing and reusing it never makes compute wait for later copies.
- **A late copy costs a wait, never wrong data**: unpack always waits for the tensor's own copy.

Eligible: tensors on the device of at least ``min_bytes`` that are not leaves requiring grad
(parameters stay where they are). A tensor saved several times in a step is copied once. On a CPU
device the same logic runs with plain copies (no streams), so it can be tested without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .policy import size_arg

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_WINDOW = 1 << 30  # also what schedule_window: auto means here


@dataclass
class _Packed:
    """One offloaded tensor: its host copy, and while backward needs it, its copy back."""
    host: torch.Tensor
    out_done: torch.cuda.Event | None               # None on the CPU
    uses: int = 1                                   # unpacks still to come this step
    gpu: torch.Tensor | None = None                 # the copy back, once started
    in_done: torch.cuda.Event | None = None
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = self.host.numel() * self.host.element_size()


@dataclass
class OffloadStats:
    """What the last step did; bytes each way are the link traffic it caused."""
    saved_bytes: int = 0        # eligible saved tensors, counted once each
    kept_bytes: int = 0         # left on the GPU
    out_bytes: int = 0          # copied to host memory
    in_bytes: int = 0           # copied back
    on_demand: int = 0          # copies back that started only when backward asked (window too short)
    offload_all: bool = True    # calibrating, or the step differed from the first


class ActivationOffload:
    """Offloads autograd's saved tensors beyond a GPU budget; see the module docstring.

    budget: the GPU memory the training may use (bytes or "16GiB"); None keeps nothing back on
        the GPU (offload everything eligible, as save_on_cpu does).
    window: bytes of copies back in flight ahead of backward (default 1 GiB).
    min_bytes: smaller tensors stay on the GPU (default 1 MiB).
    margin: headroom left under the budget when deciding what to keep (default 512 MiB).
    calibration_steps: steps that offload everything before the plan is made (default 2: the
        optimizer's state appears at the end of the first, and the peak must include it).
    device: "cuda", "cuda:N" (default: the current CUDA device) or "cpu" (tests).
    peak_fn: the peak so far in bytes (default: um_alloc's GPU-backed peak when installed, else
        torch.cuda.max_memory_reserved).
    """

    def __init__(self, budget: int | str | None = None, *, window: int | str = DEFAULT_WINDOW,
                 min_bytes: int | str = MiB, margin: int | str = "512MiB", calibration_steps: int = 2,
                 device: torch.device | str | None = None, peak_fn=None):
        self.budget = None if budget is None else _size(budget, "budget")
        self.window, self.min_bytes = _size(window, "window"), _size(min_bytes, "min_bytes")
        self.margin = _size(margin, "margin")
        if self.budget is not None and self.budget <= self.margin:
            raise ValueError(f"ActivationOffload: budget {self.budget} bytes must be larger than the "
                             f"margin {self.margin} bytes")
        if isinstance(calibration_steps, bool) or not isinstance(calibration_steps, int) or calibration_steps < 1:
            raise ValueError(f"ActivationOffload: calibration_steps must be an int >= 1, got {calibration_steps!r}")
        self.calibration_steps = calibration_steps
        self.device = _device(device)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            self._out_stream = torch.cuda.Stream(self.device)
            self._in_stream = torch.cuda.Stream(self.device)
        elif peak_fn is None and self.budget is not None:
            raise ValueError("ActivationOffload: on the CPU a budget needs peak_fn")
        self._peak_fn = peak_fn or (_default_peak_fn(self.device) if self._cuda else None)
        self._steps = 0
        self._first_sizes: list[int] | None = None   # eligible sizes in save order, first step
        self._keep_from: int | None = None           # index from which tensors stay (None: offload all)
        self.stats = OffloadStats()
        self._reset_step()

    # -- per step --

    @contextlib.contextmanager
    def step(self) -> Iterator[OffloadStats]:
        """Forward and backward of one training step run inside."""
        self._reset_step()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.stats
        except BaseException:
            # An out-of-memory error, say: let go of this step's tensors now, so that the caller
            # can retry smaller; the step is not counted and the plan is not touched.
            self._seen.clear()
            self._offloaded = []
            raise
        self._finish_step()

    def _reset_step(self) -> None:
        if self._steps:
            self._plan_if_calibrated()
        self._sizes: list[int] = []
        self._offloaded: list[_Packed] = []
        self._seen: dict[tuple, _Packed | torch.Tensor] = {}
        self._cursor = -1          # next offloaded tensor (from the end) to copy back
        self._inflight = 0         # bytes copied back and not yet used up
        self._matches = True       # this step's eligible sizes follow the first step's so far
        self.stats = OffloadStats(offload_all=self._keep_from is None)

    def _finish_step(self) -> None:
        self._steps += 1
        if self._first_sizes is None:
            self._first_sizes = self._sizes
        elif not self._matches or len(self._sizes) != len(self._first_sizes):
            log.info("activation offload: saved tensors differ from the first step's; offloading all")
        self._seen.clear()       # kept tensors and host copies are autograd's alone from here
        self._offloaded = []

    def _plan_if_calibrated(self) -> None:
        """After the calibration steps (and the optimizer steps between them), the plan."""
        if self._keep_from is None and self._first_sizes is not None and self._steps >= self.calibration_steps:
            self._keep_from = self._plan_keep(self._first_sizes)

    def _plan_keep(self, sizes: list[int]) -> int | None:
        """Index from which saved tensors stay on the GPU: the tail that fits the room left."""
        if self.budget is None:
            return None
        if self._cuda:
            torch.cuda.synchronize(self.device)
        room = self.budget - self._peak_fn() - self.margin
        keep_from, kept = len(sizes), 0
        while keep_from > 0 and kept + sizes[keep_from - 1] <= room:
            keep_from -= 1
            kept += sizes[keep_from]
        log.info("activation offload: peak %.2f GiB with all %d saved tensors (%.2f GiB) offloaded; "
                 "keeping the last %.2f GiB on the GPU", self._peak_fn() / 2**30, len(sizes),
                 sum(sizes) / 2**30, kept / 2**30)
        return keep_from

    # -- the hooks --

    def _pack(self, tensor: torch.Tensor):
        if not self._eligible(tensor):
            return tensor
        # The same tensor object saved again (a live one: once forward drops a tensor, its address
        # and id can come back as another, which must not match).
        key = (id(tensor), tensor._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is tensor:
            known = seen[1]
            if isinstance(known, _Packed):
                known.uses += 1
            return known
        nbytes = tensor.numel() * tensor.element_size()
        index = len(self._sizes)
        self._sizes.append(nbytes)
        self.stats.saved_bytes += nbytes
        self._matches = self._matches and self._first_sizes is not None and \
            index < len(self._first_sizes) and self._first_sizes[index] == nbytes
        if self._keeps(index):
            self.stats.kept_bytes += nbytes
            self._seen[key] = (weakref.ref(tensor), tensor)
            return tensor
        packed = self._copy_out(tensor)
        self._seen[key] = (weakref.ref(tensor), packed)
        return packed

    def _unpack(self, packed):
        self._copy_ahead()  # from backward's first unpack on, also while it uses what stayed
        if not isinstance(packed, _Packed):
            return packed
        if packed.gpu is None:  # not in flight: backward asked before the window reached it
            self.stats.on_demand += 1
            self._copy_in(packed)
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_event(packed.in_done)
        tensor = packed.gpu
        packed.uses -= 1
        if packed.uses <= 0:  # autograd holds it from here; the next step reuses the memory
            packed.gpu = None
            self._inflight -= packed.nbytes
        return tensor

    def _eligible(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor  # linear saves weight.t()
        is_parameter = base.is_leaf and base.requires_grad
        return (tensor.device == self.device and tensor.numel() * tensor.element_size() >= self.min_bytes
                and not is_parameter)

    def _keeps(self, index: int) -> bool:
        return self._keep_from is not None and self._matches and index >= self._keep_from

    # -- transfers --

    def _copy_out(self, tensor: torch.Tensor) -> _Packed:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._cuda)
        done = None
        if self._cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._out_stream):
                self._out_stream.wait_event(produced)
                host.copy_(tensor, non_blocking=True)
                done = self._out_stream.record_event()
            tensor.record_stream(self._out_stream)  # its memory is reused only after the copy
        else:
            host.copy_(tensor)
        packed = _Packed(host, done)
        self._offloaded.append(packed)
        self._cursor = len(self._offloaded) - 1
        self.stats.out_bytes += packed.nbytes
        return packed

    def _copy_in(self, packed: _Packed) -> None:
        if self._cuda:
            # Taken on the compute stream, which frees it: the copy waits for compute to reach this
            # point (the memory's last user), compute waits for the copy before using it, and after
            # the free nothing but compute has touched it. Taken on the side stream instead, each
            # reuse by compute would wait for every copy queued by then, draining the window.
            compute = torch.cuda.current_stream(self.device)
            gpu = torch.empty(packed.host.shape, dtype=packed.host.dtype, device=self.device)
            self._in_stream.wait_stream(compute)
            self._in_stream.wait_event(packed.out_done)
            with torch.cuda.stream(self._in_stream):
                gpu.copy_(packed.host, non_blocking=True)
                packed.in_done = self._in_stream.record_event()
        else:
            gpu = packed.host.clone()
        packed.gpu = gpu
        self._inflight += packed.nbytes
        self.stats.in_bytes += packed.nbytes

    def _copy_ahead(self) -> None:
        """Starts copies back in reverse save order while the window has room."""
        while self._cursor >= 0:
            packed = self._offloaded[self._cursor]
            if packed.gpu is None and packed.uses > 0:
                if self._inflight + packed.nbytes > self.window and self._inflight > 0:
                    return
                self._copy_in(packed)
            self._cursor -= 1


def from_policy(**overrides) -> ActivationOffload | None:
    """An ActivationOffload for the installed policy, or None when it does not ask for one.

    It asks with ``scheduler.offload_activations: true`` and a budget: the budget is the policy's
    (resolved against the device), the window its ``schedule_window`` (auto: 1 GiB) and the
    smallest tensor that moves its ``min_swap_size``. Keyword arguments override any of these.
    """
    from .install import installation, is_installed

    if not is_installed():
        return None
    chosen = installation()
    scheduler = chosen.policy.scheduler
    budget = chosen.policy.budget_bytes(chosen.device_total)
    if not scheduler.offload_activations or budget is None:
        return None
    settings = dict(budget=budget, window=scheduler.schedule_window or DEFAULT_WINDOW,
                    min_bytes=scheduler.min_swap_size, device=torch.device("cuda", chosen.device))
    return ActivationOffload(**{**settings, **overrides})


def _size(value: int | str, what: str) -> int:
    return size_arg(value, what, "ActivationOffload")


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"ActivationOffload: device must be cuda, cuda:N or cpu, got {device}")
    return device


def _default_peak_fn(device: torch.device):
    from . import is_installed, memory_stats

    if is_installed():
        return lambda: memory_stats()["peak_gpu_backed_bytes"]
    return lambda: torch.cuda.max_memory_reserved(device)
