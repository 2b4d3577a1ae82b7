"""Replay on the CPU: every decision trains exactly as plain autograd does, and the planner
attaches to a model without changes to the training loop."""
import copy

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision, PlanInfeasible, find_units
from um_alloc.planner.replay import Runtime
from planner_helpers import Block, Fixed, NoSubmodules, OneOfEach, ScaledAfter, decisions_for

transformers = pytest.importorskip("transformers")


def tiny_bert(dropout: float = 0.1):
    config = transformers.BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=64, hidden_dropout_prob=dropout,
                                     attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).double().train()


def gradients(model, ids):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]




@pytest.mark.parametrize("decision", list(Decision), ids=lambda d: d.value)
def test_every_decision_gives_plain_autograds_gradients_in_float64(decision):
    model = tiny_bert()
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(2))
    plain_loss, plain = gradients(model, ids)
    units = find_units(model)
    director = Fixed(decisions_for(units, decision))
    runtime = Runtime(model, units, torch.device("cpu"), director, window=1 << 20, min_bytes=1)
    runtime.attach()
    loss, planned = gradients(model, ids)
    moved = runtime.transfers.stats.out_bytes
    runtime.detach()
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(planned, plain))  # dropout masks replayed exactly
    assert director.ended == [True]
    assert (moved > 0) == (decision is not Decision.KEEP)  # gaps move beside a recompute


class DenseLayer(torch.nn.Module):
    """torchvision's _DenseLayer in small: it takes the list of every feature so far."""

    def __init__(self, width: int, growth: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, growth)

    def forward(self, features: list):
        return torch.tanh(self.linear(torch.cat(features, dim=-1)))


class DenseBlock(torch.nn.Module):
    """Appends each layer's output to the one list every layer is called with, as torchvision's
    _DenseBlock does: the list a layer was called with has grown by its backward."""

    def __init__(self, width: int = 6, growth: int = 4, layers: int = 3):
        super().__init__()
        self.layers = torch.nn.ModuleList(DenseLayer(width + i * growth, growth) for i in range(layers))

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, dim=-1).sum()


@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED, Decision.SELECTIVE],
                         ids=lambda d: d.value)
def test_a_block_called_with_a_list_its_caller_appends_to_recomputes_from_the_list_it_was_given(decision):
    torch.manual_seed(0)
    model = DenseBlock().double()
    x = torch.randn(5, 6, dtype=torch.float64)

    def gradients():
        model.zero_grad(set_to_none=True)
        model(x).backward()
        return [p.grad.clone() for p in model.parameters()]

    plain = gradients()
    units = find_units(model)
    assert [u.name for u in units if u.kind == "block"] == ["layers.0", "layers.1", "layers.2"]
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), window=1 << 20,
                      min_bytes=1)
    runtime.attach()
    try:
        planned = gradients()
    finally:
        runtime.detach()
    assert all(torch.equal(a, b) for a, b in zip(planned, plain))


class Noting(torch.nn.Module):
    """A block that notes each call in a list its caller passes and reads."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, x, notes: list):
        self.calls = getattr(self, "calls", 0) + 1
        notes.append(tuple(x.shape))
        return torch.tanh(self.linear(x))


class NotingModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(Noting() for _ in range(3))
        self.notes: list = []

    def forward(self, x):
        self.notes = []
        for layer in self.layers:
            x = layer(x, self.notes)
        return x.sum()


@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.SELECTIVE], ids=lambda d: d.value)
def test_a_blocks_forward_changes_the_list_its_caller_passed_and_its_rerun_does_not(decision):
    model = NotingModel().double()
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), window=1 << 20,
                      min_bytes=1)
    runtime.attach()
    try:
        for step in (1, 2):  # through checkpoint, then (recompute) as one node
            loss = model(torch.randn(5, 6, dtype=torch.float64))
            assert len(model.notes) == 3  # the forward's calls, as the caller sees them
            loss.backward()
            assert [layer.calls for layer in model.layers] == [2 * step] * 3  # each ran again in backward
            assert len(model.notes) == 3  # and its rerun noted nothing more
    finally:
        runtime.detach()


def test_detach_restores_the_modules():
    model = tiny_bert()
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)), 1 << 20)
    runtime.attach()
    assert all("forward" in u.module.__dict__ for u in units)
    runtime.detach()
    assert not any("forward" in u.module.__dict__ for u in units)


def test_batch_norm_counts_a_recomputed_batch_once():
    """A recomputation reruns BatchNorm in training mode; its running statistics must come out as
    after one forward, not two."""
    from um_alloc.planner.blocks import Unit

    def block():
        return torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU())

    def statistics(net):
        return [torch.cat([m.running_mean, m.running_var, m.num_batches_tracked.double().reshape(1)])
                for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]

    torch.manual_seed(0)
    x = torch.randn(2, 4, 8, 8)
    plain, planned = torch.nn.Sequential(block(), block()), None
    planned = torch.nn.Sequential(block(), block())
    planned.load_state_dict(plain.state_dict())
    plain(x).sum().backward()
    units = [Unit("0", planned[0], "block"), Unit("1", planned[1], "block")]
    runtime = Runtime(planned, units, torch.device("cpu"),
                      Fixed((Decision.RECOMPUTE, Decision.SELECTIVE, Decision.KEEP)), 1 << 20)
    runtime.attach()
    planned(x).sum().backward()
    runtime.detach()
    assert all(torch.equal(a, b) for a, b in zip(statistics(plain), statistics(planned)))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(plain.parameters(), planned.parameters()))


class SpectralLayer(torch.nn.Module):
    """A GAN discriminator's layer (SNGAN, BigGAN): spectral norm runs a power iteration in each
    training forward, on vectors it keeps as buffers, and divides the weight by what it finds."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(16, 16))

    def forward(self, x):
        return torch.nn.functional.leaky_relu(self.linear(x), 0.2) + x


