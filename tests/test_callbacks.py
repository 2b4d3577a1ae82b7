"""The Hugging Face Trainer and Lightning callbacks on a tiny model, on the CPU, install() faked
(tests/conftest.py). Their frameworks call them as written here; tests that need the frameworks
themselves skip where they are not installed."""
import importlib
import sys
import types

import pytest
import torch

from test_wrappers import AcceleratedOptimizer, LightningOptimizer

transformers = pytest.importorskip("transformers")


def tiny_bert():
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config)


def train(model, optimizer, steps, call=lambda model, ids: model(input_ids=ids, labels=ids).loss):
    for _ in range(steps):
        ids = torch.randint(0, 97, (4, 16))
        call(model, ids).backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)


# ---------------------------------------------------------------- Hugging Face
def test_the_trainer_callback_installs_then_plans_and_tags_through_accelerates_wrapper(fake_install, tmp_path, capsys):
    from transformers import TrainerControl, TrainerState

    from um_alloc.integrations.huggingface import UMAllocCallback

    callback = UMAllocCallback(budget="1GiB", json_path=tmp_path / "um.json")
    assert fake_install == [0] and callback.installation.policy.name == "planner"
    model = tiny_bert()
    optimizer = AcceleratedOptimizer(torch.optim.AdamW(model.parameters()))
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control, model=model, optimizer=optimizer)
    assert callback.planner is not None and len(callback.planner.units) > 3
    train(model, optimizer, 3)
    state.global_step = 3
    callback.on_train_end(None, state, control, model=model)
    assert callback.report["global_step"] == 3 and callback.report["planner"]["plan"]
    assert (tmp_path / "um.json").exists() and "predicted step" in capsys.readouterr().err
    assert "forward" not in model.bert.encoder.layer[0].__dict__  # the planner came off


def test_the_trainer_callback_leaves_gradient_checkpointing_alone(fake_install):
    from transformers import TrainerControl, TrainerState

    from um_alloc.integrations.huggingface import UMAllocCallback

    callback = UMAllocCallback(budget="1GiB")
    model = tiny_bert()
    model.activation_checkpointing_enable()
    callback.on_train_begin(None, TrainerState(), TrainerControl(), model=model,
                            optimizer=torch.optim.AdamW(model.parameters()))
    assert callback.planner is None  # the model recomputes already; the budget still holds


def test_the_trainer_callbacks_bad_budget_fails_before_install(fake_install):
    from um_alloc.errors import PolicyError
    from um_alloc.integrations.huggingface import UMAllocCallback

    with pytest.raises(PolicyError, match=r"UMAllocCallback\(budget=...\): budget: unknown size unit \(got '12GB'"):
        UMAllocCallback(budget="12GB")
    assert fake_install == []


def test_a_real_trainer_runs_the_callback(fake_install, tmp_path):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from um_alloc.integrations.huggingface import UMAllocCallback

    callback = UMAllocCallback(budget="1GiB")
    data = [{"input_ids": torch.randint(0, 97, (16,)), "labels": torch.randint(0, 97, (16,))} for _ in range(16)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no")
    Trainer(model=tiny_bert(), args=args, train_dataset=data, callbacks=[callback]).train()
    assert callback.report["global_step"] == 4 and callback.report["planner"]["plan"]


# ---------------------------------------------------------------- Lightning
@pytest.fixture
def lightning_stand_in(monkeypatch):
    """A `lightning.pytorch` with only the Callback base class: the callback's wiring, where
    Lightning is not installed."""
    package, pytorch = types.ModuleType("lightning"), types.ModuleType("lightning.pytorch")
    pytorch.Callback = type("Callback", (), {})
    package.pytorch = pytorch
    monkeypatch.setitem(sys.modules, "lightning", package)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", pytorch)
    monkeypatch.delitem(sys.modules, "um_alloc.integrations.lightning", raising=False)
    yield importlib.import_module("um_alloc.integrations.lightning")
    sys.modules.pop("um_alloc.integrations.lightning", None)


class LitModel(torch.nn.Module):
    """As a LightningModule that holds a Hugging Face model and calls it in training_step."""

    def __init__(self):
        super().__init__()
        self.model = tiny_bert()

    def training_step(self, ids):
        return self.model(input_ids=ids, labels=ids).loss


def test_the_lightning_callback_plans_the_model_the_training_step_runs(fake_install, lightning_stand_in, capsys):
    callback = lightning_stand_in.UMAllocCallback(budget="1GiB")
    lit = LitModel()
    outside = tiny_bert()  # trained first in the process, but not by this LightningModule
    optimizer = LightningOptimizer(torch.optim.AdamW(lit.parameters()))
    trainer = types.SimpleNamespace(is_global_zero=True, global_step=0)
    callback.on_train_start(trainer, lit)
    outside(input_ids=torch.zeros(2, 8, dtype=torch.long)).logits.sum().backward()
    train(lit, optimizer, 4, call=lambda lit, ids: lit.training_step(ids))
    trainer.global_step = 4
    callback.on_train_end(trainer, lit)
    assert callback.report["model"] == "BertForMaskedLM" and callback.auto.model is lit.model
    assert callback.report["planner"]["plan"] and "predicted step" in capsys.readouterr().err
    from torch.nn.modules import module
    assert not module._global_forward_pre_hooks  # its hooks came off


def test_the_lightning_module_says_what_to_install_when_lightning_is_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)
    monkeypatch.delitem(sys.modules, "um_alloc.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match="needs Lightning: pip install lightning"):
        importlib.import_module("um_alloc.integrations.lightning")


def test_a_real_lightning_trainer_runs_the_callback(fake_install):
    pl = pytest.importorskip("lightning.pytorch")
    sys.modules.pop("um_alloc.integrations.lightning", None)
    from um_alloc.integrations.lightning import UMAllocCallback

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_bert()

        def training_step(self, ids, index):
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    callback = UMAllocCallback(budget="1GiB")
    loader = torch.utils.data.DataLoader(torch.randint(0, 97, (16, 16)), batch_size=4)
    pl.Trainer(accelerator="cpu", max_steps=4, callbacks=[callback], logger=False, enable_checkpointing=False,
               enable_progress_bar=False).fit(Lit(), loader)
    assert callback.report["global_step"] == 4 and callback.report["planner"]["plan"]


def test_the_summary_puts_the_measured_step_beside_the_predicted_once_the_plan_has_run(fake_install, monkeypatch):
    from um_alloc.integrations.attach import plan_text
    from um_alloc.planner import plan

    model = tiny_bert()
    planner = plan(model, budget="1GiB")
    assert plan_text(planner) == planner.table()  # no plan yet: nothing measured to show
    optimizer = torch.optim.AdamW(model.parameters())
    train(model, optimizer, 4)
    assert planner.plan is not None
    predicted = planner.plan.predicted_step_s
    assert plan_text(planner) == planner.table()  # on the CPU no CUDA events time the steps
    monkeypatch.setattr(planner, "measured_step_s", lambda: 0.0123)
    text = plan_text(planner)
    assert text.startswith(planner.table())
    assert text.endswith(f"measured step 12.3 ms, the median of the plan's steps (predicted {1e3 * predicted:.1f} ms)")
    planner.remove()
