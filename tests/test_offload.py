"""ActivationOffload's logic on the CPU (plain copies; the CUDA path adds streams and events)."""
import contextlib

import pytest
import torch

import um_alloc
from um_alloc.offload import ActivationOffload
from um_alloc.pool import ChunkPool


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh())
                                 for _ in range(4)]).double()


def _grads(model, x, offload=None):
    model.zero_grad(set_to_none=True)
    if offload is None:
        model(x).pow(2).sum().backward()
    else:
        with offload.step():
            model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_gradients_equal_plain_autograd_while_offloading_and_keeping():
    model, x = _model(), torch.randn(32, 16, dtype=torch.float64)
    expected = _grads(model, x)
    sizes = 32 * 16 * 8  # every saved activation here is a 32 x 16 float64 tensor
    offload = ActivationOffload(budget=100 * sizes, margin=0, min_bytes=0, device="cpu",
                                peak_fn=lambda: 97 * sizes)  # room for the last 3
    for step in range(4):
        got = _grads(model, x, offload)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"step {step}"
        if step < 2:  # calibrating: everything eligible moves
            assert offload.stats.offload_all and offload.stats.kept_bytes == 0
        else:
            assert not offload.stats.offload_all and offload.stats.kept_bytes == 3 * sizes
        assert offload.stats.out_bytes == offload.stats.saved_bytes - offload.stats.kept_bytes
        assert offload.stats.in_bytes == offload.stats.out_bytes


def test_backward_lets_go_of_kept_tensors_and_lends_their_bytes_to_the_copies_back(monkeypatch):
    import weakref

    from um_alloc import offload as offload_module

    model, x = _model(), torch.randn(32, 16, dtype=torch.float64)
    sizes = 32 * 16 * 8
    offload = ActivationOffload(budget=100 * sizes, margin=0, min_bytes=0, window=0, device="cpu",
                                peak_fn=lambda: 97 * sizes)  # keeps the last 3
    for _ in range(2):
        _grads(model, x, offload)
    kept, most_in_flight = {}, [0]
    pack, copy_in = offload._pack, offload._copy_in

    def recording_pack(tensor):
        entry = pack(tensor)
        if isinstance(entry, offload_module._Kept):  # once per tensor, however often it is saved
            kept[id(entry)] = weakref.ref(entry.tensor)
        return entry

    def recording_copy_in(packed):
        copy_in(packed)
        most_in_flight[0] = max(most_in_flight[0], offload._inflight)

    monkeypatch.setattr(offload, "_pack", recording_pack)
    monkeypatch.setattr(offload, "_copy_in", recording_copy_in)
    alive_at_the_end = []  # when backward reaches the first layer
    model[0][0].weight.register_hook(lambda g: alive_at_the_end.append(sum(r() is not None for r in kept.values())))
    _grads(model, x, offload)
    assert len(kept) == 3 and offload.stats.kept_bytes == 3 * sizes
    assert alive_at_the_end == [0]  # freed after their last use, not held to the end of the step
    # With a window of 0, one copy back at a time; the kept tensors' bytes make room for both
    # offloaded ones (the input and the first Tanh's output) at once.
    assert offload.stats.out_bytes == 2 * sizes and most_in_flight[0] == 2 * sizes


def test_the_plan_keeps_the_last_tensors_then_spreads_the_rest_of_the_room():
    from um_alloc.offload import choose_kept

    assert choose_kept([1] * 10, room=5, tail=2) == {8, 9} | {2, 5, 7}  # 3 of the first 8, evenly
    assert choose_kept([1] * 10, room=10, tail=2) == set(range(10))     # all fit
    assert choose_kept([1] * 10, room=0, tail=2) == set()
    assert choose_kept([4, 1, 1], room=3, tail=8) == {1, 2}             # the tail stops at the room
    assert choose_kept([1, 1, 6], room=5, tail=1) == {0, 1}             # the last is too big to keep


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_never_keeps_more_than_the_room(seed):
    import random

    from um_alloc.offload import choose_kept

    rng = random.Random(seed)
    sizes = [rng.choice([0, 1, 2, 8, 64]) for _ in range(rng.randint(1, 60))]
    room, tail = rng.randint(0, sum(sizes)), rng.randint(0, 80)
    kept = choose_kept(sizes, room, tail)
    assert sum(sizes[i] for i in kept) <= room
    assert all(0 <= i < len(sizes) for i in kept)