@pytest.mark.parametrize("decision", [d for d in Decision if d.recomputes], ids=lambda d: d.value)
def test_spectral_norm_reruns_the_forwards_power_iteration_and_its_vectors_change_once(decision):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[SpectralLayer() for _ in range(3)], torch.nn.Linear(16, 1)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def step(net):
        net.zero_grad(set_to_none=True)
        net(x).mean().backward()
        return [p.grad.clone() for p in net.parameters()] + [b.clone() for b in net.buffers()]

    units = find_units(model)
    assert sum(u.kind == "block" for u in units) == 3
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1)
    runtime.attach()
    try:
        for _ in range(3):  # through torch.utils.checkpoint, then as one node where the decision allows
            assert all(torch.equal(a, b) for a, b in zip(step(model), step(plain)))
    finally:
        runtime.detach()


def test_the_planner_attaches_to_a_plain_loop_and_plans_after_two_steps():
    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB")
    for step in range(4):
        ids = torch.randint(0, 97, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert (planner.plan is None) == (step < 2)
    assert set(planner.plan.decisions) == {Decision.KEEP}  # no GPU memory is counted on the CPU
    assert "predicted step" in planner.table()
    assert planner.to_dict()["plan"]["decisions"] == {"keep": len(planner.units) + 1}
    planner.remove()


def test_forced_decisions_run_from_the_next_step_and_come_with_their_prediction():
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="no plan yet"):
        planner.force("recompute")
    block = next(u.module for u in planner.units if u.kind == "block")
    calls = []  # forwards of a module inside the first block, during backward
    next(block.children()).register_forward_hook(lambda *_: calls.append(1))
    losses, runs = [], []
    for step in range(4):
        if step == 3:
            forced = planner.force("recompute")
            kinds = [u.kind for u in planner.calibration.units]
            assert forced.decisions == tuple(Decision.RECOMPUTE if k == "block" else Decision.KEEP for k in kinds)
            assert planner.plan is forced and forced.predicted_step_s > 0
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        calls.clear()
        loss.backward()
        losses.append(loss.item())
        runs.append(len(calls))
    assert runs == [1, 1, 0, 1]  # recomputed in backward while measuring, kept by the plan, then forced
    assert losses[3] == losses[2]  # no optimizer: the same step, recomputed
    units = planner.calibration.units
    with pytest.raises(ValueError, match=r"force: not a decision this unit can take \(got 'recompute'; "
                                         r"allowed: keep, move\)"):
        planner.force(["recompute"] * len(units))  # the gaps cannot be recomputed
    with pytest.raises(ValueError, match=f"not a list of {len(units)} decisions"):
        planner.force(["keep"])
    with pytest.raises(ValueError, match="not a decision this unit can take"):
        planner.force("teleport")
    planner.remove()


@pytest.mark.parametrize("first, planned", [((4, 16), [False, False, True, True]),
                                            ((2, 8), [False, False, False, True])])
