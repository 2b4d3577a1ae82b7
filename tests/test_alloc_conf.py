"""PYTORCH_CUDA_ALLOC_CONF under um_alloc: its settings for PyTorch's own device allocator, which
um_alloc replaces, have no effect, and install() says so; the pinned host allocator's still apply."""
import warnings

import pytest

from um_alloc import alloc_conf


def test_device_settings_are_named_and_pinned_ones_left_alone():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, max_split_size_mb:128,"
                                         "pinned_use_cuda_host_register:True,roundup_power2_divisions:[256:1,>:4]",
               "PYTORCH_ALLOC_CONF": "pinned_num_register_threads:8"}
    assert alloc_conf.device_allocator_settings(environ) == {  # a bracketed list's commas are its own
        "PYTORCH_CUDA_ALLOC_CONF": ["expandable_segments", "max_split_size_mb", "roundup_power2_divisions"]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        alloc_conf.warn_on_pytorch_alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "pinned_use_background_threads:True"})
        alloc_conf.warn_on_pytorch_alloc_conf({})


def test_each_variable_that_configures_the_device_allocator_warns_with_what_shapes_the_pool():
    environ = {"PYTORCH_ALLOC_CONF": "expandable_segments:True", "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
    with pytest.warns(UserWarning) as caught:
        alloc_conf.warn_on_pytorch_alloc_conf(environ)
    said = sorted(str(w.message) for w in caught)
    assert said[0].startswith("um_alloc: PYTORCH_ALLOC_CONF sets expandable_segments for PyTorch's own CUDA "
                              "allocator, which um_alloc replaces: it has no effect.")
    assert said[1].startswith("um_alloc: PYTORCH_CUDA_ALLOC_CONF sets backend")
    assert all("pool.max_reserved" in s for s in said)


def test_install_warns_where_the_environment_sets_them(fake_install, monkeypatch):
    import um_alloc

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    with pytest.warns(UserWarning, match="sets expandable_segments, max_split_size_mb for PyTorch's own CUDA "
                                         "allocator.*they have no effect"):
        um_alloc.install("none")
