"""The chunked cross-entropy: PyTorch's result bit for bit where it applies, PyTorch's own call
everywhere else, and inside a planned model's forward without changes to the model."""
import functools
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers

from test_planner_replay import Fixed, decisions_for, gradients, tiny_bert
from um_alloc.planner import Decision, find_units
from um_alloc.planner.lean_loss import ALIGN_BYTES, LeanLoss, _Rows, applies, chunked_cross_entropy
from um_alloc.planner.replay import Runtime


def logits_and_target(dtype, rows=300, classes=211):
    torch.manual_seed(0)
    logits = (3 * torch.randn(rows, classes, dtype=dtype)).requires_grad_()
    target = torch.randint(0, classes, (rows,))
    target[::7] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_chunked_loss_and_gradient_equal_pytorchs_bit_for_bit(dtype, reduction):
    logits, target = logits_and_target(dtype)
    plain = F.cross_entropy(logits, target, reduction=reduction)
    plain_grad, = torch.autograd.grad(plain, logits)
    chunk = 40 * logits.size(1) * logits.element_size()  # 40 rows a chunk, the last one short
    chunked = chunked_cross_entropy(logits, target, reduction=reduction, chunk_bytes=chunk)
    chunked_grad, = torch.autograd.grad(chunked, logits)
    assert torch.equal(plain, chunked)
    assert torch.equal(plain_grad, chunked_grad)


@pytest.mark.parametrize("matches", [True, False], ids=["subtracted", "log_softmax_again"])
def test_backward_makes_log_probabilities_by_subtraction_where_that_matches(monkeypatch, matches):
    """Backward makes the log-probabilities from each row's largest logit and log(sum), where a
    process's first comparison found that equal to log-softmax; elsewhere it runs log-softmax again.
    Both give PyTorch's gradient bit for bit."""
    from um_alloc.planner import lean_loss
    monkeypatch.setattr(lean_loss, "_SUBTRACTION_MATCHES", {} if matches else
                        {("cpu", torch.bfloat16, torch.float32, 211): False})
    logits, target = logits_and_target(torch.bfloat16)
    plain = F.cross_entropy(logits.float(), target)
    plain_grad, = torch.autograd.grad(plain, logits)
    chunked = chunked_cross_entropy(logits, target, dtype=torch.float32, upcast=logits.float(),
                                    chunk_bytes=40 * 211 * 4)
    calls = []
    log_softmax = F.log_softmax
    monkeypatch.setattr(F, "log_softmax", lambda *a, **k: calls.append(1) or log_softmax(*a, **k))
    chunked_grad, = torch.autograd.grad(chunked, logits)
    assert torch.equal(plain, chunked) and torch.equal(plain_grad, chunked_grad)
    assert len(calls) == (0 if matches else 8)  # 300 rows, 40 a chunk
    assert lean_loss._SUBTRACTION_MATCHES == {("cpu", torch.bfloat16, torch.float32, 211): matches}


def test_a_gradient_with_a_graph_of_its_own_is_pytorchs_and_so_is_its_derivative():
    """create_graph=True (a gradient penalty): backward runs log-softmax again, whose graph is the
    right one, not the subtractions from forward's constants."""
    logits, target = logits_and_target(torch.float64)
    out = []
    for loss_of in (F.cross_entropy, functools.partial(chunked_cross_entropy, chunk_bytes=40 * 211 * 8)):
        grad, = torch.autograd.grad(loss_of(logits, target), logits, create_graph=True)
        out.append((grad, torch.autograd.grad(grad.square().sum(), logits)[0]))
    (plain, plain_second), (chunked, chunked_second) = out
    assert torch.equal(plain, chunked) and torch.equal(plain_second, chunked_second)


def test_an_upcast_of_another_dtype_or_shape_is_refused():
    logits, target = logits_and_target(torch.bfloat16)
    with pytest.raises(ValueError, match="upcast must be the logits as torch.float32"):
        chunked_cross_entropy(logits, target, dtype=torch.float32, upcast=logits.double())
    with pytest.raises(ValueError, match=r"of shape \(300, 211\)"):
        chunked_cross_entropy(logits, target, dtype=torch.float32, upcast=logits[:10].float())


def test_every_row_ignored_gives_pytorchs_nan_and_zero_gradient():
    logits, target = logits_and_target(torch.float64, rows=10)
    target[:] = -100
    chunked = chunked_cross_entropy(logits, target)
    assert torch.isnan(chunked) and torch.isnan(F.cross_entropy(logits, target))
    assert torch.equal(torch.autograd.grad(chunked, logits)[0], torch.zeros_like(logits))