def test_a_step_begun_from_a_global_hook_counts_for_the_next_input_if_its_positional_tensors_agree(first, planned):
    """As um_alloc run attaches: inside the first forward's global pre-hook, which sees the
    positional arguments only. That step calibrates the next step's input unless its positional
    tensors show another one."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    attached = []

    def attach(module, args):
        if module is model and not attached:
            attached.append(BlockPlanner(model, "1GiB"))
            attached[0].begin_forward(args)

    handle = register_module_forward_pre_hook(attach)
    seen = []
    for step in range(4):
        ids = torch.randint(0, 97, first if step == 0 else (4, 16))
        model(ids, labels=ids).loss.backward()
        handle.remove()
        optimizer.step()
        optimizer.zero_grad()
        seen.append(attached[0].plan is not None)
    assert seen == planned
    attached[0].remove()


def test_evaluation_without_gradients_leaves_the_training_step_alone():
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    ids = torch.randint(0, 97, (2, 8))
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad():
        model(input_ids=ids)
    loss.backward()  # the step begun before the evaluation still ends
    assert planner._shapes and next(iter(planner._shapes.values())).calibrated == 0
    model(input_ids=ids, labels=ids).loss.backward()
    assert next(iter(planner._shapes.values())).calibrated == 1
    planner.remove()


def test_bad_arguments_are_refused_before_any_work():
    model = tiny_bert()
    with pytest.raises(ValueError, match=r"strategy: invalid value \(got 'fastest'; allowed: auto, checkpoint\)"):
        BlockPlanner(model, "1GiB", strategy="fastest")
    with pytest.raises(ValueError, match="no budget"):
        BlockPlanner(model)
    with pytest.raises(ValueError, match=r"decisions: not a non-empty list of decisions \(got \['keep', 'teleport'\]"):
        BlockPlanner(model, "1GiB", decisions=["keep", "teleport"])
    with pytest.raises(ValueError, match="Linear has no submodules to plan"):
        BlockPlanner(torch.nn.Linear(2, 2), "1GiB")
    with pytest.raises(ValueError, match="budget"):
        BlockPlanner(model, "-1GiB")


def test_the_copies_back_ahead_of_backward_are_a_sixteenth_of_a_small_budget():
    model = tiny_bert()
    windows = {}
    for budget, window in (("2GiB", None), ("16GiB", None), ("2GiB", "64MiB")):
        planner = BlockPlanner(model, budget, window=window)
        windows[budget, window] = planner._runtime.transfers.window
        planner.remove()
    MiB = 1 << 20
    assert windows == {("2GiB", None): 128 * MiB, ("16GiB", None): 512 * MiB, ("2GiB", "64MiB"): 64 * MiB}


def test_calibration_times_each_units_backward_on_both_clocks():
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    for _ in range(2):
        ids = torch.randint(0, 97, (4, 16))
        model(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids).loss.backward()  # its start closes the calibration
    blocks = [u for u in planner.calibration.units if u.kind == "block"]
    assert blocks and all(u.backward_s > 0 and u.backward_cpu_s > 0 for u in blocks)
    assert all(u.recompute_s > 0 for u in blocks)  # the safe mode recomputes every block
    planner.remove()


def test_a_probing_step_that_runs_out_of_memory_is_retried_without_its_probes(caplog):
    """The first step's probes hold a rebuilt copy of a saved tensor: where that step runs out of
    memory, the retry measures without them, in one step, and its plan neither rebuilds nor
    recomputes selectively."""
    failed = []

    def once(module, args):  # the first call of the step that probes runs out of memory
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("stand-in: the budget is spent")

    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    hook = model.bert.encoder.layer[1].attention.register_forward_pre_hook(once)
    ids = torch.randint(0, 97, (2, 16))
    with caplog.at_level("WARNING", logger="um_alloc"), pytest.raises(torch.OutOfMemoryError):
        model(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    said = [r.getMessage() for r in caplog.records if "safe mode ran out of memory" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("tries once more, without the first step's probes "
                                               "(which hold a rebuilt copy of a saved tensor).")
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    assert planner.safe_steps == 2 and planner.plan is not None  # one clean step measured the input
    shape, = planner._shapes.values()
    assert not shape.probed and not shape.recipes
    assert not {Decision.REBUILD, Decision.SELECTIVE} & set(planner.plan.decisions)
    planner.remove()


def test_a_batch_that_runs_out_of_memory_in_calibration_is_refused_and_a_smaller_one_trains(caplog):
    """The safe mode runs out of memory twice for one input shape: the planner refuses that shape,
    naming it, and stays attached; a smaller batch calibrates, plans and trains as a fresh model would."""
    from um_alloc.planner import PlanInfeasible

    def too_large(module, args):  # inside a unit's forward, where the step learns it ran out
        if args[0].shape[0] > 4:
            raise torch.OutOfMemoryError("stand-in: the budget is spent")

    def train(model, optimizer, steps):
        losses, data = [], torch.Generator().manual_seed(2)
        for _ in range(steps):
            ids = torch.randint(0, 97, (2, 16), generator=data)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        return losses

    model = tiny_bert(dropout=0.0).float()
    optimizer = torch.optim.AdamW(model.parameters())
    planner = BlockPlanner(model, "1GiB")
    model.bert.encoder.layer[1].attention.register_forward_pre_hook(too_large)
    big = torch.randint(0, 97, (8, 16))
    errors = []
    for _ in range(3):
        with caplog.at_level("WARNING", logger="um_alloc"), \
                pytest.raises((torch.OutOfMemoryError, PlanInfeasible)) as info:
            model(input_ids=big, labels=big).loss.backward()
        optimizer.zero_grad(set_to_none=True)
        errors.append(info.value)
    assert [type(e) for e in errors] == [torch.OutOfMemoryError, torch.OutOfMemoryError, PlanInfeasible]
    # Each out-of-memory step said what it means before the loop saw the error.
    said = [r.getMessage() for r in caplog.records if "safe mode ran out of memory" in r.getMessage()]
    assert len(said) == 2 and "input 8x16, 8x16" in said[0] and "1.0 GiB budget (1 of 2 tries)" in said[0]
    assert "tries once more" in said[0] and "none is likely to fit: lower the batch" in said[1]
    assert "(2 of 2 tries)" in said[1] and said[1].endswith("is refused (PlanInfeasible).")
    assert "ran out of memory 2 times for input 8x16, 8x16" in str(errors[-1])
    assert str(errors[-1]).endswith("lower the batch or keep optimizer state in host memory (host_optimizer.yaml)")
    losses = train(model, optimizer, 4)
    assert planner.plan is not None  # calibrated and planned: the refused shape left no trace

    fresh = tiny_bert(dropout=0.0).float()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    fresh_planner = BlockPlanner(fresh, "1GiB")
    assert losses == train(fresh, fresh_optimizer, 4)
    planner.remove()
    fresh_planner.remove()



def test_a_planned_step_out_of_memory_widens_the_margin_and_says_how_much_lower_a_budget_would_start(caplog):
    """The error still reaches a loop that does not run the step again; the warning says by how
    much a lower budget would plan the same way from its first step. A forward that raised ends
    its step at once: the plan has changed before the loop sees the error."""
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "2GiB")
    ids = torch.randint(0, 97, (4, 16))
    for _ in range(3):  # two to calibrate, then the plan
        model(input_ids=ids, labels=ids).loss.backward()
    assert planner.plan is not None
    margin = planner.margin

    def spent(module, args):
        raise torch.OutOfMemoryError("stand-in: the budget is spent")

    hook = model.bert.encoder.layer[1].attention.register_forward_pre_hook(spent)
    with caplog.at_level("WARNING", logger="um_alloc"), pytest.raises(torch.OutOfMemoryError):
        model(input_ids=ids, labels=ids).loss.backward()
    hook.remove()
    assert planner.margin == margin + (256 << 20)  # a sixteenth of 2 GiB is less than the 256 MiB at least
    assert margin == 64 << 20  # default_margin: a thirty-second of the budget
    assert "margin now 320.0 MiB, planning again" in caplog.text
    assert "a budget 256.0 MiB lower plans with this margin from the first step" in caplog.text
    model(input_ids=ids, labels=ids).loss.backward()  # the next step runs the new plan
    assert planner.plan is not None
    planner.remove()


def test_more_memory_in_use_as_a_step_begins_plans_again_before_it_runs(caplog):
    """A loop that accumulates gradients over micro-batches makes the optimizer's state after the
    measuring steps: a step that begins with more in use than they did gets a plan with that
    much more in every peak, and where none fits, an error before its forward runs, not an
    out-of-memory error inside it. Growth within GROWTH_PLANNED_AGAIN changes nothing."""
    from um_alloc.planner.director import GROWTH_PLANNED_AGAIN

    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "2GiB", margin="512MiB")
    ids = torch.randint(0, 97, (4, 16))
    in_use = [0]
    planner._probe.live = lambda: in_use[0]  # the CPU has no pool: stand in for its live bytes
    for _ in range(3):  # two to calibrate, then the plan
        model(input_ids=ids, labels=ids).loss.backward()
    measured, plan = planner.calibration, planner.plan
    in_use[0] = GROWTH_PLANNED_AGAIN
    model(input_ids=ids, labels=ids).loss.backward()
    assert planner.calibration is measured and planner.plan is plan
    in_use[0] = 700 << 20
    with caplog.at_level("INFO", logger="um_alloc"):
        model(input_ids=ids, labels=ids).loss.backward()
    assert "700.0 MiB more in use as a step begins than when input 4x16, 4x16 was measured" in caplog.text
    assert planner.calibration.start_live_bytes == measured.start_live_bytes + (700 << 20)
    assert planner.plan is not plan
    assert planner.plan.predicted_peak_bytes == plan.predicted_peak_bytes + (700 << 20)
    in_use[0] = 7 << 28  # 1.75 GiB: with the 512 MiB margin, more than the 2 GiB budget leaves
    with pytest.raises(PlanInfeasible, match=r"more GPU memory is in use as this step begins than when input "
                                             r"4x16, 4x16 was measured .* ask for 2.25GiB or more"):
        model(input_ids=ids, labels=ids)
    planner.remove()


def test_every_config_caches_nothing_while_attached_and_caches_again_after():
    """T5's decoder holds a copy of the config: its cache, left on, would be appended to again by
    each recomputed decoder block (a different number of saved tensors in the rerun)."""
    config = transformers.T5Config(vocab_size=97, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).double().train()
    ids = torch.randint(0, 97, (2, 8), generator=torch.Generator().manual_seed(2))
    plain = copy.deepcopy(model)
    plain.config.use_cache = plain.decoder.config.use_cache = False  # as under checkpointing: a cache
    #                                                                 changes the rounding of training
    plain_loss, plain_grads = gradients(plain, ids)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE)), 1 << 20)
    runtime.attach()
    assert not model.config.use_cache and not model.decoder.config.use_cache
    loss, planned = gradients(model, ids)
    runtime.detach()
    assert model.config.use_cache and model.decoder.config.use_cache
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(planned, plain_grads))


class _Shared(torch.nn.Module):
    """Two blocks, each called twice a step (weights shared across depth)."""

    def __init__(self):
        super().__init__()
        block = lambda: torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 32), torch.nn.GELU(),
                                            torch.nn.Dropout(0.1), torch.nn.Linear(32, 16))
        self.blocks = torch.nn.ModuleList([block(), block()])
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x):
        for _ in range(2):
            for block in self.blocks:
                x = x + block(x).float()
        return self.head(x).sum()


@pytest.mark.parametrize("decision", [Decision.SELECTIVE, Decision.SELECTIVE_MOVED], ids=lambda d: d.value)
def test_a_block_called_twice_under_autocast_recomputes_selectively(decision):
    """Its second call finds its weights' casts in autocast's cache, its rerun casts them again:
    the selective checkpoint must not count those casts against the forward's."""
    from um_alloc.planner.blocks import Unit

    def step(model):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    model, x = _Shared(), torch.randn(4, 16)
    plain_loss, plain = step(model)
    units = [Unit("blocks.0", model.blocks[0], "block"), Unit("blocks.1", model.blocks[1], "block")]
    runtime = Runtime(model, units, torch.device("cpu"), Fixed((decision, decision, Decision.KEEP)), 1 << 20,
                      min_bytes=1)
    runtime.attach()
    loss, planned = step(model)
    runtime.detach()
    assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(planned, plain))


