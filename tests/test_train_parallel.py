"""bert_example/train.py --parallel under torchrun, on the CPU with gloo: DDP and FSDP2 on two
processes train as one process does on the global batch, the summary speaks for the job, and the
flags that cannot work are refused before any training."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import checkout_env

pytest.importorskip("transformers")

TRAIN = Path(__file__).resolve().parent.parent / "bert_example" / "train.py"
WORLD, PER_RANK, STEPS = 2, 4, 4
TINY = ["--device", "cpu", "--allocator", "stock", "--model", "tiny", "--seq-len", "32", "--steps", str(STEPS),
        "--dropout", "0"]


def train(tmp_path: Path, name: str, *flags: str, processes: int | None = None) -> dict:
    """train.py's summary: in one process, or under torchrun in `processes`."""
    summary = tmp_path / f"{name}.json"
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)] if processes else []
    done = subprocess.run([sys.executable, *launch, str(TRAIN), *TINY, *flags, "--json", str(summary)],
                          capture_output=True, text=True, timeout=300, env=checkout_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(summary.read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return train(tmp_path_factory.mktemp("one"), "one", "--batch-size", str(WORLD * PER_RANK))


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_parallel_training_follows_one_process_on_the_global_batch(tmp_path, one_process, kind):
    ranks = train(tmp_path, kind, "--parallel", kind, "--batch-size", str(PER_RANK), processes=WORLD)
    # float32: DDP's mean over ranks and one process's mean over the batch add in other orders.
    assert ranks["losses"] == pytest.approx(one_process["losses"], rel=1e-5)
    assert ranks["losses"][0] != ranks["losses"][-1]  # it trained
    assert ranks["batch"] == WORLD * PER_RANK
    assert ranks["parallel"] == {"kind": kind, "world": WORLD, "batch_per_rank": PER_RANK, "backend": "gloo"}
    assert ranks["samples_per_s"] == pytest.approx(WORLD * PER_RANK / ranks["step_s_median"])


@pytest.mark.parametrize("under_torchrun, flags, says", [
    (False, ["--parallel", "ddp"], "under torchrun, which sets WORLD_SIZE"),
    (True, ["--fsdp-cpu-offload"], "applies to --parallel fsdp only"),
    (True, ["--parallel", "ddp", "--checkpoint", "ckpt"], "does not combine with --checkpoint"),
    (True, ["--parallel", "fsdp", "--micro-batch", "2"], "does not combine with --micro-batch"),
])
def test_what_cannot_run_in_parallel_is_refused_first(tmp_path, under_torchrun, flags, says):
    env = {key: value for key, value in checkout_env().items() if key != "WORLD_SIZE"}
    env.update({"WORLD_SIZE": "2"} if under_torchrun else {})
    done = subprocess.run([sys.executable, str(TRAIN), *TINY, "--batch-size", "4", *flags], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 2 and says in done.stderr, done.stderr[-2000:]
    assert "train:" not in done.stderr  # refused before the first step
