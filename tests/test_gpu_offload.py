"""ActivationOffload on a GPU: the same losses as plain autograd, offloading all and keeping a tail.

    python -m pytest -q -m gpu tests/test_gpu_offload.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu


def _train(steps, offload=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(),
                                                      torch.nn.Linear(2048, 512)) for _ in range(6)]).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(256, 512, generator=data).cuda()
        with offload.step() if offload else torch.enable_grad():
            loss = model(x).pow(2).mean()
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("staging", [False, True])  # copies direct, or through device stages
@pytest.mark.parametrize("room_mib", [0, 8])  # offload everything; keep the last 8 MiB
def test_losses_equal_plain_autograd(cuda_device, room_mib, staging):
    from um_alloc.offload import STAGE_BYTES, ActivationOffload

    expected = _train(5)
    budget = 1 << 40
    staged = STAGE_BYTES if staging else 0  # the plan keeps the stages' bytes free
    offload = ActivationOffload(budget, margin=0, window="4MiB",  # a short window: on-demand copies too
                                peak_fn=lambda: budget - (room_mib << 20) - staged, staging=staging)
    got = _train(5, offload)
    assert got == pytest.approx(expected, rel=1e-6)
    stats = offload.stats
    assert stats.out_bytes > 0 and stats.in_bytes == stats.out_bytes
    # Each GELU's output, saved by the next linear, is rebuilt from the GELU's saved input.
    assert stats.rebuilt_bytes == 6 * 256 * 2048 * 4
    assert stats.kept_bytes == (0 if room_mib == 0 else stats.saved_bytes - stats.out_bytes - stats.rebuilt_bytes)
    if room_mib:
        assert 0 < stats.kept_bytes <= room_mib << 20


@pytest.mark.parametrize("slots, fill_stream", [(1, False), (3, True)])
def test_a_stage_moves_every_byte_both_ways_in_slices(cuda_device, slots, fill_stream):
    from um_alloc.staging import DeviceStage

    stage = DeviceStage(1 << 20, torch.device("cuda"), slots=slots)
    n = (9 << 19) + 3  # 4.5 MiB and 3 bytes: whole slices, a short one, every slot reused
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)).cuda()
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(n, dtype=torch.uint8, device="cuda")
    side, fill = torch.cuda.Stream(), torch.cuda.Stream() if fill_stream else None
    side.wait_stream(torch.cuda.current_stream())
    if fill:
        fill.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        stage.to_host(data, host, fill_stream=fill)
        stage.from_host(host, back)
    torch.cuda.synchronize()
    assert torch.equal(host, data.cpu()) and torch.equal(back, data)
    stage.close()


def test_a_copys_timing_leaves_out_the_wait_for_the_tensor_it_copies(cuda_device):
    """The rate plans are costed at comes from these timings: a copy queued while the GPU is still
    making its tensor must not count that time as the link's."""
    from um_alloc.offload import STAGE_BYTES, ActivationOffload
    from um_alloc.planner.record import link_rate

    budget = 1 << 40
    offload = ActivationOffload(budget, margin=0, peak_fn=lambda: budget - STAGE_BYTES, staging=True)
    weight = torch.randn(16 << 20, device="cuda", requires_grad=True)  # 64 MiB
    offload.time_copies()
    with offload.step():
        torch.cuda._sleep(200_000_000)        # about 0.1 s of GPU time before the saved tensor is made
        saved = torch.randn(16 << 20, device="cuda")
        (weight * saved).sum().backward()    # mul saves `saved`, which goes out and comes back
    out_rate, in_rate = offload.copy_rates()
    assert offload.stats.out_bytes == 64 << 20
    link = link_rate(torch.device("cuda"))
    # At the link's rate the copy takes about 1.3 ms; counted from before the sleep, about 100 ms.
    assert out_rate > link / 4, f"copies out timed at {out_rate / 1e9:.1f} GB/s, the link at {link / 1e9:.1f}"
    assert in_rate > link / 4, f"copies back timed at {in_rate / 1e9:.1f} GB/s, the link at {link / 1e9:.1f}"


def test_the_wait_for_a_copy_back_that_backward_needs_at_once_is_timed_as_a_stall(cuda_device):
    """The planner's base step leaves out what the measured step's GPU stood waiting for copies
    back: a backward whose first need is a tensor in host memory waits about the copy's length."""
    from um_alloc.offload import STAGE_BYTES, ActivationOffload
    from um_alloc.planner.record import link_rate

    budget = 1 << 40
    offload = ActivationOffload(budget, margin=0, peak_fn=lambda: budget - STAGE_BYTES, staging=True)
    weight = torch.randn(64 << 20, device="cuda", requires_grad=True)  # 256 MiB
    offload.time_copies()
    with offload.step():
        saved = torch.randn(64 << 20, device="cuda")
        (weight * saved).sum().backward()    # the mul's backward reads `saved` first thing
    copied_s = (256 << 20) / link_rate(torch.device("cuda"))
    offload.copy_rates()
    stalled = offload.copy_stalls_s()
    assert stalled is not None and stalled > copied_s / 4, \
        f"stood {1e3 * stalled:.2f} ms for a copy of about {1e3 * copied_s:.2f} ms at the link's rate"
    assert offload.copy_stalls_s() is None  # read once; untimed from here


@pytest.mark.parametrize("staging", [False, True])
def test_a_slice_of_a_larger_tensor_moves_in_its_own_order_and_backward_is_exact(cuda_device, staging):
    """A saved tensor that is not dense goes to pinned memory laid out as torch.clone lays it out
    (copied into that layout on the GPU first, so the copy to the host needs no pageable buffer),
    and backward reads it back as it read the original: the same gradient, bit for bit."""
    from um_alloc.offload import STAGE_BYTES, ActivationOffload

    torch.manual_seed(0)
    fused = torch.randn(1024, 3072, device="cuda")
    weight = torch.randn(256, 512, device="cuda", requires_grad=True)
    part = fused[:, 1024:1536].t()                 # (512, 1024), strides (1, 3072): not dense, column-major

    def gradient(offload=None):
        weight.grad = None
        with offload.step() if offload else torch.enable_grad():
            (weight @ part).sum().backward()       # mm saves `part` for weight's gradient
        return weight.grad.clone()

    budget = 1 << 40
    reserved = STAGE_BYTES if staging else 0
    offload = ActivationOffload(budget, margin=0, peak_fn=lambda: budget - reserved, staging=staging)
    assert torch.equal(gradient(offload), gradient())
    assert offload.stats.out_bytes == 512 * 1024 * 4