def _scaled_step(model, x):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
    loss.backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("decision", [Decision.RECOMPUTE, Decision.SELECTIVE, Decision.RECOMPUTE_MOVED],
                         ids=lambda d: d.value)
def test_an_input_changed_in_place_after_its_block_is_never_recomputed_from(decision):
    """Rerun from the scaled input, the block would save other casts and the gradients would be
    wrong without a word; the moved forms rerun from copies taken at the end of the forward."""
    torch.manual_seed(0)
    model, x = ScaledAfter(), torch.randn(4, 8, requires_grad=True)
    plain = _scaled_step(model, x)
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, decision)), 1 << 20, min_bytes=1,
                      lean_loss=False)
    runtime.attach()
    try:
        if decision.moves_inputs:
            assert all(torch.equal(a, b) for a, b in zip(_scaled_step(model, x), plain))
        else:
            with pytest.raises(RuntimeError, match=r"an input of shape \(4, 8\) of blocks.1 was changed in place "
                                                   r"after its forward \(version 0 -> 1\)"):
                _scaled_step(model, x)
    finally:
        runtime.detach()


def test_a_block_that_changes_its_own_input_is_stopped_in_its_forward():
    class Scaling(Block):
        def forward(self, x):
            y = self.linear(x)
            x.mul_(2.0)
            return y + x

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Scaling(), Scaling())
    units = find_units(model)
    runtime = Runtime(model, units, torch.device("cpu"), Fixed(decisions_for(units, Decision.RECOMPUTE_MOVED)),
                      1 << 20, min_bytes=1, lean_loss=False)
    runtime.attach()
    with pytest.raises(RuntimeError, match=r"of 1 was changed in place by its own forward .*cannot be recomputed"):
        model(torch.randn(4, 8))
    runtime.detach()


