"""Rebuild trees as one kernel (um_alloc.planner.fused_tree), on the CPU: the program a tree is
written as, evaluated here with PyTorch's own CPU operations one rounding at a time, gives the
eager tree's bits; a call the table lacks is made by itself and read as one of the program's
tensors, its reads counted as eager calls count them; a planned GPT-2 whose GELU trees run as
programs trains as plain autograd, its trees' inner calls never run in backward; trees the table
cannot write stay eager. A tree whose output is bf16, or cast to it, reads the bf16 tensors its
float32 copies widen and writes bf16 itself, where that gives the bits of the float32 kernel cast.

The kernel itself needs CUDA's runtime compiler: tests/test_gpu_fused_tree.py runs it."""
import copy
import gc
import math
import weakref

import pytest
import torch

from um_alloc import rebuild as rebuild_module
from um_alloc.planner import fused_tree, rebuilt
from um_alloc.planner.fused_tree import tree_program
from um_alloc.planner.rebuilt import count_reads
from um_alloc.rebuild import Call, Shared, Source
from test_planner_rebuild import recipes_of
from test_planner_rebuild_chains import ids_of, loss_of, matches_plain, planned, pow_in_float32, tiny_gpt2  # noqa: F401

T = torch.Tensor
NO_AUTOCAST = (False, torch.bfloat16)

_OPERATIONS = {"mul": torch.mul, "add": torch.add, "sub": torch.sub, "div": torch.div, "neg": torch.neg,
               "tanh": torch.tanh, "exp": torch.exp, "rsqrt": torch.rsqrt,
               "bf16": lambda t: t.to(torch.bfloat16).float()}


def evaluate(program: tuple, leaves: list) -> torch.Tensor:
    """A tree's program run with PyTorch's float32 CPU operations, each rounded once."""
    lines, result = program
    values = []

    def value(node):
        kind = node[0]
        if kind == "leaf":
            return leaves[node[1]]
        if kind == "const":
            return torch.tensor(node[1], dtype=torch.float32)
        if kind == "var":
            return values[node[1]]
        return _OPERATIONS[kind](*(value(n) for n in node[1:]))

    for line in lines:
        values.append(value(line))
    return value(result)


def call(func, *args, **kwargs) -> Call:
    return Call(func, args, kwargs, NO_AUTOCAST, 0)


def program_of(tree: Call):
    dtypes = {}
    with torch.no_grad():
        fused_tree._eager(tree, lambda e: e, "cpu", dtypes)
    return tree_program(tree, dtypes)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32 if tensor.dtype == torch.float32 else torch.int16)


@pytest.fixture
def programs_run_on_the_cpu(monkeypatch):
    """Trees fuse on the CPU too, their 'kernel' being their program evaluated by `evaluate`; the
    comparison with the eager tree is the one the GPU makes. Yields the kernels made."""
    made = []
    monkeypatch.setattr(fused_tree, "DEVICE_TYPES", ("cpu", "cuda"))
    monkeypatch.setattr(fused_tree, "_VERDICTS", {})
    monkeypatch.setattr(fused_tree, "_NARROW_VERDICTS", {})
    monkeypatch.setattr(fused_tree.FusedTree, "_launch", lambda self, leaves: made.append(self) or
                        as_jiterator_writes(evaluate(self.program, [leaf.float() for leaf in leaves]), leaves))
    monkeypatch.setattr(fused_tree, "_GROUP_VERDICTS", {})
    yield made


@pytest.fixture
def groups_run_on_the_cpu(programs_run_on_the_cpu, monkeypatch):
    """A copy's group kernel as the CPU runs it: the copy widened, each member's program evaluated
    on it and written in the member's dtype. Yields the names of the members' calls, a list a launch."""
    launched = []

    def launch(group, code, name, narrow, outs, members):
        launched.append([member.call.func.__name__ for member, _ in members])
        wide = narrow.float()
        outs[0].copy_(wide)
        for out, (member, _) in zip(outs[1:], members):
            out.copy_(evaluate(member.program, [wide.view(out.shape)]))
    monkeypatch.setattr(fused_tree.FusedGroup, "_launch", launch)
    yield launched


def as_jiterator_writes(out: torch.Tensor, leaves: list) -> torch.Tensor:
    """jiterator's kernel computes in float32 from its tensors and writes the dtype they promote to."""
    dtype = leaves[0].dtype
    for leaf in leaves[1:]:
        dtype = torch.promote_types(dtype, leaf.dtype)
    return out.to(dtype)


