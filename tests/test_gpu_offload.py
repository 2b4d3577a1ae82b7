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


@pytest.mark.parametrize("room_mib", [0, 8])  # offload everything; keep the last 8 MiB
def test_losses_equal_plain_autograd(cuda_device, room_mib):
    from um_alloc.offload import ActivationOffload

    expected = _train(5)
    budget = 1 << 40
    offload = ActivationOffload(budget, margin=0, window="4MiB",  # a short window: on-demand copies too
                                peak_fn=lambda: budget - (room_mib << 20))
    got = _train(5, offload)
    assert got == pytest.approx(expected, rel=1e-6)
    stats = offload.stats
    assert stats.out_bytes > 0 and stats.in_bytes == stats.out_bytes
    # Each GELU's output, saved by the next linear, is rebuilt from the GELU's saved input.
    assert stats.rebuilt_bytes == 6 * 256 * 2048 * 4
    assert stats.kept_bytes == (0 if room_mib == 0 else stats.saved_bytes - stats.out_bytes - stats.rebuilt_bytes)
    if room_mib:
        assert 0 < stats.kept_bytes <= room_mib << 20
