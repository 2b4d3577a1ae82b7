"""The installed allocator on a real GPU. Each check runs in its own process, since PyTorch
takes a new allocator only before CUDA is initialised. Skipped where there is no CUDA device."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
SCRIPTS = Path(__file__).parent / "gpu_scripts"
ROOT = SCRIPTS.parent.parent
MiB = 1 << 20


def run_script(*args, timeout=600) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def check(name):
    return run_script(SCRIPTS / "allocator_checks.py", name)


def test_policy_hints_are_set_on_the_device(cuda_device):
    found = check("advice")
    assert found["parameter_preferred"] == 0  # device 0, as best.yaml asks
    assert found["parameter_accessed_by"] == [0]
    assert found["input_read_mostly_before_retag"] == 0 and found["input_read_mostly"] == 1
    assert found["activation_preferred"] == -2  # cudaInvalidDeviceId: no preferred location
    assert found["activation_last_prefetch"] == 0  # prefetched to the GPU when allocated
    assert found["block_tag"] == "input" and found["backend_errors"] == 0


def test_same_losses_as_stock_allocator(cuda_device):
    stock = run_script(SCRIPTS / "train_tiny.py", "stock", "none", 20)["losses"]
    for policy in ("best.yaml", "none.yaml"):
        um = run_script(SCRIPTS / "train_tiny.py", "um", policy, 20)
        assert len(um["losses"]) == 20
        for a, b in zip(um["losses"], stock):
            assert abs(a - b) <= 1e-5 * abs(b), (policy, um["losses"], stock)
        assert um["tags"]["parameter"] > 0 and um["tags"]["optimizer_state"] > 0
        assert um["backend_errors"] == 0


def test_out_of_memory_is_a_torch_error_and_training_continues(cuda_device):
    found = check("oom")
    assert "1.00 GiB limit" in found["message"]
    # PyTorch's words, by which Trainer's auto_find_batch_size and Lightning's batch size finder know it
    assert "CUDA out of memory. Tried to allocate 64.00 MiB" in found["message"]
    assert found["num_ooms"] >= 1 and found["peak_reserved"] <= found["limit"] == 1 << 30
    assert len(found["losses"]) == 3 and all(l == l for l in found["losses"])  # finite, no NaN


def test_record_stream_keeps_reuse_after_the_side_stream(cuda_device):
    found = check("record_stream")
    assert found["reused_address"], "the test must exercise reuse of the freed block"
    assert found["b_all_two"]
    assert found["stream_waits"] >= 1


def test_reuse_waits_only_for_side_work_enqueued_before_the_free(cuda_device):
    found = check("reuse_waits_only_for_the_point_of_free")
    assert found["reused_address"], "the test must exercise reuse of the freed block"
    assert found["b_all_two"]  # the work before the free was waited for
    assert found["main_done_before_later_side_work"]  # the work after it was not
    assert found["free_events"] >= 1


def test_empty_cache_returns_free_arenas(cuda_device):
    found = check("empty_cache_and_stats")
    assert found["live_before"] == 3 * 1024 * MiB and found["live_after"] == 0
    assert found["reserved_before"] >= 3 * 1024 * MiB and found["reserved_after"] == 0
    assert found["summary_has_tags"]


def test_pytorchs_memory_statistics_answer_from_the_pool(cuda_device):
    found = check("torch_memory_stats")
    assert found["allocated"] == found["pool_live"] >= 320 * MiB
    assert found["after_free"] == found["allocated"] - 256 * MiB
    assert found["peak"] >= found["allocated"]
    assert found["reserved"] == found["pool_reserved"] >= found["allocated"]
    assert found["peak_after_reset"] == found["after_free"]
    assert found["summary"] and found["stats_keys"] > 50


def test_a_script_that_turns_cudnn_benchmark_on_trains_its_convolutions(cuda_device):
    found = check("cudnn_benchmark")
    assert found["warned"] and found["benchmark"] is False
    assert len(found["losses"]) == 2 and all(loss > 0 for loss in found["losses"])


def test_install_after_cuda_work_says_how_to_fix_it(cuda_device):
    error = check("install_after_cuda")["error"]
    assert error and "before any CUDA work" in error and "top of your script" in error


def test_reactive_budget_gives_the_same_losses_within_the_budget(cuda_device):
    budget = 96 * MiB  # the small BERT needs several times this: evictions must happen
    stock = run_script(SCRIPTS / "train_tiny.py", "stock", "none", 10)["losses"]
    um = run_script(SCRIPTS / "train_tiny.py", "um", "none.yaml", 10, "none", "96MiB", "reactive")
    assert um["budget"] == budget and um["evictions"] > 0 and um["evicts_live"]
    for a, b in zip(um["losses"], stock):
        assert abs(a - b) <= 1e-5 * abs(b), (um["losses"], stock)
    assert um["backend_errors"] == 0
    # No high-water check here: this model's whole footprint plus the CUDA context is about the
    # 1 GiB constant such a check allows, so it could not fail. At BERT-Large scale the budget is
    # not kept (bench/results/budget_16GiB_b32_reactive.json: 26.4 GiB at a 16 GiB budget).


def test_a_budget_without_evict_live_is_hard(cuda_device):
    um = run_script(SCRIPTS / "train_tiny.py", "um", "none.yaml", 2, "none", "1GiB")
    assert um["budget"] == 1 << 30 and not um["evicts_live"] and um["evictions"] == 0


def test_lms_controls_set_the_budget(cuda_device):
    found = check("lms_controls")
    assert found["before"] == [True, 0, 1 << 20]
    assert found["after"] == [False, 64 * MiB, 2 * MiB]
    assert found["evictions"] > 0 and found["resident"] <= 64 * MiB
    assert found["installation_budget"] == 64 * MiB  # what offload.from_policy and the timeline read


def test_a_spilled_head_lives_in_host_memory_and_trains_the_same(cuda_device):
    plain = run_script(SCRIPTS / "spill_check.py", "plain")
    spill = run_script(SCRIPTS / "spill_check.py", "spill")
    assert len(spill["losses"]) == 3
    for a, b in zip(spill["losses"], plain["losses"]):
        assert abs(a - b) <= 1e-6 * abs(b), (spill["losses"], plain["losses"])
    assert plain["logits"] == ["activation", "gpu"] and spill["logits"] == ["spill", "host"]
    assert plain["logits_grad"][0] == "activation" and spill["logits_grad"] == ["spill", "host"]
    # the scope is open in backward's head, closed once the gradient reaches the head's input
    assert spill["scope_at_logits"] == 16 * MiB and spill["scope_at_trunk_input"] == 0
    assert spill["scope_after_step"] == 0 and plain["scope_at_logits"] == 0
    # log-softmax's fp32 output (128 MiB), saved for backward, stays in host memory: not offloaded
    assert plain["saved_bytes"] - spill["saved_bytes"] >= 128 * MiB
    assert plain["peak_gpu_backed_bytes"] - spill["peak_gpu_backed_bytes"] >= 128 * MiB
    assert spill["backend_errors"] == 0 and plain["backend_errors"] == 0


def test_train_py_refuses_a_budget_below_the_parameters_gradients_and_moments(cuda_device):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "bert_example" / "train.py"), "--model", "tiny", "--seq-len", "32",
                           "--batch-size", "2", "--steps", "2", "--policy", "best.yaml", "--budget", "16MiB"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "GPU budget 16.0 MiB (16777216 bytes) is below what stays on the GPU all step" in done.stderr
    assert "optimizer state (expected)" in done.stderr and "Traceback" not in done.stderr
