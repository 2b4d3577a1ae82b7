"""What the GPU offers: memory and clocks (NVML) and unified-memory capabilities (CUDA runtime
attributes).

``device_memory`` and ``device_clocks`` use NVML only, so they are safe before the allocator is
installed: they never initialise CUDA. ``unified_memory_capabilities`` asks the CUDA runtime
through cuda-bindings, which initialises the CUDA driver in this process (not torch's CUDA
state); call it from tools such as ``python -m um_alloc info``, not on the way to ``install()``.

All import their bindings lazily, so this module imports with neither installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["DeviceMemory", "device_memory", "device_clocks", "visible_device_count", "visible_devices_note",
           "unified_memory_capabilities"]

# cudaDeviceAttr member -> key in the capabilities dict (the attribute's name in CUDA docs).
_UM_ATTRIBUTES = {
    "cudaDevAttrManagedMemory": "managedMemory",
    "cudaDevAttrConcurrentManagedAccess": "concurrentManagedAccess",
    "cudaDevAttrPageableMemoryAccess": "pageableMemoryAccess",
    "cudaDevAttrPageableMemoryAccessUsesHostPageTables": "pageableMemoryAccessUsesHostPageTables",
    "cudaDevAttrDirectManagedMemAccessFromHost": "directManagedMemAccessFromHost",
}


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int
    free_bytes: int
    used_bytes: int      # NVML "used": includes managed chunks the driver keeps after eviction
    name: str


def device_memory(index: int = 0) -> DeviceMemory | None:
    """Memory of CUDA device `index` via NVML; None where NVML, the driver or the device is missing.

    `index` counts devices as CUDA does under CUDA_VISIBLE_DEVICES (integers or GPU-/MIG- UUIDs).
    Otherwise NVML counts in PCI bus order, which is CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    or a single GPU. Never initialises CUDA.
    """
    def query(pynvml: Any) -> DeviceMemory | None:
        handle = _nvml_handle(pynvml, index)
        return None if handle is None else _memory_of(pynvml, handle)
    return _with_nvml(query)


# NVML's clock event reasons (nvmlClocksEventReason*), by the names device_clocks gives them.
_CLOCK_EVENTS = {"GpuIdle": "idle", "ApplicationsClocksSetting": "applications_clocks",
                 "SwPowerCap": "power_cap", "HwSlowdown": "hardware_slowdown", "SyncBoost": "sync_boost",
                 "SwThermalSlowdown": "thermal", "HwThermalSlowdown": "hardware_thermal",
                 "HwPowerBrakeSlowdown": "power_brake", "DisplayClockSetting": "display_clocks"}


def device_clocks(index: int = 0) -> dict[str, Any] | None:
    """The SM clock of CUDA device `index` now and its maximum (MHz), its temperature (C), its
    power draw (W), and the reasons NVML gives for clocks below the maximum (power cap, thermal,
    ...); None where NVML, the driver or the device is missing, and None for a figure NVML does not
    give. Steps on a shared host drift with these: a benchmark records them beside its times.
    Devices are counted as by device_memory. Never initialises CUDA."""
    def query(pynvml: Any) -> dict[str, Any] | None:
        handle = _nvml_handle(pynvml, index)
        return None if handle is None else _clocks_of(pynvml, handle)
    return _with_nvml(query)


def _clocks_of(pynvml: Any, handle: Any) -> dict[str, Any]:
    def read(call: str, *args: Any) -> Any:
        try:
            return getattr(pynvml, call)(handle, *args)
        except (pynvml.NVMLError, AttributeError):  # a query this GPU or these bindings do not have
            return None

    sm = getattr(pynvml, "NVML_CLOCK_SM", 1)
    power_mw = read("nvmlDeviceGetPowerUsage")
    reasons = read("nvmlDeviceGetCurrentClocksEventReasons")
    return {"sm_mhz": read("nvmlDeviceGetClockInfo", sm), "sm_max_mhz": read("nvmlDeviceGetMaxClockInfo", sm),
            "temperature_c": read("nvmlDeviceGetTemperature", getattr(pynvml, "NVML_TEMPERATURE_GPU", 0)),
            "power_w": None if power_mw is None else power_mw / 1000,
            "held_back_by": None if reasons is None else _clock_events(pynvml, reasons)}


def _clock_events(pynvml: Any, reasons: int) -> list[str]:
    return [name for key, name in _CLOCK_EVENTS.items() if reasons & getattr(pynvml, f"nvmlClocksEventReason{key}", 0)]


def visible_device_count() -> int | None:
    """How many CUDA devices this process sees, counted through NVML (never initialises CUDA);
    None where NVML, the driver or the library is missing.

    Under CUDA_VISIBLE_DEVICES, its entries up to the first that names no device: CUDA ignores
    the rest of the list from there.
    """
    def query(pynvml: Any) -> int:
        entries = _visible_entries()
        if entries is None:
            return int(pynvml.nvmlDeviceGetCount())
        for index in range(len(entries)):
            try:
                _nvml_handle(pynvml, index)
            except pynvml.NVMLError:
                return index
        return len(entries)
    return _with_nvml(query)


def _with_nvml(query: Any) -> Any:
    """query(pynvml) between nvmlInit and nvmlShutdown; None when NVML is missing or fails."""
    try:
        import pynvml  # here, not at the top: this module must import without it (module docstring)
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError):
        return None
    try:
        return query(pynvml)
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def _visible_entries() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (indices, GPU-/MIG- UUIDs), or None where it is not set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return None if visible is None else [e.strip() for e in visible.split(",") if e.strip()]


def _nvml_handle(pynvml: Any, index: int) -> Any:
    entries = _visible_entries()
    if entries is None:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    if index >= len(entries):
        return None
    entry = entries[index]
    if entry.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    return pynvml.nvmlDeviceGetHandleByUUID(entry)


def _memory_of(pynvml: Any, handle: Any) -> DeviceMemory:
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    name = pynvml.nvmlDeviceGetName(handle)
    if isinstance(name, bytes):        # older nvidia-ml-py returned bytes
        name = name.decode(errors="replace")
    return DeviceMemory(total_bytes=int(info.total), free_bytes=int(info.free),
                        used_bytes=int(info.used), name=name)


def unified_memory_capabilities(index: int = 0) -> dict[str, Any]:
    """Unified-memory attributes of CUDA device `index`, plus versions and NVML memory.

    Keys: name, pci_bus_id, compute_capability ("9.0"), the attributes in _UM_ATTRIBUTES (bool),
    driver_version and runtime_version ("13.0"), and when NVML answers total_bytes / free_bytes /
    used_bytes (int) and the clocks of device_clocks (sm_mhz, ..., held_back_by: the names of what
    keeps the clocks below their maximum, None where NVML gives none of these). Raises
    RuntimeError saying what is missing when there is no usable device.
    """
    try:
        from cuda.bindings import runtime as rt  # here, as pynvml above
    except ImportError as exc:
        raise RuntimeError("cuda-bindings is not installed (pip install cuda-bindings); "
                           "it is needed to query the CUDA device") from exc
    if _cuda(rt, rt.cudaDriverGetVersion(), "cudaDriverGetVersion") == 0:
        # Without libcuda, cudaGetDeviceCount would blame an "insufficient" driver.
        raise RuntimeError("no NVIDIA driver found (cudaDriverGetVersion returned 0): "
                           "this machine has no usable CUDA device")
    count = _cuda(rt, rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
    if not 0 <= index < count:
        raise RuntimeError(f"CUDA device {index} does not exist: {count} device(s) visible"
                           f"{visible_devices_note()}")
    caps: dict[str, Any] = {"device": index}
    props = _cuda(rt, rt.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
    caps["name"] = _text(props.name)
    bus_id = _cuda(rt, rt.cudaDeviceGetPCIBusId(32, index), "cudaDeviceGetPCIBusId")
    caps["pci_bus_id"] = _text(bus_id)
    caps["compute_capability"] = f"{props.major}.{props.minor}"
    for attribute, key in _UM_ATTRIBUTES.items():
        value = rt.cudaDeviceGetAttribute(getattr(rt.cudaDeviceAttr, attribute), index)
        caps[key] = bool(_cuda(rt, value, f"cudaDeviceGetAttribute({attribute})"))
    for key, call in (("driver_version", "cudaDriverGetVersion"),
                      ("runtime_version", "cudaRuntimeGetVersion")):
        caps[key] = _version(_cuda(rt, getattr(rt, call)(), call))
    memory = _memory_by_bus_id(caps["pci_bus_id"])
    if memory is not None:
        caps.update(total_bytes=memory.total_bytes, free_bytes=memory.free_bytes,
                    used_bytes=memory.used_bytes)
    caps.update(_with_nvml(lambda nv: _clocks_of(nv, nv.nvmlDeviceGetHandleByPciBusId(caps["pci_bus_id"]))) or {})
    return caps


def _cuda(rt: Any, result: tuple, call: str) -> Any:
    """The value of a cuda-bindings call `(err, value)`, or RuntimeError naming call and error."""
    err, *values = result
    if err != rt.cudaError_t.cudaSuccess:
        _, error_text = rt.cudaGetErrorString(err)
        raise RuntimeError(f"no usable CUDA device: {call} failed with {err.name} "
                           f"({_text(error_text)}){visible_devices_note()}; is an NVIDIA driver "
                           f"installed and a GPU visible to this process?")
    return values[0] if len(values) == 1 else tuple(values)


def _memory_by_bus_id(bus_id: str) -> DeviceMemory | None:
    """NVML memory of the device at `bus_id`: exact, whatever the CUDA and NVML orders are."""
    return _with_nvml(lambda nv: _memory_of(nv, nv.nvmlDeviceGetHandleByPciBusId(bus_id)))


def visible_devices_note() -> str:
    """" (CUDA_VISIBLE_DEVICES='1,3')" for a message about device numbers, or "" where it is not set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        value = value.split(b"\0", 1)[0].decode(errors="replace")
    return str(value)


def _version(v: int) -> str:
    """CUDA's encoding 1000*major + 10*minor (13000 -> "13.0")."""
    return f"{v // 1000}.{(v % 1000) // 10}"
