"""bench/detection_losses.py on the CPU: its arguments are checked before any GPU work, and
without a CUDA device it says so."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import detection_losses  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["fasterrcnn_mobilenet_v3_large_fpn"], "each run is MODEL@BUDGET"),
    (["a@1GiB@2GiB"], "each run is MODEL@BUDGET"),
    (["fasterrcnn_mobilenet_v3_large_fpn@none", "--steps", "2"], "--steps must be at least 3"),
    (["maskrcnn_resnet50_fpn@14Gb"], "the budget of maskrcnn_resnet50_fpn@14Gb"),
    (["maskrcnn_resnet50_fpn@14GiB", "fasterrcnn_mobilenet_v3_large_fpn@none", "--float64"],
     "give each run a budget, not none"),
])
def test_bad_runs_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        detection_losses.parse_args(argv)
    assert message in capsys.readouterr().err


def test_runs_name_a_model_and_a_budget():
    args = detection_losses.parse_args(["maskrcnn_resnet50_fpn@14GiB", "fasterrcnn_mobilenet_v3_large_fpn@none"])
    assert [run.split("@") for run in args.runs] == [["maskrcnn_resnet50_fpn", "14GiB"],
                                                    ["fasterrcnn_mobilenet_v3_large_fpn", "none"]]
    assert args.steps == 12 and args.pool_budget == "40GiB"
    assert not args.no_one_node and not args.float64  # recomputation as one node, losses compared


def test_the_float64_comparison_and_checkpoint_only_recomputation_are_asked_for_by_flag():
    args = detection_losses.parse_args(["maskrcnn_resnet50_fpn@14GiB", "--float64", "--no-one-node", "--steps", "4"])
    assert args.float64 and args.no_one_node and args.steps == 4


def test_without_a_cuda_device_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(detection_losses.torch.cuda, "is_available", lambda: False)
    assert detection_losses.main(["fasterrcnn_mobilenet_v3_large_fpn@none"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