def test_parameters_are_never_offloaded_and_a_tensor_saved_twice_moves_once():
    weight = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.float64))
    x = torch.randn(64, 64, dtype=torch.float64, requires_grad=True)
    offload = ActivationOffload(min_bytes=0, device="cpu")
    with offload.step():
        y = torch.tanh(x @ weight)   # mm saves x (a leaf requiring grad: stays) and weight (stays)
        (y * y).sum().backward()     # y is saved twice by mul (and once by tanh): one copy
    assert offload.stats.saved_bytes == offload.stats.out_bytes == 64 * 64 * 8
    expected_x = (2 * y * (1 - y**2)) @ weight.T
    assert torch.allclose(x.grad, expected_x.detach())


@pytest.mark.parametrize("expanded", [True, False])
def test_a_broadcast_tensor_stays_where_it_is_and_backward_is_exact(expanded):
    x = torch.randn(8, 64, 64, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(1, 64, 64, dtype=torch.float64).expand(8, 64, 64)  # as transformers' masks
    mask = mask if expanded else mask.contiguous()
    offload = ActivationOffload(min_bytes=0, device="cpu")
    with offload.step():
        (x * mask).sum().backward()  # mul saves the mask for x's gradient
    assert offload.stats.out_bytes == (0 if expanded else mask.numel() * 8)
    assert torch.equal(x.grad, mask)


def test_small_tensors_stay():
    model, x = _model(), torch.randn(4, 16, dtype=torch.float64)
    offload = ActivationOffload(min_bytes=4 * 16 * 8 + 1, device="cpu")
    _grads(model, x, offload)
    assert offload.stats.saved_bytes == offload.stats.out_bytes == 0


def test_a_step_unlike_the_first_offloads_everything():
    model = _model()
    offload = ActivationOffload(budget=10**9, margin=0, min_bytes=0, device="cpu", peak_fn=lambda: 0)
    for _ in range(3):
        _grads(model, torch.randn(32, 16, dtype=torch.float64), offload)
    assert offload.stats.kept_bytes == offload.stats.saved_bytes > 0  # all fits: nothing moves
    x = torch.randn(8, 16, dtype=torch.float64)  # other shapes: the plan does not apply
    expected = _grads(model, x)
    got = _grads(model, x, offload)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert offload.stats.kept_bytes == 0 and offload.stats.out_bytes == offload.stats.saved_bytes > 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(budget="1GiB", margin="2GiB"), r"budget: must be larger than the margin \(2GiB\) kept under it \(got '1GiB'"),
    (dict(budget="16GiB"), "on the CPU a budget needs peak_fn"),
    (dict(calibration_steps=0), r"calibration_steps: out of range \(got 0; allowed: an integer >= 1\)"),
    (dict(calibration_steps=1.5), r"calibration_steps: not an integer \(got 1.5"),
    (dict(window=-1), r"window: negative size \(got -1"),
    (dict(budget=0), r"budget: size must be > 0 \(got 0"),
    (dict(min_bytes=2.5), r"min_bytes: a bare decimal number is not a size \(got 2.5"),
    (dict(host_reserve="8 GB"), r"host_reserve: unknown size unit \(got '8 GB'"),
    (dict(rebuild="no"), r"rebuild: expected a boolean \(got 'no'; allowed: true, false\)"),
    (dict(staging=1), r"staging: expected a boolean \(got 1"),
    (dict(peak_fn=5), r"peak_fn: not callable \(got 5"),
    (dict(window="1 GB"), "window"),
    (dict(device="meta"), r"device: not a CUDA device or the CPU \(got 'meta'; allowed: cuda, cuda:N, cpu"),
    (dict(device="gpu0"), r"device: not a CUDA device or the CPU \(got 'gpu0'"),
    (dict(device="cpu", staging=True), "staging needs a CUDA device"),
])
def test_bad_settings_say_what_is_allowed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ActivationOffload(**{"device": "cpu", **kwargs})


