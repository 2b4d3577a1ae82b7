"""The rebuild decision on the CPU: calibration finds what a kept block can rebuild, replay rebuilds
it, and training is bit for bit plain autograd's; a recipe that does not rebuild equal is never used."""
import copy
import dataclasses

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision, UnitCost, evaluate
from um_alloc.planner import rebuild_probe as probe_module
from um_alloc.planner import rebuilt as rebuilt_module
from um_alloc.planner.rebuild_probe import route_to
from um_alloc.planner.rebuilt import MAX_ROUTE, Slot, reached
from um_alloc.planner.planning import Calibration, Segment
from um_alloc.rebuild import Recipe
from planner_helpers import ScaledAfter

transformers = pytest.importorskip("transformers")


def tiny_bert():
    config = transformers.BertConfig(vocab_size=97, hidden_size=64, num_hidden_layers=3, num_attention_heads=2,
                                     intermediate_size=256, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(config).train()


def loss_of(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as BERT trains on a GPU: casts to rebuild
        return model(input_ids=ids, labels=ids).loss


class PackCounter:
    """Counts what RebuiltSaves stood a recipe in for, and what it kept."""

    def __init__(self, monkeypatch):
        self.rebuilt = self.kept = 0
        pack = rebuilt_module.RebuiltSaves._pack

        def counting(saves, tensor):
            out = pack(saves, tensor)
            if type(out) in (rebuilt_module._Rebuilt, rebuilt_module._MadeAgain):
                self.rebuilt += 1
            else:
                self.kept += 1
            return out
        monkeypatch.setattr(rebuilt_module.RebuiltSaves, "_pack", counting)


def assert_nothing_rebuilt_and_plain_gradients(model, plain, ids, monkeypatch):
    counter = PackCounter(monkeypatch)
    loss_of(model, ids).backward()
    loss_of(plain, ids).backward()
    assert counter.rebuilt == 0
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def planned_rebuild(model, ids, steps: int = 3) -> BlockPlanner:
    """Two calibration steps, then planned steps allowed nothing but rebuild (and the safe mode)."""
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], lean_loss=False)
    planner._runtime.min_bytes = 1  # the tiny model's tensors are far below 1 MiB
    for _ in range(steps):
        loss_of(model, ids).backward()
        model.zero_grad()
    return planner


def test_rebuilt_blocks_train_as_plain_autograd_does(monkeypatch):
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    planner = planned_rebuild(model, ids)
    assert planner.plan.counts()["rebuild"] == 3
    counter = PackCounter(monkeypatch)
    loss = loss_of(model, ids)
    loss.backward()
    expected = loss_of(plain, ids)
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    # Per layer: the query, key and value casts of its input, the cast of a LayerNorm output, the
    # GELU output and the weights' casts are rebuilt; the rest is kept.
    assert counter.rebuilt == 3 * 11 and counter.kept > 0
    planner.remove()


def test_bases_are_told_apart_when_every_nodes_id_is_the_same(monkeypatch):
    """On PyTorch 2.11 a node's Python object is made afresh for each lookup and dropped at once,
    so ids repeat across distinct nodes. Here every id rebuilt.py asks for is the same: replay
    still rebuilds each save from its own base (plain autograd's gradients), and calibration still
    times each base replay builds, once."""
    monkeypatch.setattr(rebuilt_module, "id", lambda obj: 0, raising=False)
    probes, replays = [], []
    for cls, made in ((probe_module.RebuildProbe, probes), (rebuilt_module.RebuiltSaves, replays)):
        def noted(obj, *args, init=cls.__init__, made=made):
            init(obj, *args)
            made.append(obj)
        monkeypatch.setattr(cls, "__init__", noted)
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(2))
    planner = planned_rebuild(model, ids)
    replays.clear()
    loss = loss_of(model, ids)
    bases = [saves.bases for saves in replays]
    loss.backward()
    loss_of(plain, ids).backward()
    planner.remove()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    timed = [len(probe.timings) for probe in probes]
    assert len(bases) == 3 and bases == timed and min(bases) > 3


def recipes_of(planner: BlockPlanner) -> dict:
    return next(iter(planner._shapes.values())).recipes


def outline(recipe) -> tuple:
    """What a place's recipe does, without the tensors and parameters it reads."""
    what = recipe.func.__name__ if recipe.root == "call" else getattr(recipe.source, "kind", "")
    return recipe.root, what, recipe.cast, recipe.size, recipe.stride, recipe.path