def test_the_programs_of_arithmetic_trees():
    x, y = Source(torch.randn(64)), Source(torch.randn(64))
    one_minus_over_three = call(T.__truediv__, call(T.__rsub__, x, 1.0), 3.0)
    lines, result, leaves = program_of(one_minus_over_three)
    third = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(3.0, dtype=torch.float32)
    assert lines == [("sub", ("const", 1.0), ("leaf", 0)), ("mul", ("var", 0), ("const", third.item()))]
    assert result == ("var", 1) and leaves == 1
    # x read twice is one leaf; the divisor a tensor: a division
    lines, _, leaves = program_of(call(torch.div, call(torch.sub, x, y), call(T.__mul__, x, x)))
    assert leaves == 2 and lines[-1] == ("div", ("var", 0), ("var", 1))
    # Tensor.__rtruediv__ is reciprocal(self) * other
    lines, _, _ = program_of(call(T.__rtruediv__, x, 2.0))
    assert lines == [("mul", ("div", ("const", 1.0), ("leaf", 0)), ("const", 2.0))]
    lines, _, _ = program_of(call(T.__mul__, x, call(torch.sigmoid, x)))
    assert lines[0] == ("div", ("const", 1.0), ("add", ("const", 1.0), ("exp", ("neg", ("leaf", 0)))))


def test_a_bfloat16_call_is_rounded_after_it_and_its_cube_after_each_product():
    b = Source(torch.randn(64).to(torch.bfloat16))
    lines, _, _ = program_of(call(T.__sub__, call(torch.pow, b, 3), b))
    square = ("mul", ("leaf", 0), ("leaf", 0))
    assert lines == [("bf16", ("mul", ("bf16", square), ("leaf", 0))), ("bf16", ("sub", ("var", 0), ("leaf", 0)))]


@pytest.mark.parametrize("tree", [
    lambda x: call(torch.add, x, call(T.__mul__, x, x), alpha=2),          # alpha other than 1
    lambda x: call(T.__add__, x, call(torch.pow, x, 4)),                   # an exponent ATen does not multiply
    lambda x: call(torch.div, call(T.__mul__, x, x), 2.0, rounding_mode="floor"),
    lambda x: call(T.__add__, call(T.__mul__, Source(x.entry.double()), x), 1.0),  # float64
    lambda x: call(T.__mul__, x, call(T.__add__, x, 1e39)),               # past float32's range
    lambda x: _sum_of_leaves(9),                                           # more leaves than a kernel takes
], ids=["alpha", "pow 4", "floor division", "float64", "overflow", "nine leaves"])
def test_trees_the_table_cannot_write_have_no_program(tree):
    assert program_of(tree(Source(torch.randn(64)))) is None


def test_a_call_the_table_lacks_is_one_of_the_programs_tensors(programs_run_on_the_cpu):
    """sin (as a linear would) is made by itself, once, and read by the program as a leaf: the
    eager tree's bits, and its reads counted down as the calls that read it give theirs up."""
    x = Source(torch.randn(256) * 3)
    sine = call(torch.sin, x)
    tree = call(T.__mul__, call(T.__add__, x, sine), call(T.__rmul__, sine, 0.5))
    lines, result, leaves = program_of(tree)
    assert leaves == 2 and lines[0] == ("add", ("leaf", 0), ("leaf", 1))
    with torch.no_grad():
        eager = tree.run(lambda e: e, "cpu")
    tree.fused = fused_tree.fuse(tree, lambda e: e, "cpu")
    assert tree.fused is not None
    count_reads(tree)
    assert sine.shared.uses == 2  # read by the sum and by the half
    made = []
    run = sine._run
    sine._run = lambda fetch, device: made.append(1) or run(fetch, device)
    with torch.no_grad():
        fused = tree.run(lambda e: e, "cpu")
    assert torch.equal(bits(fused), bits(eager)) and made == [1]
    assert sine.shared.uses == 0 and sine.shared.tensor is None


def _sum_of_leaves(count: int) -> Call:
    tree = Source(torch.randn(8))
    for _ in range(count - 1):
        tree = call(T.__add__, tree, Source(torch.randn(8)))
    return tree


def test_a_single_call_or_a_cpu_tree_is_not_fused():
    x = Source(torch.randn(64))
    assert fused_tree.fuse(call(T.__mul__, x, 0.5), lambda e: e, "cpu") is None
    assert fused_tree.fuse(call(T.__mul__, x, call(torch.tanh, x)), lambda e: e, "cpu") is None


