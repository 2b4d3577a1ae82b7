"""Saved activations to host memory during forward, back to the GPU ahead of backward (as vDNN
does: Rhu et al., 2016), sized to a GPU budget.

    offload = ActivationOffload(budget="16GiB")
    for batch in loader:
        with offload.step():
            loss = model(**batch).loss
            loss.backward()
        optimizer.step()

Like ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, tensors autograd saves for backward go
to pinned host memory and come back when backward unpacks them. Five things differ:

- **Only what does not fit moves.** The first steps offload every eligible tensor and measure the
  step's GPU peak with them gone. Later steps keep ``budget - peak - margin`` bytes of saved
  tensors on the GPU (choose_kept): the last ones, up to a window's worth, since backward needs
  them first, and the rest spread evenly over the earlier ones, so that copies out run through all
  of forward and copies back through all of backward. A step whose saved tensors differ from the
  first step's (other shapes) offloads everything again: never a plan that passes the budget.
- **Transfers overlap compute.** Copies out run on side streams after an event, so forward never
  waits for them; the memory they read goes back to the pool once read. In backward, copies in run
  on another side stream, ``window`` bytes ahead of use in reverse save order, starting at
  backward's first unpack, and compute waits on an event only for the tensor it needs now. A kept
  tensor is let go of after backward's last use of it, and its bytes widen the window.
- **Copies go through stages when the memory is managed** (um_alloc installed; um_alloc.staging):
  the driver runs no kernel while the copy engine reads or writes managed memory, so each slice
  goes through 128 MiB of plain device memory, and the copy engine touches only that and the host.
- **A late copy costs a wait, never wrong data**: unpack always waits for the tensor's own copy.
- **What backward can rebuild does not move** (``rebuild=True``, see um_alloc.rebuild): views and
  casts of tensors saved anyway, and outputs of cheap functions (GELU, LayerNorm, ...) whose
  inputs are saved anyway, are recomputed at unpack. The calibration steps move them *and*
  rebuild them, and later steps rebuild only what came out equal, place by place in the step.

Eligible: tensors on the device of at least ``min_bytes`` that are not leaves requiring grad
(parameters stay where they are) and are not in host memory already (um_alloc.spill). A tensor
saved several times in a step is copied once. On a CPU device the same logic runs with plain
copies (no streams), so it can be tested without a GPU.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field
from typing import Iterator

import torch

from . import _lib, arguments
from .byte_views import byte_view, storage_bytes
from .errors import At
from .install import installation, is_installed
from .policy import host_mapped
from .pool import ChunkPool
from .rebuild import Recipe, RootRecorder, as_saved, broadcast, dense
from .sizes import size_text
from .staging import DeviceStage
from .stats import memory_stats

log = logging.getLogger(__name__)

MiB = 1 << 20
HOST_CHECK_EVERY = 512 * MiB  # copied out between looks at the host's available memory
DEFAULT_WINDOW = 1 << 30  # also what schedule_window: auto means here
# When copies go through stages (um_alloc.staging): out, 4 slots of 16 MiB, filled on a stream of
# their own so that the memory read is let go of ahead of the copies to the host; in, one of 64 MiB.
STAGE_OUT, STAGE_IN = (16 * MiB, 4), (64 * MiB, 1)
STAGE_BYTES = STAGE_OUT[0] * STAGE_OUT[1] + STAGE_IN[0] * STAGE_IN[1]


@dataclass
class _Packed:
    """One offloaded tensor: its host copy, and while backward needs it, its copy back."""
    host: torch.Tensor
    out_done: torch.cuda.Event | None               # None on the CPU
    uses: int = 1                                   # unpacks still to come this step
    gpu: torch.Tensor | None = None                 # the copy back, once started
    in_done: torch.cuda.Event | None = None
    check: tuple[int, Recipe] | None = None         # calibrating: (index, recipe) to compare at unpack
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = self.host.numel() * self.host.element_size()


@dataclass
class _Kept:
    """A saved tensor left on the GPU. Once backward has used it for the last time, its bytes
    lend the copies back room: the window grows by what backward let go of."""
    tensor: torch.Tensor
    nbytes: int
    uses: int = 1


@dataclass
class _Rebuilt:
    """A saved tensor backward rebuilds from others (um_alloc.rebuild) instead of copying it back."""
    recipe: Recipe


@dataclass
class OffloadStats:
    """What the last step did; bytes each way are the link traffic it caused."""
    saved_bytes: int = 0        # eligible saved tensors, counted once each
    kept_bytes: int = 0         # left on the GPU
    rebuilt_bytes: int = 0      # rebuilt in backward from other saved tensors: never moved
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
    host_reserve: host memory the copies must leave available (default 8 GiB): a copy out that
        finds less raises torch.OutOfMemoryError naming host memory, rather than let the host's
        out-of-memory killer end the process (pinned memory cannot be swapped).
    calibration_steps: steps that offload everything before the plan is made (default 2: the
        optimizer's state appears at the end of the first, and the peak must include it).
    device: "cuda", "cuda:N" (default: the current CUDA device) or "cpu" (tests).
    peak_fn: the peak so far in bytes (default: um_alloc's GPU-backed peak when installed, else
        torch.cuda.max_memory_reserved).
    rebuild: rebuild what backward can instead of moving it (default True; False moves all).
    staging: copy through stages of plain device memory (um_alloc.staging), so that kernels run
        during the copies (default: when um_alloc is installed, whose memory is managed). The
        stages, STAGE_BYTES (128 MiB) together, are outside the pool: the plan keeps them free of
        the budget.
    """

    def __init__(self, budget: int | str | None = None, *, window: int | str = DEFAULT_WINDOW,
                 min_bytes: int | str = MiB, margin: int | str = "512MiB", calibration_steps: int = 2,
                 device: torch.device | str | None = None, peak_fn=None, rebuild: bool = True,
                 staging: bool | None = None, host_reserve: int | str = "8GiB"):
        self._take_sizes(budget, window, min_bytes, margin, host_reserve)
        self.calibration_steps = arguments.whole_number(calibration_steps, _at("calibration_steps"), minimum=1)
        rebuild = arguments.flag(rebuild, _at("rebuild"))
        staging = None if staging is None else arguments.flag(staging, _at("staging"))
        peak_fn = arguments.function(peak_fn, _at("peak_fn"), optional=True)
        self._unchecked = 0  # bytes copied out since host memory was last looked at
        self.device = _device(device)
        self._cuda = self.device.type == "cuda"
        self._stages: tuple[DeviceStage, DeviceStage] | None = None  # (out, in)
        if self._cuda:
            self._out_stream = torch.cuda.Stream(self.device)
            self._in_stream = torch.cuda.Stream(self.device)
            if _staging_default() if staging is None else staging:
                self._stages = (DeviceStage(STAGE_OUT[0], self.device, slots=STAGE_OUT[1]),
                                DeviceStage(STAGE_IN[0], self.device, slots=STAGE_IN[1]))
                self._fill_stream = torch.cuda.Stream(self.device)
        elif staging:
            raise ValueError("ActivationOffload: staging needs a CUDA device")
        elif peak_fn is None and self.budget is not None:
            raise ValueError("ActivationOffload: on the CPU a budget needs peak_fn")
        self._peak_fn = peak_fn or (_default_peak_fn(self.device) if self._cuda else None)
        self._spill_check = _SpillCheck.for_device(self.device)
        self._roots = RootRecorder(self._held_of, self.device.type) if rebuild else None
        self._copy_times: list | None = None  # (direction, start, end, bytes) while time_copies() asks
        self._stalls: list | None = None      # (before, after) a wait for a copy back, while time_copies() asks
        self._verified: dict[int, tuple | None] = {}  # save index -> recipe signature that rebuilt equal
        self._steps = 0
        self._first_sizes: list[int] | None = None   # eligible sizes in save order, first step
        self._kept: frozenset[int] | None = None     # save indices that stay (None: offload all)
        self.stats = OffloadStats()
        self._reset_step()

    def _take_sizes(self, budget, window, min_bytes, margin, host_reserve) -> None:
        """The size arguments, checked before anything touches CUDA."""
        self.budget = arguments.optional_size(budget, _at("budget"), minimum=1)
        self.window, self.min_bytes = arguments.size(window, _at("window")), arguments.size(min_bytes, _at("min_bytes"))
        self.margin = arguments.size(margin, _at("margin"))
        self.host_reserve = arguments.size(host_reserve, _at("host_reserve"))
        if self.budget is not None and self.budget <= self.margin:
            raise _at("budget").error(f"must be larger than the margin ({size_text(self.margin)}) kept under it",
                                      allowed=f"more than {size_text(self.margin)}, or a smaller margin",
                                      received=budget)

    # -- per step --

    @contextlib.contextmanager
    def step(self) -> Iterator[OffloadStats]:
        """Forward and backward of one training step run inside."""
        self._reset_step()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                    (self._roots.mode() if self._roots else contextlib.nullcontext()):
                yield self.stats
        except BaseException:
            # An out-of-memory error, say: let go of this step's tensors now, so that the caller
            # can retry smaller; the step is not counted and the plan is not touched.
            self._let_go()
            raise
        self._finish_step()

    # -- the same, step by step, for callers that cannot wrap forward and backward in one block
    #    (um_alloc.planner drives it from module hooks; budget=None there: everything it is given moves)

    def begin_step(self) -> None:
        """A step begins: what step() does on entry, without the hooks."""
        self._reset_step()

    def pack(self, tensor: torch.Tensor):
        """autograd's pack hook: the tensor, or what stands for it until unpack."""
        return self._pack(tensor)

    def unpack(self, packed) -> torch.Tensor:
        """autograd's unpack hook (also for what stash() returned: waits for the copy back)."""
        return self._unpack(packed)

    def stash(self, tensor: torch.Tensor):
        """Copies a tensor out now, whatever its size, to be unpack()ed in backward."""
        return self._copy_out(tensor)

    def copy_ahead(self) -> None:
        """Backward has reached another part of the model: copy back as far as the window allows."""
        if not self._in_backward:
            self._start_backward()
        self._copy_ahead()

    def ahead_low_water(self) -> int:
        """The fewest bytes copied back and not yet used that were on the GPU since the last call
        (or the step's start): what a measured peak of that stretch held of copies ahead of use."""
        low, self._ahead_low = self._ahead_low, self._inflight
        return min(low, self._inflight)

    def end_step(self) -> None:
        """Backward is over: what step() does on a normal exit."""
        self._finish_step()

    def abort_step(self) -> None:
        """The step failed (or never reached backward): let go of its tensors; nothing is counted."""
        self._let_go()

    def _reset_step(self) -> None:
        if self._steps:
            self._plan_if_calibrated()
        self._sizes: list[int] = []
        self._offloaded: list[_Packed] = []
        self._seen: dict[tuple, tuple] = {}  # (id, version) -> (weakref to the tensor, its entry)
        self._cursor = -1          # next offloaded tensor (from the end) to copy back
        self._inflight = 0         # bytes copied back and not yet used up
        self._ahead_low = 0        # the least of _inflight since ahead_low_water() last read it
        self._lent = 0             # bytes of kept tensors backward has used for the last time
        self._in_backward = False
        self._matches = True       # this step's eligible sizes follow the first step's so far
        self.stats = OffloadStats(offload_all=self._kept is None)

    def _finish_step(self) -> None:
        self._steps += 1
        if self._first_sizes is None:
            self._first_sizes = self._sizes
        elif self.budget is not None and (not self._matches or len(self._sizes) != len(self._first_sizes)):
            log.info("activation offload: saved tensors differ from the first step's; offloading all")
        self._let_go()

    def _let_go(self) -> None:
        """Kept tensors and host copies are autograd's alone from here: a backward still to come
        over what the step saved (a second loss of the step's forwards) copies each back as it asks."""
        self._seen.clear()
        self._offloaded = []
        self._cursor = -1
        if self._roots:
            self._roots.clear()

    def _plan_if_calibrated(self) -> None:
        """After the calibration steps (and the optimizer steps between them), the plan."""
        if self._kept is None and self._first_sizes is not None and self._steps >= self.calibration_steps:
            self._kept = self._plan_keep(self._first_sizes)

    def _plan_keep(self, sizes: list[int]) -> frozenset[int] | None:
        """The save indices whose tensors stay on the GPU: as many bytes as the room left allows."""
        if self.budget is None:
            return None
        if self._cuda:
            torch.cuda.synchronize(self.device)
        staged = sum(stage.nbytes for stage in self._stages) if self._stages else 0
        room = self.budget - self._peak_fn() - self.margin - staged
        sizes = [0 if self._verified.get(i) else nbytes for i, nbytes in enumerate(sizes)]  # rebuilt
        kept = choose_kept(sizes, room, tail=self.window)
        log.info("activation offload: peak %.2f GiB with all %d saved tensors (%.2f GiB) offloaded; "
                 "keeping %.2f GiB on the GPU", self._peak_fn() / 2**30, len(sizes), sum(sizes) / 2**30,
                 sum(sizes[i] for i in kept) / 2**30)
        return kept

    # -- the hooks --

    def _pack(self, tensor: torch.Tensor):
        if not self._eligible(tensor):
            return as_saved(tensor)
        # The same tensor object saved again (a live one: once forward drops a tensor, its address
        # and id can come back as another, which must not match).
        key = (id(tensor), tensor._version)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is tensor:
            known = seen[1]
            if isinstance(known, (_Packed, _Kept)):
                known.uses += 1
                if isinstance(known, _Packed) and known.check:
                    self._use_sources(known.check[1])
            elif isinstance(known, _Rebuilt):
                self._use_sources(known.recipe)
            return known
        nbytes = tensor.numel() * tensor.element_size()
        index = len(self._sizes)
        self._sizes.append(nbytes)
        self.stats.saved_bytes += nbytes
        self._matches = self._matches and self._first_sizes is not None and \
            index < len(self._first_sizes) and self._first_sizes[index] == nbytes
        entry = self._store(tensor, index, nbytes)
        self._seen[key] = (weakref.ref(tensor), entry)
        return entry

    def _store(self, tensor: torch.Tensor, index: int, nbytes: int):
        """Rebuilt at unpack, kept on the GPU, or copied out (and, calibrating, checked at unpack)."""
        recipe = self._roots.recipe_for(tensor) if self._roots else None
        calibrating = self._steps < self.calibration_steps
        if self._matches and index in self._verified and not calibrating:
            if recipe is not None and self._verified[index] == recipe.signature():
                self._use_sources(recipe)
                self.stats.rebuilt_bytes += nbytes
                return _Rebuilt(recipe)
            if self._verified[index]:  # the plan counted on rebuilding it: the step is not the first's
                self._matches = False
        if self._keeps(index):
            self.stats.kept_bytes += nbytes
            entry = _Kept(as_saved(tensor), nbytes)
        else:
            entry = self._copy_out(tensor)
            if calibrating and recipe is not None:
                self._use_sources(recipe)
                entry.check = (index, recipe)
                return entry  # held this step, but not a root: later steps will not hold it
        if self._roots:
            self._roots.add_held(tensor, entry)
        return entry

    def _unpack(self, packed):
        if not self._in_backward:
            self._start_backward()
        self._copy_ahead()  # from backward's first unpack on, also while it uses what stayed
        if isinstance(packed, _Rebuilt):
            return self._rebuild(packed.recipe)
        if isinstance(packed, _Kept):
            return self._use_kept(packed)
        if not isinstance(packed, _Packed):
            return packed
        if packed.check:
            return self._check(packed)
        if packed.gpu is None:  # not in flight: backward asked before the window reached it
            self.stats.on_demand += 1
            self._copy_in(packed)
        if self._cuda:
            self._wait_for(packed.in_done)
        tensor = packed.gpu
        packed.uses -= 1
        if packed.uses <= 0:  # autograd holds it from here; the next step reuses the memory
            packed.gpu = None
            self._inflight -= packed.nbytes
            self._ahead_low = min(self._ahead_low, self._inflight)
            # The window has room again: the next copy runs under the compute that reads this
            # one (a recomputed block's rerun and backward), not after it, when the next block
            # asks. Only within the window: a copy larger than it waits for a block to ask.
            self._copy_ahead(within_window=True)
        return tensor

    def _start_backward(self) -> None:
        """Forward's bookkeeping holds kept tensors; from here only autograd does, so backward
        frees each one after its last use, as it would without the offload."""
        self._in_backward = True
        self._seen.clear()
        if self._roots:
            self._roots.clear()

    def _use_kept(self, kept: _Kept) -> torch.Tensor:
        kept.uses -= 1
        if kept.uses == 0:
            self._lent += kept.nbytes
        return kept.tensor

    def _eligible(self, tensor: torch.Tensor) -> bool:
        """Whether a saved tensor may go to host memory: large, on this device, not a parameter,
        not spilled, and not broadcast (its bytes are fewer than its size says, and it would come
        back dense: more memory, and backward could take other kernels than with the original)."""
        base = tensor._base if tensor._base is not None else tensor  # linear saves weight.t()
        is_parameter = base.is_leaf and base.requires_grad
        return (tensor.device == self.device and tensor.numel() * tensor.element_size() >= self.min_bytes
                and not is_parameter and not broadcast(tensor)
                and not (self._spill_check and self._spill_check.spilled(tensor)))

    def _keeps(self, index: int) -> bool:
        return self._kept is not None and self._matches and index in self._kept

    # -- rebuilding --

    def _held_of(self, tensor: torch.Tensor):
        """The entry of a tensor saved this step and held (kept or copied out), else None."""
        seen = self._seen.get((id(tensor), tensor._version))
        if seen is None or seen[0]() is not tensor:
            return None
        entry = seen[1]
        held = not isinstance(entry, _Rebuilt) and not (isinstance(entry, _Packed) and entry.check)
        return entry if held else None

    def _use_sources(self, recipe: Recipe) -> None:
        """Each rebuild reads its sources once: they stay until then."""
        for entry in recipe.sources:
            if isinstance(entry, (_Packed, _Kept)):
                entry.uses += 1

    def _fetch(self, entry) -> torch.Tensor:
        return self._unpack(entry) if isinstance(entry, (_Packed, _Kept)) else entry

    def _rebuild(self, recipe: Recipe) -> torch.Tensor:
        return recipe.build(self._fetch, self.device.type)

    def _check(self, packed: _Packed) -> torch.Tensor:
        """Calibrating: rebuild instead of copying back, and compare with the host copy.

        The recipe at this place in the step is trusted later only if every check gives the same
        bits. Comparing chunk by chunk against the host copy needs no second full-size tensor on
        the GPU, so the calibration steps' peak is the planned steps' peak.
        """
        index, recipe = packed.check
        packed.uses -= 1
        if packed.out_done is not None:  # the host copy is read from here on
            torch.cuda.current_stream(self.device).wait_event(packed.out_done)
        rebuilt = self._rebuild(recipe)
        same = rebuilt.shape == packed.host.shape and rebuilt.dtype == packed.host.dtype and \
            self._same_bits(rebuilt, packed)
        signature = recipe.signature() if same else None
        if self._verified.get(index, signature) != signature:
            signature = None  # the calibration steps disagree
        self._verified[index] = signature
        if same:
            return rebuilt
        log.info("activation offload: saved tensor %d %s does not rebuild equal; it will move",
                 index, tuple(packed.host.shape))
        return self._copy_back_now(packed)

    def _same_bits(self, rebuilt: torch.Tensor, packed: _Packed, chunk: int = 64 * MiB) -> bool:
        gpu, host = storage_bytes(rebuilt), storage_bytes(packed.host)
        if gpu.numel() != host.numel():
            return False
        self.stats.in_bytes += host.numel()  # the comparison carries the bytes back
        return all(torch.equal(gpu[at:at + chunk], host[at:at + chunk].to(self.device, non_blocking=True))
                   for at in range(0, host.numel(), chunk))

    def _copy_back_now(self, packed: _Packed) -> torch.Tensor:
        tensor = torch.empty_strided(packed.host.shape, packed.host.stride(), dtype=packed.host.dtype,
                                     device=self.device)
        self.stats.in_bytes += packed.nbytes
        return tensor.copy_(packed.host, non_blocking=True)

    # -- transfers --

    def _copy_out(self, tensor: torch.Tensor) -> _Packed:
        # Dense tensors keep their layout (a flat copy), so views of the same storage can be
        # rebuilt from the copy. Others (a slice of a larger tensor) are copied dense, with their
        # dimensions in the same order of strides, as torch.clone lays them out: a matmul in
        # backward then reads them transposed or not as it did, and adds in the same order.
        laid_out = dense(tensor)
        stride = tensor.stride() if laid_out else torch.empty_like(tensor, device="meta").stride()
        self._check_host_memory(tensor.numel() * tensor.element_size())
        host = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, pin_memory=self._cuda)
        done = None
        if self._cuda:
            produced = torch.cuda.current_stream(self.device).record_event()
            staged = self._stages is not None and laid_out  # same strides: the same bytes, in order
            reader = self._fill_stream if staged else self._out_stream
            reader.wait_event(produced)
            if staged:
                # The stage's copies to the host wait for the reader's anyway; waiting here as well
                # starts the copy's timing when the tensor is there, not while compute still makes it.
                self._out_stream.wait_event(produced)
            with torch.cuda.stream(self._out_stream), self._timed("out", tensor.numel() * tensor.element_size()):
                if staged:
                    self._stages[0].to_host(byte_view(tensor), byte_view(host), fill_stream=reader)
                else:
                    host.copy_(_laid_out_as(tensor, host), non_blocking=True)
                done = self._out_stream.record_event()
            tensor.record_stream(reader)  # its memory is reused only after the stream that reads it
        else:
            host.copy_(tensor)
        packed = _Packed(host, done)
        self._offloaded.append(packed)
        self._cursor = len(self._offloaded) - 1
        self.stats.out_bytes += packed.nbytes
        return packed

    def _check_host_memory(self, nbytes: int) -> None:
        """Every HOST_CHECK_EVERY bytes copied out (reading /proc/meminfo costs ~30 us): enough host
        memory left? Between looks the copies take at most that much more, which the reserve covers."""
        self._unchecked += nbytes
        if self._unchecked < HOST_CHECK_EVERY:
            return
        self._unchecked = 0
        available = host_available()
        if available is not None and available - nbytes < self.host_reserve:
            raise torch.OutOfMemoryError(
                f"ActivationOffload: host memory is running out: {available / 2**30:.1f} GiB available, and "
                f"copying out a {nbytes / 2**20:.0f} MiB tensor would leave less than host_reserve "
                f"({self.host_reserve / 2**30:.1f} GiB); this step has copied {self.stats.out_bytes / 2**30:.1f} "
                "GiB to pinned memory so far. Lower the batch size, or raise the budget so that more stays "
                "on the GPU.")

    def time_copies(self) -> None:
        """From now on, time each copy on its stream (two events each), until copy_rates(), and
        each wait of the compute stream for a copy back, until copy_stalls_s()."""
        self._copy_times = []
        self._stalls = []

    def stop_timing(self) -> None:
        """Times nothing more and forgets what was timed: a measuring step that did not finish."""
        self._copy_times = self._stalls = None

    def copy_stalls_s(self) -> float | None:
        """Seconds the compute stream stood waiting for copies back since time_copies(): per wait,
        from the stream reaching it to the copy's end, nothing where the copy was done first. None
        where nothing was timed. Synchronizes."""
        timed, self._stalls = self._stalls, None
        if not timed:
            return None
        torch.cuda.synchronize(self.device)
        return sum(before.elapsed_time(after) for before, after in timed) / 1e3

    def _wait_for(self, copied: torch.cuda.Event) -> None:
        """The compute stream waits for a copy back; timed between two events around the wait
        while time_copies() asks: the span is the time the stream had nothing else to run."""
        compute = torch.cuda.current_stream(self.device)
        if self._stalls is None:
            compute.wait_event(copied)
            return
        before = compute.record_event(torch.cuda.Event(enable_timing=True))
        compute.wait_event(copied)
        self._stalls.append((before, compute.record_event(torch.cuda.Event(enable_timing=True))))

    def copy_rates(self) -> tuple[float, float] | None:
        """Bytes per second out and back, over the copies since time_copies(): each direction's
        bytes over the time its stream spent copying them (stages included; a direction that
        copied nothing counts as infinitely fast). None where nothing was timed. Synchronizes."""
        timed, self._copy_times = self._copy_times, None
        if not timed:
            return None
        torch.cuda.synchronize(self.device)
        return copy_rates([(d, start.elapsed_time(end) / 1e3, nbytes) for d, start, end, nbytes in timed])

    @contextlib.contextmanager
    def _timed(self, direction: str, nbytes: int):
        if self._copy_times is None:
            yield
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._copy_times.append((direction, start, end, nbytes))

    def _copy_in(self, packed: _Packed) -> None:
        if self._cuda:
            # Taken on the compute stream, which frees it: the copy waits for compute to reach this
            # point (the memory's last user), compute waits for the copy before using it, and after
            # the free nothing but compute has touched it. Taken on the side stream instead, each
            # reuse by compute would wait for every copy queued by then, draining the window.
            compute = torch.cuda.current_stream(self.device)
            gpu = torch.empty_strided(packed.host.shape, packed.host.stride(), dtype=packed.host.dtype,
                                      device=self.device)
            self._in_stream.wait_stream(compute)
            self._in_stream.wait_event(packed.out_done)
            with torch.cuda.stream(self._in_stream), self._timed("in", packed.nbytes):
                if self._stages:
                    self._stages[1].from_host(byte_view(packed.host), byte_view(gpu))
                else:
                    gpu.copy_(packed.host, non_blocking=True)
                packed.in_done = self._in_stream.record_event()
        else:
            gpu = packed.host.clone()
        packed.gpu = gpu
        self._inflight += packed.nbytes
        self.stats.in_bytes += packed.nbytes

    def _copy_ahead(self, within_window: bool = False) -> None:
        """Starts copies back in reverse save order while the window has room: `window` bytes,
        and the bytes of kept tensors backward is done with, as the step's peak counted them.
        With none in flight, one larger than the window starts too (backward asks for it), unless
        `within_window`."""
        while self._cursor >= 0:
            packed = self._offloaded[self._cursor]
            if packed.gpu is None and packed.uses > 0 and not packed.check:  # checks rebuild
                if self._inflight + packed.nbytes > self.window + self._lent and \
                        (self._inflight > 0 or within_window):
                    return
                self._copy_in(packed)
            self._cursor -= 1