def test_from_policy_reads_budget_window_and_min_swap_size(monkeypatch):
    import importlib

    install_module = importlib.import_module("um_alloc.install")  # um_alloc.install is also the function
    offload_module = importlib.import_module("um_alloc.offload")
    from um_alloc.policy import policy_from_dict

    assert offload_module.from_policy() is None  # nothing installed

    def installed(scheduler):
        policy = policy_from_dict({"scheduler": scheduler}, source="p.yaml", name="p")
        monkeypatch.setattr(install_module, "_installation", install_module.Installation(
            policy, 0, 2**40, device_total=64 * 2**30, device_free_at_install=0, device_used_at_install=0))

    installed({"budget": 0.25, "evict_live": False, "offload_activations": True,
               "schedule_window": "256MiB", "min_swap_size": "4MiB"})
    made = offload_module.from_policy(device="cpu", peak_fn=lambda: 0)
    assert (made.budget, made.window, made.min_bytes) == (16 * 2**30, 256 * 2**20, 4 * 2**20)
    installed({"budget": "8GiB", "evict_live": False, "offload_activations": True})
    assert offload_module.from_policy(device="cpu", peak_fn=lambda: 0).window == offload_module.DEFAULT_WINDOW
    installed({"budget": "8GiB", "evict_live": False})               # no offload asked
    assert offload_module.from_policy(device="cpu", peak_fn=lambda: 0) is None
    installed({"evict_live": False, "offload_activations": True})    # no budget: nothing to size it to
    assert offload_module.from_policy(device="cpu", peak_fn=lambda: 0) is None
    with _host_pool_as_the_device_pool(monkeypatch):  # set_limit_lms reaches what from_policy reads
        um_alloc.set_limit_lms("4GiB")
        assert offload_module.from_policy(device="cpu", peak_fn=lambda: 0).budget == 4 * 2**30
        installed({"budget": "8GiB", "offload_activations": True})    # hard by default
        um_alloc.set_limit_lms(0)                                     # no budget: nothing to size it to
        assert offload_module.from_policy(device="cpu", peak_fn=lambda: 0) is None


@contextlib.contextmanager
def _host_pool_as_the_device_pool(monkeypatch):
    """A pool over host memory stands in for the installed device's, so the budget controls run here."""
    pool = ChunkPool.host(2 << 20, 16 << 20)
    monkeypatch.setattr(ChunkPool, "for_device", classmethod(lambda cls, device: pool))
    try:
        yield pool
    finally:
        pool.close()


def test_a_failed_step_lets_go_of_its_tensors_and_the_next_one_trains():
    model, x = _model(), torch.randn(32, 16, dtype=torch.float64)
    expected = _grads(model, x)
    offload = ActivationOffload(min_bytes=0, device="cpu")
    with pytest.raises(torch.OutOfMemoryError):
        with offload.step():
            model(x).pow(2).sum()
            raise torch.OutOfMemoryError("as the allocator would raise it")
    assert not offload._seen and not offload._offloaded and offload._steps == 0
    got = _grads(model, x, offload)
    assert all(torch.equal(g, e) for g, e in zip(got, expected)) and offload._steps == 1


def test_copies_out_stop_with_an_out_of_memory_error_before_host_memory_runs_out(monkeypatch):
    model, x = _model(), torch.randn(32, 16, dtype=torch.float64)
    expected = _grads(model, x)
    monkeypatch.setattr("um_alloc.offload.HOST_CHECK_EVERY", 1)  # look at every copy
    available = [10 << 30]
    monkeypatch.setattr("um_alloc.offload.host_available", lambda: available[0])
    offload = ActivationOffload(min_bytes=0, device="cpu", host_reserve="9GiB")
    got = _grads(model, x, offload)  # 10 GiB available: every copy leaves more than 9
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    available[0] = 9 << 30  # a copy would leave less than the reserve
    with pytest.raises(torch.OutOfMemoryError, match=r"host memory is running out: 9\.0 GiB available"):
        _grads(model, x, offload)
    assert not offload._offloaded and offload._steps == 1  # let go of; the failed step is not counted


def test_host_available_reads_memavailable(tmp_path):
    from um_alloc.offload import host_available

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:         1000 kB\nMemAvailable:   2048 kB\n")
    assert host_available(str(meminfo)) == 2048 * 1024
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert host_available(str(meminfo)) is None and host_available(str(tmp_path / "absent")) is None


