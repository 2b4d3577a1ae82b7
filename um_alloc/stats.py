"""Memory statistics of the installed allocator.

um_alloc's own figures: live, peak and held bytes per tag, reserved bytes, fragmentation and its
bound, and the calls the pool made to the driver. PyTorch's torch.cuda.memory_stats() and its
kin answer from the same pool (torch_stats.py).
"""
from __future__ import annotations

from .device_info import device_memory
from .install import installation
from .pool import ChunkPool
from .sizes import format_size
from .stats_fields import PER_TAG, TOTALS
from .tag_names import TAGS


def memory_stats(device: int | None = None) -> dict:
    """Statistics of the pool of `device` (default: the one install() was given).

    Keys: live_bytes / peak_live_bytes (bytes asked for and still held by tensors), reserved_bytes /
    peak_reserved_bytes (managed memory reserved), limit_bytes (the cap), fragmentation_bytes
    (reserved - live) = internal_waste_bytes (rounding inside held chunks, always below
    internal_waste_bound_bytes = chunks in use x chunk_size) + free_chunk_bytes, device_highwater_bytes
    (NVML used now - at install: the driver keeps GPU pages once used, so this is a high-water
    mark of GPU residency), resident_bytes / peak_resident_bytes (GPU residency as the pool
    believes it; faults can bring evicted data back unseen), budget_bytes, evictions and
    evicted_bytes, counts of driver calls, and "tags": per tag live_bytes, peak_bytes,
    reserved_bytes (whole chunks held), resident_bytes, allocations, frees.
    """
    inst = installation()
    device = inst.device if device is None else device
    stats = public_stats(ChunkPool.for_device(device).raw_stats())
    now = device_memory(device)
    stats["device_highwater_bytes"] = None if now is None else now.used_bytes - inst.device_used_at_install
    stats["policy"] = inst.policy.name
    return stats


def public_stats(raw: dict) -> dict:
    """ChunkPool.raw_stats() under memory_stats()'s names (stats_fields.FIELDS)."""
    stats = {f.public: raw[f.core] for f in TOTALS}
    stats["tags"] = {t: {f.public: raw["tags"][t][f.core] for f in PER_TAG} for t in TAGS}
    return stats


def memory_summary(device: int | None = None) -> str:
    """A human-readable table of memory_stats(), like torch.cuda.memory_summary()."""
    s = memory_stats(device)
    rows = [f"{'tag':<16}{'live':>12}{'peak':>12}{'reserved':>12}{'allocs':>10}"]
    for t in TAGS:
        v = s["tags"][t]
        rows.append(f"{t:<16}{format_size(v['live_bytes']):>12}{format_size(v['peak_bytes']):>12}"
                    f"{format_size(v['reserved_bytes']):>12}{v['allocations']:>10}")
    rows.append(f"{'total':<16}{format_size(s['live_bytes']):>12}{format_size(s['peak_live_bytes']):>12}"
                f"{format_size(s['reserved_bytes'] - s['free_chunk_bytes']):>12}")
    limit = "none" if s["limit_bytes"] >= 2**63 else format_size(s["limit_bytes"])
    highwater = "n/a" if s["device_highwater_bytes"] is None else format_size(s["device_highwater_bytes"])
    width = len(rows[0])
    lines = [
        "=" * width,
        f" um_alloc memory summary (policy {s['policy']}, chunk {format_size(s['chunk_size'])})",
        "-" * width, *rows, "-" * width,
        f" reserved {format_size(s['reserved_bytes'])} in {s['arenas']} arenas "
        f"(peak {format_size(s['peak_reserved_bytes'])}, limit {limit})",
        f" fragmentation {format_size(s['fragmentation_bytes'])}: rounding "
        f"{format_size(s['internal_waste_bytes'])} (bound {format_size(s['internal_waste_bound_bytes'])}),"
        f" free chunks {format_size(s['free_chunk_bytes'])}",
        f" driver calls: advise {s['advise_calls']}, prefetch {s['prefetch_calls']} "
        f"({format_size(s['prefetch_bytes'])}), stream waits {s['stream_waits']} "
        f"(side-stream points recorded at free {s['free_events']}), "
        f"errors {s['backend_errors']}; OOMs {s['num_ooms']}; arenas reserved {s['arena_reserves']}, "
        f"released {s['arena_releases']}",
        f" GPU residency (pool's view) {format_size(s['resident_bytes'])}, peak "
        f"{format_size(s['peak_resident_bytes'])}, budget "
        f"{'none' if not s['budget_bytes'] else format_size(s['budget_bytes'])}; evictions {s['evictions']} "
        f"({format_size(s['evicted_bytes'])})",
        f" GPU-backed (what the driver holds for the pool) {format_size(s['gpu_backed_bytes'])}, peak "
        f"{format_size(s['peak_gpu_backed_bytes'])}",
        f" GPU memory high-water since install (NVML): {highwater}",
        "=" * width,
    ]
    return "\n".join(lines)