def test_arithmetic_and_gelu_programs_give_the_eager_bits(programs_run_on_the_cpu):
    x, b = torch.randn(4096) * 3, (torch.randn(4096) * 3).to(torch.bfloat16)
    trees = {
        "gelu": _gelu(Source(x)),
        "gelu_bf16": _gelu(Source(b)),
        "rsub": call(T.__rsub__, call(T.__mul__, Source(x), Source(x)), 1.0),
        "neg_exp": call(T.__sub__, call(torch.exp, call(T.__neg__, Source(x))), Source(x)),
        "half_bf16": call(T.__add__, call(T.__rmul__, Source(b), 0.5), Source(b)),
    }
    for name, tree in trees.items():
        kernel = fused_tree.fuse(tree, lambda e: e, "cpu")
        assert kernel is not None, name
        tree.fused = kernel
        with torch.no_grad():
            fused = tree.run(lambda e: e, "cpu")
            tree.fused = None
            eager = tree.run(lambda e: e, "cpu")
        assert fused.dtype == eager.dtype and torch.equal(bits(fused), bits(eager)), name


def _gelu(x: Source) -> Call:
    cube = call(torch.pow, x, 3.0)
    inner = call(T.__add__, x, call(T.__rmul__, cube, 0.044715))
    one_plus = call(T.__radd__, call(torch.tanh, call(T.__rmul__, inner, math.sqrt(2.0 / math.pi))), 1.0)
    return call(T.__mul__, call(T.__rmul__, x, 0.5), one_plus)


def test_a_program_that_differs_from_the_eager_tree_is_not_used(monkeypatch, programs_run_on_the_cpu):
    monkeypatch.setattr(fused_tree.FusedTree, "_launch", lambda self, leaves: evaluate(self.program, leaves) + 1e-3)
    assert fused_tree.fuse(_gelu(Source(torch.randn(256))), lambda e: e, "cpu") is None


class _Widened:
    """A held entry whose float32 tensor is a widening of a bf16 one it still has (rebuilt.py's
    _MadeAgain: the GELU's float32 copy made again from the linear's bf16 product)."""

    def __init__(self, narrow: torch.Tensor):
        self.narrow, self.wide = narrow, narrow.float()

    def narrowed(self, dtype: torch.dtype) -> torch.Tensor | None:
        return self.narrow if dtype is self.narrow.dtype else None


def _launches_of(monkeypatch) -> list:
    """The dtypes of the tensors each kernel launch reads."""
    launched, launch = [], fused_tree.FusedTree._launch
    monkeypatch.setattr(fused_tree.FusedTree, "_launch", lambda self, leaves: launched.append(
        [leaf.dtype for leaf in leaves]) or launch(self, leaves))
    return launched


def test_a_bf16_tree_reads_the_bf16_tensors_its_copies_widen(programs_run_on_the_cpu, monkeypatch):
    """Read through float32 copies that widen bf16 tensors backward still has, a tree whose output
    is bf16 takes those: jiterator's kernel writes bf16 itself, the bits of the float32 kernel's
    output cast; where a copy has no bf16 form left, the float32 kernel and a cast run."""
    b = (torch.randn(4096) * 3).to(torch.bfloat16)
    entry = _Widened(b)
    fetch = lambda e: e.wide if isinstance(e, _Widened) else e  # noqa: E731
    tree = _gelu(Source(entry, cast=torch.bfloat16))
    tree.fused = fused_tree.fuse(tree, fetch, "cpu")
    assert tree.fused is not None and tree.fused.dtype is torch.bfloat16
    launched = _launches_of(monkeypatch)
    with torch.no_grad():
        made = tree.run(fetch, "cpu")
        assert launched[-1] == [torch.bfloat16]  # after the first comparison with the float32 kernel
        entry.narrowed = lambda dtype: None  # its bf16 tensor let go
        wide = tree.run(fetch, "cpu")
        assert launched[-1] == [torch.float32]
        tree.fused = None
        eager = tree.run(fetch, "cpu")
    assert made.dtype is wide.dtype is eager.dtype is torch.bfloat16
    assert torch.equal(bits(made), bits(eager)) and torch.equal(bits(wide), bits(eager))