@pytest.mark.parametrize("extra", [{"weight": torch.ones(211)}, {"label_smoothing": 0.1}, {"reduction": "none"}],
                         ids=["weight", "label_smoothing", "reduction_none"])
def test_calls_it_does_not_compute_stay_pytorchs(extra):
    logits, target = logits_and_target(torch.float32)
    assert not applies(logits, target, min_bytes=0, **extra)
    with LeanLoss(min_bytes=0) as mode:
        F.cross_entropy(logits, target, **extra)
    assert mode.calls == 0


def test_small_logits_probabilities_and_no_grad_stay_pytorchs():
    logits, target = logits_and_target(torch.float32)
    assert not applies(logits, target)  # under min_bytes (512 MiB)
    assert not applies(logits, torch.softmax(logits.detach(), 1), min_bytes=0)
    assert not applies(logits.detach(), target, min_bytes=0)
    assert applies(logits, target, None, None, -100, None, "sum", min_bytes=0)  # positional, as PyTorch's signature


def test_mode_routes_positional_and_keyword_arguments():
    logits, target = logits_and_target(torch.float32)
    with LeanLoss(min_bytes=0) as mode:
        a = F.cross_entropy(logits, target, None, None, -100, None, "sum")
        b = F.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    assert mode.calls == 2 and torch.equal(a, b) and torch.equal(a, F.cross_entropy(logits, target, reduction="sum"))


def tiny_gpt2():
    config = transformers.GPT2Config(vocab_size=97, n_embd=32, n_layer=3, n_head=2, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).to(torch.bfloat16).train()


def tiny_bart():
    config = transformers.BartConfig(vocab_size=97, d_model=32, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32, dropout=0.0)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).train()
    with torch.no_grad():
        model.final_logits_bias.normal_()  # zeros at first; the sum would hide a wrong bias
    return model


@pytest.mark.parametrize("make,upcasts,autocast", [(tiny_bert, 0, False), (tiny_gpt2, 1, False), (tiny_bart, 1, True)],
                         ids=["bert", "gpt2_upcast", "bart_biased_upcast"])
def test_a_planned_models_loss_is_chunked_with_plain_gradients(make, upcasts, autocast):
    """BERT's loss takes its logits as they are; GPT-2's (transformers' ForCausalLMLoss) upcasts
    them first, and the chunks take the bf16 logits instead. Under autocast BART's head makes bf16
    logits and adds its fp32 ``final_logits_bias``: fp32 logits, which the chunks take as the bf16
    product and the bias."""
    model = make()
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        plain_loss, plain = gradients(model, ids)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)),
                      window=1 << 20, min_bytes=1)
    runtime.lean_loss.min_bytes = 0
    runtime.attach()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, planned = gradients(model, ids)
    runtime.detach()
    assert runtime.lean_loss.calls == 1 and runtime.lean_loss.upcast_calls == upcasts
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(planned, plain))
    assert torch._C._len_torch_function_stack() == 0  # the mode left with the forward


def upcast_logits(dtype, rows=300, classes=211):
    """Narrow logits as a model's head makes them, and a target, as in transformers' loss: the
    logits upcast, then flattened."""
    logits, target = logits_and_target(torch.float64, rows, classes)
    return logits.detach().to(dtype).view(3, rows // 3, classes).requires_grad_(), target


def plain_and_lean(narrow, target, wide=torch.float32, reduction="mean", change=None):
    """The loss and the narrow logits' gradient, plainly and under LeanLoss, of
    cross_entropy(narrow.to(wide).view(-1, classes)); `change` is applied to the upcast first."""
    out = []
    for mode in (None, LeanLoss(min_bytes=0)):
        if mode is not None:
            mode.__enter__()
        upcast = narrow.float() if wide is torch.float32 else narrow.to(wide)
        if change is not None:
            change(upcast)
        loss = F.cross_entropy(upcast.view(-1, narrow.size(-1)), target, reduction=reduction)
        if mode is not None:
            mode.__exit__(None, None, None)
        out.append((loss, torch.autograd.grad(loss, narrow)[0], mode))
    return out


@pytest.mark.parametrize("narrow,wide", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                         (torch.float32, torch.float64)], ids=str)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_upcast_logits_are_taken_narrow_with_pytorchs_loss_and_gradient_bit_for_bit(narrow, wide, reduction):
    logits, target = upcast_logits(narrow)
    (plain, plain_grad, _), (lean, lean_grad, mode) = plain_and_lean(logits, target, wide, reduction)
    assert mode.calls == 1 and mode.upcast_calls == 1
    assert lean_grad.dtype == narrow
    assert torch.equal(plain, lean) and torch.equal(plain_grad, lean_grad)


