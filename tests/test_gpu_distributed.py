"""um_alloc in each of two processes under DistributedDataParallel and FSDP2 with NCCL: every rank installs
on its own GPU (LOCAL_RANK) with its own budget, the planner recomputes every block, and the
training matches one process on the global batch (tests/ddp_train.py, as on the CPU with gloo in
test_distributed_cpu.py), and bert_example/train.py --parallel with the planner on both GPUs.
Needs two GPUs; skipped with fewer.

    python -m pytest -q -m gpu tests/test_gpu_distributed.py
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import checkout_env, start_ranks, wait_all
from ddp_train import CASES

pytestmark = pytest.mark.gpu

SCRIPT = Path(__file__).parent / "ddp_train.py"
WORLD = 2
BUDGET, BUDGET_TEXT = 2 << 30, "2GiB"       # per rank
TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}  # float64; the GPU's kernels sum in their own order


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every case on two GPUs under um_alloc, then the reference on one GPU without it."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    out = tmp_path_factory.mktemp("ddp_gpu")
    wait_all(start_ranks(SCRIPT, WORLD, "--out", out, "--gpu", "--budget", BUDGET_TEXT, *CASES), timeout=600)
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--gpu", "--reference"],
                          capture_output=True, text=True, timeout=600, env=checkout_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return {"reference": torch.load(out / "reference.pt"),
            **{r: torch.load(out / f"rank{r}.pt") for r in range(WORLD)}}


@pytest.mark.parametrize("case", CASES)
def test_ddp_under_um_alloc_trains_as_one_process_on_the_global_batch(trained, case):
    reference = trained["reference"]
    for rank in range(WORLD):
        seen = trained[rank][case]
        torch.testing.assert_close(seen["losses"], reference["losses"], **TOLERANCE)
        torch.testing.assert_close(seen["params"], reference["params"], **TOLERANCE)
        assert seen["decisions"].count("recompute") == 3


def test_each_rank_installed_on_its_own_gpu_with_its_own_budget(trained):
    for rank in range(WORLD):
        installed = trained[rank]["um_alloc"]
        assert installed["device"] == rank and installed["budget_bytes"] == BUDGET
        assert installed["peak_live_bytes"] > 0  # the model and its activations came from this GPU's pool


TRAIN = Path(__file__).resolve().parent.parent / "bert_example" / "train.py"
TINY = ["--model", "tiny", "--seq-len", "64", "--steps", "6", "--dropout", "0", "--no-bf16", "--deterministic"]


def _train_json(tmp_path: Path, name: str, *flags: str, processes: int = 1) -> dict:
    summary = tmp_path / f"{name}.json"
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    launch = launch if processes > 1 else []
    done = subprocess.run([sys.executable, *launch, str(TRAIN), *TINY, *flags, "--json", str(summary)],
                          capture_output=True, text=True, timeout=600, env=checkout_env())
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    return json.loads(summary.read_text())


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_train_py_with_the_planner_on_every_gpu_follows_one_gpu_on_the_global_batch(tmp_path, kind):
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        pytest.skip(f"needs {WORLD} CUDA devices")
    one = _train_json(tmp_path, "one", "--allocator", "stock", "--batch-size", str(WORLD * 8))
    ranks = _train_json(tmp_path, kind, "--parallel", kind, "--batch-size", "8", "--allocator", "um",
                        "--policy", "planner.yaml", "--budget", BUDGET_TEXT, processes=WORLD)
    assert ranks["losses"] == pytest.approx(one["losses"], rel=1e-4)  # float32, sums in other orders
    assert ranks["parallel"]["world"] == WORLD and ranks["batch"] == WORLD * 8
    assert ranks["planner"]["plan"]["decisions"]  # the planner planned on the ranks
    assert 0 < ranks["peak_bytes"] <= BUDGET