def test_a_tree_cast_to_bf16_by_its_recipe_writes_bf16_itself(programs_run_on_the_cpu, monkeypatch):
    """A float32 tree whose recipe casts it to bf16 (the GELU's output, which the next linear
    saves cast): given the bf16 tensors, the kernel writes the cast itself, with its bits."""
    entry = _Widened((torch.randn(4096) * 3).to(torch.bfloat16))
    fetch = lambda e: e.wide  # noqa: E731
    x = Source(entry, cast=torch.bfloat16)
    tree = call(T.__mul__, call(T.__rmul__, x, 0.5), call(T.__radd__, call(torch.tanh, Source(entry)), 1.0))
    tree.fused = fused_tree.fuse(tree, fetch, "cpu")
    assert tree.fused is not None and tree.fused.dtype is torch.float32
    launched = _launches_of(monkeypatch)
    with torch.no_grad():
        made = tree.run_cast(fetch, "cpu", torch.bfloat16)
        tree.fused = None
        eager = tree.run(fetch, "cpu").to(torch.bfloat16)
    assert launched[-1] == [torch.bfloat16]
    assert made.dtype is torch.bfloat16 and torch.equal(bits(made), bits(eager))


def test_a_tree_two_recipes_read_is_made_once_in_float32_and_cast_for_each(programs_run_on_the_cpu, monkeypatch):
    """Where the root is read twice (two saves of its output), run_cast makes the float32 output
    once, for both, and lets it go after the second: the kernel writes no bf16 of its own."""
    entry = _Widened((torch.randn(256) * 3).to(torch.bfloat16))
    fetch = lambda e: e.wide  # noqa: E731
    tree = call(T.__mul__, call(T.__rmul__, Source(entry, cast=torch.bfloat16), 0.5),
                call(T.__radd__, call(torch.tanh, Source(entry)), 1.0))
    tree.fused = fused_tree.fuse(tree, fetch, "cpu")
    count_reads(tree)
    count_reads(tree)
    launched = _launches_of(monkeypatch)
    with torch.no_grad():
        first = tree.run_cast(fetch, "cpu", torch.bfloat16)
        assert tree.shared.uses == 1 and tree.shared.tensor is not None
        second = tree.run_cast(fetch, "cpu", torch.bfloat16)
    assert launched == [[torch.float32]]
    assert tree.shared.uses == 0 and tree.shared.tensor is None
    assert torch.equal(bits(first), bits(second)) and first.dtype is torch.bfloat16


def test_narrow_tensors_that_change_the_bits_are_not_used(programs_run_on_the_cpu, monkeypatch):
    entry = _Widened((torch.randn(256) * 3).to(torch.bfloat16))
    fetch = lambda e: e.wide  # noqa: E731
    launch = fused_tree.FusedTree._launch
    monkeypatch.setattr(fused_tree.FusedTree, "_launch", lambda self, leaves: launch(self, leaves) + 1.0
                        if leaves[0].dtype is torch.bfloat16 else launch(self, leaves))
    tree = _gelu(Source(entry, cast=torch.bfloat16))
    tree.fused = fused_tree.fuse(tree, fetch, "cpu")
    assert tree.fused is not None  # the float32 kernel, cast, still gives the eager bits
    with torch.no_grad():
        made = tree.run(fetch, "cpu")
        tree.fused = None
        eager = tree.run(fetch, "cpu")
    assert torch.equal(bits(made), bits(eager))
    assert list(fused_tree._NARROW_VERDICTS.values()) == [False]


def test_a_fused_root_releases_the_calls_it_did_not_run(programs_run_on_the_cpu):
    """Replay counts each nested call's reads; a fused root reads none of their outputs, and must
    not leave them held until the tree is dropped."""
    x = Source(torch.randn(256))
    tanh = call(torch.tanh, call(T.__rmul__, Source(x.entry), 2.0))
    one_plus, product = call(T.__radd__, tanh, 1.0), call(T.__mul__, tanh, Source(x.entry))
    for root in (one_plus, product):
        root.fused = fused_tree.fuse(root, lambda e: e, "cpu")
        assert root.fused is not None
        count_reads(root)
    assert tanh.shared.uses == 2
    with torch.no_grad():
        one_plus.run(lambda e: e, "cpu")
        assert tanh.shared.uses == 1
        product.run(lambda e: e, "cpu")
    assert tanh.shared.uses == 0 and tanh.shared.tensor is None
    skipped = Shared(uses=1, tensor=torch.ones(1))
    made = call(torch.tanh, Source(torch.ones(1)))
    made.shared = skipped
    made.skip()
    assert skipped.tensor is None