def test_an_upcast_that_also_feeds_a_z_loss_gives_pytorchs_loss_and_a_gradient_within_rounding():
    """The docstring's limit: where the upcast also feeds another term, the two gradients meet in
    the narrow dtype, not in fp32. The loss stays PyTorch's; the gradient differs by at most the
    narrow dtype's rounding of each element."""
    logits, target = upcast_logits(torch.bfloat16)
    out = []
    for mode in (None, LeanLoss(min_bytes=0)):
        if mode is not None:
            mode.__enter__()
        upcast = logits.float().view(-1, logits.size(-1))
        loss = F.cross_entropy(upcast, target) + 1e-2 * torch.logsumexp(upcast, -1).square().mean()
        if mode is not None:
            mode.__exit__(None, None, None)
        out.append((loss, torch.autograd.grad(loss, logits)[0]))
    (plain, plain_grad), (lean, lean_grad) = out
    assert mode.upcast_calls == 1 and torch.equal(plain, lean)
    spacing = plain_grad.float().abs() * 2 ** -7 + 1e-12  # bf16 keeps 8 significant bits
    assert ((lean_grad.float() - plain_grad.float()).abs() <= spacing).all()


def test_the_upcast_is_not_held_for_backward():
    logits, target = upcast_logits(torch.bfloat16)
    with LeanLoss(min_bytes=0) as mode:
        upcast = logits.float()
        flat = upcast.view(-1, logits.size(-1))
        loss = F.cross_entropy(flat, target)
    held = weakref.ref(upcast)
    del upcast, flat
    assert mode.upcast_calls == 1 and held() is None  # nothing in the graph holds the fp32 logits
    loss.backward()


@pytest.mark.parametrize("change", [lambda upcast: upcast.mul_(1.5), lambda upcast: upcast.view(-1)[0].zero_()],
                         ids=["scaled", "one_value"])
def test_an_upcast_changed_in_place_is_left_to_the_plain_path(change):
    logits, target = upcast_logits(torch.bfloat16)
    (plain, plain_grad, _), (lean, lean_grad, mode) = plain_and_lean(logits, target, change=change)
    assert mode.calls == 1 and mode.upcast_calls == 0
    assert torch.equal(plain, lean) and torch.equal(plain_grad, lean_grad)


def test_a_source_changed_after_its_upcast_is_left_to_the_plain_path():
    logits, target = upcast_logits(torch.bfloat16)
    narrow = logits.detach().clone().requires_grad_()
    source = narrow * 1  # a non-leaf, which may change in place
    with LeanLoss(min_bytes=0) as mode:
        upcast = source.float()
        with torch.no_grad():
            source.mul_(2)
        lean = F.cross_entropy(upcast.view(-1, logits.size(-1)), target)
    plain = F.cross_entropy((logits * 1).float().view(-1, logits.size(-1)), target)
    assert mode.upcast_calls == 0 and torch.equal(lean, plain)


def test_views_as_another_dtype_and_narrowing_casts_stay_plain():
    logits, target = upcast_logits(torch.float32)
    with LeanLoss(min_bytes=0) as mode:
        assert logits.view(torch.int32).dtype == torch.int32  # a reinterpretation of the bytes, noted nowhere
        narrowed = logits.to(torch.bfloat16)                    # not an upcast
        F.cross_entropy(narrowed.float().view(-1, logits.size(-1)), target)
        F.cross_entropy(logits.to(torch.bfloat16).view(-1, logits.size(-1)), target)
    assert mode.calls == 2 and mode.upcast_calls == 1



