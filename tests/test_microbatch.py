"""Micro-batch streaming equals full-batch training (CPU, float64), validates input, finds sizes."""

import copy
import logging
import math
from collections import namedtuple

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from um_alloc.microbatch import (MicroBatchStreamer, batch_size_of, find_micro_batch_size, shape_signature,
                                 split_batch)

RTOL = 1e-10


@pytest.fixture(autouse=True)
def _float64():
    """Every model and batch here is float64, so micro-batch and full-batch results agree to 1e-10."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)



# --- models and losses -------------------------------------------------------------------------

def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def regression_batch(n=10):
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n, 5, generator=generator), torch.randn(n, 3, generator=generator)


def tuple_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)  # mean over samples x 3 outputs: a per-sample mean, counted by samples


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.reg, self.cls = nn.Linear(5, 8), nn.Linear(8, 2), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.reg(h), self.cls(h)


def two_head_loss(model, batch):
    value, logits = model(batch["x"])
    return F.mse_loss(value, batch["target"]) + F.cross_entropy(logits, batch["label"])


class Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(20, 6), nn.Linear(6, 20)

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids)))


def token_loss(model, batch):  # mean over the labelled tokens, like BERT's MLM loss
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def count_tokens(batch):
    return int((batch["labels"] != -100).sum())


def token_batch(n=10, length=7):
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 20, (n, length), generator=generator)
    keep = torch.rand(n, length, generator=generator) < torch.linspace(0.1, 0.9, n)[:, None]
    keep[:, 0] = True  # every row has at least one label, rows have very different counts
    return {"ids": ids, "labels": ids.masked_fill(~keep, -100)}


def full_batch_grads(model, loss_fn, batch):
    reference = copy.deepcopy(model)
    loss = loss_fn(reference, batch)
    loss.backward()
    return loss.item(), [p.grad for p in reference.parameters()]


def assert_close(actual, expected):
    """Within 1e-10 of the tensor's scale: summation order differs, so an element that cancels to
    nearly zero may differ by more than 1e-10 of itself."""
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * expected.abs().max().item())


# --- exactness -----------------------------------------------------------------------------------

@pytest.mark.parametrize("make_model, loss_fn, make_batch, count_fn", [
    (mlp, tuple_loss, regression_batch, None),
    (mlp, lambda m, b: tuple_loss(m, (b["x"], b["y"])), lambda: dict(zip("xy", regression_batch())), None),
    (TwoHeads, two_head_loss,
     lambda: {"x": regression_batch()[0], "target": regression_batch()[1][:, :2],
              "label": torch.arange(10) % 4}, None),
    (Tokens, token_loss, token_batch, count_tokens),
], ids=["tuple", "dict", "two-outputs", "token-mean"])
@pytest.mark.parametrize("size", [3, 4, 10, 1])
def test_accumulated_gradient_equals_full_batch(make_model, loss_fn, make_batch, count_fn, size):
    model, batch = make_model(), make_batch()
    expected_loss, expected = full_batch_grads(model, loss_fn, batch)
    streamer = MicroBatchStreamer(model, None, loss_fn, micro_batch_size=size, count_fn=count_fn)
    loss = streamer.accumulate(batch)
    assert streamer.last_micro_batch_size == size
    assert loss == pytest.approx(expected_loss, rel=RTOL)
    for param, grad in zip(model.parameters(), expected):
        assert_close(param.grad, grad)


def test_token_mean_needs_counts_not_micro_batch_count():
    """Weighting by 1 / (number of micro-batches), as in the paper, is wrong for uneven token counts."""
    model, batch = Tokens(), token_batch()
    expected_loss, _ = full_batch_grads(model, token_loss, batch)
    by_samples = MicroBatchStreamer(model, None, token_loss, micro_batch_size=3).accumulate(batch)
    by_tokens = MicroBatchStreamer(model, None, token_loss, micro_batch_size=3,
                                   count_fn=count_tokens).accumulate(batch)
    assert by_tokens == pytest.approx(expected_loss, rel=RTOL)
    assert abs(by_samples - expected_loss) > 1e-3


def test_step_updates_like_full_batch_adamw():
    model, batch = mlp(), regression_batch()
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    streamer = MicroBatchStreamer(model, optimizer, tuple_loss, micro_batch_size=3)
    for _ in range(3):
        ref_optimizer.zero_grad()
        expected = tuple_loss(reference, batch)
        expected.backward()
        ref_optimizer.step()
        assert streamer.step(batch) == pytest.approx(expected.item(), rel=RTOL)
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert_close(param, ref)


def test_grad_scaler_scales_per_micro_batch_and_steps_once():
    model, batch = mlp(), regression_batch()
    reference = copy.deepcopy(model)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    tuple_loss(reference, batch).backward()
    ref_optimizer.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    streamer = MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=0.5), tuple_loss,
                                  micro_batch_size=3, scaler=scaler)
    streamer.step(batch)
    # scaling by a power of two is exact, so the update equals the unscaled full-batch one
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert_close(param, ref)
    assert scaler.get_scale() == 2.0**11  # update() ran once for the mini-batch (growth_interval=1)


def test_clipping_sees_the_unscaled_mini_batch_gradient():
    model, batch = mlp(), regression_batch()
    reference = copy.deepcopy(model)
    tuple_loss(reference, batch).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    assert norm > 0.01
    torch.optim.SGD(reference.parameters(), lr=1.0).step()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    streamer = MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=1.0), tuple_loss,
                                  micro_batch_size=4, scaler=scaler, max_grad_norm=0.01)
    streamer.step(batch)
    for param, ref in zip(model.parameters(), reference.parameters()):
        assert_close(param, ref)


def test_micro_batch_larger_than_the_batch_is_clamped():
    model, batch = mlp(), regression_batch(4)
    streamer = MicroBatchStreamer(model, None, tuple_loss, micro_batch_size=64)
    streamer.accumulate(batch)
    assert streamer.last_micro_batch_size == 4


def test_mini_batch_without_counted_items_is_skipped():
    model, batch = Tokens(), token_batch()
    batch["labels"].fill_(-100)
    before = [p.detach().clone() for p in model.parameters()]
    streamer = MicroBatchStreamer(model, torch.optim.SGD(model.parameters(), lr=1.0), token_loss,
                                  micro_batch_size=3, count_fn=count_tokens)
    with pytest.warns(RuntimeWarning, match="no counted items"):
        assert math.isnan(streamer.step(batch))
    for param, old in zip(model.parameters(), before):
        assert torch.equal(param, old)


# --- splitting and validation -----------------------------------------------------------------------

def test_split_keeps_containers_and_sizes():
    Pair = namedtuple("Pair", "x y")
    x, y = regression_batch()
    parts = split_batch({"pair": Pair(x, y), "list": [x]}, 4)
    assert [batch_size_of(part) for part in parts] == [4, 4, 2]
    assert isinstance(parts[0]["pair"], Pair) and isinstance(parts[0]["list"], list)
    assert torch.equal(torch.cat([part["pair"].y for part in parts]), y)


@pytest.mark.parametrize("batch, size, error, words", [
    (torch.empty(0, 3), 2, ValueError, ["empty", "0"]),
    ({"x": torch.zeros(10, 2), "y": torch.zeros(9)}, 2, ValueError, ["10", "9", "'x'", "'y'"]),
    (torch.zeros(10, 2), 0, ValueError, ["micro_batch_size", "0"]),
    (torch.zeros(10, 2), -3, ValueError, ["-3"]),
    (torch.zeros(10, 2), 2.5, ValueError, ["2.5"]),
    ({"x": torch.zeros(4), "text": ["a", "b", "c", "d"]}, 2, TypeError, ["batch['text'][0]", "str"]),
    ({}, 2, ValueError, ["no tensors"]),
    (torch.tensor(3.0), 1, ValueError, ["0-dim"]),
])
def test_bad_batches_are_rejected_with_numbers(batch, size, error, words):
    with pytest.raises(error) as info:
        split_batch(batch, size)
    for word in words:
        assert word in str(info.value)


def test_bad_streamer_arguments():
    with pytest.raises(ValueError, match="got 0"):
        MicroBatchStreamer(mlp(), None, tuple_loss, micro_batch_size=0)
    with pytest.raises(ValueError, match="'half'"):
        MicroBatchStreamer(mlp(), None, tuple_loss, micro_batch_size="half")
    streamer = MicroBatchStreamer(mlp(), None, lambda m, b: F.mse_loss(m(b[0]), b[1], reduction="none"),
                                  micro_batch_size=5)
    with pytest.raises(ValueError, match=r"0-dim tensor.*\(5, 3\)"):
        streamer.accumulate(regression_batch())
    streamer = MicroBatchStreamer(mlp(), None, tuple_loss, micro_batch_size=5, count_fn=lambda b: -2)
    with pytest.raises(ValueError, match="-2"):
        streamer.accumulate(regression_batch())
    with pytest.raises(RuntimeError, match="optimizer"):
        MicroBatchStreamer(mlp(), None, tuple_loss, micro_batch_size=5).step(regression_batch())


# --- finding the size ----------------------------------------------------------------------------

class FakeMemory:
    """Runs out of memory above ``threshold`` samples per micro-batch; records every probe."""

    def __init__(self, threshold):
        self.threshold, self.probes = threshold, []

    def __call__(self, micro):
        size = batch_size_of(micro)
        self.probes.append(size)
        if size > self.threshold:
            raise torch.OutOfMemoryError(f"fake: {size} > {self.threshold}")


@pytest.mark.parametrize("threshold", [1, 2, 5, 37, 63, 64, 100])
def test_search_finds_exactly_the_threshold(threshold, caplog):
    run = FakeMemory(threshold)
    batch = torch.zeros(100, 3)
    with caplog.at_level(logging.INFO, logger="um_alloc.microbatch"):
        assert find_micro_batch_size(run, batch) == threshold
    assert run.probes[0] == 100
    assert len(run.probes) <= 2 * math.ceil(math.log2(100)) + 1
    assert len([r for r in caplog.records if "micro-batch probe" in r.message]) == len(run.probes)


def test_search_respects_start_and_caches_per_shape():
    run, cache = FakeMemory(13), {}
    assert find_micro_batch_size(run, torch.zeros(64, 3), start=40, cache=cache) == 13
    assert max(run.probes) == 40
    run.probes.clear()
    assert find_micro_batch_size(run, torch.zeros(50, 3), start=40, cache=cache) == 13  # other dim 0
    assert run.probes == []
    assert find_micro_batch_size(run, torch.zeros(64, 4), cache=cache) == 13  # other shape: probed
    assert run.probes
    assert set(cache) == {shape_signature(torch.zeros(1, 3)), shape_signature(torch.zeros(1, 4))}
    run.probes.clear()
    assert find_micro_batch_size(run, torch.zeros(64, 3, dtype=torch.float32), cache=cache) == 13  # other dtype
    assert run.probes


def test_search_grows_past_a_batch_that_fitted_whole():
    run, cache = FakeMemory(30), {}
    assert find_micro_batch_size(run, torch.zeros(8, 2), cache=cache) == 8
    assert find_micro_batch_size(run, torch.zeros(100, 2), cache=cache) == 30


def test_search_raises_when_one_sample_does_not_fit():
    with pytest.raises(torch.OutOfMemoryError, match="not even 1 sample"):
        find_micro_batch_size(FakeMemory(0), torch.zeros(16, 2))


class OomAbove(nn.Module):
    """Wraps a model; raises OutOfMemoryError for inputs above ``threshold`` samples."""

    def __init__(self, inner, threshold):
        super().__init__()
        self.inner, self.threshold, self.sizes = inner, threshold, []

    def forward(self, x):
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.threshold:
            raise torch.OutOfMemoryError("fake")
        return self.inner(x)


def test_auto_streams_exactly_and_searches_again_when_memory_shrinks():
    model, batch = OomAbove(mlp(), threshold=4), regression_batch(10)
    streamer = MicroBatchStreamer(model, None, tuple_loss, micro_batch_size="auto")
    expected_loss, expected = full_batch_grads(model.inner, tuple_loss, batch)
    assert streamer.accumulate(batch) == pytest.approx(expected_loss, rel=RTOL)
    assert streamer.last_micro_batch_size == 4
    model.threshold = 2  # e.g. optimizer state appeared after the first step
    assert streamer.accumulate(batch) == pytest.approx(expected_loss, rel=RTOL)
    assert streamer.last_micro_batch_size == 2
    for param, grad in zip(model.inner.parameters(), expected):
        assert_close(param.grad, grad)


def test_fixed_size_out_of_memory_says_which_size():
    streamer = MicroBatchStreamer(OomAbove(mlp(), threshold=2), None, tuple_loss, micro_batch_size=5)
    with pytest.raises(torch.OutOfMemoryError) as info:
        streamer.accumulate(regression_batch(10))
    assert "micro-batch of 5 samples" in "".join(getattr(info.value, "__notes__", []))


def test_probing_leaves_buffers_and_rng_untouched():
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 3))
    model = OomAbove(inner, threshold=3)
    streamer = MicroBatchStreamer(model, None, tuple_loss, micro_batch_size="auto")
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    assert streamer.resolve_micro_batch_size(regression_batch(10)) == 3
    assert len(model.sizes) > 1  # it did probe
    assert all(torch.equal(b, old) for b, old in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