def test_a_planned_gpt2_with_fused_gelu_trees_trains_as_plain_autograd(pow_in_float32, programs_run_on_the_cpu,  # noqa: F811
                                                                       monkeypatch):
    """Under autocast with pow in float32 as CUDA runs it: each block's tanh, 1 + tanh and product
    run as their programs, from autocast's float32 copy of x, which the first linear's product
    makes again once; no call inside them runs in backward."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    planner = planned(model, ids_of(), autocast=True)
    for unit in recipes_of(planner).values():
        assert sorted(unit.places[p].node for p in unit.fused) == ["AddBackward0", "MulBackward0", "TanhBackward0"]
    runs, launched = [], len(programs_run_on_the_cpu)
    leaves = _launches_of(monkeypatch)
    run = rebuild_module.Call._run
    monkeypatch.setattr(rebuild_module.Call, "_run", lambda c, fetch, device: runs.append(c.func.__name__)
                        or run(c, fetch, device))
    for seed in (3, 4):
        loss = loss_of(model, ids_of(seed), autocast=True)
        loss.backward()
        matches_plain(loss, model, plain, seed)
    # Per block and step: two roots run (tanh's, 1 + t's) and 0.5 * x, a single call, with the
    # LayerNorms, and x made again (the linear's product of the second LayerNorm's output, viewed
    # as a matrix); the product's root, cast, is its kernel alone (Call.run_cast). No call inside a
    # tree runs (pow, the inner mul and add).
    assert sorted(runs) == sorted(["tanh", "add", "mul", "layer_norm", "layer_norm", "addmm", "view"] * 3 * 2)
    assert len(programs_run_on_the_cpu) - launched == 3 * 3 * 2
    # The product's tree, cast to bf16 for the second linear, reads the first linear's bf16 product
    # that the float32 copy widens, and writes bf16 itself; tanh's and 1 + t's write float32.
    assert sorted(map(str, leaves)) == sorted((["[torch.bfloat16]"] + ["[torch.float32]"] * 2) * 3 * 2)
    planner.remove()


def test_a_planned_gpt2s_gelu_is_made_with_its_copy_in_one_kernel(pow_in_float32, groups_run_on_the_cpu,  # noqa: F811
                                                                    monkeypatch):
    """Each block's tanh, 1 + t, 0.5 * x and the product cast to bf16 read nothing but autocast's
    float32 copy of x: one kernel makes them with the copy from the first linear's bf16 product,
    backward takes each as it comes, and training is plain autograd's, bit for bit."""
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    planner = planned(model, ids_of(), autocast=True)
    launched, trees_launched = len(groups_run_on_the_cpu), []
    taken, take = [], fused_tree.FusedGroup.take
    monkeypatch.setattr(fused_tree.FusedGroup, "take", lambda group, call, fetch, dtype: taken.append(
        (call.func.__name__, take(group, call, fetch, dtype))) or taken[-1][1])
    monkeypatch.setattr(fused_tree.FusedTree, "_wide", lambda tree, call, fetch: trees_launched.append(tree))
    groups, init = [], fused_tree.FusedGroup.__init__
    monkeypatch.setattr(fused_tree.FusedGroup, "__init__", lambda group, entry, *args: groups.extend(
        [weakref.ref(group), weakref.ref(entry)]) or init(group, entry, *args))
    walks, only_source = [], rebuilt.only_source
    monkeypatch.setattr(rebuilt, "only_source", lambda call: walks.append(call) or only_source(call))
    gc.disable()  # what refcounting alone frees
    try:
        for seed in (3, 4):
            loss = loss_of(model, ids_of(seed), autocast=True)
            loss.backward()
            matches_plain(loss, model, plain, seed)
            del loss
            # The groups and the copies made again (with their originals) go with the step's
            # graph: no cycle that only the cycle collector would free.
            assert len(groups) == 2 * 3 * (seed - 2) and not any(ref() for ref in groups)
    finally:
        gc.enable()
    # One kernel a block and step, for four members, each taken once in the dtype its reader reads.
    assert [len(calls) for calls in groups_run_on_the_cpu[launched:]] == [4] * 3 * 2
    assert sorted(name for name, _ in taken) == sorted(["tanh", "add", "mul", "mul"] * 3 * 2)
    assert all(made is not None for _, made in taken)
    assert not trees_launched  # no tree ran as its own kernel
    assert not walks  # which recipes join, and which never do, was found in the planned steps before
    planner.remove()