class _Block(torch.nn.Module):
    """LayerNorm -> linear -> GELU -> linear, plus a view and a cast of saved tensors."""

    def __init__(self, width=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        a = self.up(self.norm(x))          # LayerNorm saves x; up saves the LayerNorm's output
        g = torch.nn.functional.gelu(a)    # saves a
        y = torch.exp(a)                   # saves its output y
        side = torch.sin(a.view(-1, 4, a.shape[-1] // 4).transpose(0, 1))  # saves a view of a
        side2 = torch.sin(y.to(torch.float64))                                # saves a cast of y
        return x + self.down(g) + side.transpose(0, 1).reshape(a.shape).mean() + side2.float().mean()


def _block_grads(model, x, offload=None, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    return _grads(model, x, offload)


def test_what_backward_can_rebuild_does_not_move_and_gradients_stay_exact():
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(_Block(), _Block()), torch.randn(8, 16)
    expected = _grads(model, x)
    offload = ActivationOffload(min_bytes=0, device="cpu")
    for step in range(4):
        got = _grads(model, x, offload)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"step {step}"
        stats = offload.stats
        assert stats.in_bytes == stats.out_bytes == stats.saved_bytes - stats.rebuilt_bytes
    # Per block: the LayerNorm's output, the GELU's output (8 x 16 and 8 x 64 float32), the view
    # of a (8 x 64 float32) and the cast of y (8 x 64 float64).
    assert offload.stats.rebuilt_bytes == 2 * (8 * 16 * 4 + 8 * 64 * 4 + 8 * 64 * 4 + 8 * 64 * 8)


def test_a_recipe_that_does_not_rebuild_equal_keeps_moving(monkeypatch, caplog):
    from um_alloc import rebuild

    caplog.set_level("INFO", logger="um_alloc.offload")
    monkeypatch.setattr(rebuild, "CHEAP_FUNCTIONS", {torch.nn.functional.dropout})  # random: never equal

    class Dropped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            a = self.lin(x)
            return self.lin(torch.nn.functional.dropout(torch.tanh(a), 0.5)) + a  # tanh saves its output

    torch.manual_seed(0)
    model, x = Dropped(), torch.randn(8, 16)
    offload = ActivationOffload(min_bytes=0, device="cpu")
    for step in range(4):
        expected = _block_grads(model, x, seed=step)
        got = _block_grads(model, x, offload, seed=step)
        assert all(torch.equal(g, e) for g, e in zip(got, expected)), f"step {step}"
        assert offload.stats.rebuilt_bytes == 0 and offload.stats.out_bytes == offload.stats.saved_bytes
    assert "does not rebuild equal; it will move" in caplog.text  # the dropout's output was tried


def test_rebuild_off_moves_everything():
    torch.manual_seed(0)
    model, x = _Block(), torch.randn(8, 16)
    offload = ActivationOffload(min_bytes=0, device="cpu", rebuild=False)
    for _ in range(3):
        _grads(model, x, offload)
    assert offload.stats.rebuilt_bytes == 0 and offload.stats.out_bytes == offload.stats.saved_bytes > 0


def test_a_step_unlike_the_first_rebuilds_nothing_and_stays_exact():
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(), _Block())
    offload = ActivationOffload(min_bytes=0, device="cpu")
    for _ in range(3):
        _grads(model, torch.randn(8, 16), offload)
    assert offload.stats.rebuilt_bytes > 0
    x = torch.randn(5, 16)  # other shapes: the verified recipes do not apply
    expected = _grads(model, x)
    got = _grads(model, x, offload)
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert offload.stats.rebuilt_bytes == 0 and offload.stats.out_bytes == offload.stats.saved_bytes


def test_a_parameter_changed_between_forward_and_backward_is_an_error_not_a_wrong_gradient():
    torch.manual_seed(0)
    linear = torch.nn.Linear(16, 16)
    offload = ActivationOffload(min_bytes=0, device="cpu")
    with pytest.raises(RuntimeError, match="modified in place between forward and backward"):
        with offload.step():
            y = torch.sin(linear.weight.to(torch.float64).t())  # saves a view of a cast of the weight
            with torch.no_grad():
                linear.weight.add_(1.0)
            y.sum().backward()


def test_views_of_a_cast_of_a_view_are_not_rebuilt():
    from um_alloc.rebuild import RootRecorder

    recorder = RootRecorder(lambda tensor: None, "cpu")
    weight = torch.nn.Parameter(torch.randn(4, 6))
    assert recorder.recipe_for(weight.to(torch.float64).t()) is not None       # view of a cast of a root
    assert recorder.recipe_for(weight.t().to(torch.float64).t()) is None       # the cast read a view
    assert recorder.recipe_for(weight[:2].to(torch.float64)) is None           # a slice: not the root's storage


def test_copy_rates_are_each_directions_bytes_over_its_copying_time():
    from um_alloc.offload import copy_rates
    copies = [("out", 0.002, 100 << 20), ("out", 0.001, 28 << 20), ("in", 0.004, 100 << 20)]
    out, back = copy_rates(copies)
    assert out == pytest.approx((128 << 20) / 0.003) and back == pytest.approx((100 << 20) / 0.004)
    assert copy_rates([("out", 0.001, 1 << 20)])[1] == float("inf")  # nothing came back


def test_the_low_water_of_copies_back_ahead_of_use_is_what_stayed_on_the_device_all_along():
    """The planner's calibration reads it at each mark: the bytes of copies back that a stretch of
    backward held all through, which a plan that moves less does not have."""
    offload = ActivationOffload(None, window=3 * 64, min_bytes=0, device="cpu", rebuild=False)
    offload.begin_step()
    entries = [offload.stash(torch.full((16,), float(i))) for i in range(4)]  # 64 bytes each
    assert offload.ahead_low_water() == 0                  # forward: nothing copied back
    offload.copy_ahead()                                   # backward: the last three come back
    assert offload.ahead_low_water() == 0                  # this stretch began with none
    assert offload.ahead_low_water() == 3 * 64             # the next one holds the three all through
    assert torch.equal(offload.unpack(entries[3]), torch.full((16,), 3.0))  # used: its bytes are autograd's
    assert offload.ahead_low_water() == 2 * 64
    offload.unpack(entries[2])                             # the first comes back, then the third is used
    assert offload.ahead_low_water() == 2 * 64
    for i in (1, 0):
        offload.unpack(entries[i])
    assert offload.ahead_low_water() == 0
    offload.end_step()


def test_a_copy_back_starts_as_soon_as_the_one_before_it_is_used_within_the_window():
    """A recomputed block reads its moved input once, then reruns and runs its backward with
    nothing more to unpack. The next input's copy starts then, under that compute, not when the
    next block asks for it; one larger than the window waits for a block to ask."""
    offload = ActivationOffload(None, window=2 * 64, min_bytes=0, device="cpu", rebuild=False)
    offload.begin_step()
    sizes = (16, 48, 16, 16)  # float32 elements: 64, 192 (larger than the window), 64, 64 bytes
    entries = [offload.stash(torch.full((n,), float(i))) for i, n in enumerate(sizes)]
    offload.copy_ahead()                                    # backward reaches the last block
    assert [e.gpu is not None for e in entries] == [False, False, True, True]
    offload.unpack(entries[3])
    offload.unpack(entries[2])                              # none in flight now
    assert entries[1].gpu is None                           # too large for the window: not yet
    assert torch.equal(offload.unpack(entries[1]), torch.full((48,), 1.0))  # asked for: it comes
    assert entries[0].gpu is not None                       # and the next one follows at once
    assert offload.stats.on_demand == 0
    offload.unpack(entries[0])
    offload.end_step()


def test_a_slice_of_a_larger_tensor_comes_back_with_its_dimensions_in_the_same_order():
    """A tensor that is not dense (here a slice, transposed) is copied dense, its dimensions in
    the order of their strides, as torch.clone lays it out: a matmul in backward reads it
    transposed as it did, and adds in the same order. Copied row-major instead, Mamba's scan
    trained 7e-18 away from plain autograd in float64."""
    class Times(torch.autograd.Function):  # weight * part, keeping what backward read
        @staticmethod
        def forward(ctx, weight, part):
            ctx.save_for_backward(part)
            return weight * part

        @staticmethod
        def backward(ctx, grad):
            (part,) = ctx.saved_tensors
            read.append(part)
            return grad * part, None

    torch.manual_seed(0)
    fused = torch.randn(48, 96, dtype=torch.float64)
    weight = torch.randn(32, 48, dtype=torch.float64, requires_grad=True)
    part = fused[:, :32].t()                       # (32, 48), strides (1, 96): not dense
    read = []
    offload = ActivationOffload(min_bytes=0, device="cpu")
    with offload.step():
        Times.apply(weight, part).sum().backward()
    assert offload.stats.out_bytes == 32 * 48 * 8
    assert torch.equal(read[0], part)
    assert read[0].stride() == torch.empty_like(part).stride() == (1, 32)  # column-major, as `part` reads


def test_a_copy_to_the_host_reads_a_source_in_the_hosts_own_layout():
    from um_alloc.offload import _laid_out_as

    part = torch.randn(48, 96)[:, :32].t()          # not dense
    host = torch.empty_strided(part.shape, torch.empty_like(part).stride())
    source = _laid_out_as(part, host)
    assert source.stride() == host.stride() and torch.equal(source, part)
    dense = torch.randn(32, 48)
    assert _laid_out_as(dense, torch.empty_like(dense)) is dense  # the same layout: no copy


def test_a_measuring_step_that_did_not_finish_leaves_no_copy_timed():
    """The planner stops the timing of a measuring step that ran out of memory: the steps after it
    record no events, and nothing of it is read as a rate or a stall."""
    from um_alloc.offload import ActivationOffload

    offload = ActivationOffload(min_bytes=0, device="cpu")
    offload.time_copies()
    offload.stop_timing()
    assert offload.copy_rates() is None and offload.copy_stalls_s() is None
