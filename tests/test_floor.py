"""A hard budget below what never leaves the GPU is refused before the first step, with figures.

The figures come from the model on any device, so these run on the CPU; on a GPU the same check
runs in tag_training() and in bert_example/train.py before the model is moved."""
import importlib

import pytest
import torch

import um_alloc
from um_alloc.floor import BudgetBelowFloor, check_budget, floor_of
from um_alloc.policy import load_policy
from um_alloc.sizes import MiB

install_module = importlib.import_module("um_alloc.install")  # um_alloc.install is also the function
CHUNK = 2 * MiB


def model_of(*shapes):
    """fp32 parameters of the given shapes, one Linear-free module per shape."""
    module = torch.nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))
    return module


def test_adamw_holds_parameters_gradients_and_two_moments_in_whole_chunks():
    model = model_of((1024, 1024), (1024, 1536))   # 4 MiB and 6 MiB
    floor = floor_of(model, torch.optim.AdamW(model.parameters()), load_policy("best"))
    assert (floor.parameters, floor.gradients, floor.optimizer_state) == (10 * MiB, 10 * MiB, 20 * MiB)
    assert floor.total == 40 * MiB and floor.largest == 6 * MiB and floor.state_estimated


def test_requests_above_half_a_chunk_take_whole_chunks_and_small_ones_do_not():
    model = model_of((300_000,), (100,))            # 1.14 MiB -> one 2 MiB chunk; 400 B -> 512 B
    floor = floor_of(model, None, load_policy("none"))
    assert floor.parameters == CHUNK + 512 and floor.gradients == CHUNK + 512 and floor.optimizer_state == 0


def test_frozen_parameters_have_no_gradients_or_state():
    model = model_of((1024, 1024), (1024, 1024))
    model.p1.requires_grad_(False)
    floor = floor_of(model, torch.optim.SGD([model.p0], lr=0.1, momentum=0.9), load_policy("none"))
    assert (floor.parameters, floor.gradients, floor.optimizer_state) == (8 * MiB, 4 * MiB, 4 * MiB)


def test_host_mapped_optimizer_state_does_not_count():
    model = model_of((1024, 1024))
    floor = floor_of(model, torch.optim.AdamW(model.parameters()), load_policy("host_optimizer"))
    assert floor.optimizer_state == 0 and floor.total == 8 * MiB


def test_existing_state_is_counted_as_it_is():
    model = model_of((1024, 1024))
    optimizer = torch.optim.Adam(model.parameters(), amsgrad=True)
    model.p0.grad = torch.ones_like(model.p0)
    optimizer.step()
    floor = floor_of(model, optimizer, load_policy("none"))
    assert floor.optimizer_state == 12 * MiB and not floor.state_estimated   # three moments; the CPU step count is not


def test_an_optimizer_of_unknown_state_counts_none_and_says_so():
    model = model_of((1024, 1024))
    floor = floor_of(model, torch.optim.Adamax(model.parameters()), load_policy("none"))
    assert floor.optimizer_state == 0 and not floor.state_known
    assert "not known before the first step: not counted" in floor.text()


def test_a_budget_below_the_floor_is_refused_with_the_figures():
    model = model_of((1024, 1024))                  # 4 MiB: with AdamW 16 MiB stay on the GPU
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(BudgetBelowFloor) as info:
        check_budget(model, optimizer, budget=12 * MiB, policy=load_policy("best"))
    assert str(info.value) == (
        "GPU budget 12.0 MiB (12582912 bytes) is below what stays on the GPU all step under policy 'best': "
        "parameters 4.0 MiB + gradients 4.0 MiB + optimizer state (expected) 8.0 MiB = 16.0 MiB (16777216 bytes); "
        "the largest single tensor 4.0 MiB. Nothing of these can be recomputed or moved under a hard budget, so "
        "training would run out of memory in its first step; raise the budget, train a smaller model, or keep "
        "optimizer state in host memory (host_optimizer.yaml)")
    assert info.value.floor.total == 16 * MiB and info.value.budget == 12 * MiB
    assert check_budget(model, optimizer, budget=16 * MiB, policy=load_policy("best")).total == 16 * MiB
    assert check_budget(model, optimizer, budget=12 * MiB, policy=load_policy("host_optimizer")).total == 8 * MiB


def test_a_reactive_budget_may_evict_anything_and_is_not_refused():
    model = model_of((1024, 1024))
    reactive = load_policy({"scheduler": {"evict_live": True}})
    assert check_budget(model, None, budget=4 * MiB, policy=reactive).total == 8 * MiB


def test_tag_training_refuses_before_tagging_anything(monkeypatch):
    policy = load_policy({"scheduler": {"budget": "8MiB"}})
    monkeypatch.setattr(install_module, "_installation", install_module.Installation(
        policy, 0, 1 << 40, 1 << 40, 1 << 40, 0))
    monkeypatch.setattr(um_alloc.tags, "retag", lambda *a, **k: pytest.fail("tagged before the budget was checked"))
    model = model_of((1024, 1024))
    with pytest.raises(BudgetBelowFloor, match=r"GPU budget 8.0 MiB .* = 16.0 MiB"):
        um_alloc.tag_training(model, torch.optim.AdamW(model.parameters()))


def test_train_py_checks_the_model_while_it_is_on_the_cpu(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from bert_example import options, train

    policy = load_policy({"scheduler": {"budget": "8MiB"}})
    monkeypatch.setattr(install_module, "_installation", install_module.Installation(
        policy, 0, 1 << 40, 1 << 40, 1 << 40, 0))
    args = options.build_parser().parse_args(["--model", "tiny"])
    model = train.build_model(args, vocab_size=30522)
    assert next(model.parameters()).device.type == "cpu" and isinstance(model, transformers.BertForMaskedLM)
    with pytest.raises(BudgetBelowFloor, match=r"parameters 1\d.\d MiB \+ gradients"):
        train.check_budget_floor(model)
