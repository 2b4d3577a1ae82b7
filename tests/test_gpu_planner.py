"""The block planner on a GPU: the same losses as plain training, and an out-of-memory step
replanned and trained (each in a process of its own: um_alloc installs before CUDA starts).

    python -m pytest -q -m gpu tests/test_gpu_planner.py
"""
import math
from pathlib import Path

import pytest
from conftest import run_gpu_script

pytestmark = pytest.mark.gpu
SCRIPT = Path(__file__).parent / "gpu_scripts" / "planner_check.py"


def _check(mode: str) -> dict:
    return run_gpu_script(SCRIPT, mode)


def test_planned_training_gives_plain_trainings_losses(cuda_device):
    result = _check("equal")
    assert result["planned"] == result["plain"]  # dropout 0.1: masks replayed exactly in recomputes
    assert sum(result["plan"].values()) == 6 + 3  # six layers, embeddings, head, the rest
    assert result["lean_loss_calls"] > 0          # the model's loss went through the chunked cross-entropy


def test_a_compiled_model_trains_under_the_planner(cuda_device):
    result = _check("compiled")
    assert result["safe_steps"] == 2 and sum(result["plan"].values()) == 6 + 4  # embeddings, norm, classifier, rest
    # Inductor fuses what lies between the units; the blocks run as eager: close, not bit for bit.
    assert result["planned"] == pytest.approx(result["plain"], rel=2e-2)


def test_rebuilt_blocks_give_plain_trainings_losses(cuda_device):
    result = _check("rebuild")
    assert result["planned"] == result["plain"]
    assert result["plan"].get("rebuild") == 6      # every layer: nothing else is allowed but the safe mode
    assert result["rebuildable_bytes"] > 0         # casts and GELU outputs found, and rebuilt equal


def test_a_gelu_written_as_elementwise_calls_is_rebuilt_and_gives_plain_trainings_losses(cuda_device):
    result = _check("rebuild_gpt2")
    assert result["planned"] == result["plain"]
    assert result["plan"].get("rebuild") == 6
    # The GELU's tanh output, 1 + tanh, half its input and the product's bf16 cast, about half of
    # what a block saves; without them only the linears' casts (under a tenth).
    assert result["rebuilt_share"] > 0.4
    assert result["fused_places"] == 3 * 6  # tanh, 1 + tanh and the product: each one kernel
    assert result["product_places"] == 6    # pow's float32 copy of x, from the first linear's product
    # Made with the copy by one kernel, in every block of every planned step: tanh, 1 + tanh, half
    # x and the product, the kernel's bits compared once with each made by itself.
    assert result["group_verdicts"] == [True] and result["group_members"] == [4]
    assert result["group_launches"] >= 6


def test_blocks_recomputed_as_one_node_give_plain_trainings_losses(cuda_device):
    result = _check("one_node")
    assert result["planned"] == result["plain"]  # dropout 0.1: the GPU's RNG state restored for each rerun
    assert result["plan"].get("recompute", 0) + result["plan"].get("recompute_moved", 0) == 6
    assert result["one_node_blocks"] == 6


def test_two_forwards_before_each_backward_are_measured_as_one_step_and_give_plain_trainings_losses(cuda_device):
    result = _check("pairs")
    assert result["safe_steps"] == 2  # two steps of two forwards each measured, not four of one
    # Both forwards' saves are held until backward, and the measured step counted both.
    assert 1.8 < result["pair_kept_bytes"] / result["single_kept_bytes"] < 2.2
    assert result["planned"] == result["plain"]


def test_a_critic_with_a_gradient_penalty_trains_with_plain_trainings_losses(cuda_device):
    result = _check("penalty")
    assert result["second_derivatives"] and result["safe_steps"] == 2
    # A block recomputed as one node sums its share of a gradient in another order.
    assert result["planned"] == pytest.approx(result["plain"], rel=1e-5)


def test_blocks_held_as_attributes_and_layers_planned_as_gaps_give_plain_trainings_losses(cuda_device):
    result = _check("attributes")
    unet, sequential = result["unet"], result["sequential"]
    assert (unet["blocks"], unet["gaps"]) == (5, 1) and unet["planned"] == unet["plain"]
    assert sequential["blocks"] == 0 and sequential["plan"] == {"move": sequential["gaps"] + 1}
    assert sequential["moved_out_bytes"] > 0 and sequential["planned"] == sequential["plain"]


def test_layers_rerun_as_one_chain_give_plain_trainings_losses(cuda_device):
    result = _check("chain")
    assert result["plan"] == {"recompute": 1, "chained": result["gaps"] - 1, "keep": 1}
    assert result["planned"] == result["plain"]  # BatchNorm counted once, the dropout's masks drawn again


def test_inputs_of_changing_length_borrow_plans_and_give_plain_trainings_losses(cuda_device):
    result = _check("lengths")
    assert result["planned"] == result["plain"]
    assert result["safe_steps"] == 3                 # 128 twice, 160 once; the others borrow
    assert [length for length, _ in result["borrowed"]] == [96, 64, 112, 144, 80]
    assert all(counts.get("recompute_moved") == 6 for _, counts in result["borrowed"])  # not rebuilt