class Wide(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(256, 256)

    def forward(self, x):
        return torch.tanh(self.linear(x))


class WideStack(torch.nn.Module):
    """Three blocks whose inputs (2048 x 256 fp32, 2 MiB) the safe mode moves to host memory."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Wide() for _ in range(3)])
        self.head = torch.nn.Linear(256, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum()


def test_calibration_counts_the_copies_back_each_stretch_of_backward_held_all_through():
    torch.manual_seed(0)
    model, x = WideStack(), torch.randn(2048, 256)
    planner = BlockPlanner(model, "1GiB", window="4MiB")
    for _ in range(3):  # two safe steps; the third's forward closes the calibration
        model(x).backward()
    segments, units = planner.calibration.segments, planner.calibration.units
    first_backward = next(k for k, s in enumerate(segments) if "backward" in s.label)
    assert all(s.ahead_bytes == 0 for s in segments[:first_backward])  # forward copies nothing back
    held_back = [s.ahead_bytes for s in segments[first_backward:]]
    assert max(held_back) > 0 and all(a <= 4 << 20 for a in held_back)  # within the window
    moved = sum(u.input_bytes + (u.saved_bytes if u.kind == "gap" else 0) for u in units)
    assert all(a <= moved for a in held_back)
    planner.remove()


def test_a_refused_batch_does_not_suggest_host_optimizer_state_to_a_policy_that_has_it(monkeypatch):
    from types import SimpleNamespace

    from um_alloc.planner import director
    from um_alloc.policy import load_policy

    for name, hint in (("large_batch", "lower the batch"),
                       ("planner", "lower the batch or keep optimizer state in host memory (host_optimizer.yaml)")):
        monkeypatch.setattr(director, "is_installed", lambda: True)
        monkeypatch.setattr(director, "installation", lambda: SimpleNamespace(policy=load_policy(name)))
        assert director._lighter_hint() == hint, name


def assert_planned_training_is_plain(model, train, decision: str, blocks: int):
    """`train(model, planner)` (which forces `decision` once the planner has planned) gives the
    parameters plain training gives a copy of `model`, `train(copy, None)`, bit for bit."""
    plain = train(copy.deepcopy(model))
    planner = BlockPlanner(model, "1GiB")
    planner._runtime.min_bytes = 1  # the tiny models' tensors are far below 1 MiB
    try:
        planned = train(model, planner)
        assert planner.plan.counts()[decision] == blocks
    finally:
        planner.remove()
    assert all(torch.equal(a, b) for a, b in zip(planned, plain))


@pytest.mark.parametrize("decision", ["recompute", "recompute_moved", "rebuild", "move"])
def test_gradient_accumulation_trains_as_plain_training_does(decision):
    """Three micro-batches a step, each its own forward and backward into the same gradients (a
    Trainer's gradient_accumulation_steps=3), dropout on: the planner measures two of them, then
    every block runs `decision`, and the parameters after each optimizer step are plain training's."""
    def tiny_gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=3, n_head=2)
        model = transformers.GPT2LMHeadModel(config).double().train()
        model.config.use_cache = False
        return model

    def train(model, planner=None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(5)
        for step in range(4):
            if planner is not None and step == 1:  # its two measuring micro-batches are behind it
                planner.force(decision)
            for micro in range(3):
                ids = torch.randint(0, 97, (2, 16), generator=data)
                torch.manual_seed(100 * step + micro)
                (model(input_ids=ids, labels=ids).loss / 3).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach() for p in model.parameters()]

    assert_planned_training_is_plain(tiny_gpt2(), train, decision, blocks=3)


@pytest.mark.parametrize("compile_first", [False, True], ids=["plan-then-compile", "compile-then-plan"])
def test_under_torch_compile_the_units_run_eagerly_and_train_as_plain_training(compile_first):
    """torch.compile leaves the planner's wrappers and hooks to Python (its saved-tensor hooks and
    events cannot live in a graph: traced into one, the safe step's moves failed to compile), so the
    units run as they do without it and what lies outside them compiles. aot_eager: the same
    kernels as eager, so the same bits."""
    def tiny_gpt2():
        torch.manual_seed(0)
        config = transformers.GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=3, n_head=2,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config).train()
        model.config.use_cache = False
        return model

    def train(model, call, planner=None):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
        data = torch.Generator().manual_seed(5)
        for step in range(5):
            if planner is not None and step == 3:  # planned from step 2; recompute from step 3
                planner.force("recompute")
            ids = torch.randint(0, 97, (2, 16), generator=data)
            call(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach() for p in model.parameters()]

    model = tiny_gpt2()
    plain_model = copy.deepcopy(model)
    plain = train(plain_model, plain_model)
    torch._dynamo.reset()
    if compile_first:
        compiled = torch.compile(model, backend="aot_eager")
        planner = BlockPlanner(compiled, "1GiB")
    else:
        planner = BlockPlanner(model, "1GiB")
        compiled = torch.compile(model, backend="aot_eager")
    try:
        planned = train(model, compiled, planner)
        assert planner.safe_steps == 2 and planner.plan.counts()["recompute"] == 3
    finally:
        planner.remove()
        torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(planned, plain))