def test_calibration_names_the_places_and_their_recipes():
    model = tiny_bert()
    ids = torch.randint(0, 97, (4, 32))
    planner = planned_rebuild(model, ids)
    recipes = recipes_of(planner)
    blocks = [j for j, u in enumerate(planner.units) if u.kind == "block"]
    assert sorted(recipes) == blocks
    roots = {outline(r)[:2] for r in recipes[blocks[0]].places.values()}
    assert roots == {("call", "layer_norm"), ("call", "gelu"), ("held", "input"), ("param", "")}
    outlines = [{p: outline(r) for p, r in recipes[j].places.items()} for j in blocks]
    assert all(o == outlines[0] for o in outlines)  # the same layer, the same places
    # Replay holds only what recipes read: the block's input, and the inputs of the LayerNorm after
    # the attention and of the GELU (the last LayerNorm's output leaves the block; the next one's
    # linears save their casts of it).
    sources = recipes[blocks[0]].sources
    assert Slot("input", 0) in sources and len(sources) == 3
    planner.remove()


def test_a_recipe_that_does_not_rebuild_equal_is_never_used(monkeypatch):
    build = Recipe.build_base
    monkeypatch.setattr(Recipe, "build_base", lambda self, fetch, device: build(self, fetch, device) + 1)
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 32))
    planner = planned_rebuild(model, ids)
    assert {j: r.places for j, r in recipes_of(planner).items()} == {j: {} for j, u in enumerate(planner.units)
                                                                     if u.kind == "block"}
    assert_nothing_rebuilt_and_plain_gradients(model, plain, ids, monkeypatch)
    planner.remove()


def rebound_to_the_input(recipe):
    """A LayerNorm's recipe made to read the block's input, of its own input's dtype and shape."""
    (slot, *meta), = recipe.reads
    args = tuple(Slot("input", 0) if a == slot else a for a in recipe.args)
    edges = tuple((Slot("input", 0), index) for _, index in recipe.edges)
    return dataclasses.replace(recipe, args=args, edges=edges, reads=((Slot("input", 0), *meta),))


@pytest.mark.parametrize("change", [
    lambda r: dataclasses.replace(r, size=(1,) * len(r.size)),                      # another shape
    lambda r: dataclasses.replace(r, path=("TanhBackward0",) * len(r.path)),         # another autograd path
    lambda r: dataclasses.replace(r, node="TanhBackward0") if r.root == "call" else None,  # another function
    lambda r: rebound_to_the_input(r) if outline(r)[:2] == ("call", "layer_norm") else None,
], ids=["shape", "path", "function", "reads another tensor of the same shape"])
def test_a_save_that_differs_from_calibrations_is_kept(monkeypatch, change):
    """Replay rebuilds a place only where the tensor, its autograd path and the tensors its root
    read are calibration's."""
    model = tiny_bert()
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 97, (4, 32))
    planner = planned_rebuild(model, ids)
    for unit in recipes_of(planner).values():
        changed = {p: change(r) for p, r in unit.places.items()}
        unit.places = {p: r for p, r in changed.items() if r is not None}
    assert any(unit.places for unit in recipes_of(planner).values())
    assert_nothing_rebuilt_and_plain_gradients(model, plain, ids, monkeypatch)
    planner.remove()


def _calibration(rebuildable: int) -> Calibration:
    """Four blocks of 1 GiB saved each, `rebuildable` of it rebuilt in 0.1 ms; a safe step whose
    segments hold every block until backward reaches it."""
    gib = 1 << 30
    units = tuple(UnitCost(f"layer.{j}", "block", forward_s=4e-3, recompute_s=2e-3, saved_bytes=gib,
                           input_bytes=64 << 20, hide_s=0.0, rebuildable_bytes=rebuildable,
                           rebuild_s=1e-4, rebuild_cpu_s=5e-5, backward_s=4e-3, backward_cpu_s=3e-3)
                  for j in range(4)) + (UnitCost("(outside the units)", "gap", 0.0),)
    segments = (Segment("end of forward", 2 * gib, held=(0, 1, 2, 3)),)
    return Calibration(units, segments, step_s=0.05, link_bytes_per_s=50e9)


