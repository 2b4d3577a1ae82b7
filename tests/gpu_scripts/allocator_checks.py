"""GPU checks of the installed allocator, one per fresh process (install must precede CUDA work).

Run: python tests/gpu_scripts/allocator_checks.py CHECK. Prints one JSON line of findings;
tests/test_gpu_allocator.py asserts on them. Exits non-zero on an unexpected exception.
"""
import json
import sys

import torch

import um_alloc

MiB = 1 << 20


def range_attribute(ptr: int, nbytes: int, attribute: str, size: int = 4):
    from cuda.bindings import runtime as rt

    err, value = rt.cudaMemRangeGetAttribute(size, getattr(rt.cudaMemRangeAttribute, attribute), ptr, nbytes)
    assert err == rt.cudaError_t.cudaSuccess, f"cudaMemRangeGetAttribute({attribute}): {err}"
    return value


def check_advice():
    """The hints best.yaml asks for, read back from the driver."""
    um_alloc.install("best.yaml")
    with um_alloc.tag("parameter"):
        weight = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    batch = torch.empty(6 * MiB, dtype=torch.uint8, device="cuda")  # born an activation
    before_retag = range_attribute(batch.data_ptr(), batch.numel(), "cudaMemRangeAttributeReadMostly")
    um_alloc.retag({"input_ids": batch}, "input")
    activation = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    accessed = range_attribute(weight.data_ptr(), weight.numel(), "cudaMemRangeAttributeAccessedBy", 4 * 4)
    return {
        "parameter_preferred": range_attribute(weight.data_ptr(), weight.numel(),
                                               "cudaMemRangeAttributePreferredLocation"),
        "parameter_accessed_by": [d for d in accessed if d >= 0],
        "input_read_mostly_before_retag": before_retag,
        "input_read_mostly": range_attribute(batch.data_ptr(), batch.numel(), "cudaMemRangeAttributeReadMostly"),
        "activation_preferred": range_attribute(activation.data_ptr(), activation.numel(),
                                                "cudaMemRangeAttributePreferredLocation"),
        "activation_last_prefetch": range_attribute(activation.data_ptr(), activation.numel(),
                                                    "cudaMemRangeAttributeLastPrefetchLocation"),
        "block_tag": um_alloc.block_at(batch.data_ptr() + 100).tag,
        "backend_errors": um_alloc.memory_stats()["backend_errors"],
    }


def check_oom():
    """Hitting the cap raises torch.OutOfMemoryError; training carries on after it."""
    um_alloc.install("none.yaml", max_reserved="1GiB")
    model = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hog = []
    message = ""
    try:
        while True:
            hog.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
    except torch.OutOfMemoryError as e:
        message = str(e)
    held = len(hog)
    del hog
    losses = []
    for _ in range(3):
        loss = model(torch.randn(64, 1024, device="cuda")).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    stats = um_alloc.memory_stats()
    return {"message": message, "held_before_oom": held, "losses": losses,
            "num_ooms": stats["num_ooms"], "limit": stats["limit_bytes"],
            "peak_reserved": stats["peak_reserved_bytes"]}


def _read_on_a_busy_side_stream(n: int, cycles: int):
    """A tensor of the main stream that a side stream reads after `cycles` of sleep (so that a
    reuse racing ahead would overwrite it first), marked with record_stream and freed."""
    side = torch.cuda.Stream()
    a = torch.ones(n, device="cuda")
    a_ptr = a.data_ptr()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(cycles)
        b = a * 2
    a.record_stream(side)
    return side, a_ptr, b


def check_record_stream():
    """A block used on a side stream and freed on the main one is not reused too early."""
    um_alloc.install("none.yaml")
    n = 16 * MiB
    _, a_ptr, b = _read_on_a_busy_side_stream(n, 200_000_000)
    c = torch.zeros(n, device="cuda")  # reuses a's memory on the main stream
    reused = c.data_ptr() == a_ptr
    torch.cuda.synchronize()
    return {"reused_address": reused, "b_all_two": bool((b == 2).all().item()),
            "stream_waits": um_alloc.memory_stats()["stream_waits"]}


