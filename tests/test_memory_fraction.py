"""torch.cuda.set_per_process_memory_fraction() under um_alloc: the pluggable allocator drops the
fraction, so the call warns and names what bounds memory instead."""
import pytest
import torch

from um_alloc import memory_fraction


def test_setting_a_fraction_warns_with_what_bounds_memory(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction", lambda fraction, device: None, raising=False)
    memory_fraction.warn_on_memory_fraction()
    with pytest.warns(UserWarning, match=r"set_per_process_memory_fraction\(0.5\) has no effect under um_alloc.*--budget"):
        torch._C._cuda_setMemoryFraction(0.5, 0)
    warning = torch._C._cuda_setMemoryFraction
    memory_fraction.warn_on_memory_fraction()  # a second install changes nothing
    assert torch._C._cuda_setMemoryFraction is warning
