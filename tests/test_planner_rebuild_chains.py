"""Recipes that are trees of elementwise calls: GPT-2's GELU (0.5 * x * (1 + tanh(c * (x + k * x**3))))
rebuilds from x, which pow saves; a call several places read runs once in a unit's backward; a tree
whose leaf changed or whose graph differs is never rebuilt from."""
import copy
import dataclasses

import pytest
import torch

from um_alloc import rebuild as rebuild_module
from um_alloc.planner import BlockPlanner
from um_alloc.planner import rebuilt as rebuilt_module
from um_alloc.planner.rebuilt import Nested
from test_planner_rebuild import PackCounter, recipes_of

transformers = pytest.importorskip("transformers")

GELU_NODES = {"TanhBackward0", "AddBackward0", "MulBackward0"}


def tiny_gpt2(dtype=torch.float32):
    config = transformers.GPT2Config(vocab_size=97, n_embd=64, n_layer=3, n_head=2, n_positions=64,
                                     resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).train().to(dtype)


def loss_of(model, ids, autocast: bool):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model(input_ids=ids, labels=ids).loss


def planned(model, ids, autocast: bool) -> BlockPlanner:
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], lean_loss=False)
    planner._runtime.min_bytes = 1  # the tiny model's tensors are far below 1 MiB
    for _ in range(3):  # two calibration steps, then the plan
        loss_of(model, ids, autocast).backward()
        model.zero_grad()
    return planner


def ids_of(seed=2):
    return torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(seed))


def matches_plain(loss, model, plain, seed: int, autocast: bool = True) -> None:
    """`loss`, the planned model's on ids_of(seed) with its backward run, and the model's gradients
    are plain autograd's on the same tokens, bit for bit."""
    expected = loss_of(plain, ids_of(seed), autocast)
    expected.backward()
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def gelu_places(unit) -> dict:
    return {p: r for p, r in unit.places.items() if r.root == "call" and r.node in GELU_NODES}


@pytest.mark.parametrize("dtype, autocast", [(torch.float64, False), (torch.float32, True)], ids=["float64", "bf16"])
def test_gpt2s_gelu_rebuilds_and_trains_as_plain_autograd_does(monkeypatch, dtype, autocast):
    model = tiny_gpt2(dtype)
    plain = copy.deepcopy(model)
    ids = ids_of()
    planner = planned(model, ids, autocast)
    assert planner.plan.counts()["rebuild"] == 3
    for unit in recipes_of(planner).values():
        # t = tanh(...), 1 + t, 0.5 * x and their product (which the next linear saves as a view)
        assert sorted(r.node for r in gelu_places(unit).values()) == [
            "AddBackward0", "MulBackward0", "MulBackward0", "TanhBackward0"]
        assert any(isinstance(a, Nested) for r in gelu_places(unit).values() for a in r.args)
    counter = PackCounter(monkeypatch)
    for seed in (3, 4):  # two planned steps, other tokens
        loss = loss_of(model, ids_of(seed), autocast)
        loss.backward()
        matches_plain(loss, model, plain, seed, autocast)
    assert counter.rebuilt >= 2 * 3 * 4
    planner.remove()


@pytest.fixture
def pow_in_float32():
    """pow under CPU autocast as CUDA's autocast runs it: on a float32 copy of its input, which it
    saves (autograd's ToCopyBackward0 below its PowBackward0), instead of the bf16 input itself."""
    library = torch.library.Library("aten", "IMPL")

    def pow_widened(tensor, exponent):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)):
            return torch.ops.aten.pow.Tensor_Scalar(tensor.to(torch.float32), exponent)
    library.impl("pow.Tensor_Scalar", pow_widened, "AutocastCPU")
    yield
    library._destroy()