def check_reuse_waits_only_for_the_point_of_free():
    """A reuse waits for the side stream's work up to the free, not for what it was given later."""
    um_alloc.install("none.yaml")
    n = 16 * MiB
    side, a_ptr, b = _read_on_a_busy_side_stream(n, 100_000_000)
    with torch.cuda.stream(side):
        torch.cuda._sleep(4_000_000_000)  # work given to the side stream after the free: ~2 s
        later = side.record_event()
    c = torch.zeros(n, device="cuda")  # reuses a's memory on the main stream
    reused = c.data_ptr() == a_ptr
    torch.cuda.current_stream().record_event().synchronize()
    main_done_first = not later.query()
    torch.cuda.synchronize()
    return {"reused_address": reused, "b_all_two": bool((b == 2).all().item()),
            "main_done_before_later_side_work": main_done_first,
            "free_events": um_alloc.memory_stats()["free_events"]}


def check_empty_cache_and_stats():
    um_alloc.install("none.yaml")
    x = torch.empty(3 * 1024 * MiB, dtype=torch.uint8, device="cuda")
    before = um_alloc.memory_stats()
    del x
    torch.cuda.empty_cache()
    after = um_alloc.memory_stats()
    summary = um_alloc.memory_summary()
    return {"reserved_before": before["reserved_bytes"], "reserved_after": after["reserved_bytes"],
            "live_before": before["live_bytes"], "live_after": after["live_bytes"],
            "summary_has_tags": all(t in summary for t in um_alloc.TAGS)}


def check_torch_memory_stats():
    """PyTorch's own statistics calls, which raise under a bare pluggable allocator, answered by
    the pool: what a training script logs."""
    um_alloc.install("none.yaml")
    x = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    y = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    found = {"allocated": torch.cuda.memory_allocated(), "pool_live": um_alloc.memory_stats()["live_bytes"]}
    del x
    found.update(after_free=torch.cuda.memory_allocated(), peak=torch.cuda.max_memory_allocated(),
                 reserved=torch.cuda.memory_reserved(), pool_reserved=um_alloc.memory_stats()["reserved_bytes"])
    torch.cuda.reset_peak_memory_stats()
    found.update(peak_after_reset=torch.cuda.max_memory_allocated(),
                 summary="Allocated memory" in torch.cuda.memory_summary(),
                 stats_keys=len(torch.cuda.memory_stats()))
    del y
    return found


def check_cudnn_benchmark():
    """A script that turns cuDNN's benchmark mode on trains its convolutions (the mode stays off,
    with a warning): with it on, each would raise for want of the allocator's cacheInfo."""
    import warnings

    um_alloc.install("none.yaml")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.backends.cudnn.benchmark = True
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 7, 2, 3), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 16, 3, 1, 1)).cuda()
    images = torch.randn(8, 3, 64, 64, device="cuda")
    losses = []
    for dtype in (None, torch.bfloat16):
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(images).float().square().mean()
        loss.backward()
        losses.append(loss.item())
    return {"warned": any("stays off" in str(w.message) for w in caught),
            "benchmark": torch.backends.cudnn.benchmark, "losses": losses}


def check_lms_controls():
    """The LMS-style functions read and write the pool's budget settings (here the reactive mode's,
    which evicts to keep 128 MiB of tensors under a 64 MiB limit)."""
    um_alloc.install({"scheduler": {"evict_live": True}})
    before = (um_alloc.get_enabled_lms(), um_alloc.get_limit_lms(), um_alloc.get_size_lms())
    um_alloc.set_limit_lms("64MiB")
    um_alloc.set_size_lms(2 * MiB)
    um_alloc.set_enabled_lms(True)
    tensors = [torch.empty(8 * MiB, dtype=torch.uint8, device="cuda") for _ in range(16)]  # 128 MiB
    stats = um_alloc.memory_stats()
    um_alloc.set_enabled_lms(False)
    return {"before": before, "after": [um_alloc.get_enabled_lms(), um_alloc.get_limit_lms(), um_alloc.get_size_lms()],
            "evictions": stats["evictions"], "resident": stats["resident_bytes"], "tensors": len(tensors),
            "installation_budget": um_alloc.installation().budget}


def check_install_after_cuda():
    torch.zeros(1, device="cuda")
    try:
        um_alloc.install("none.yaml")
    except RuntimeError as e:
        return {"error": str(e)}
    return {"error": None}


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}

if __name__ == "__main__":
    print(json.dumps(CHECKS[sys.argv[1]]()))