def test_between_steps_the_step_arenas_are_wholly_free(cuda_device):
    result = _check("arenas")
    assert result["open_between"] == [False] * 5      # closed at each backward's end
    # The parameters' 1 GiB arena has room for all this small model's steps hold; without step
    # arenas the pool would reserve no other.
    grown = result["reserved"][1] - result["reserved"][0]
    assert result["arenas"][1] > result["arenas"][0] and grown > 0 and grown % (1 << 30) == 0
    assert len(result["losses"]) == 6 and all(math.isfinite(x) for x in result["losses"])
    # The first planned step lays activations out anew: the step arena the safe steps used is
    # given back, although the last one's loss is still held. The second safe step repeats the
    # first one's layout in its arenas and gives none back.
    assert result["given_back_in_steps"] == 1


def test_chunked_cross_entropy_is_pytorchs_bit_for_bit(cuda_device):
    result = _check("lean")
    for case, seen in result["cases"].items():
        assert seen["loss_equal"] and seen["grad_equal"], (case, seen)
        assert seen.get("took_narrow", True), case  # upcast logits: the chunks read the narrow ones
    # fp32 losses of fp32, bf16 and fp16 logits and of bf16 logits plus an fp32 bias: backward's
    # log-probabilities came by subtraction, and the fused gradient was compared with PyTorch's
    # (used, where it matched, in the cases above).
    assert len(result["subtracted"]) == 4 and len(result["compared_fused"]) == 4, result


def test_a_language_models_upcast_logits_are_taken_narrow_with_plain_trainings_losses(cuda_device):
    result = _check("gpt2")
    assert result["planned"] == result["plain"]
    assert result["lean_loss_upcasts"] > 0 and result["lean_loss_upcasts"] == result["lean_loss_calls"]


def test_an_out_of_memory_step_is_replanned_and_trains(cuda_device):
    result = _check("oom")
    assert result["retried"] >= 1
    assert result["margin_after"] > result["margin_before"]
    assert len(result["losses"]) == 6 and all(math.isfinite(x) for x in result["losses"])


def test_a_planned_step_that_needs_more_than_the_budget_overflows_to_host_memory_and_trains(cuda_device):
    result = _check("overflow")
    assert result["over_host"] and result["over_ok"]  # kernels wrote and read the overflowed bytes
    assert result["over_bytes"] > 0
    assert result["planned"] == result["plain"]
    assert result["overflowed_steps"] == 1 and result["overflow_allocations"] >= 1 and result["num_ooms"] == 0
    assert result["margin_after"] - result["margin_before"] == result["over_bytes"] + (64 << 20)  # and slack
    assert result["peak_gpu_backed_bytes"] <= result["budget_bytes"]


def test_a_budget_even_the_safe_mode_passes_trains_with_the_excess_in_host_memory(cuda_device):
    result = _check("past_budget")
    assert result["smallest_budget_bytes"] > result["budget_bytes"]  # the measured peak counts what overflowed
    assert result["made"] == "the model's fastest within the least plan's peak" and result["margin"] == 0
    assert result["tried"] == ["the model's fastest within the least plan's peak", "the plan that keeps least"]
    assert result["planned"] == result["plain"]
    assert result["safe_steps"] == 2 and result["num_ooms"] == 0 and result["overflow_allocations"] >= 2
    assert result["overflowed_steps"] == 0  # planned steps: the hog ran only in the measuring ones
    assert result["peak_gpu_backed_bytes"] <= result["budget_bytes"]


def test_large_batch_policy_plans_with_host_optimizer_state_and_a_spilled_head(cuda_device):
    result = _check("large_batch")
    assert result["planned"] == result["plain"]
    assert sum(result["plan"].values()) == 6 + 3
    assert result["spill_peak_bytes"] > 0 and result["spill_resident_bytes"] == 0  # logits lived in host memory


def test_logits_made_again_from_the_heads_input_train_as_plain_training_does(cuda_device):
    """recompute_logits: the first loss is plain training's bit for bit (forward is the same); the
    gradients are the same to rounding, so the losses after it are close, not equal."""
    for case, seen in _check("projected").items():
        assert seen["lean_loss_projected"] == seen["lean_loss_calls"] > 0, case  # every loss took the head's input
        assert seen["planned"][0] == seen["plain"][0], case
        assert seen["planned"] == pytest.approx(seen["plain"], rel=1e-2), case


def test_a_step_that_runs_out_of_memory_leaves_nothing_of_itself_live(cuda_device):
    """Whatever the decision, a step that ran out of memory in forward or in backward leaves none
    of its tensors live once its partial gradients are dropped: a loop that runs it again has the
    room it had (no saved-tensor hook holds the step's graph in a cycle only backward breaks)."""
    result = _check("failed")
    assert len(result) == 8
    slack = 8 << 20  # a step's graph here holds tens of MiB; a side stream's cuBLAS workspace is 4
    for case, figures in result.items():
        assert figures["failed"], case
        assert figures["after_next_step"] <= figures["between_steps"] + slack, (case, figures)
        if case != "move backward":  # copies back already made are let go as the next step begins
            assert figures["after_failure"] <= figures["between_steps"] + slack, (case, figures)