def test_under_torch_compile_planned_steps_compile_nothing_new():
    """Once planned, a compiled model's steps reuse their graphs. Traced, the chunked loss's
    bookkeeping of upcasts by id() guarded on each step's logits, and every step compiled the
    graph after the classifier again until dynamo's recompile limit."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    intermediate_size=64, image_size=32, patch_size=8, num_labels=10)
    model = transformers.ViTForImageClassification(config).train()
    torch._dynamo.reset()
    counters.clear()
    planner = BlockPlanner(model, "1GiB")
    compiled = torch.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(5)
    graphs = []
    try:
        for _ in range(8):
            images, labels = torch.randn(2, 3, 32, 32, generator=data), torch.randint(0, 10, (2,), generator=data)
            compiled(pixel_values=images, labels=labels).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            graphs.append(counters["stats"]["unique_graphs"])
        assert planner.plan is not None and planner.safe_steps == 2
        assert graphs[3] == graphs[-1], graphs  # planned from the third step; nothing compiled after
    finally:
        planner.remove()
        torch._dynamo.reset()



@pytest.mark.parametrize("compiled", [False, True])
def test_a_model_called_through_torch_compile_is_told_what_a_plan_costs_it(compiled, caplog):
    model = torch.nn.Sequential(*[Block() for _ in range(3)])
    planner = BlockPlanner(model, "1GiB")
    call = torch.compile(model, backend="eager") if compiled else model
    try:
        with caplog.at_level("WARNING", logger="um_alloc.planner"):
            for _ in range(3):
                call(torch.randn(4, 8, requires_grad=True)).sum().backward()
        notes = [r for r in caplog.records if "called through torch.compile" in r.getMessage()]
        assert len(notes) == (1 if compiled else 0)  # once, at the first step
    finally:
        planner.remove()
        torch._dynamo.reset()


class LowRankAdapter(torch.nn.Module):
    """A frozen linear layer plus a trainable low-rank update, as LoRA fine-tuning adds them."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = torch.nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        torch.nn.init.normal_(self.up.weight, std=0.02)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


