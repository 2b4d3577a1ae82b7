"""In-process unified-memory counters through CUPTI's Activity API (cupti-python).

nvprof, which Choi & Lee used, does not support compute capability 8.0 and newer, and Nsight
Systems is not on our GPU machines, so the allocator measures itself:

    from um_alloc.profile import UMCounters
    with UMCounters() as counters:      # before the model is built: set-up faults count too
        counters.start_steps()          # optional: what came before is "set-up", not step 0
        for batch in loader:
            train_step(batch)           # ends with loss.item(), so the GPU is done
            counters.mark_step()
    counters.totals(), counters.per_step()

If cupti-python is missing, no CUDA driver is found, or CUPTI is already in use by another
profiler (nsys, ncu, torch.profiler), the session logs "CUPTI unavailable: <reason>; running
without counters" and every counter reads None (not measured, never 0); with ``required=True``
it raises CountersUnavailable instead.

Troubleshooting: CUPTI delivers records in buffers from its own thread; totals() and
per_step() force a flush first. Records are attributed to steps by their CUPTI start timestamp,
so a step that returns before the GPU has finished (no synchronisation) lends its late faults
to the next step. One session per process: CUPTI's activity callbacks are process-wide.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time

from .aggregate import COUNTER_FIELDS, COUNTER_KINDS, MIGRATION_CAUSES, StepCounts

log = logging.getLogger("um_alloc.profile")

ENV_FLAG = "UM_PROFILE"

BUFFER_BYTES = 8 << 20         # per activity buffer handed to CUPTI (the samples' size)
_CORE_KINDS = ("BYTES_TRANSFER_HTOD", "BYTES_TRANSFER_DTOH", "CPU_PAGE_FAULT_COUNT", "GPU_PAGE_FAULT")
_EXTRA_FIELDS = {"THRASHING": ("thrashing_events", "thrashing_bytes"),
                 "THROTTLING": ("throttling_events", "throttling_ns"),
                 "REMOTE_MAP": ("remote_map_events", "remote_map_bytes"),
                 "BYTES_TRANSFER_DTOD": ("dtod_bytes",)}
_CAUSE_NAMES = {"USER": "prefetch", "COHERENCE": "fault", "PREFETCH": "speculative",
                "EVICTION": "eviction", "ACCESS_COUNTERS": "access_counters", "UNKNOWN": "unknown"}

_active: "UMCounters | None" = None
_keepalive: list = []  # CUPTI keeps pointers to the callbacks: hold them for the process


class CountersUnavailable(RuntimeError):
    """CUPTI's unified-memory counters cannot run here; the message says why."""


class _Unavailable(Exception):
    pass


