"""Installing um_alloc as PyTorch's CUDA allocator.

PyTorch lets the allocator be swapped only before CUDA is first used, so install() must run at
the top of a script. Everything that can be wrong with the input (policy file, sizes, the device,
a cap larger than the device allows) is checked before CUDA is touched: device counts and memory
figures come from NVML, which does not initialise CUDA.

Under torchrun each process installs for its own GPU (um_alloc.ranks): the cap comes from that
GPU's free memory, and the budget holds for that GPU alone.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from . import _lib
from .alloc_conf import warn_on_pytorch_alloc_conf
from .cudnn_benchmark import keep_cudnn_benchmark_off
from .device_info import DeviceMemory, device_memory, visible_device_count, visible_devices_note
from .errors import At, PolicyError
from .graphs import refuse_cuda_graphs
from .memory_fraction import warn_on_memory_fraction
from .memory_history import answer_memory_history
from .policy import Policy, load_policy, validate_for_device, with_budget, with_max_reserved
from .pool import ChunkPool, tag_policy_struct
from .ranks import ChosenDevice, choose_device
from .sizes import format_size
from .tag_names import TAGS
from .torch_stats import answer_torch_memory_stats

NO_CAP = 2**64 - 1


@dataclass(frozen=True)
class Installation:
    """What install() set up: the policy, the device and the memory figures it was sized by."""
    policy: Policy
    device: int
    max_reserved: int          # cap on managed memory reserved (NO_CAP with oversubscribe and auto)
    device_total: int
    device_free_at_install: int
    device_used_at_install: int  # NVML "used" then: the base of the residency high-water mark
    budget_override: int | None = None  # bytes set since install (set_limit_lms; 0: none)
    installed_by: str = "um_alloc.install()"  # named when a later install() asks for other settings

    @property
    def budget(self) -> int | None:
        """The GPU residency budget in bytes, or None: the policy's, resolved against the device,
        unless set_limit_lms changed it since. Everything that sizes itself to the budget reads this."""
        if self.budget_override is not None:
            return self.budget_override or None
        return self.policy.budget_bytes(self.device_total)


_installation: Installation | None = None
_allocator = None  # PyTorch keeps a raw pointer to it: hold the Python object for the process


def install(policy=None, *, max_reserved: int | str | None = None, budget: int | float | str | None = None,
            device: int | None = None, installed_by: str = "um_alloc.install()") -> Installation:
    """Makes um_alloc PyTorch's CUDA allocator for this process.

    Args:
        policy: a policy file path, a bare name of a shipped policy ("best.yaml", "none"),
            a dict, a Policy, or None for the UM_POLICY environment variable (else none.yaml).
        max_reserved: overrides the policy's pool.max_reserved: bytes or a size ("16GiB"), at
            least one chunk. Above the device's free memory minus pool.reserve_margin only with
            the policy's pool.oversubscribe: true.
        budget: overrides the policy's scheduler.budget (GPU residency): bytes, a size ("16GiB")
            or a fraction of device memory (0.5). It is this process's: under torchrun every rank
            installs with its own budget for its own GPU (16GiB on two ranks: 16 GiB on each GPU).
        device: the CUDA device (as CUDA numbers them) that um_alloc manages and whose free memory
            sets the default cap. Default: LOCAL_RANK where a launcher such as torchrun sets it,
            else 0. Call ``torch.cuda.set_device(device)`` before moving the model there, as any
            torchrun script does: um_alloc sizes and reports this device's pool.
        installed_by: who installs (``python -m um_alloc run``, a callback), for the error a later
            install() asking for other settings gets.

    Once installed, install() with no arguments returns the installation, whatever its policy: a
    script that calls it keeps working under ``python -m um_alloc run`` and the callbacks.
    CUDA-graph capture is refused from then on (um_alloc.graphs says why).

    Raises:
        PolicyError: the policy, an argument or LOCAL_RANK is invalid; each is checked before NVML
            or CUDA is asked anything, and the message names it, the value and what is allowed.
        RuntimeError: CUDA is already initialised, no GPU is visible, the device is not among the
            visible ones, or um_alloc is already installed with different settings.
    """
    global _installation, _allocator
    if _installation is not None and policy is None and max_reserved is None and budget is None:
        return _installation
    chosen = policy_with_arguments(policy, max_reserved, budget)
    gpu = choose_device(device, At("install()", "device"))
    if _installation is not None:
        if _installation.policy == chosen and _installation.device == gpu.index:
            return _installation
        raise RuntimeError(
            f"um_alloc is already installed by {_installation.installed_by} with policy "
            f"{_installation.policy.name!r} ({_installation.policy.source}, budget "
            f"{_budget_text(_installation.budget)}); this call asks for policy {chosen.name!r} (budget "
            f"{_budget_text(chosen.budget_bytes(_installation.device_total))}). PyTorch cannot swap allocators "
            "in a running process: give the settings in one place, or start a new process.")
    _require_cuda_untouched()
    _require_visible(gpu)
    memory = _device_memory_or_raise(gpu.index)
    validate_for_device(chosen, memory.total_bytes)
    made = Installation(chosen, gpu.index, reserve_cap(chosen, memory), memory.total_bytes,
                        memory.free_bytes, memory.used_bytes, installed_by=installed_by)
    _configure_core(made)
    _allocator = _swap_torch_allocator()
    answer_torch_memory_stats()  # torch.cuda.memory_allocated() and the rest, from the pool
    refuse_cuda_graphs()
    keep_cudnn_benchmark_off()  # cuDNN's benchmark asks the allocator what a pluggable one cannot say
    warn_on_memory_fraction()  # a pluggable allocator drops the fraction: say so, and what bounds memory
    warn_on_pytorch_alloc_conf()  # PYTORCH_CUDA_ALLOC_CONF's device settings were for the allocator replaced
    answer_memory_history()  # PyTorch's memory history and snapshots: a warning and a clear error, not its own
    _installation = made
    return _installation


def policy_with_arguments(policy, max_reserved, budget) -> Policy:
    """The policy install() is given, with its max_reserved and budget arguments in place, each
    checked as the policy key it replaces."""
    chosen = load_policy(policy)
    if max_reserved is not None:
        chosen = with_max_reserved(chosen, max_reserved, source="install()")
    if budget is not None:
        chosen = with_budget(chosen, budget, source="install()")
    return chosen


def _budget_text(budget: int | None) -> str:
    return "none" if not budget else format_size(budget)


def set_budget(budget: int, min_swap_size: int, enabled: bool) -> None:
    """Gives the installed pool a budget of `budget` bytes (0: none), in the mode the policy chose,
    and makes it what installation().budget reports. enabled=False pauses it, keeping the figures."""
    global _installation
    pool = ChunkPool.for_device(installation().device)
    pool.set_budget(budget, min_swap_size, enabled, evict_live=pool.budget_evicts_live())
    _installation = replace(_installation, budget_override=budget)


def is_installed() -> bool:
    return _installation is not None


def installation() -> Installation:
    if _installation is None:
        raise RuntimeError("um_alloc is not installed: call um_alloc.install() at the top of your "
                           "script, before any CUDA work")
    return _installation


def reserve_cap(policy: Policy, memory: DeviceMemory) -> int:
    """Bytes of managed memory the pool may reserve in total: the policy's pool.max_reserved
    (install()'s argument in its place), or auto.

    On a shared GPU the cap never exceeds the device's free memory minus pool.reserve_margin:
    managed memory beyond what the card has free can hang the GPU for everyone on it. Only
    pool.oversubscribe: true lifts it.
    """
    requested = policy.pool.max_reserved
    if policy.pool.oversubscribe:
        return requested if requested is not None else NO_CAP
    margin = policy.pool.reserve_margin
    safe = memory.free_bytes - margin
    if safe <= 0:
        raise RuntimeError(
            f"um_alloc: device {memory.name} has {format_size(memory.free_bytes)} free, no more than "
            f"pool.reserve_margin {format_size(margin)}; free GPU memory or lower the margin")
    if requested is None:
        return safe
    if requested > safe:
        raise PolicyError(
            f"{policy.source}: max_reserved {format_size(requested)} is more than the device's free "
            f"memory {format_size(memory.free_bytes)} minus pool.reserve_margin {format_size(margin)} "
            f"= {format_size(safe)}; lower it, or set pool.oversubscribe: true on a GPU you do not share")
    return requested


def _require_cuda_untouched() -> None:
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "um_alloc.install() must run before any CUDA work, and CUDA is already initialised in "
            "this process (a tensor or model was moved to the GPU, or torch.cuda was queried). Call "
            "um_alloc.install() at the very top of your script, right after `import torch`.")


def _require_visible(gpu: ChosenDevice) -> None:
    """The device is one this process sees (NVML's count; unchecked where NVML cannot count, and
    then _device_memory_or_raise says that no GPU is visible)."""
    count = visible_device_count()
    if not count or gpu.index < count:
        return
    hint = (f"start at most {count} processes per node (torchrun --nproc-per-node {count}), or where the "
            "launcher gives each process a GPU of its own through CUDA_VISIBLE_DEVICES, name it: "
            "install(device=0), or python -m um_alloc run --device 0"
            if gpu.from_local_rank else f"name a device from 0 to {count - 1}")
    raise RuntimeError(f"um_alloc: CUDA device {gpu.index} ({gpu.source}) does not exist: this process sees "
                       f"{count} GPU(s), devices 0 to {count - 1}{visible_devices_note()}; {hint}")


def _device_memory_or_raise(device: int) -> DeviceMemory:
    memory = device_memory(device)
    if memory is None:
        raise RuntimeError(f"um_alloc: no NVIDIA GPU {device} visible (NVML found none); um_alloc "
                           "manages CUDA memory and needs a CUDA device. Where there is none, leave "
                           "um_alloc.install() out: PyTorch's own allocator serves the CPU.")
    return memory


def _configure_core(installing: Installation) -> None:
    policy, lib = installing.policy, _lib.load()
    if lib.um_configure(policy.pool.chunk_size, policy.pool.arena_size, installing.max_reserved) != 0:
        raise RuntimeError(f"um_alloc: {_lib.last_error()[1]}")
    for i, tag in enumerate(TAGS):
        lib.um_set_default_tag_policy(i, tag_policy_struct(policy.tags[tag]))
    lib.um_set_default_budget(installing.budget or 0, policy.scheduler.min_swap_size, 1,
                              int(policy.scheduler.evict_live))


def _swap_torch_allocator():
    allocator = torch.cuda.memory.CUDAPluggableAllocator(
        str(_lib.library_path()), "um_torch_malloc", "um_torch_free")
    hooks = allocator.allocator()
    hooks.set_reset_fn(_lib.function_address("um_torch_empty_cache"))
    hooks.set_record_stream_fn(_lib.function_address("um_torch_record_stream"))
    torch.cuda.memory.change_current_allocator(allocator)
    return allocator