def test_rebuilding_keeps_more_blocks_in_the_same_budget():
    from um_alloc.planner import make_plan
    budget = (2 << 30) + (512 << 20) + 2 * (1 << 30) + (256 << 20)  # room for two kept blocks, not three
    allowed = frozenset({Decision.KEEP, Decision.REBUILD, Decision.RECOMPUTE})
    plain = make_plan(_calibration(0), budget, allowed=allowed)
    lean = make_plan(_calibration(600 << 20), budget, allowed=allowed)
    assert plain.decisions[:4].count(Decision.KEEP) == 2 and Decision.REBUILD not in plain.decisions
    assert lean.decisions[:4] == (Decision.REBUILD,) * 4  # 488 MiB each instead of 1088
    assert lean.predicted_step_s < plain.predicted_step_s
    assert lean.predicted_peak_bytes <= lean.limit_bytes


def test_a_rebuild_costs_what_it_adds_on_the_slower_clock():
    unit = _calibration(600 << 20).units[0]
    assert unit.retained(Decision.REBUILD) == unit.retained(Decision.KEEP) - (600 << 20)
    # backward: 4 ms on the GPU, 3 ms on the host; the rebuild: 0.1 ms and 0.05 ms -> the GPU's 0.1 ms
    assert unit.cost_s(Decision.REBUILD) == pytest.approx(1e-4)
    # With nothing to rebuild, rebuild is keep: the plan prefers keep on a tie.
    plan = evaluate(_calibration(0), (Decision.REBUILD,) * 4 + (Decision.KEEP,), 64 << 30)
    assert plan.predicted_step_s == evaluate(_calibration(0), (Decision.KEEP,) * 5, 64 << 30).predicted_step_s


def test_calibration_counts_the_bytes_replay_rebuilds(monkeypatch):
    """The moved input a calibration recomputes from is a leaf: autocast must not cache its cast,
    or the query, key and value projections would share one where forward makes three."""
    model = tiny_bert()
    ids = torch.randint(0, 97, (4, 32))
    planner = planned_rebuild(model, ids)
    made = []
    init = rebuilt_module.RebuiltSaves.__init__
    monkeypatch.setattr(rebuilt_module.RebuiltSaves, "__init__",
                        lambda saves, *args: init(saves, *args) or made.append(saves))
    loss_of(model, ids).backward()
    first = next(iter(planner._shapes.values())).first
    calibrated = [first[j]["rebuildable_bytes"] for j, u in enumerate(planner.units) if u.kind == "block"]
    assert calibrated == [saves.rebuilt_bytes for saves in made] and all(calibrated)
    finding = [first[j]["rebuild_forward_cpu_s"] for j, u in enumerate(planner.units) if u.kind == "block"]
    assert all(0 < seconds < 1 for seconds in finding)  # the host's time of finding them, timed
    planner.remove()


def test_a_held_input_changed_in_place_after_its_block_stops_backward():
    """The blocks' linears save bf16 casts of their input, which the model then scales in place:
    plain autograd is content (it saved the casts), a rebuild from the scaled input would not be."""

    torch.manual_seed(0)
    model, x = ScaledAfter(), torch.randn(4, 8, requires_grad=True)
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], lean_loss=False)
    planner._runtime.min_bytes = 1
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x).backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(x)
    assert planner.plan.counts()["rebuild"] == 2
    assert all(("held", "input") in {outline(r)[:2] for r in unit.places.values()}  # casts of each block's input
               for unit in recipes_of(planner).values())
    with pytest.raises(RuntimeError, match=r"a tensor of shape \(4, 8\) that blocks.1 holds to rebuild others from "
                                           r"was changed in place after its forward \(version 0 -> 1\)"):
        loss.backward()
    planner.remove()


@pytest.mark.parametrize("decision", ["keep", "rebuild", "recompute_moved"])
def test_no_step_leaves_its_activations_for_the_cycle_collector(decision):
    """After each step's backward nothing of its forward is alive, also while Python's cycle
    collector does not run: on a GPU, a calibration step whose activations waited for it held a
    whole step's memory at the optimizer step and ran out of memory there."""
    import gc

    # Large enough that its saved tensors pass the planner's smallest size (1 MiB) and are rebuilt.
    config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = transformers.BertForMaskedLM(config).train()
    planner = BlockPlanner(model, "1GiB", decisions=[decision])
    scores_shape = (8, 4, 128, 64)  # batch, heads, sequence, head size: the attention's query, key and value
    gc.collect()
    gc.disable()
    try:
        for step in range(3):  # two calibration steps (rebuilds compared in the first), then the plan
            ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(step))
            model(input_ids=ids, labels=ids).loss.backward()
            alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == scores_shape]
            assert alive == [], f"step {step}: {len(alive)} query/key/value tensors still alive after backward"
    finally:
        gc.enable()
        planner.remove()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("decision", ["keep", "rebuild", "move", "recompute", "recompute_moved"])
