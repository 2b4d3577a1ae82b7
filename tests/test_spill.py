"""Spill scopes on the CPU: where um_alloc.spill_from opens and ends the core's process-wide scope
for large allocations (what the GPU's allocator reads), and tag(name, min_size) itself. Where the
memory then lives is checked on the GPU (tests/test_gpu_allocator.py)."""
import pytest
import torch

from um_alloc import _lib
from um_alloc.policy import PolicyError, load_policy, policy_from_dict
from um_alloc.spill import SpillFrom, spill_from
from um_alloc.tag_names import TAGS
from um_alloc.tags import tag

MiB = 1 << 20


def _scope() -> tuple[str, int]:
    """(tag, min_size) of the open large-allocation scope; min_size 0 when none is open."""
    lib = _lib.load()
    return TAGS[lib.um_large_tag()], lib.um_large_tag_min()


def _open_size() -> int:
    return _scope()[1]


class TinyLM(torch.nn.Module):
    """A trunk, a head, and the loss after the head (as BertForMaskedLM computes it)."""

    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(4, 8)
        self.head = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 16))

    def forward(self, x, seen):
        logits = self.head(self.trunk(x))
        seen.append(("loss", _open_size()))
        if logits.requires_grad:
            logits.register_hook(lambda g: seen.append(("logits grad", _open_size())))
        return torch.nn.functional.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long))


@pytest.fixture
def model():
    model = TinyLM()
    seen = []
    model.head[1].register_forward_hook(lambda *_: seen.append(("in head", _open_size())))
    spill = SpillFrom(model.head, "2MiB")
    yield model, seen, spill
    spill.remove()
    assert _open_size() == 0


def test_spills_from_the_head_to_the_loss_and_back_through_the_head(model):
    model, seen, _ = model
    x = torch.randn(3, 4, requires_grad=True)
    x.register_hook(lambda g: seen.append(("trunk input grad", _open_size())))
    loss = model(x, seen)
    assert _scope() == ("spill", 2 * MiB)  # forward is over; backward's head is still to come
    loss.backward()
    assert seen == [("in head", 2 * MiB), ("loss", 2 * MiB), ("logits grad", 2 * MiB),
                    ("trunk input grad", 0)]
    assert _open_size() == 0


def test_when_the_input_needs_no_grad_only_the_module_itself_spills(model):
    model, seen, _ = model
    model.trunk.requires_grad_(False)  # no gradient will reach the head's input to end the scope
    model(torch.randn(3, 4), seen).backward()
    assert seen == [("in head", 2 * MiB), ("loss", 0), ("logits grad", 0)]


def test_forward_without_grad_spills_only_inside_the_module(model):
    model, seen, _ = model
    with torch.no_grad():
        model(torch.randn(3, 4), seen)
    assert seen == [("in head", 2 * MiB), ("loss", 0)]
    assert _open_size() == 0


def test_a_step_that_never_ran_backward_does_not_leave_scopes_stacked(model):
    model, seen, _ = model
    model(torch.randn(3, 4), seen)  # an error before backward, say: the scope stays open
    assert _open_size() == 2 * MiB
    model(torch.randn(3, 4), seen).backward()  # the next forward closes it before opening its own
    assert _open_size() == 0


def test_remove_ends_an_open_scope_and_the_hooks(model):
    model, seen, spill = model
    model(torch.randn(3, 4), seen)
    spill.remove()
    assert _open_size() == 0
    seen.clear()
    model(torch.randn(3, 4), seen).backward()
    assert seen == [("in head", 0), ("loss", 0), ("logits grad", 0)]


def test_tag_with_min_size_nests_and_leaves_the_current_tag_alone():
    lib = _lib.load()
    before = lib.um_current_tag()
    with tag("spill", "1MiB"):
        assert _scope() == ("spill", MiB)
        with tag("other"):  # a plain scope changes the tag of everything below 1 MiB only
            assert TAGS[lib.um_current_tag()] == "other" and _scope() == ("spill", MiB)
        with tag("input", 4096):
            assert _scope() == ("input", 4096)
        assert _scope() == ("spill", MiB)
    assert _open_size() == 0 and lib.um_current_tag() == before


@pytest.mark.parametrize("bad, message", [(0, "must be > 0"), (-1, r"negative size \(got -1"), ("1GB", "ambiguous")])
def test_tag_refuses_a_bad_min_size(bad, message):
    with pytest.raises(ValueError, match=message):
        with tag("spill", bad):
            pass
    assert _open_size() == 0


def test_spill_from_needs_um_alloc_installed():
    with pytest.raises(ValueError, match="not installed"):
        spill_from(torch.nn.Linear(2, 2))


def test_a_policy_that_spills_must_place_the_spill_tag_in_host_memory():
    with pytest.raises(PolicyError, match=r"scheduler\.spill_min_size: spills to the spill tag"):
        policy_from_dict({"scheduler": {"spill_min_size": "256MiB"}}, source="p.yaml", name="p")
    host = {"preferred_location": "cpu", "accessed_by": ["gpu"]}
    policy = policy_from_dict({"scheduler": {"spill_min_size": "256MiB"}, "tags": {"spill": host}},
                              source="p.yaml", name="p")
    assert policy.scheduler.spill_min_size == 256 * MiB
    shipped = load_policy("large_batch")
    assert shipped.scheduler.spill_min_size == 256 * MiB and shipped.scheduler.strategy == "auto"
    assert load_policy("best").scheduler.spill_min_size is None  # best.yaml places spill, spills nothing
