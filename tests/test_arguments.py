"""Every public entry point refuses a bad argument before CUDA or NVML is asked anything: a
PolicyError (a ValueError) naming the argument, the value as written and what is allowed."""
import importlib

import pytest
import torch

import um_alloc
from um_alloc import arguments, lms
from um_alloc.device_info import DeviceMemory
from um_alloc.errors import At, PolicyError
from um_alloc.microbatch import MicroBatchStreamer
from um_alloc.policy import load_policy
from um_alloc.sizes import GiB, MiB

install_module = importlib.import_module("um_alloc.install")  # um_alloc.install is also the function
DEVICE = DeviceMemory(total_bytes=80 * GiB, free_bytes=70 * GiB, used_bytes=10 * GiB, name="fake GPU")


@pytest.fixture
def no_device_calls(monkeypatch):
    """Fails the test if install() reaches NVML or configures the core."""
    def asked(*args, **kwargs):
        raise AssertionError("an argument reached NVML or the core unchecked")
    monkeypatch.setattr(install_module, "device_memory", asked)
    monkeypatch.setattr(install_module, "_configure_core", asked)
    monkeypatch.delenv("UM_POLICY", raising=False)


@pytest.fixture
def fake_device(monkeypatch):
    """A GPU NVML reports, and a core that must not be configured: install() stops before it."""
    def configured(*args, **kwargs):
        raise AssertionError("install() configured the core")
    monkeypatch.setattr(install_module, "device_memory", lambda index: DEVICE)
    monkeypatch.setattr(install_module, "_configure_core", configured)
    monkeypatch.delenv("UM_POLICY", raising=False)


# ---------------------------------------------------------------- install()
@pytest.mark.parametrize("value, fragment", [
    (-5, r"install\(\): max_reserved: negative size \(got -5"),
    (0, r"install\(\): max_reserved: size must be > 0 \(got 0; allowed: auto, or a size > 0"),
    (1, r"install\(\): max_reserved: must hold at least one chunk \(2MiB, 2097152 bytes\) \(got 1;"),
    (2.5, r"install\(\): max_reserved: a bare decimal number is not a size \(got 2.5.*Write the unit, e.g. '2.5GiB'"),
    ("12 GB", r"install\(\): max_reserved: unknown size unit \(got '12 GB'.*write 12GiB"),
    (True, r"install\(\): max_reserved: not a size \(got True"),
])
def test_install_refuses_a_bad_max_reserved_before_nvml(no_device_calls, value, fragment):
    with pytest.raises(PolicyError, match=fragment):
        um_alloc.install("none", max_reserved=value)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(budget="-1GiB"), r"install\(\): budget: negative size \(got '-1GiB'; allowed: none, a size > 0"),
    (dict(budget=1.5), r"install\(\): budget: fraction out of range \(0, 1\] \(got 1.5"),
    (dict(device=-1), r"install\(\): device: out of range \(got -1; allowed: an integer >= 0\)"),
    (dict(device="cuda:1"), r"install\(\): device: not an integer \(got 'cuda:1'"),
])
def test_install_refuses_other_bad_arguments_before_nvml(no_device_calls, kwargs, fragment):
    with pytest.raises(PolicyError, match=fragment):
        um_alloc.install("none", **kwargs)


def test_the_reserve_cap_rises_above_free_memory_only_with_oversubscribe(fake_device):
    # 70 GiB free, a 2 GiB margin: 68 GiB is the most a shared GPU gives the pool.
    with pytest.raises(PolicyError, match=r"max_reserved 69.0 GiB is more than the device's free memory 70.0 GiB "
                                          r"minus pool.reserve_margin 2.0 GiB = 68.0 GiB.*oversubscribe: true"):
        um_alloc.install("none", max_reserved="69GiB")
    free_for_all = load_policy({"pool": {"oversubscribe": True}})
    assert install_module.reserve_cap(install_module.policy_with_arguments(free_for_all, "69GiB", None),
                                      DEVICE) == 69 * GiB
    assert install_module.reserve_cap(load_policy("none"), DEVICE) == 68 * GiB


def test_max_reserved_above_the_device_is_refused_like_the_policy_key(fake_device):
    with pytest.raises(PolicyError, match=r"pool.max_reserved: larger than device memory \(80.0 GiB"):
        um_alloc.install("none", max_reserved="100GiB")


def test_install_without_a_gpu_speaks_to_library_users(monkeypatch):
    monkeypatch.setattr(install_module, "device_memory", lambda index: None)
    with pytest.raises(RuntimeError) as info:
        um_alloc.install("none")
    message = str(info.value)
    assert "no NVIDIA GPU 0 visible" in message and "leave um_alloc.install() out" in message
    assert "--allocator" not in message


# ---------------------------------------------------------------- the LMS setters
@pytest.mark.parametrize("call, fragment", [
    (lambda: lms.set_limit_lms(-5), r"set_limit_lms\(\): limit: negative size \(got -5"),
    (lambda: lms.set_limit_lms("10 GB"), r"set_limit_lms\(\): limit: unknown size unit \(got '10 GB'"),
    (lambda: lms.set_size_lms(1.5), r"set_size_lms\(\): size: a bare decimal number is not a size \(got 1.5"),
    (lambda: lms.set_enabled_lms("no"), r"set_enabled_lms\(\): enable: expected a boolean \(got 'no'"),
])
def test_lms_setters_check_their_argument_first(call, fragment):
    # Not installed: the argument is refused before the missing installation is noticed.
    with pytest.raises(PolicyError, match=fragment):
        call()