def test_a_step_that_fails_leaves_nothing_of_itself_alive(decision, where):
    """An error in a step (out of memory at the loss, after the blocks' forward, or in backward
    between the blocks) leaves none of the step's tensors alive once it is handled: a loop that
    runs the step again has the room it had. A saved-tensor hook that hands autograd back the
    tensor it was given makes a cycle through autograd's C++, which Python's cycle collector
    cannot see, wherever an op saves its own output; so does anything reaching the step's graph
    from the hooks' object, which every saved tensor holds: only backward would break them."""
    import gc

    config = transformers.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(config).train()
    planner = BlockPlanner(model, "1GiB", decisions=[decision])
    planner._runtime.min_bytes = 1
    scores_shape = (8, 4, 128, 64)  # batch, heads, sequence, head size: the attention's query, key and value

    def fail(*_):
        raise torch.OutOfMemoryError(f"raised in {where}")

    def fail_in_backward(module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(fail)  # backward fails where it reaches the first layer's output

    try:
        for step in range(4):  # two calibration steps, then the plan; the fourth fails
            ids = torch.randint(0, 1000, (8, 128), generator=torch.Generator().manual_seed(step))
            if step < 3:
                loss_of(model, ids).backward()
                model.zero_grad(set_to_none=True)
                continue
            failing = model.cls if where == "forward" else model.bert.encoder.layer[0]
            handle = failing.register_forward_hook(fail if where == "forward" else fail_in_backward)
            try:  # not pytest.raises, whose record of the error would hold the failed step's frames
                loss_of(model, ids).backward()
            except torch.OutOfMemoryError as error:
                assert f"raised in {where}" in str(error)
            else:
                pytest.fail("the step did not fail")
            handle.remove()
        assert planner.plan.counts().get(decision, 0) >= 1
        gc.collect()
        alive = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and tuple(o.shape) == scores_shape]
        assert alive == [], f"{len(alive)} query/key/value tensors of the failed step still alive"
    finally:
        planner.remove()


def test_a_large_saves_rebuild_is_compared_a_slice_at_a_time(monkeypatch):
    """The comparison's temporary is a byte per byte compared: a large saved tensor is compared in
    slices, and a difference in any of them, the last included, is found."""
    monkeypatch.setattr(probe_module, "COMPARED_BYTES", 16)
    saved = torch.arange(40, dtype=torch.float32)        # 160 bytes: ten slices
    assert not bool(probe_module._differs(saved.clone(), saved))
    for where in (0, 17, 39):
        changed = saved.clone()
        changed[where] += 1
        assert bool(probe_module._differs(changed, saved))
    small = torch.arange(3, dtype=torch.float32)          # 12 bytes: one comparison
    assert not bool(probe_module._differs(small.clone(), small))
    assert probe_module._differs(saved.view(4, 10), saved.view(10, 4)) is True


def test_a_route_steps_through_the_nodes_a_call_makes_itself():
    """A linear under autocast reads its input through its own cast, view and product: replay
    follows the route calibration found, node type by node type, to the input's edge."""
    weight, bias = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8))
    x = torch.randn(2, 3, 4, requires_grad=True) * 1.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, weight, bias)
    inputs = y.grad_fn.next_functions
    route = route_to(inputs, x.grad_fn, x.output_nr)
    assert route == (0, "AddmmBackward0", 1, "ViewBackward0", 0, "ToCopyBackward0", 0)
    assert reached(inputs, route) == (x.grad_fn, 0)
    assert reached(inputs, (0, "MmBackward0", *route[2:])) is None      # another node on the way
    assert reached(inputs, (*route[:-1], 5)) is None                      # past the node's inputs
    deep = x
    for _ in range(MAX_ROUTE + 1):
        deep = deep.view(-1).view(2, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        far = torch.nn.functional.linear(deep, weight, bias)
    assert route_to(far.grad_fn.next_functions, x.grad_fn, x.output_nr) is None  # too far below
