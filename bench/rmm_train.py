"""bert_example/train.py on RMM's pool over managed memory, for compare_peers.py:

    python bench/rmm_train.py [--memory-limit SIZE] TRAIN_ARGS...

RMM becomes PyTorch's allocator (rmm_torch_allocator) before any CUDA work, and train.py runs
with --allocator stock. --memory-limit is taken out of the arguments and becomes the pool's
maximum_pool_size, because torch.cuda's per-process fraction and memory statistics do not work
under a pluggable allocator; the peak comes from RMM's statistics adaptor instead.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def split_limit(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--memory-limit's value or None, the other arguments)."""
    rest, limit, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--memory-limit" and i + 1 < len(argv):
            limit, i = argv[i + 1], i + 2
            continue
        if argv[i].startswith("--memory-limit="):
            limit = argv[i].split("=", 1)[1]
        else:
            rest.append(argv[i])
        i += 1
    return limit, rest


def install_rmm(limit_bytes: int | None):
    """Managed-memory pool capped at limit_bytes, with statistics; returns a peak-bytes reader."""
    import rmm
    import torch
    from rmm.allocators.torch import rmm_torch_allocator

    rmm.reinitialize(pool_allocator=True, managed_memory=True, maximum_pool_size=limit_bytes)
    try:
        import rmm.statistics

        rmm.statistics.enable_statistics()
        peak = lambda: rmm.statistics.get_statistics().peak_bytes  # noqa: E731
    except (ImportError, AttributeError):  # older RMM: no statistics adaptor
        peak = lambda: None  # noqa: E731
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    return peak


def main(argv: list[str] | None = None) -> dict:
    from um_alloc.sizes import parse_size

    limit, rest = split_limit(sys.argv[1:] if argv is None else argv)
    limit_bytes = None if limit is None else parse_size(int(limit) if limit.isdigit() else limit,
                                                        key="--memory-limit", source="command line")
    peak = install_rmm(limit_bytes)
    from bert_example import summary, train

    # torch.cuda.max_memory_allocated raises under a pluggable allocator: report RMM's peak.
    summary.memory_report = lambda args, device: {"peak_bytes": peak(), "peak_reserved_bytes": None}
    return train.main(["--allocator", "stock", *rest])


if __name__ == "__main__":
    try:
        main()
    except (MemoryError, RuntimeError) as error:  # torch.OutOfMemoryError is a RuntimeError
        text = str(error).lower()
        if not isinstance(error, MemoryError) and "out of memory" not in text and "out_of_memory" not in text:
            raise
        print(f"rmm_train.py: out of GPU memory: {error}", file=sys.stderr)
        sys.exit(3)  # train.py's EXIT_OOM: compare_peers.py reports it as "oom"
