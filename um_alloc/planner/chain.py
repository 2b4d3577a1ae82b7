"""Chains: units rerun in backward one from another, holding nothing but the first one's inputs.

A convolutional network's stem saves several tensors the size of its largest activation: a
ResNet's convolution output (for its BatchNorm), the ReLU's output and the max-pool's indices,
1.1 GB each at batch 704. Recomputing each layer alone keeps its input, which is the layer
before's output: nothing is saved. Moving them costs the link 3.4 GB each way a step, where the
GPU reruns the four layers in a few milliseconds. A chain reruns them from the first one's input:
each later unit's input is the rerun output of the unit before it.

Calibration sees which unit's calls take the previous unit's output as their one argument, unchanged
(``follows``), and times a rerun of each such gap alone in the probed step. A plan then marks a unit
that reruns from its inputs (recompute, recompute_moved) and the chained units after it.

Replay (RerunChain) is torch.utils.checkpoint's non-reentrant scheme over several calls of the
model's own forward: while each unit of the chain runs, autograd's saved tensors are replaced by
handles, and the graph stays as plain autograd built it. The first handle backward unpacks, in the
last unit's backward, reruns the chain from the first unit's inputs up to that unit, under each
call's RNG state, autocast and buffers as its forward found them, and hands back what each rerun
saved in the forward's order; each unit's saved tensors go as its own backward takes them. At that
moment the chain's units hold what keeping them would, and the planner counts it
(planning._rerun_together). A rerun that saves other tensors than its forward did stops backward
with an error: never a wrong gradient.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, ContextManager

import torch
import torch.utils._pytree as pytree

from ..rebuild import as_saved
from .rerun import AutocastState, RngState

__all__ = ["RerunChain", "CHAINS_OFF", "takes_output"]

CHAINS_OFF = "turn chains off (chains=False, or scheduler.chains: false in the policy)"


def takes_output(tail: tuple | None, unit: int, args: tuple, kwargs: dict) -> bool:
    """Whether a call of `unit` takes `tail`'s output, unchanged, as its one argument: `tail` is
    (the unit before it, a weak reference to that unit's output, the output's version)."""
    if tail is None or kwargs or len(args) != 1:
        return False
    last, output, version = tail
    return last == unit - 1 and args[0] is output() and args[0]._version == version


class _Link:
    """One call of the chain: its forward, and what its rerun runs under."""
    __slots__ = ("name", "forward", "rng", "autocast", "rerunning", "saved")

    def __init__(self, name: str, forward: Callable, device: torch.device, rerunning: Callable[[], ContextManager]):
        self.name, self.forward, self.rerunning = name, forward, rerunning
        self.rng = RngState(device)
        self.autocast = AutocastState(device.type)
        self.saved: list[tuple[torch.Size, torch.dtype]] = []  # what its forward saved, in order


class RerunChain:
    """The calls of one chain in one step, from the first (`held`: its arguments as the rerun reads
    them, each resolved by `resolve`) to the last one that continued it."""

    def __init__(self, device: torch.device, held: tuple, resolve: Callable[[Any], Any]):
        self._device, self._resolve = device, resolve
        self._leaves, self._spec = pytree.tree_flatten(held)
        self._links: list[_Link] = []
        self._ready: dict[tuple[int, int], torch.Tensor] = {}  # rerun saves backward has yet to take
        self._taken: set[tuple[int, int]] = set()
        self._tail: tuple[int, weakref.ref, int] | None = None  # (unit, its output, that output's version)

    def call(self, unit: int, name: str, forward: Callable, args: tuple, kwargs: dict,
             rerunning: Callable[[], ContextManager]) -> Any:
        """Runs one unit of the chain (the first, or one that `continues_with`), saving handles."""
        link = _Link(name, forward, self._device, rerunning)
        k = len(self._links)
        self._links.append(link)

        def pack(tensor: torch.Tensor) -> tuple[int, int]:
            link.saved.append((tensor.shape, tensor.dtype))
            return k, len(link.saved) - 1

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            out = forward(*args, **kwargs)
        self._tail = (unit, weakref.ref(out), out._version) if isinstance(out, torch.Tensor) else None
        return out

    def continues_with(self, unit: int, args: tuple, kwargs: dict) -> bool:
        """Whether a call of `unit` takes this chain's last output, unchanged, as its one argument,
        and that output is the unit before it's. Asked once: the chain lets go of that output."""
        tail, self._tail = self._tail, None
        return takes_output(tail, unit, args, kwargs)

    def close(self) -> None:
        """No unit continues the chain: let go of its last output."""
        self._tail = None

    def _unpack(self, handle: tuple[int, int]) -> torch.Tensor:
        if handle not in self._ready:  # the first the chain's backward takes, or one taken before (retain_graph)
            self._taken.discard(handle)
            self._rerun(handle[0])
        self._taken.add(handle)
        return self._ready.pop(handle)

    def _rerun(self, last: int) -> None:
        """The chain's calls again, from the first one's inputs to call `last`, keeping what each
        saves that backward has yet to take. The rerun's own graph goes when it is done: what it
        saved is held as aliases without history (as_saved), so no op that saves its own output
        (a ReLU) makes a cycle through autograd's C++ that would keep it. A rerun that fails (out
        of memory) leaves nothing of itself held."""
        leaves = [self._resolve(v) for v in self._leaves]
        leaves = [v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v for v in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, self._spec)
        out, seen = None, []
        try:
            for k, link in enumerate(self._links[:last + 1]):
                seen = []

                def capture(tensor: torch.Tensor) -> torch.Tensor:
                    seen.append(as_saved(tensor))
                    return seen[-1]

                with link.rng.restored(), link.autocast.restored(), torch.enable_grad(), link.rerunning(), \
                        torch.autograd.graph.saved_tensors_hooks(capture, _same):
                    out = link.forward(*args, **kwargs) if k == 0 else link.forward(out)
                self._keep(k, link, seen)
        except BaseException:
            self._ready.clear()
            seen.clear()
            raise
        finally:
            del out, args, kwargs, leaves

    def _keep(self, k: int, link: _Link, seen: list[torch.Tensor]) -> None:
        rerun = [(t.shape, t.dtype) for t in seen]
        if rerun != link.saved:
            raise RuntimeError(
                f"planner: {link.name}, rerun in backward as part of a chain of recomputed units, saved "
                f"{len(rerun)} tensors where its forward saved {len(link.saved)} (or of other shapes or types): its "
                f"forward does not compute the same thing again: {CHAINS_OFF}")
        for n, tensor in enumerate(seen):
            if (k, n) not in self._taken:
                self._ready[(k, n)] = tensor


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