class UMCounters:
    """One CUPTI unified-memory counter session: start/stop, step marks, counts."""

    def __init__(self, device: int = 0, *, keep_records: bool = False, required: bool = False):
        self.device = device
        self.required = required
        self.available = False
        self.reason: str | None = None
        self.unsupported: list[str] = []        # counter kinds this device would not enable
        self.dropped_records: int | None = None
        self.callback_errors = 0
        self._keep_all = keep_records
        self._windows: list[list] = []           # [start_ns, end_ns or None]: keep raw records in these
        self._records: list[dict] = []
        self._counts = StepCounts(0)
        self._lock = threading.Lock()
        self._cupti = None
        self._stopped = False

    # --- session --------------------------------------------------------------------------

    def start(self) -> "UMCounters":
        global _active
        try:
            self._cupti = _import_cupti()
            self._check_free()
            _init_driver(self.device)
            _check_enums(self._cupti)
            self._enable()
        except _Unavailable as error:
            self._cupti = None
            self.reason = str(error)
            message = f"CUPTI unavailable: {self.reason}; running without counters"
            if self.required:
                raise CountersUnavailable(message) from None
            log.warning(message)
        else:
            self.available = True
            _active = self
        self._counts.origin_ns = self.now()
        return self

    def stop(self) -> None:
        global _active
        if not self.available or self._stopped:
            return
        cupti = self._cupti
        try:
            # Flush while the kind is still enabled: records the driver has not handed over yet
            # are lost once it is disabled. 1 = CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: partial buffers too.
            cupti.activity_flush_all(1)
            cupti.activity_disable(cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
            cupti.activity_flush_all(1)
        finally:
            self._stopped = True
            _active = None if _active is self else _active
        self.dropped_records = _dropped_records(cupti)

    def __enter__(self) -> "UMCounters":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- marks ----------------------------------------------------------------------------

    def now(self) -> int:
        """CUPTI's clock in ns (the records' clock); perf_counter_ns without CUPTI."""
        return int(self._cupti.get_timestamp()) if self.available else time.perf_counter_ns()

    def start_steps(self) -> None:
        """Records from now on go to steps; what came before is set-up traffic."""
        with self._lock:
            self._counts.start_steps(self.now())

    def mark_step(self) -> None:
        """Ends the current step (call it once the GPU has finished the step)."""
        with self._lock:
            self._counts.mark(self.now())

    def keep_records(self, on: bool) -> None:
        """Keep raw records whose start falls between keep_records(True) and (False) (timelines)."""
        with self._lock:
            if on:
                self._windows.append([self.now(), None])
            elif self._windows and self._windows[-1][1] is None:
                self._windows[-1][1] = self.now()

    # --- results --------------------------------------------------------------------------

    def flush(self) -> None:
        if self.available and not self._stopped:
            self._cupti.activity_flush_all(1)

    def totals(self) -> dict:
        """Every counter over the whole session, set-up included."""
        self.flush()
        with self._lock:
            return self._measured(self._counts.totals())

    def per_step(self) -> list[dict]:
        """One dict per marked step: "step", "start_ns", "end_ns" and every counter."""
        self.flush()
        with self._lock:
            return [self._measured(step) for step in self._counts.per_step()]

    def setup(self) -> dict:
        self.flush()
        with self._lock:
            return self._measured(self._counts.setup)

    def records(self, start_ns: int | None = None, end_ns: int | None = None) -> list[dict]:
        """Kept raw records (keep_records=True, or inside keep_records windows), by start time."""
        self.flush()
        with self._lock:
            return [r for r in self._records
                    if (start_ns is None or r["start"] >= start_ns) and (end_ns is None or r["start"] <= end_ns)]

    def summary(self) -> dict:
        """Everything, JSON-ready: availability, totals, set-up, per step, after the last mark."""
        steps = self.per_step()
        with self._lock:
            after = self._measured(self._counts.after_last_mark())
        return {"source": "cupti", "available": self.available, "reason": self.reason,
                "unsupported_kinds": self.unsupported, "dropped_records": self.dropped_records,
                "callback_errors": self.callback_errors, "totals": self.totals(), "setup": self.setup(),
                "per_step": steps, "after_last_mark": after}

    def _measured(self, counts: dict) -> dict:
        out = dict(counts)
        if not self.available:
            out.update(dict.fromkeys(COUNTER_FIELDS, None))
        for kind in self.unsupported:
            out.update(dict.fromkeys(_EXTRA_FIELDS.get(kind, ()), None))
        return out

    # --- CUPTI ----------------------------------------------------------------------------

    def _check_free(self) -> None:
        if _active is not None and _active is not self:
            raise _Unavailable("another UMCounters session is already running in this process "
                               "(CUPTI's activity callbacks are per process); stop it first")
        torch = sys.modules.get("torch")
        if torch is not None and getattr(torch.autograd, "_profiler_enabled", lambda: False)():
            raise _Unavailable("torch.profiler is running and owns CUPTI's activity buffers; "
                               "profile without it, or drop --profile")

    def _enable(self) -> None:
        cupti = self._cupti
        kinds = [name for name in COUNTER_KINDS.values()]
        try:
            self._configure(kinds)
        except _Unavailable as error:
            if "NOT_SUPPORTED" not in str(error) and "INVALID_PARAMETER" not in str(error):
                raise
            # Some devices refuse the rarer counters; keep faults and migrations at least.
            self.unsupported = [k for k in kinds if k not in _CORE_KINDS]
            log.warning("CUPTI: %s; retrying with %s only", error, ", ".join(_CORE_KINDS))
            self._configure(list(_CORE_KINDS))
        requested, completed = self._buffer_requested, self._buffer_completed
        _keepalive.append((requested, completed))
        _call(cupti, "activity_register_callbacks", requested, completed)
        _call(cupti, "activity_enable", cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)

    def _configure(self, kinds: list[str]) -> None:
        cupti = self._cupti
        config = cupti.ActivityUnifiedMemoryCounterConfig(len(kinds))
        config.scope = int(cupti.ActivityUnifiedMemoryCounterScope.PROCESS_SINGLE_DEVICE)  # sets every entry
        config.device_id = self.device
        config.enable = 1
        for i, name in enumerate(kinds):
            config[i].kind = int(cupti.ActivityUnifiedMemoryCounterKind[name])
        _call(cupti, "activity_configure_unified_memory_counter", config.ptr, len(kinds))

    @staticmethod
    def _buffer_requested():
        return BUFFER_BYTES, 0  # 0: as many records as fit

    def _buffer_completed(self, activities) -> None:
        # Runs on CUPTI's thread: never raise into it. The activity objects point into a buffer
        # CUPTI reuses, so copy the fields out now.
        try:
            kind_um = int(self._cupti.ActivityKind.UNIFIED_MEMORY_COUNTER)
            records = [_record(a) for a in activities if getattr(a, "kind", None) == kind_um]
        except Exception as error:  # noqa: BLE001 - reported, not raised into CUPTI
            self._callback_failed(error)
            return
        with self._lock:
            for record in records:
                self._counts.add(record)
                if self._keep_all or any(s <= record["start"] and (e is None or record["start"] <= e)
                                         for s, e in self._windows):
                    self._records.append(record)

    def _callback_failed(self, error: Exception) -> None:
        self.callback_errors += 1
        if self.callback_errors == 1:
            log.error("CUPTI buffer callback failed (counts will be short): %r", error)


def active() -> UMCounters | None:
    """The running session of this process, if any."""
    return _active


def mark_step() -> None:
    """Ends a step of the running session, if there is one (a no-op otherwise)."""
    session = active()
    if session is not None:
        session.mark_step()


def env_enabled() -> bool:
    """True when UM_PROFILE is set to anything but "", 0, false, no or off."""
    return os.environ.get(ENV_FLAG, "").strip().lower() not in ("", "0", "false", "no", "off")


def _record(activity) -> dict:
    kind = int(activity.counter_kind)
    return {"kind": COUNTER_KINDS.get(kind, f"KIND_{kind}"), "value": int(activity.value),
            "start": int(activity.start), "end": int(activity.end), "address": int(activity.address),
            "src_id": int(activity.src_id), "dst_id": int(activity.dst_id),
            "flags": int(getattr(activity, "flags_", getattr(activity, "flags", 0)))}


def _import_cupti():
    try:  # optional (um_alloc[profile]): imported only when counters start
        from cupti import cupti
    except ImportError as error:
        raise _Unavailable(f"cupti-python is not installed ({error}); pip install 'um_alloc[profile]' "
                           "(cupti-python of your CUDA major version)") from None
    return cupti


def _init_driver(device: int) -> None:
    """cuInit (no context yet, so um_alloc.install() may still follow) and a device check."""
    try:  # imported here: bindings that do not load make the counters unavailable, not this module
        from cuda.bindings import driver
        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise _Unavailable(f"cuInit failed: {err.name} ({int(err)})")
        err, count = driver.cuDeviceGetCount()
    except _Unavailable:
        raise
    except Exception as error:  # noqa: BLE001 - no driver library, or bindings that do not load
        raise _Unavailable(f"no usable CUDA driver ({type(error).__name__}: {error})") from None
    if device >= count:
        raise _Unavailable(f"device {device} requested, but the driver sees {count} device(s)")


def _check_enums(cupti) -> None:
    """aggregate.py decodes CUPTI's ints by its own tables: make sure they still match."""
    for value, name in COUNTER_KINDS.items():
        got = int(cupti.ActivityUnifiedMemoryCounterKind[name])
        if got != value:
            raise _Unavailable(f"cupti-python's {name} is {got}, um_alloc expects {value}; update "
                               "um_alloc/profile/aggregate.py to this CUPTI")
    for member in cupti.ActivityUnifiedMemoryMigrationCause:
        ours = _CAUSE_NAMES.get(member.name)
        if ours is not None and MIGRATION_CAUSES.get(int(member)) != ours:
            raise _Unavailable(f"cupti-python's migration cause {member.name} is {int(member)}, "
                               f"um_alloc expects {ours!r} there; update um_alloc/profile/aggregate.py")


def _call(cupti, name: str, *args):
    """A cupti call whose failure becomes a sentence: which call, CUPTI's code, what it means."""
    try:
        return getattr(cupti, name)(*args)
    except Exception as error:  # noqa: BLE001 - cuptiError, NotSupportedError, RuntimeError
        raise _Unavailable(f"{name} failed: {_explain(cupti, error)}") from None


def _explain(cupti, error: Exception) -> str:
    status = getattr(error, "status", None)
    try:
        code = cupti.Result(status).name if status is not None else None
    except ValueError:
        code = None
    text = f"{code} ({status})" if code else f"{type(error).__name__}: {error}"
    if code in ("ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED", "ERROR_LEGACY_PROFILER_NOT_SUPPORTED"):
        text += ": CUPTI is already in use by another profiler (Nsight Systems or Compute, " \
                "torch.profiler/Kineto, or another CUPTI client)"
    elif code and code.startswith("ERROR_UM_PROFILING_NOT_SUPPORTED"):
        text += ": unified-memory profiling is not supported on this system or device"
    elif code and "PRIVILEGES" in code:
        text += ": the driver does not let this user profile (see NVreg_RestrictProfilingToAdminUsers)"
    injection = os.environ.get("CUDA_INJECTION64_PATH")
    if injection:
        text += f"; CUDA_INJECTION64_PATH={injection} says a profiler is attached"
    return text


def _dropped_records(cupti) -> int | None:
    dropped = ctypes.c_size_t(0)
    try:
        cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(dropped))
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None
    return int(dropped.value)