def _laid_out_as(tensor: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`tensor`, or its copy on its device in `host`'s strides where they differ: a copy to pinned
    memory of another layout would go through a pageable buffer and hold up the host."""
    if tensor.stride() == host.stride():
        return tensor
    return torch.empty_strided(host.shape, host.stride(), dtype=tensor.dtype, device=tensor.device).copy_(tensor)


def copy_rates(copies: list[tuple[str, float, int]]) -> tuple[float, float]:
    """(out, in) bytes per second from (direction, seconds, bytes) per copy: a direction's bytes
    over its stream's time copying them (its copies run one after another); infinite for a
    direction with nothing copied."""
    rates = []
    for direction in ("out", "in"):
        seen = [(seconds, nbytes) for d, seconds, nbytes in copies if d == direction]
        busy = sum(seconds for seconds, _ in seen)
        rates.append(sum(nbytes for _, nbytes in seen) / busy if busy > 0 else float("inf"))
    return rates[0], rates[1]


def choose_kept(sizes: list[int], room: int, tail: int) -> frozenset[int]:
    """Which saved tensors (by save index; `sizes` in save order) stay on the GPU: at most `room`
    bytes. First the last ones, until `tail` bytes: backward needs them first, and no compute is
    left around them to hide their copies. Then the rest of the room spread evenly over the earlier
    ones, so that copies out run through all of forward and copies back through all of backward,
    under compute, rather than in one stretch beside little of it."""
    kept, used, i = set(), 0, len(sizes)
    while i > 0 and used < tail and used + sizes[i - 1] <= room:
        i -= 1
        kept.add(i)
        used += sizes[i]
    spare, body = room - used, sum(sizes[:i])
    if body <= spare:
        return frozenset(range(len(sizes)))
    spare, seen, body_kept = max(spare, 0), 0, 0
    for j in range(i):  # keep j when every prefix keeps at most its share, spare / body, of its bytes
        seen += sizes[j]
        if (body_kept + sizes[j]) * body <= spare * seen:
            kept.add(j)
            body_kept += sizes[j]
    for j in reversed(range(i)):  # what a large tensor late in the body left unused: the latest that fit
        if j not in kept and body_kept + sizes[j] <= spare:
            kept.add(j)
            body_kept += sizes[j]
    return frozenset(kept)


class _SpillCheck:
    """Whether a saved tensor lives in host memory the GPU maps (um_alloc.spill): moving it would
    only copy it to the host again. Asks the pool only while a spill scope is open, and only for
    storages it could have spilled, so other steps and tensors cost nothing."""

    def __init__(self, device: torch.device):
        self._lib, self._pool = _lib.load(), ChunkPool.for_device(device.index)
        self._host_tags = frozenset(t for t, advice in installation().policy.tags.items() if host_mapped(advice))

    @classmethod
    def for_device(cls, device: torch.device) -> "_SpillCheck | None":
        return cls(device) if device.type == "cuda" and is_installed() else None

    def spilled(self, tensor: torch.Tensor) -> bool:
        smallest = self._lib.um_large_tag_min()
        storage = tensor.untyped_storage()
        if not smallest or storage.nbytes() < smallest:
            return False
        block = self._pool.block_at(storage.data_ptr())
        return block is not None and block.tag in self._host_tags


def host_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The host memory available to new allocations (Linux's MemAvailable), in bytes; None where
    the system does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _staging_default() -> bool:
    return is_installed()  # its memory is managed: copies of it would stall kernels


def from_policy(**overrides) -> ActivationOffload | None:
    """An ActivationOffload for the installed policy, or None when it does not ask for one.

    It asks with ``scheduler.offload_activations: true`` and a budget: the budget is
    ``installation().budget`` (the policy's, resolved against the device, or set_limit_lms's), the
    window its ``schedule_window`` (auto: 1 GiB) and the smallest tensor that moves its
    ``min_swap_size``. Keyword arguments override any of these.
    """
    if not is_installed():
        return None
    chosen = installation()
    scheduler = chosen.policy.scheduler
    budget = chosen.budget
    if not scheduler.offload_activations or budget is None:
        return None
    settings = dict(budget=budget, window=scheduler.schedule_window or DEFAULT_WINDOW,
                    min_bytes=scheduler.min_swap_size, device=torch.device("cuda", chosen.device))
    return ActivationOffload(**{**settings, **overrides})


def _at(argument: str) -> At:
    return At("ActivationOffload", argument)


def _device(device: torch.device | str | None) -> torch.device:
    """The device argument, checked before CUDA is asked for the current device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        chosen = None
    if chosen is None or chosen.type not in ("cuda", "cpu"):
        raise _at("device").error("not a CUDA device or the CPU", allowed="cuda, cuda:N, cpu, or None",
                                  received=device)
    if chosen.type == "cuda" and chosen.index is None:
        chosen = torch.device("cuda", torch.cuda.current_device())
    return chosen


def _default_peak_fn(device: torch.device):
    if is_installed():
        return lambda: memory_stats()["peak_gpu_backed_bytes"]
    return lambda: torch.cuda.max_memory_reserved(device)
