"""Each distinct unit's forward and backward, timed by itself once the probed step is over.

The planner prices a plan from the step with everything kept (Calibration.base_step_s), which no
step under the budget runs: it comes from the safe step, whose blocks run wrapped in the safe
mode (their inputs copied out, checkpoint's bookkeeping), rerun in backward beside the copies
coming back, and wait for those copies. Taking the reruns and the modelled waits out of that
step left ResNet-50's base at 1.45 times stock's step at batch 176 on one H200, and the median
record's at 1.27 times (bench/replay_predictions.py). A kept block runs none of that.

So the probed step notes each distinct unit call (the module's class and the shapes, strides and
dtypes of its tensor arguments: a block's, or a gap's) and, once that step is over and nothing is
in flight, each one runs again by itself: its forward, then its backward to its inputs and
parameters through torch.autograd.grad (no .grad is touched), twice, the second timed on CUDA
events, and its forward on the host's clock too: where the GPU takes longer over a kept forward
than the host, the host's checks for a rebuild hide (UnitCost.added_to_forward_s). Its tensor
arguments are new tensors of the same shapes, strides and dtypes (random floating values; other
tensors are the call's own), its buffers copies of the forward's, the RNG's state as it was, and
autocast and um_alloc's tag scopes as the call had them: a unit whose large temporaries a spilled
loss's scope put in host memory (spill.py) puts them there again, not in GPU memory the budget may
not hold. A call that fails (a unit that needs its real inputs, parameters only its wrapper
gathers), whose outputs seen need no gradient (its backward would seem free), or that the budget
cannot hold leaves its unit without the figures, and the base prices that unit from the safe step
as before.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..tags import OpenScopes
from .rerun import AutocastState

__all__ = ["AloneCalls", "AloneTime"]

log = logging.getLogger("um_alloc.planner")

TIMED_RUNS = 2  # the first run of a shape may pick kernels (cudnn.benchmark) and warm caches


@dataclass(frozen=True)
class AloneTime:
    """One unit call run by itself: its forward and its backward on the GPU's clock (the host's on
    the CPU), each from when the host began issuing it to when the GPU was done with it, and the
    host's time of issuing the forward: a rebuild's checks in forward cost the step only where
    they take the host past the GPU (UnitCost.added_to_forward_s)."""
    forward_s: float
    backward_s: float
    forward_cpu_s: float = 0.0

    def __add__(self, other: "AloneTime") -> "AloneTime":
        return AloneTime(self.forward_s + other.forward_s, self.backward_s + other.backward_s,
                         self.forward_cpu_s + other.forward_cpu_s)


@dataclass(frozen=True)
class _FreshTensor:
    """A floating tensor argument, as a new tensor of its shape is made."""
    size: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool

    def make(self) -> torch.Tensor:
        made = torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device).normal_()
        return made.requires_grad_(self.requires_grad)


class _Call:
    """A unit call as the probed step made it, to make again."""

    def __init__(self, name: str, module: nn.Module, forward: Callable, args: tuple, kwargs: dict, buffers,
                 device_type: str):
        self.name, self.forward, self.buffers = name, forward, buffers
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.autocast = AutocastState(device_type)
        self.scopes = OpenScopes.now()
        leaves, self._spec = pytree.tree_flatten((args, kwargs))
        self._leaves = [_FreshTensor(tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t.requires_grad)
                        if _floating(t) else t for t in leaves]

    def arguments(self) -> tuple[tuple, dict, list[torch.Tensor]]:
        """New arguments, and the tensors backward differentiates them from. An argument that
        needs a gradient is a copy of such a tensor, not the tensor itself: the call's own was
        made by the unit before, and a unit that changes its argument in place (an in-place
        ReLU) may do so to it, never to a leaf."""
        made = [v.make() if isinstance(v, _FreshTensor) else v for v in self._leaves]
        leaves = [t.clone() if isinstance(v, _FreshTensor) and t.requires_grad else t
                  for v, t in zip(self._leaves, made)]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        own = {id(p) for p in self.parameters}
        differentiated = [t for t in made if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in own]
        return args, kwargs, differentiated


class AloneCalls:
    """The distinct unit calls of one step, each timed by itself after the step."""

    def __init__(self, device: torch.device, clock: Callable[[], object], seconds: Callable[[object, object], float]):
        """`clock()` marks a moment on `device` (a CUDA event on its current stream, or the host's
        clock), `seconds(start, end)` the time between two marks: the step recorder's."""
        self.device, self._clock, self._seconds = device, clock, seconds
        self._calls: dict[tuple, _Call] = {}
        self._made: list[tuple[int, tuple]] = []  # (unit, key) per call, in the step's order

    def note(self, unit: int, name: str, module: nn.Module, forward: Callable, args: tuple, kwargs: dict,
             buffers: Callable) -> None:
        """A call of unit `unit` in the probed step, before it runs. `buffers()`: its buffers as
        this forward finds them, with swap_in() and put_back() (replay._BuffersBefore)."""
        key = (type(module), _shapes((args, kwargs)))
        if key not in self._calls:
            self._calls[key] = _Call(name, module, forward, args, kwargs, buffers(), self.device.type)
        self._made.append((unit, key))

    def time(self) -> dict[int, AloneTime]:
        """Per unit, its calls' times summed, each distinct call run once; units whose call failed
        are left out. Runs on the caller's stream, and synchronizes."""
        timed = {key: self._timed(call) for key, call in self._calls.items()}
        per_unit: dict[int, AloneTime | None] = {}
        for unit, key in self._made:
            found, before = timed[key], per_unit.get(unit, AloneTime(0.0, 0.0))
            per_unit[unit] = None if found is None or before is None else before + found
        self._calls.clear()
        self._made.clear()
        return {unit: t for unit, t in per_unit.items() if t is not None}

    def _timed(self, call: _Call) -> AloneTime | None:
        self._synchronize()
        kept = call.buffers.swap_in()
        devices = [self.device] if self.device.type == "cuda" else []
        try:
            with (torch.random.fork_rng(devices=devices), call.autocast.restored(), call.scopes.restored(),
                  torch.enable_grad()):
                for _ in range(TIMED_RUNS):
                    marks = self._run(call)
                    self._synchronize()
            start, forward, backward, issued_s = marks
            return AloneTime(self._seconds(start, forward), self._seconds(forward, backward), issued_s)
        except Exception as error:  # noqa: BLE001 (a probe: the unit is priced from the safe step)
            log.info("planner: %s did not run by itself (%s); the base prices it from the safe step",
                     call.name, str(error).splitlines()[0][:200])
            return None
        finally:
            type(call.buffers).put_back(kept)

    def _run(self, call: _Call) -> tuple:
        """The call's forward and backward; the marks before, between and after them, and the
        host's time of issuing the forward."""
        args, kwargs, differentiated = call.arguments()
        start = self._clock()
        began = time.perf_counter()
        out = call.forward(*args, **kwargs)
        issued_s = time.perf_counter() - began
        forward = self._clock()
        outputs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        wrt = differentiated + call.parameters
        if not outputs or not wrt:  # a backward not run would price the unit's as free
            raise ValueError("none of its outputs seen needs a gradient from its inputs or parameters")
        torch.autograd.grad(outputs, wrt, [torch.ones_like(t) for t in outputs], allow_unused=True)
        return start, forward, self._clock(), issued_s

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and not isinstance(value, nn.Parameter)


def _shapes(values) -> tuple:
    return tuple((tuple(t.shape), tuple(t.stride()), t.dtype) if isinstance(t, torch.Tensor) else type(t)
                 for t in pytree.tree_leaves(values))
