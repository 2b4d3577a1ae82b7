"""cuDNN's benchmark mode under um_alloc: whichever way a script turns it on, it stays off with a
warning, since its algorithm search asks the allocator what a pluggable one cannot answer."""
import warnings

import pytest
import torch

from um_alloc import cudnn_benchmark


@pytest.fixture
def kept_off(monkeypatch):
    """keep_cudnn_benchmark_off() as install() calls it, undone after the test."""
    prop = type(torch.backends.cudnn).__dict__["benchmark"]
    monkeypatch.setattr(torch._C, "_set_cudnn_benchmark", torch._C._set_cudnn_benchmark)
    monkeypatch.setattr(prop, "setter", prop.setter)
    before = torch._C._get_cudnn_benchmark()
    cudnn_benchmark.keep_cudnn_benchmark_off()
    yield
    torch._C._set_cudnn_benchmark(before)


def test_the_attribute_stays_off_with_a_warning(kept_off):
    with pytest.warns(UserWarning, match="cudnn.benchmark stays off under um_alloc"):
        torch.backends.cudnn.benchmark = True
    assert torch.backends.cudnn.benchmark is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.backends.cudnn.benchmark = False  # turning it off says nothing


def test_the_flags_context_stays_off_too(kept_off):
    with pytest.warns(UserWarning, match="stays off"):
        with torch.backends.cudnn.flags(enabled=True, benchmark=True):
            assert torch.backends.cudnn.benchmark is False


def test_on_before_install_is_turned_off_and_a_second_call_changes_nothing(monkeypatch):
    prop = type(torch.backends.cudnn).__dict__["benchmark"]
    monkeypatch.setattr(torch._C, "_set_cudnn_benchmark", torch._C._set_cudnn_benchmark)
    monkeypatch.setattr(prop, "setter", prop.setter)
    before = torch._C._get_cudnn_benchmark()
    torch._C._set_cudnn_benchmark(True)
    try:
        with pytest.warns(UserWarning, match="stays off"):
            cudnn_benchmark.keep_cudnn_benchmark_off()
        assert torch.backends.cudnn.benchmark is False
        wrapped = torch._C._set_cudnn_benchmark
        cudnn_benchmark.keep_cudnn_benchmark_off()
        assert torch._C._set_cudnn_benchmark is wrapped
    finally:
        torch._C._set_cudnn_benchmark(before)
