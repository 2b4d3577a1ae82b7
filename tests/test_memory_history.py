"""PyTorch's memory history and snapshots under um_alloc: recording warns and records nothing, a
snapshot raises an error that names what to use, where PyTorch's pluggable allocator would raise
"does not yet support"."""
import warnings

import pytest
import torch

from um_alloc import memory_history


@pytest.fixture
def answered(monkeypatch):
    """answer_memory_history() on this process's torch._C, put back after the test."""
    for name in ("_cuda_record_memory_history", "_cuda_record_memory_history_legacy", "_cuda_memorySnapshot"):
        monkeypatch.setattr(torch._C, name, lambda *a, **k: pytest.fail("PyTorch's own was called"), raising=False)
    memory_history.answer_memory_history()


def test_recording_history_warns_once_and_records_nothing(answered):
    with pytest.warns(UserWarning, match=r"_record_memory_history\(\) records nothing under um_alloc"):
        torch.cuda.memory._record_memory_history(max_entries=100_000)  # PyTorch's guide, as written
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.cuda.memory._record_memory_history()                 # once is enough
        torch.cuda.memory._record_memory_history(enabled=None)     # turning it off says nothing


def test_a_snapshot_raises_what_shows_um_allocs_memory_instead(answered, tmp_path):
    with pytest.raises(memory_history.MemorySnapshotUnsupported, match="um_alloc.memory_summary()"):
        torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
    with pytest.raises(RuntimeError, match="caching allocator's segments, which um_alloc replaces"):
        torch.cuda.memory_snapshot()
    assert not (tmp_path / "snapshot.pickle").exists()


def test_a_second_install_changes_nothing(answered):
    snapshot = torch._C._cuda_memorySnapshot
    memory_history.answer_memory_history()
    assert torch._C._cuda_memorySnapshot is snapshot