@pytest.mark.parametrize("decision", ["recompute", "recompute_moved", "rebuild", "move"])
@pytest.mark.parametrize("frozen", ["adapters", "lower half"])
def test_frozen_parameters_train_as_plain_training_does(frozen, decision):
    """Fine-tuning: every weight frozen but low-rank adapters in the attention, or the embeddings and
    the lower half of the layers frozen (their blocks' inputs need no gradient)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=64)
    model = transformers.LlamaForCausalLM(config).double().train()
    model.config.use_cache = False
    if frozen == "adapters":
        model.requires_grad_(False)
        for layer in model.model.layers:
            layer.self_attn.q_proj = LowRankAdapter(layer.self_attn.q_proj)
            layer.self_attn.v_proj = LowRankAdapter(layer.self_attn.v_proj)
    else:
        model.model.embed_tokens.requires_grad_(False)
        model.model.layers[:2].requires_grad_(False)

    def train(model, planner=None):
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        data = torch.Generator().manual_seed(5)
        for step in range(5):
            if planner is not None and step == 3:
                planner.force(decision)
            ids = torch.randint(0, 97, (2, 16), generator=data)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach() for p in model.parameters()]

    assert_planned_training_is_plain(model, train, decision, blocks=4)


class TorchSeq2Seq(torch.nn.Module):
    """PyTorch's own nn.Transformer (encoder and decoder layers, padding and causal masks, dropout)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(97, 32)
        self.transformer = torch.nn.Transformer(32, 2, 2, 2, 64, dropout=0.1, batch_first=True)
        self.head = torch.nn.Linear(32, 97)

    def forward(self, ids, padding):
        target = self.embed(ids[:, :8])
        causal = torch.nn.Transformer.generate_square_subsequent_mask(8, dtype=target.dtype)
        return self.head(self.transformer(self.embed(ids), target, tgt_mask=causal, src_key_padding_mask=padding))


