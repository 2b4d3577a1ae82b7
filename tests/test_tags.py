"""Tag scopes around optimizer steps, on the CPU: the scope is the core's process-wide current
tag, which needs no GPU; retag (which needs um_alloc installed) is recorded instead. And the
vocabulary, and the walk over nested containers that retag and the micro-batches share."""
import collections

import pytest
import torch

from um_alloc import _lib
from um_alloc.tag_names import DEFAULT_TAG, TAGS, tag_index
from um_alloc.tags import OpenScopes, TrainingTags, tag
from um_alloc.tensor_trees import map_tensors, tensor_leaves, tensors


def _current_tag() -> str:
    return TAGS[_lib.load().um_current_tag()]


@pytest.fixture
def retags(monkeypatch):
    calls = []
    monkeypatch.setattr("um_alloc.tags.retag", lambda obj, name: calls.append((name, len(list(obj)))) or 0)
    return calls


def test_state_is_born_under_its_tag_and_later_steps_run_as_scratch(retags):
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tags = TrainingTags(model, optimizer)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(_current_tag()))  # runs after TrainingTags'
    for _ in range(3):
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert seen == ["optimizer_state", "other", "other"]
    assert _current_tag() == "activation"  # the scope ends with the step
    # the state (step, exp_avg, exp_avg_sq for weight and bias) is retagged once, after step 1
    assert [c for c in retags if c[0] == "optimizer_state"] == [("optimizer_state", 6)]
    tags.remove()


def test_a_step_that_raised_leaves_its_scope_at_the_next_step(retags):
    """PyTorch runs no post-hook after a step that raised (out of memory): the next step's pre-hook
    closes its scope, so that the step after it runs under its own tag, not under the failed one's."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    tags = TrainingTags(model, optimizer)
    seen = []
    failing = optimizer.register_step_pre_hook(lambda *_: (_ for _ in ()).throw(torch.OutOfMemoryError("test")))
    model(torch.randn(3, 4)).sum().backward()
    with pytest.raises(torch.OutOfMemoryError):
        optimizer.step()
    failing.remove()
    optimizer.register_step_pre_hook(lambda *_: seen.append(_current_tag()))
    optimizer.step()
    assert seen == ["optimizer_state"] and _current_tag() == "activation"
    tags.remove()


def test_state_made_by_a_later_step_is_retagged_after_it(retags):
    first, second = torch.nn.Linear(4, 2), torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(first.parameters(), lr=0.1)
    TrainingTags(first, optimizer)
    seen = []
    optimizer.register_step_pre_hook(lambda *_: seen.append(_current_tag()))
    for step in range(4):
        if step == 2:
            optimizer.add_param_group({"params": second.parameters()})
        second(first(torch.randn(3, 4))).sum().backward()
        optimizer.step()
    # step 2 makes the new group's state under "other" (the old state looked settled); the hook
    # after it retags all state, and step 3 is settled again
    assert seen == ["optimizer_state", "other", "other", "other"]
    assert [c for c in retags if c[0] == "optimizer_state"] == [("optimizer_state", 6), ("optimizer_state", 12)]


def test_the_vocabulary_is_the_cores_and_names_what_it_allows():
    lib = _lib.load()
    assert tuple(lib.um_tag_name(i).decode() for i in range(lib.um_num_tags())) == TAGS
    assert TAGS[lib.um_current_tag()] == DEFAULT_TAG and tag_index("spill") == 6
    with pytest.raises(ValueError, match="unknown tag 'weights'; allowed: parameter, gradient"):
        tag_index("weights")


class _Items:
    """A mapping by duck type only, as some batch classes are."""

    def __init__(self, **values):
        self._values = values

    def items(self):
        return self._values.items()


def test_one_walk_finds_the_tensors_of_nested_containers():
    a, b, c, d = (torch.zeros(i + 1) for i in range(4))
    tree = {"x": [a, (b, "text")], "y": _Items(z=c), "n": 3, "w": collections.OrderedDict(v=d)}
    assert [t.numel() for t in tensors(tree)] == [1, 2, 3, 4]  # other leaves are skipped
    Cos = collections.namedtuple("Cos", "cos sin")
    mixed = ((None, a, True), {"p": torch.nn.Parameter(b)}, Cos(c, d), [0.5, [_Items(e=a)]])
    assert [id(t) for t in tensors(mixed)] == [id(t) for _, t in tensor_leaves(mixed)]
    assert len(tensors(mixed)) == 5
    paths = [p for p, _ in tensor_leaves({"x": [a, (b,)]}, "batch", strict=True)]
    assert paths == ["batch['x'][0]", "batch['x'][1][0]"]
    with pytest.raises(TypeError, match=r"batch\['x'\]\[1\]\[1\] is a str"):
        list(tensor_leaves(tree, "batch", strict=True))
    Pair = collections.namedtuple("Pair", "p q")
    doubled = map_tensors(lambda t: t + 1, {"k": Pair(a, [b])})
    assert isinstance(doubled["k"], Pair) and doubled["k"].p.tolist() == [1.0]


def test_open_scopes_are_put_back_for_a_while_and_then_left_as_they_were():
    with tag("spill", "1MiB"), tag("other"):
        then = OpenScopes.now()
    assert then == OpenScopes(tag_index("other"), tag_index("spill"), 1 << 20)
    before = OpenScopes.now()
    assert before.large_min == 0 and before != then
    with pytest.raises(RuntimeError, match="inside"):
        with then.restored():
            assert OpenScopes.now() == then
            raise RuntimeError("inside")
    assert OpenScopes.now() == before