def test_a_gelu_whose_pow_saves_a_float32_copy_rebuilds_from_it(monkeypatch, pow_in_float32):
    """x itself is then saved by nothing: the trees read it as the float32 copy cast back to bf16."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    planner = planned(model, ids_of(), autocast=True)
    for unit in recipes_of(planner).values():
        assert sorted(r.node for r in gelu_places(unit).values()) == [
            "AddBackward0", "MulBackward0", "MulBackward0", "TanhBackward0"]
        half_x = next(r for r in gelu_places(unit).values() if r.node == "MulBackward0" and r.widened)
        assert [a.dtype for a in half_x.args if isinstance(a, rebuilt_module.Narrowed)] == [torch.bfloat16]
    counter = PackCounter(monkeypatch)
    loss = loss_of(model, ids_of(3), autocast=True)
    loss.backward()
    matches_plain(loss, model, plain, 3)
    assert counter.rebuilt >= 3 * 4
    planner.remove()


def test_pows_float32_copy_is_made_again_from_the_linears_product(monkeypatch, pow_in_float32):
    """That copy, twice the first linear's output in bytes, is held by nothing: backward makes it
    again from the linear's product of the second LayerNorm's output (itself made again from what
    that LayerNorm saves), once for pow and for the trees that read x back from it. Those that read
    x itself (0.5 * x) take the bf16 product the copy widens, not a cast of the copy."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    planner = planned(model, ids_of(), autocast=True)
    for unit in recipes_of(planner).values():
        (copy_place,) = [p for p, r in unit.places.items() if r.root == "call" and r.func is torch.addmm]
        assert unit.places[copy_place].cast is torch.float32 and copy_place in unit.held_places
    made, narrowed = [], []
    pack = rebuilt_module.RebuiltSaves._pack
    monkeypatch.setattr(rebuilt_module.RebuiltSaves, "_pack", lambda saves, t: _noted(pack(saves, t), made))
    narrow = rebuilt_module._MadeAgain.narrowed
    monkeypatch.setattr(rebuilt_module._MadeAgain, "narrowed", lambda entry, dtype: _noted_narrow(
        narrow(entry, dtype), narrowed))
    loss = loss_of(model, ids_of(3), autocast=True)
    assert len(made) == 3 and all(entry.tensor is None for entry in made)  # one a block, nothing held
    loss.backward()
    assert len(narrowed) >= 3 and all(t.dtype is torch.bfloat16 for t in narrowed)
    matches_plain(loss, model, plain, 3)
    planner.remove()


def _noted_narrow(tensor, narrowed: list):
    if tensor is not None:
        narrowed.append(tensor)
    return tensor


def _noted(packed, made: list):
    if type(packed) is rebuilt_module._MadeAgain:
        made.append(packed)
    return packed


class _SquaredCopy(torch.nn.Module):
    """A float32 copy of a linear's output (as RMSNorm's x.float()) that one call saves twice, and a
    bf16 cast of it that another saves."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.scale = torch.nn.Parameter(torch.randn(64))

    def forward(self, x):
        copy_ = self.inner(x).float()
        return x + self.outer(copy_ * copy_ + self.scale * copy_.bfloat16())


class _Copies(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_SquaredCopy() for _ in range(3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def test_a_float32_copy_saved_twice_is_made_again_for_both_saves(monkeypatch):
    """Both saves of the copy rebuild from the product (one base, made once), so no save of it is
    held; the bf16 cast of it, two casts from the product, is held."""
    torch.manual_seed(0)
    model, x = _Copies(), torch.randn(4, 8, 16, requires_grad=True)
    plain = copy.deepcopy(model)

    def loss_of_(net):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return net(x)
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], lean_loss=False)
    planner._runtime.min_bytes = 1
    for _ in range(3):
        loss_of_(model).backward()
        model.zero_grad()
    for unit in recipes_of(planner).values():
        copies = sorted(p for p, r in unit.places.items() if r.root == "call" and r.func is torch.nn.functional.linear)
        assert len(copies) == 2 and all(unit.places[p].cast is torch.float32 for p in copies)
        assert copies[0] + 2 in unit.held_places  # the bf16 cast, read by the sum's tree
    made = []
    pack = rebuilt_module.RebuiltSaves._pack
    monkeypatch.setattr(rebuilt_module.RebuiltSaves, "_pack", lambda saves, t: _noted(pack(saves, t), made))
    loss = loss_of_(model)
    loss.backward()
    expected = loss_of_(plain)
    expected.backward()
    planner.remove()
    assert len(made) == 3  # one a block: the save the sum's tree reads
    assert torch.equal(loss, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))


def test_no_recipe_reruns_a_product_where_it_makes_no_float32_copy():
    """Under CPU autocast pow saves x itself, the linear's bf16 output: rerunning the product would
    save its own bytes only, at nearly a recomputation's cost. x stays held."""
    model = tiny_gpt2()
    planner = planned(model, ids_of(), autocast=True)
    for unit in recipes_of(planner).values():
        assert not [r for r in unit.places.values() if r.root == "call" and r.func is torch.addmm]
        assert len(gelu_places(unit)) == 4
    planner.remove()


@pytest.fixture
def call_runs(monkeypatch) -> list:
    """The names of the functions recipes' calls run, in order, from when it is asked for."""
    runs = []
    run = rebuild_module.Call._run

    def counted(call, fetch, device_type):
        runs.append(call.func.__name__)
        return run(call, fetch, device_type)
    monkeypatch.setattr(rebuild_module.Call, "_run", counted)
    return runs