def biased_plain_and_lean(narrow, target, bias, reduction="mean", bias_first=False):
    """As plain_and_lean, of cross_entropy((narrow + bias).view(-1, classes)): BART's logits,
    ``lm_head(x) + final_logits_bias``, a bf16 product and an fp32 buffer under autocast."""
    out = []
    for mode in (None, LeanLoss(min_bytes=0)):
        if mode is not None:
            mode.__enter__()
        wide = bias + narrow if bias_first else narrow + bias
        loss = F.cross_entropy(wide.view(-1, narrow.size(-1)), target, reduction=reduction)
        if mode is not None:
            mode.__exit__(None, None, None)
        out.append((loss, torch.autograd.grad(loss, narrow)[0], mode))
    return out


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("bias_first", [False, True], ids=["logits_plus_bias", "bias_plus_logits"])
def test_logits_widened_by_adding_a_bias_are_taken_narrow_bit_for_bit(reduction, bias_first):
    logits, target = upcast_logits(torch.bfloat16)
    bias = torch.randn(1, logits.size(-1), generator=torch.Generator().manual_seed(3))
    (plain, plain_grad, _), (lean, lean_grad, mode) = biased_plain_and_lean(logits, target, bias, reduction,
                                                                            bias_first)
    assert mode.calls == 1 and mode.upcast_calls == 1
    assert lean_grad.dtype == torch.bfloat16
    assert torch.equal(plain, lean) and torch.equal(plain_grad, lean_grad)


@pytest.mark.parametrize("subtract", [True, False], ids=["subtracted", "log_softmax_again"])
def test_a_biased_upcasts_chunks_make_the_sum_again_in_backward(monkeypatch, subtract):
    """In chunks, backward adds the bias to each chunk of narrow rows again: the log-probabilities
    by subtraction from the sum's largest value (not the narrow logits', which the bias moves), or
    by log-softmax again; both give PyTorch's gradient bit for bit."""
    from um_alloc.planner import lean_loss
    monkeypatch.setattr(lean_loss, "_SUBTRACTION_MATCHES", {} if subtract else
                        {("cpu", torch.float32, torch.float32, 211): False})
    logits, target = logits_and_target(torch.bfloat16)
    bias = 10 * torch.randn(211, generator=torch.Generator().manual_seed(4))  # moves each row's largest
    plain = F.cross_entropy(logits + bias, target)
    plain_grad, = torch.autograd.grad(plain, logits)
    chunked = chunked_cross_entropy(logits, target, dtype=torch.float32, upcast=logits + bias, bias=bias,
                                    chunk_bytes=40 * 211 * 4)
    chunked_grad, = torch.autograd.grad(chunked, logits)
    assert torch.equal(plain, chunked) and torch.equal(plain_grad, chunked_grad)
    assert lean_loss._SUBTRACTION_MATCHES == {("cpu", torch.float32, torch.float32, 211): subtract}


def test_a_bias_that_needs_a_gradient_or_is_not_one_value_per_class_leaves_the_sum_plain():
    logits, target = upcast_logits(torch.bfloat16)
    trained = torch.zeros(1, logits.size(-1), requires_grad=True)
    per_row = torch.zeros(logits.size(1), 1)  # broadcasts over classes, not one value per class
    for bias in (trained, per_row):
        (plain, plain_grad, _), (lean, lean_grad, mode) = biased_plain_and_lean(logits, target, bias)
        assert mode.calls == 1 and mode.upcast_calls == 0
        assert torch.equal(plain, lean) and torch.equal(plain_grad, lean_grad)


def test_the_biased_upcast_is_not_held_for_backward():
    logits, target = upcast_logits(torch.bfloat16)
    with LeanLoss(min_bytes=0) as mode:
        wide = logits + torch.ones(logits.size(-1))
        loss = F.cross_entropy(wide.view(-1, logits.size(-1)), target)
    held = weakref.ref(wide)
    del wide
    assert mode.upcast_calls == 1 and held() is None
    loss.backward()


def test_a_bias_of_another_size_dtype_or_one_that_needs_a_gradient_is_refused():
    logits, target = logits_and_target(torch.bfloat16)
    for bias in (torch.zeros(210), torch.zeros(211, dtype=torch.float64), torch.zeros(211, requires_grad=True)):
        with pytest.raises(ValueError, match="bias must be a vector of 211 classes in torch.float32"):
            chunked_cross_entropy(logits, target, dtype=torch.float32, bias=bias)


@pytest.mark.parametrize("phase", [0, 4, 12, 500])
def test_an_upcast_chunks_rows_start_where_they_would_in_the_whole_upcast(phase):
    narrow = torch.zeros(50, 257, dtype=torch.bfloat16)
    rows = _Rows(narrow, torch.float32, phase, chunk_bytes=7 * 257 * 4)  # 7 rows a chunk
    for start, end in rows.spans():
        chunk = rows.rows(start, end)
        assert chunk.shape == (end - start, 257) and chunk.dtype == torch.float32
        assert chunk.data_ptr() % ALIGN_BYTES == (phase + start * 257 * 4) % ALIGN_BYTES
    assert end == 50
