"""train.py's summary of a run: what it measured, as a dict (the --json record) and as text."""
from __future__ import annotations

import os
import statistics
from datetime import datetime, timezone

import torch


def device_used(device: torch.device) -> int | None:
    """Bytes in use on the device, every process's, as the driver counts them; None on the CPU."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def memory_report(args, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"peak_bytes": None, "peak_reserved_bytes": None}
    if args.allocator == "um":
        import um_alloc

        stats = um_alloc.memory_stats()
        return {"peak_bytes": stats["peak_live_bytes"], "peak_reserved_bytes": stats["peak_reserved_bytes"],
                "budget_bytes": stats.get("budget_bytes") or None, "memory_stats": stats}
    return {"peak_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}


def summarize(args, device, first_step, losses, seconds, streamer, limit, used_before) -> dict:
    timed = seconds[args.warmup_steps:]  # check_args keeps at least one step timed
    step_s = statistics.median(timed)
    bf16 = device.type == "cuda" and not args.no_bf16
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "workload": f"bert-{args.model}-mlm-seq{args.seq_len}-{'bf16' if bf16 else 'fp32'}"
                    + ("-text" if args.data else "-synthetic"),
        "method": "um_alloc" if args.allocator == "um" else "stock",
        "policy": (args.policy or os.environ.get("UM_POLICY") or "none.yaml") if args.allocator == "um" else None,
        "batch": args.batch_size,
        "micro_batch": streamer.last_micro_batch_size if streamer is not None else None,
        "seq_len": args.seq_len, "bf16": bf16, "memory_limit_bytes": limit,
        "first_step": first_step, "steps": len(losses), "timed_steps": len(timed), "step_s": seconds,
        "step_s_median": step_s, "samples_per_s": args.batch_size / step_s,
        "loss_first": losses[0], "loss_last": losses[-1], "losses": losses,
    }
    summary.update(memory_report(args, device))
    used_after = device_used(device)
    summary["device_used_delta_bytes"] = used_after - used_before if used_before is not None else None
    return summary


def print_summary(summary: dict, allocator: str) -> None:
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.2f} GiB"  # noqa: E731
    micro = f" in micro-batches of {summary['micro_batch']}" if summary["micro_batch"] else ""
    print(f"\n{summary['workload']} on {summary['device']} ({summary['method']}), batch {summary['batch']}{micro}")
    print(f"  steps {summary['first_step']}..{summary['first_step'] + summary['steps'] - 1} "
          f"({summary['timed_steps']} timed): median step {summary['step_s_median']:.3f} s, "
          f"{summary['samples_per_s']:.1f} samples/s")
    print(f"  loss {summary['loss_first']:.4f} -> {summary['loss_last']:.4f}")
    print(f"  peak memory {gib(summary['peak_bytes'])} live, {gib(summary['peak_reserved_bytes'])} reserved")
    if summary.get("plan_table"):
        planned = summary["planner"].get("plan", {})
        measured = summary["planner"].get("measured_step_s")
        print(f"  block planner: predicted step {1e3 * planned.get('predicted_step_s', 0):.1f} ms"
              + (f", measured {1e3 * measured:.1f} ms" if measured else ""))
        print("  " + summary["plan_table"].replace("\n", "\n  "))
    offload = summary.get("activation_offload")
    if offload:
        print(f"  activation offload (last step): saved {gib(offload['saved_bytes'])}, kept "
              f"{gib(offload['kept_bytes'])} on the GPU, rebuilt {gib(offload['rebuilt_bytes'])} in backward, "
              f"moved {gib(offload['out_bytes'])} each way")
    phases = summary.get("phase_s_median")
    if phases:
        print("  median phases: " + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in phases.items()))
    rates = summary.get("link_rates")
    if rates:
        print(f"  pinned-host link: {rates['d2h_GBps']:.1f} GB/s to the host, {rates['h2d_GBps']:.1f} GB/s back")
    if allocator == "um" and summary["peak_bytes"] is not None:
        import um_alloc

        print(um_alloc.memory_summary())