def test_a_call_trees_share_runs_once_per_unit_backward(request):
    """tanh is read by its own place, by 1 + t's and by the product's: one tanh per block in backward."""
    model = tiny_gpt2(torch.float64)
    ids = ids_of()
    planner = planned(model, ids, autocast=False)
    loss = loss_of(model, ids, autocast=False)
    runs = request.getfixturevalue("call_runs")  # only the planned step's backward counts
    loss.backward()
    planner.remove()
    # Per block: tanh, the four calls under it, 1 + t, 0.5 * x, the product: each once.
    assert runs.count("tanh") == 3 and runs.count("pow") == 3
    assert runs.count("mul") == 3 * 4 and runs.count("add") == 3 * 2


def test_calibration_times_a_shared_call_once(call_runs):
    """The probe makes each call of a unit call once, as replay does: its timings price that."""
    runs = call_runs
    model = tiny_gpt2(torch.float64)
    ids = ids_of()
    planner = BlockPlanner(model, "1GiB", decisions=["rebuild"], lean_loss=False)
    planner._runtime.min_bytes = 1
    loss_of(model, ids, autocast=False).backward()  # the step whose recomputations are probed
    planner.remove()
    assert runs.count("tanh") == 3 and runs.count("pow") == 3


def test_a_leaf_changed_in_place_after_forward_stops_backward():
    """x (the c_fc output pow saves, from which the GELU's tree rebuilds), scaled in place after the
    last block's forward: backward stops with the recipe's error, never a wrong gradient."""
    model = tiny_gpt2(torch.float64)
    ids = ids_of()
    planner = planned(model, ids, autocast=False)
    _rebuilt_packs.clear()
    loss = loss_of(model, ids, autocast=False)
    x = _last_tanh_source()
    with torch.no_grad():
        x.tensor.mul_(2)
    with pytest.raises(RuntimeError, match=r"a tensor of shape \(4, 32, 256\) that transformer.h.2 holds to rebuild "
                                           r"others from was changed in place after its forward \(version 0 -> 1\)"):
        loss.backward()
    planner.remove()


def _last_tanh_source():
    """What the last block's tanh tree reads: its x."""
    tanh = [p for p in _rebuilt_packs if getattr(p.recipe.root, "func", None) is torch.tanh]
    entries = {id(s.entry): s.entry for s in _sources(tanh[-1].recipe)}
    (entry,) = entries.values()
    return entry


_rebuilt_packs: list = []


def _sources(recipe):
    return [s for s in rebuild_module._leaves(recipe.root) if isinstance(s, rebuild_module.Source)]


@pytest.fixture(autouse=True)
def _note_rebuilt_packs(monkeypatch):
    _rebuilt_packs.clear()
    pack = rebuilt_module.RebuiltSaves._pack

    def noting(saves, tensor):
        out = pack(saves, tensor)
        if type(out) is rebuilt_module._Rebuilt:
            _rebuilt_packs.append(out)
        return out
    monkeypatch.setattr(rebuilt_module.RebuiltSaves, "_pack", noting)
    yield
    _rebuilt_packs.clear()


def _renamed_nested(recipe):
    """The recipe with its first nested call's node type changed: the graph differs there."""
    args = list(recipe.args)
    for k, a in enumerate(args):
        if isinstance(a, Nested):
            args[k] = Nested(a.route, dataclasses.replace(a.call, node="SigmoidBackward0"))
            return dataclasses.replace(recipe, args=tuple(args))
    return None


def _moved_nested(recipe):
    """The recipe with its first nested call read at another input of its reader's node."""
    args = list(recipe.args)
    for k, a in enumerate(args):
        if isinstance(a, Nested):
            args[k] = Nested((1 - a.route[0], *a.route[1:]), a.call)
            return dataclasses.replace(recipe, args=tuple(args))
    return None


@pytest.mark.parametrize("change", [_renamed_nested, _moved_nested], ids=["nested node", "nested edge"])
def test_a_tree_whose_graph_differs_is_kept(monkeypatch, change):
    model = tiny_gpt2(torch.float64)
    plain = copy.deepcopy(model)
    ids = ids_of()
    planner = planned(model, ids, autocast=False)
    changed_any = False
    for unit in recipes_of(planner).values():
        places = {p: change(r) for p, r in gelu_places(unit).items()}
        unit.places = {p: r for p, r in places.items() if r is not None}
        changed_any |= bool(unit.places)
    assert changed_any
    _rebuilt_packs.clear()
    loss_of(model, ids, autocast=False).backward()
    loss_of(plain, ids, autocast=False).backward()
    assert _rebuilt_packs == []
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), plain.parameters()))
    planner.remove()