@pytest.mark.parametrize("decision", ["recompute", "recompute_moved", "rebuild", "move", "selective"])
def test_pytorchs_own_transformer_trains_as_plain_training_does(decision):
    torch.manual_seed(0)
    model = TorchSeq2Seq().double().train()

    def train(model, planner=None):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data = torch.Generator().manual_seed(5)
        for step in range(5):
            if planner is not None and step == 3:
                planner.force(decision)
            ids = torch.randint(0, 97, (2, 16), generator=data)
            padding = torch.zeros(2, 16, dtype=torch.bool)
            padding[1, -4:] = True
            torch.manual_seed(step)  # dropout's masks: the same draws in both runs
            logits = model(ids, padding)
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, :8].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return [p.detach() for p in model.parameters()]

    blocks = [u.name for u in find_units(model) if u.kind == "block"]
    assert blocks == ["transformer.encoder.layers.0", "transformer.encoder.layers.1",
                      "transformer.decoder.layers.0", "transformer.decoder.layers.1"]
    assert_planned_training_is_plain(model, train, decision, blocks=4)


def test_blocks_the_search_cannot_find_are_named_by_the_policy_or_the_argument(monkeypatch, caplog):
    """Under the launcher or a callback there is no call to pass block_classes to: the installed
    policy's scheduler.block_classes names them. Where none is found the model's parts are gaps,
    and the warning says both ways; a model with no submodules is refused."""
    from types import SimpleNamespace
    from um_alloc.planner import director
    from um_alloc.policy import policy_from_dict

    gaps_only = BlockPlanner(OneOfEach(), "1GiB")
    try:
        assert {u.kind for u in gaps_only.units} == {"gap"} and len(gaps_only.units) == 5
        assert "no repeated blocks found in OneOfEach" in caplog.text and "scheduler.block_classes" in caplog.text
    finally:
        gaps_only.remove()
    with pytest.raises(ValueError, match=r"NoSubmodules has no submodules to plan"):
        BlockPlanner(NoSubmodules(), "1GiB")
    with pytest.raises(ValueError, match=r"no module of class Block in OneOfEach; its classes are: "
                                         r"Gated, Linear, Residual"):
        BlockPlanner(OneOfEach(), "1GiB", block_classes=["Block"])
    policy = policy_from_dict({"scheduler": {"strategy": "auto", "block_classes": ["Residual", "Gated"]}},
                              source="p.yaml", name="p")
    monkeypatch.setattr(director, "is_installed", lambda: True)
    monkeypatch.setattr(director, "installation", lambda: SimpleNamespace(policy=policy, budget=1 << 30))
    planner = BlockPlanner(OneOfEach())
    try:
        assert [u.name for u in planner.units if u.kind == "block"] == ["encode", "decode"]
    finally:
        planner.remove()


def test_a_broadcast_input_is_not_parked_to_move_as_it_would_come_back_laid_out_otherwise():
    from um_alloc.planner.replay import _parkable
    cpu = torch.device("cpu")
    mask = torch.zeros(1, 1, 64, 64).expand(32, 1, 64, 64)  # transformers' mask, expanded to the batch
    assert not _parkable(mask, cpu, min_bytes=1024)
    assert _parkable(mask.contiguous(), cpu, min_bytes=1024)
    assert _parkable(torch.zeros(32, 64, 64).transpose(1, 2), cpu, min_bytes=1024)  # dense, permuted
    assert not _parkable(torch.zeros(8), cpu, min_bytes=1024)                       # small
    assert not _parkable(torch.nn.Parameter(torch.zeros(32, 64, 64)), cpu, min_bytes=1024)
    assert _parkable(torch.zeros(64).expand(1, 64), cpu, min_bytes=1)  # a stride of 0 over size 1 repeats nothing
