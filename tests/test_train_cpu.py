"""bert_example/train.py on the CPU with the stock allocator and a tiny BERT."""

import gzip
import json
import math

import pytest
import torch

from bert_example import train
from bert_example.train import CHECKPOINT, PREVIOUS, main

TINY = ["--device", "cpu", "--allocator", "stock", "--model", "tiny", "--seq-len", "32", "--batch-size", "4"]
EXACT = ["--dropout", "0", "--no-bf16"]  # deterministic arithmetic to compare runs
JSON_KEYS = {"device", "date", "workload", "method", "policy", "batch", "micro_batch", "seq_len", "steps",
             "step_s_median", "samples_per_s", "loss_first", "loss_last", "losses", "peak_bytes"}


def run(*args):
    return main(TINY + [str(a) for a in args])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Four steps with checkpoints every two, in a directory of its own."""
    directory = tmp_path_factory.mktemp("uninterrupted")
    summary = run("--steps", 4, "--checkpoint", directory / "ckpt", "--checkpoint-every", 2,
                  "--json", directory / "out" / "run.json")
    return summary, directory


@pytest.fixture(scope="module")
def exact_baseline():
    return run("--steps", 3, *EXACT)


def test_trains_and_writes_json(uninterrupted):
    summary, directory = uninterrupted
    written = json.loads((directory / "out" / "run.json").read_text())
    assert JSON_KEYS <= set(written)
    assert written["losses"] == summary["losses"]
    assert len(summary["losses"]) == summary["steps"] == 4
    assert all(math.isfinite(loss) for loss in summary["losses"])
    assert 9 < summary["loss_first"] < 11  # about ln(30522) for an untrained model
    assert summary["method"] == "stock" and summary["device"] == "cpu" and summary["micro_batch"] is None
    assert summary["batch"] == 4 and summary["seq_len"] == 32 and summary["policy"] is None
    assert summary["samples_per_s"] == pytest.approx(4 / summary["step_s_median"])
    assert summary["timed_steps"] == 2  # --warmup-steps 2 of 4


def test_checkpoints_are_whole_files(uninterrupted):
    _, directory = uninterrupted
    names = sorted(p.name for p in (directory / "ckpt").iterdir())
    assert names == sorted([CHECKPOINT, PREVIOUS])  # no temporary left behind
    latest = torch.load(directory / "ckpt" / CHECKPOINT, weights_only=True)
    previous = torch.load(directory / "ckpt" / PREVIOUS, weights_only=True)
    assert (latest["step"], previous["step"]) == (4, 2)


def test_resume_continues_the_step_count_and_the_losses(uninterrupted, tmp_path):
    expected = uninterrupted[0]["losses"]
    first = run("--steps", 2, "--checkpoint", tmp_path)
    assert first["losses"] == pytest.approx(expected[:2], rel=1e-6)
    resumed = run("--steps", 4, "--checkpoint", tmp_path, "--resume")
    assert resumed["first_step"] == 2 and resumed["steps"] == 2
    # same batches, weights, AdamW state and dropout RNG: the same arithmetic as without the break
    assert resumed["losses"] == expected[2:]
    assert torch.load(tmp_path / CHECKPOINT, weights_only=True)["step"] == 4


def test_text_file_data(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("\n".join(f"the quick brown fox number {i} jumps over the lazy dog {i % 7}."
                              for i in range(50)))
    summary = run("--steps", 2, "--data", text, "--checkpoint", tmp_path / "ckpt")
    assert summary["workload"].endswith("-text")
    assert all(math.isfinite(loss) for loss in summary["losses"])
    assert summary["loss_first"] < 9  # a vocabulary of a few hundred words, not BERT's 30522
    checkpoint = torch.load(tmp_path / "ckpt" / CHECKPOINT, weights_only=True)
    assert '"[MASK]"' in checkpoint["data"]["tokenizer"]  # the resumed run keeps the vocabulary


@pytest.mark.parametrize("micro_batch, used", [("2", 2), ("3", 3), ("auto", 4)])
def test_micro_batches_give_the_full_batch_losses(exact_baseline, micro_batch, used):
    streamed = run("--steps", 3, "--micro-batch", micro_batch, *EXACT)
    assert streamed["micro_batch"] == used
    assert streamed["losses"] == pytest.approx(exact_baseline["losses"], rel=1e-5)
    assert streamed["losses"][0] != streamed["losses"][-1]  # it did train


@pytest.mark.parametrize("args, message", [
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--seq-len", "4"], "--seq-len must be between 8 and 512, got 4"),
    (["--seq-len", "1024"], "--seq-len must be between 8 and 512, got 1024"),
    (["--steps", "0"], "--steps must be >= 1"),
    (["--lr", "-1"], "--lr must be a finite number > 0"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    (["--micro-batch", "0"], "expected an integer >= 1 or 'auto', got '0'"),
    (["--micro-batch", "half"], "got 'half'"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--allocator", "um"], "--allocator um needs a CUDA device"),
    (["--policy", "best.yaml"], "--policy applies to --allocator um only"),
    (["--memory-limit", "1GiB"], "--memory-limit applies to CUDA devices only"),
    (["--resume"], "--resume needs --checkpoint DIR"),
    (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: no such file"),
    (["--phase-times", "--micro-batch", "2"], "--phase-times times one forward and one backward a step"),
    (["--link-rates"], "--link-rates times copies between pinned host memory and a GPU: it needs a CUDA device"),
    (["--trace", "t.json", "--profile"], "--trace does not combine with --profile or --timeline"),
    (["--no-rebuild"], "--no-rebuild: applies to an activation offload: --offload activations"),
    (["--offload", "activations", "--micro-batch", "2"], "--offload activations does not combine with --micro-batch"),
    (["--offload", "activations", "--offload-window", "0"], "--offload-window must be more than 0 bytes"),
    (["--steps", "3", "--warmup-steps", "3"], "--warmup-steps 3 leaves none of this run's 3 steps timed; allowed: 0 to 2"),
    (["--micro-batch", "5"], "--micro-batch 5 is larger than --batch-size 4; allowed: 1 to 4, or auto"),
])
def test_bad_arguments_exit_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        run(*args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_resume_without_a_checkpoint_or_with_nothing_left(tmp_path, capsys):
    with pytest.raises(SystemExit):
        run("--resume", "--checkpoint", tmp_path)
    assert f"no checkpoint in {tmp_path}" in capsys.readouterr().err
    run("--steps", 1, "--checkpoint", tmp_path)
    with pytest.raises(SystemExit):
        run("--steps", 1, "--checkpoint", tmp_path, "--resume")
    assert "at step 1; --steps 1 leaves nothing to do" in capsys.readouterr().err


def test_empty_text_file_is_refused(tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(SystemExit):
        run("--data", tmp_path / "empty.txt")
    assert "holds no text" in capsys.readouterr().err


def test_warmup_defaults_to_fewer_steps_than_a_short_run(tmp_path, capsys):
    assert run("--steps", 2)["timed_steps"] == 1                    # the default 2, lowered to 1
    run("--steps", 2, "--checkpoint", tmp_path)
    with pytest.raises(SystemExit):                                  # 2 steps left after step 2 of 4
        run("--steps", 4, "--checkpoint", tmp_path, "--resume", "--warmup-steps", "2")
    assert "--warmup-steps 2 leaves none of this run's 2 steps timed" in capsys.readouterr().err


@pytest.mark.parametrize("budget, message", [
    ("-1GiB", "command line: --budget: negative size (got '-1GiB'; allowed: none, a size > 0"),
    ("16GB", "command line: --budget: unknown size unit (got '16GB'"),
    ("1.5", "command line: --budget: fraction out of range (0, 1] (got 1.5"),
    ("1", "command line: --budget: an absolute budget must hold at least one chunk"),
])
def test_bad_budget_names_the_flag_before_cuda_work(budget, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "tiny", f"--budget={budget}"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "install(" not in err
    assert not torch.cuda.is_initialized()


def test_a_memory_limit_below_one_chunk_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--memory-limit", "1MiB"])
    assert "command line: --memory-limit: must hold at least one chunk (2MiB, 2097152 bytes) (got '1MiB'" \
        in capsys.readouterr().err
    assert not torch.cuda.is_initialized()


def test_um_without_a_gpu_names_the_flags_that_run_without_one(capsys):
    from um_alloc.device_info import device_memory

    if device_memory(0) is not None:
        pytest.skip("a GPU is visible to NVML; this covers machines without one")
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--steps", "1"])
    err = capsys.readouterr().err
    assert "no NVIDIA GPU visible" in err and "--device cpu --allocator stock" in err
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("size, message", [("16GB", "--memory-limit"), ("0", "more than 0 bytes")])
def test_bad_memory_limit_is_refused_before_cuda_work(size, message, capsys):
    with pytest.raises(SystemExit):
        main(["--allocator", "stock", "--model", "tiny", "--memory-limit", size])
    assert message in capsys.readouterr().err
    assert not torch.cuda.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where there is no GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit):
        main(["--allocator", "stock", "--model", "tiny", "--seq-len", "8", "--steps", "1"])
    assert "no CUDA device is available" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [["--micro-batch", "4"], ["--offload", "save_on_cpu"], ["--checkpointing"]])
def test_a_policy_that_offloads_activations_refuses_other_memory_savers(flags, capsys):
    parser = train.build_parser()
    args = parser.parse_args(["--policy", "offload.yaml", *flags])
    with pytest.raises(SystemExit):
        train.check_policy(parser, args)
    assert f"offloads activations (scheduler.offload_activations: true), which does not combine with {flags[0]}" \
        in capsys.readouterr().err
    train.check_policy(parser, parser.parse_args(["--policy", "host_optimizer.yaml", *flags]))  # no offload: fine


def test_a_bad_policy_is_refused_before_cuda_work(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("scheduler: {offload_activations: true, evict_live: true}\n")  # offload needs a hard budget
    parser = train.build_parser()
    with pytest.raises(SystemExit):
        train.check_policy(parser, parser.parse_args(["--policy", str(bad)]))
    assert "scheduler.strategy: needs a hard budget" in capsys.readouterr().err


def test_deterministic_flag_turns_on_deterministic_algorithms():
    before = torch.are_deterministic_algorithms_enabled()
    try:
        plain = run("--steps", 2)
        exact = run("--steps", 2, "--deterministic")
        assert torch.are_deterministic_algorithms_enabled()
        assert exact["losses"] == plain["losses"]  # on the CPU the kernels were deterministic already
    finally:
        torch.use_deterministic_algorithms(before)


def test_the_summary_says_what_the_offload_kept_rebuilt_and_moved(capsys):
    import dataclasses

    from um_alloc.offload import OffloadStats

    stats = OffloadStats(saved_bytes=19 * 2**30, kept_bytes=6 * 2**30, rebuilt_bytes=9 * 2**30,
                         out_bytes=4 * 2**30, in_bytes=4 * 2**30)
    summary = {"workload": "bert", "device": "gpu", "method": "um", "batch": 32, "micro_batch": None,
               "first_step": 0, "steps": 8, "timed_steps": 5, "step_s_median": 0.31, "samples_per_s": 103.2,
               "loss_first": 10.6, "loss_last": 9.1, "peak_bytes": None, "peak_reserved_bytes": None,
               "activation_offload": dataclasses.asdict(stats)}
    train.print_summary(summary, "stock")
    assert ("saved 19.00 GiB, kept 6.00 GiB on the GPU, rebuilt 9.00 GiB in backward, moved 4.00 GiB each way"
            in capsys.readouterr().out)


@pytest.mark.parametrize("args, message", [
    (["--offload", "activations"], "--offload activations is for --allocator stock; under um_alloc use a policy"),
    (["--policy", "none.yaml", "--offload-window", "1GiB"], "--offload-window: policy 'none' does not offload"),
])
def test_um_alloc_offloads_activations_through_its_policy_only(args, message, capsys):
    import torch

    with pytest.raises(SystemExit):
        main(args)  # --device cuda, --allocator um: refused before any CUDA work
    assert message in capsys.readouterr().err
    assert not torch.cuda.is_initialized()


def test_phase_times_split_each_step_into_forward_backward_and_optimizer():
    summary = run("--steps", 3, "--phase-times")
    assert [len(phases) for phases in summary["phase_s"]] == [3, 3, 3]
    assert set(summary["phase_s_median"]) == {"forward", "backward", "optimizer"}
    for phases, step_s in zip(summary["phase_s"], summary["step_s"]):
        assert 0 < sum(phases) <= step_s
    assert summary["phase_s_median"]["backward"] == summary["phase_s"][2][1]  # --warmup-steps 2: one timed step
    plain = run("--steps", 1)
    assert "phase_s" not in plain and "link_rates" not in plain and "trace" not in plain


def test_the_activation_offload_over_stock_pytorch_trains_like_the_plain_run(exact_baseline, monkeypatch):
    from um_alloc import offload

    made, original = [], offload.ActivationOffload

    def spy(*args, **kwargs):
        made.append((args, kwargs))
        return original(*args, **kwargs)
    monkeypatch.setattr(offload, "ActivationOffload", spy)
    summary = run("--steps", 3, "--offload", "activations", *EXACT)
    assert summary["losses"] == pytest.approx(exact_baseline["losses"], rel=1e-5)
    assert summary["offload"] == "activations" and summary["activation_offload"]["out_bytes"] > 0
    assert summary["activation_offload"]["budget_bytes"] is None  # no --memory-limit on the CPU: offload all
    tuned = run("--steps", 3, "--offload", "activations", "--offload-window", "64MiB", "--no-rebuild", *EXACT)
    assert tuned["losses"] == pytest.approx(exact_baseline["losses"], rel=1e-5)
    assert tuned["activation_offload"]["window_bytes"] == 64 * 2**20
    assert made[0][1] == {"device": made[0][1]["device"]} and made[0][0] == (None,)
    assert made[1][1]["window"] == 64 * 2**20 and made[1][1]["rebuild"] is False


def test_trace_writes_a_chrome_trace_of_the_last_step(tmp_path):
    path = tmp_path / "trace.json.gz"
    summary = run("--steps", 2, "--trace", path)
    assert summary["trace"] == str(path)
    with gzip.open(path, "rt") as file:
        events = json.load(file)["traceEvents"]
    assert any(event.get("cat") == "cpu_op" and event["name"].startswith("aten::") for event in events)


def test_a_batch_the_planner_cannot_fit_exits_as_out_of_memory(monkeypatch, capsys):
    """The planner refuses a batch whose safe mode ran out of memory twice: train.py ends as it
    does for any out-of-memory step, with EXIT_OOM and one line (what bench/ searches test for)."""
    from um_alloc.planner import PlanInfeasible

    def refused(*args):
        raise PlanInfeasible("budget 8.0 GiB: the safe mode (every block recomputed, activations in host "
                             "memory) ran out of memory 2 times for input 192x512; lower the batch", 0)

    monkeypatch.setattr(train, "build_training", refused)
    assert train.cli(TINY + ["--steps", "1"]) == train.EXIT_OOM
    assert "train.py: out of GPU memory: budget 8.0 GiB: the safe mode" in capsys.readouterr().err
