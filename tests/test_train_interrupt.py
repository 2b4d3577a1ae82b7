"""Ctrl-C (SIGINT) during bert_example/train.py on the CPU: in a step and halfway through a
checkpoint write. The run ends with status 130 and a message naming the last complete checkpoint,
no half-written checkpoint is left, and --resume continues with an uninterrupted run's losses.
(tests/test_gpu_soak.py does the same on a GPU under um_alloc.)"""
import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import interrupt_when_paused

from bert_example import checkpoints, train
from bert_example.checkpoints import CHECKPOINT, PREVIOUS, Progress, load_checkpoint, save_checkpoint

SCRIPT = Path(__file__).parent / "gpu_scripts" / "interrupted_train.py"
TINY = ["--device", "cpu", "--allocator", "stock", "--model", "tiny", "--seq-len", "32", "--batch-size", "4"]
STEPS, EVERY = 5, 2


def interrupted_train():
    spec = importlib.util.spec_from_file_location("interrupted_train", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(directory, *args):
    return train.main(TINY + ["--steps", str(STEPS), "--checkpoint", str(directory),
                              "--checkpoint-every", str(EVERY), *map(str, args)])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    return run(tmp_path_factory.mktemp("uninterrupted"))["losses"]


def interrupt_in_process(at: str, directory, *args) -> tuple[str, list[float]]:
    """train.main() with KeyboardInterrupt raised at `at`, as Python's SIGINT handler raises it;
    (the message, the losses of the steps done)."""
    def ctrl_c(where):
        raise KeyboardInterrupt

    losses = []
    with interrupted_train().interruption(at, ctrl_c, lambda step, loss: losses.append(loss)):
        with pytest.raises(train.TrainingInterrupted) as info:
            run(directory, *args)
    return str(info.value), losses


def only_whole_checkpoints(directory) -> list[str]:
    names = sorted(p.name for p in Path(directory).iterdir())
    assert all(name in (CHECKPOINT, PREVIOUS) for name in names), names  # no temporary left behind
    return names


def test_an_interrupt_in_a_step_resumes_from_the_last_checkpoint(uninterrupted, tmp_path):
    message, before = interrupt_in_process("step:3", tmp_path)
    assert message == (f"train.py: interrupted with 3 of {STEPS} steps done. The last complete checkpoint, at "
                       f"step 2, is in {tmp_path}: the same command with --resume continues from it.")
    assert before == uninterrupted[:3]
    only_whole_checkpoints(tmp_path)
    resumed = run(tmp_path, "--resume")
    assert resumed["first_step"] == 2
    assert before[:2] + resumed["losses"] == uninterrupted  # step 2 again, from the checkpoint


def test_an_interrupt_halfway_through_a_checkpoint_write_keeps_the_one_before(uninterrupted, tmp_path):
    message, before = interrupt_in_process("checkpoint:4", tmp_path)
    assert message.startswith(f"train.py: interrupted with 4 of {STEPS} steps done, while writing the checkpoint "
                              "at step 4 (not kept). The last complete checkpoint, at step 2,")
    assert only_whole_checkpoints(tmp_path) == [CHECKPOINT]
    assert load_checkpoint(tmp_path)["step"] == 2
    resumed = run(tmp_path, "--resume")
    assert before[:2] + resumed["losses"] == uninterrupted


def test_sigint_ends_the_command_with_status_130_and_says_where_to_resume(uninterrupted, tmp_path):
    checkpoint_dir, losses = tmp_path / "ckpt", tmp_path / "losses.jsonl"
    status, stderr = interrupt_when_paused(
        SCRIPT, "--at", "checkpoint:4", "--losses", losses, "--", *TINY, "--steps", STEPS,
        "--checkpoint", checkpoint_dir, "--checkpoint-every", EVERY, directory=tmp_path, timeout=300)
    assert status == train.EXIT_INTERRUPTED, stderr[-3000:]
    assert "while writing the checkpoint at step 4 (not kept). The last complete checkpoint, at step 2" in stderr
    assert "Traceback" not in stderr
    assert only_whole_checkpoints(checkpoint_dir) == [CHECKPOINT]
    before = [json.loads(line)["loss"] for line in losses.read_text().splitlines()]
    resumed = run(checkpoint_dir, "--resume")
    assert before[:2] + resumed["losses"] == uninterrupted  # the losses of another process, too


def test_an_interrupt_between_the_two_renames_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"step": 2})
    save_checkpoint(tmp_path, {"step": 4})
    renames, real_replace = [], os.replace

    def replace(source, target):
        renames.append(Path(target).name)
        if len(renames) == 2:  # checkpoint.pt is already checkpoint.prev.pt; the new one is not yet in place
            raise KeyboardInterrupt
        real_replace(source, target)

    monkeypatch.setattr(checkpoints.os, "replace", replace)  # the os module's own, until the test ends
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, {"step": 6})
    assert only_whole_checkpoints(tmp_path) == [PREVIOUS]
    assert load_checkpoint(tmp_path)["step"] == 4  # the last complete one


def test_an_interrupt_before_the_first_step_exits_130(monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "build_training", interrupted)
    assert train.cli(TINY + ["--steps", "1"]) == train.EXIT_INTERRUPTED
    assert "train.py: interrupted before the first step or after the last" in capsys.readouterr().err


@pytest.mark.parametrize("directory, saved, writing, ending", [
    (None, None, None, ". Without --checkpoint DIR nothing was kept: a new run starts from step 0."),
    ("ck", None, None, ". This run completed no checkpoint in ck."),
    ("ck", None, 10, ", while writing the checkpoint at step 10 (not kept). This run completed no checkpoint in ck."),
    ("ck", 10, None, ". The last complete checkpoint, at step 10, is in ck: the same command with --resume "
                     "continues from it."),
])
def test_the_interrupted_message_names_what_is_kept(directory, saved, writing, ending):
    progress = Progress(20, directory, done=12, saved=saved, writing=writing)
    assert progress.interrupted_text() == "train.py: interrupted with 12 of 20 steps done" + ending


def test_a_resumed_run_counts_its_checkpoint_as_the_last_complete_one(tmp_path):
    run(tmp_path, "--steps", 2)  # overrides --steps 5: a first part of two steps
    message, _ = interrupt_in_process("step:3", tmp_path, "--resume")
    assert message.startswith(f"train.py: interrupted with 3 of {STEPS} steps done. The last complete checkpoint, "
                              "at step 2, is in")


def test_the_script_refuses_a_bad_pause_point(capsys):
    with pytest.raises(SystemExit):
        interrupted_train().main(["--at", "middle", "--", *TINY])
    assert "--at: expected step:N or checkpoint:N with N >= 0, got 'middle'" in capsys.readouterr().err