def test_a_group_kernel_that_differs_is_not_used(pow_in_float32, groups_run_on_the_cpu, monkeypatch):  # noqa: F811
    """Compared with each member made by itself the first time, a kernel whose output differs is
    never used: the members make their own, and training is still plain autograd's."""
    launch = fused_tree.FusedGroup._launch

    def off_by_one(group, code, name, narrow, outs, members):
        launch(group, code, name, narrow, outs, members)
        outs[-1].add_(1)
    monkeypatch.setattr(fused_tree.FusedGroup, "_launch", off_by_one)
    model = tiny_gpt2()
    plain = copy.deepcopy(model)
    planner = planned(model, ids_of(), autocast=True)
    loss = loss_of(model, ids_of(3), autocast=True)
    loss.backward()
    matches_plain(loss, model, plain, 3)
    assert list(fused_tree._GROUP_VERDICTS.values()) == [False]
    assert len(groups_run_on_the_cpu) == 1  # tried once, in the first block's backward
    planner.remove()


class _MadeOnce:
    """An entry that makes its float32 copy once, through a group, as rebuilt.py's _MadeAgain does."""

    def __init__(self, narrow: torch.Tensor):
        self.narrow, self.wide = narrow, None
        self.group = fused_tree.FusedGroup(self, "cpu")

    def get(self) -> torch.Tensor:
        if self.wide is None:
            made = self.group.launch(self.narrow, torch.float32, lambda t: t)
            self.wide = made if made is not None else self.narrow.float()
        return self.wide


def test_a_groups_outputs_are_taken_once_in_their_readers_dtype_and_dropped_when_unread(groups_run_on_the_cpu):
    entry = _MadeOnce((torch.randn(512) * 3).to(torch.bfloat16))
    alone, fetch = lambda e: e.narrow.float(), lambda e: e.get()  # noqa: E731 (made alone; through the group)
    x, narrow = Source(entry), Source(entry, cast=torch.bfloat16)
    tanh = call(torch.tanh, call(T.__rmul__, x, 0.8))
    one_plus, half = call(T.__radd__, tanh, 1.0), call(T.__rmul__, narrow, 0.5)
    product = call(T.__mul__, call(T.__rmul__, narrow, 0.5), call(T.__radd__, call(torch.tanh, x), 1.0))
    for root in (tanh, one_plus, product):
        root.fused = fused_tree.fuse(root, alone, "cpu")
        assert root.fused is not None and fused_tree.only_source(root) is entry
    with torch.no_grad():
        eager = {name: c.run(alone, "cpu") for name, c in
                 (("tanh", tanh), ("one_plus", one_plus), ("half", half), ("product", product))}
    for root in (tanh, one_plus, half, product):
        root.shared = None
        count_reads(root)
    entry.group.join(tanh, tanh.fused.program, torch.float32, tree=tanh.fused)
    entry.group.join(one_plus, one_plus.fused.program, torch.float32, tree=one_plus.fused)
    entry.group.join(half, fused_tree.single_program(half, torch.bfloat16), torch.bfloat16)
    entry.group.join(product, product.fused.program, torch.float32, torch.bfloat16, product.fused)
    code, _ = fused_tree._group_code(torch.bfloat16, torch.float32, tuple((m.program, m.wanted())
                                                                          for m in entry.group.members))
    assert "const unsigned short* __restrict__ in0" in code and "float* __restrict__ out0" in code
    assert code.count("unsigned short* __restrict__ out") == 2  # 0.5 * x, and the product cast to bf16
    with torch.no_grad():
        made = product.run_cast(fetch, "cpu", torch.bfloat16)  # the first read makes the copy, and the group
        assert [len(c) for c in groups_run_on_the_cpu] == [4]
        assert made.dtype is torch.bfloat16 and torch.equal(bits(made), bits(eager["product"].to(torch.bfloat16)))
        assert torch.equal(bits(half.run(fetch, "cpu")), bits(eager["half"]))
        assert torch.equal(bits(one_plus.run(fetch, "cpu")), bits(eager["one_plus"]))
        assert entry.group.take(one_plus, fetch, None) is None  # taken once
        tanh.skip()  # its one reader made its own: the output made ahead goes
        assert not entry.group._made
    assert list(fused_tree._GROUP_VERDICTS.values()) == [True]
