"""The block planner under DistributedDataParallel and FSDP2 on the CPU: two processes with the
gloo backend (tests/ddp_train.py, started with the variables torchrun sets) train a tiny BERT with
every block recomputed, with DDP's options, no_sync() accumulation, um_alloc's micro-batch
streamer and fully_shard before or after the planner, and match one process training the same
global batch.

Equal to a tolerance, not bit for bit: DDP divides each rank's gradient by the world size and
sums the ranks' in its all-reduce, where one process takes the mean over the whole batch at once;
the same numbers are added in another order, which in float64 moves the last bits or two. The
ranks, which receive the same all-reduced sum, agree with each other exactly.
"""
from pathlib import Path

import pytest
import torch
from conftest import start_ranks, wait_all
from ddp_train import CASES, STEPS

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parent / "ddp_train.py"
WORLD = 2
# float64: the order of the sums moves losses (about 4.5) by up to 9e-16 and gradients and parameters
# by up to 1e-16; a real error (a gradient reduced twice, or missed) is larger by many orders.
TOLERANCE = {"rtol": 1e-12, "atol": 1e-14}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case on two ranks, and the reference in this process meanwhile (no DDP, no planner):
    {"reference": ..., 0: ..., 1: ...}."""
    import ddp_train

    out = tmp_path_factory.mktemp("ddp")
    ranks = start_ranks(SCRIPT, WORLD, "--out", out, *CASES)
    try:
        reference = ddp_train.reference(torch.device("cpu"))
    finally:
        wait_all(ranks, timeout=120)
    return {"reference": reference, **{r: torch.load(out / f"rank{r}.pt") for r in range(WORLD)}}


@pytest.mark.parametrize("case", CASES)
def test_ddp_with_the_planner_trains_as_one_process_on_the_global_batch(trained, case):
    reference, ranks = trained["reference"], [trained[r][case] for r in range(WORLD)]
    for seen in ranks:
        torch.testing.assert_close(seen["losses"], reference["losses"], **TOLERANCE)
        torch.testing.assert_close(seen["first_grads"], reference["first_grads"], **TOLERANCE)
        torch.testing.assert_close(seen["params"], reference["params"], **TOLERANCE)
    for key in ("first_grads", "params"):  # one all-reduced sum on every rank
        assert torch.equal(ranks[0][key], ranks[1][key])
    blocks = [d for d in ranks[0]["decisions"] if d == "recompute"]
    assert len(blocks) == 3  # BERT's three layers recomputed in backward, as decisions= asked
    # As one node of the graph under DDP (its hooks see the gradients as ever); FSDP2's sharded
    # parameters keep torch.utils.checkpoint.
    assert ranks[0]["one_node_blocks"] == (0 if case.startswith("fsdp") else 3)


def test_gradients_are_reduced_once_a_step_with_no_sync_and_with_the_streamer(trained):
    """One reduced backward a step, whatever the micro-batches; the streamer under a static graph
    reduces both micro-batches of its first step (PyTorch's reducer fails otherwise), once a step after."""
    reductions = {case: trained[0][case]["reductions"] for case in CASES if not case.startswith("fsdp")}
    per_step = reductions["plan-then-wrap"] // STEPS
    assert per_step >= 1 and reductions["plan-then-wrap"] == STEPS * per_step
    expected = {case: STEPS * per_step for case in reductions} | {"stream-static-graph": (STEPS + 1) * per_step}
    assert reductions == expected


def test_no_um_alloc_was_installed_on_the_cpu(trained):
    assert trained[0]["um_alloc"] is None and trained[1]["um_alloc"] is None


def test_each_rank_trained_on_its_own_half_of_the_batch(trained):
    """A guard on the test itself: equal results are not one process's numbers read twice."""
    halves = [trained[r]["plan-then-wrap"]["rank_losses"] for r in range(WORLD)]
    assert all(a != b for a, b in zip(*halves))
    assert halves[0][0] + halves[1][0] == pytest.approx(2 * trained["reference"]["losses"][0], rel=1e-12)