def test_lms_limit_above_the_device_gives_the_figures(monkeypatch):
    monkeypatch.setattr(install_module, "_installation", install_module.Installation(
        load_policy("none"), 0, 68 * GiB, DEVICE.total_bytes, DEVICE.free_bytes, DEVICE.used_bytes))
    with pytest.raises(PolicyError, match=r"set_limit_lms\(\): limit: larger than the device's memory "
                                          r"\(80.0 GiB, 85899345920 bytes\) \(got '96GiB'; allowed: 0 \(no budget\) to 80GiB"):
        lms.set_limit_lms("96GiB")


# ---------------------------------------------------------------- spill_from, the planner, the streamer
@pytest.mark.parametrize("args, fragment", [
    ((torch.nn.Linear(2, 2), 0), r"um_alloc.spill_from: min_size: size must be > 0 \(got 0"),
    ((torch.nn.Linear(2, 2), "256 MB"), r"um_alloc.spill_from: min_size: .*got '256 MB'"),
    (("cls", "256MiB"), r"um_alloc.spill_from: module: not a torch.nn.Module \(got 'cls'"),
])
def test_spill_from_checks_its_arguments_first(args, fragment):
    with pytest.raises(PolicyError, match=fragment):  # um_alloc is not installed: that comes after
        um_alloc.spill_from(*args)


class Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(budget=0), r"BlockPlanner: budget: size must be > 0 \(got 0"),
    (dict(budget="1GiB", hide_fraction=0), r"BlockPlanner: hide_fraction: out of range \(got 0; allowed: a number > 0 and <= 1\)"),
    (dict(budget="1GiB", hide_fraction="most"), r"BlockPlanner: hide_fraction: not a finite number \(got 'most'"),
    (dict(budget="1GiB", margin=-1), r"BlockPlanner: margin: negative size \(got -1"),
    (dict(budget="1GiB", window="1 GB"), r"BlockPlanner: window: .*got '1 GB'"),
    (dict(budget="1GiB", decisions="keep"), r"BlockPlanner: decisions: not a non-empty list of decisions \(got 'keep'"),
    (dict(budget="1GiB", decisions=[]), r"BlockPlanner: decisions: not a non-empty list"),
    (dict(budget="1GiB", block_classes="Linear"), r"BlockPlanner: block_classes: not a list of class names \(got 'Linear'"),
    (dict(budget="1GiB", lean_loss="yes"), r"BlockPlanner: lean_loss: expected a boolean \(got 'yes'"),
])
def test_planner_checks_its_arguments_before_attaching(kwargs, fragment):
    model = Blocks()
    with pytest.raises(PolicyError, match=fragment):
        um_alloc.plan(model, **kwargs)
    assert not model._forward_pre_hooks and not any(m._forward_pre_hooks for m in model.modules())


def test_planner_refuses_what_is_not_a_model():
    with pytest.raises(PolicyError, match=r"BlockPlanner: model: not a torch.nn.Module \(got 'bert'"):
        um_alloc.plan("bert", "1GiB")


def _loss(model, batch):
    return model(batch).mean()


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(micro_batch_size=0), r"MicroBatchStreamer: micro_batch_size: out of range \(got 0; allowed: an integer >= 1\)"),
    (dict(micro_batch_size="Auto"), r"MicroBatchStreamer: micro_batch_size: invalid value \(got 'Auto'; allowed: auto, or"),
    (dict(micro_batch_size=2.0), r"MicroBatchStreamer: micro_batch_size: not an integer \(got 2.0"),
    (dict(max_micro_batch=True), r"MicroBatchStreamer: max_micro_batch: not an integer \(got True"),
    (dict(max_grad_norm=0), r"MicroBatchStreamer: max_grad_norm: out of range \(got 0; allowed: a number > 0\)"),
    (dict(max_grad_norm=float("nan")), r"MicroBatchStreamer: max_grad_norm: not a finite number"),
    (dict(count_fn=3), r"MicroBatchStreamer: count_fn: not callable \(got 3"),
    (dict(autocast_dtype="bf16"), r"MicroBatchStreamer: autocast_dtype: not a torch.dtype \(got 'bf16'"),
    (dict(input_tag="inputs"), r"MicroBatchStreamer: input_tag: invalid value \(got 'inputs'; allowed: parameter"),
    (dict(device="gpu"), r"MicroBatchStreamer: device: not a device \(got 'gpu'"),
])
def test_streamer_checks_its_arguments(kwargs, fragment):
    model = torch.nn.Linear(3, 1)
    with pytest.raises(PolicyError, match=fragment):
        MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, **kwargs)


def test_streamer_refuses_a_loss_that_is_not_a_function():
    model = torch.nn.Linear(3, 1)
    with pytest.raises(PolicyError, match=r"MicroBatchStreamer: loss_fn: not callable \(got 'mse'"):
        MicroBatchStreamer(model, None, "mse")


# ---------------------------------------------------------------- the checks themselves
def test_whole_numbers_are_not_booleans_and_flags_are_not_strings():
    at = At("f()", "n")
    assert arguments.whole_number(3, at, minimum=1, maximum=3) == 3
    with pytest.raises(PolicyError, match=r"f\(\): n: out of range \(got 4; allowed: an integer from 1 to 3\)"):
        arguments.whole_number(4, at, minimum=1, maximum=3)
    with pytest.raises(PolicyError, match="not an integer"):
        arguments.whole_number(False, at)
    assert arguments.flag(False, at) is False
    with pytest.raises(PolicyError, match="Write true or false without quotes"):
        arguments.flag("false", at)
    assert arguments.optional_size(None, at) is None and arguments.size("1.5GiB", at) == 3 * GiB // 2
    assert arguments.number_in(1, at, 0, 1) == 1.0
    with pytest.raises(PolicyError, match=r"allowed: a number >= 0 and < 1"):
        arguments.number_in(1, at, 0, 1, low_open=False, high_open=True)
    assert arguments.size(MiB, at, minimum=MiB) == MiB
