"""bench/decision_costs.py and bench/alloc_cost.py on the CPU: their options are checked before any
GPU work, and decision_costs' arithmetic over forced plans."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import alloc_cost  # noqa: E402
import decision_costs  # noqa: E402


@pytest.mark.parametrize("flags, says", [
    (["--decisions", "keep,bogus"], "--decisions: bogus not among keep, rebuild, move"),
    (["--host-lead", "-1"], "--host-lead must be 0 or more milliseconds, got -1.0"),
    (["--model", "bert", "--seq-len", "1024"], "--seq-len 1024: BERT's positions end at 512"),
    (["--model", "gpt2", "--batch", "0"], "--batch and --seq-len must be 1 or more, got 0 and 1024"),
    (["--model", "t5"], "invalid choice: 't5'"),
])
def test_decision_costs_refuses_bad_options_with_what_is_allowed(flags, says, capsys):
    with pytest.raises(SystemExit):
        decision_costs.parse_args(flags)
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["stock", "--budget", "16GiB"], "--budget applies to um_alloc"),
    (["um", "--budget", "1GiB", "--held", "2GiB"], "--held (2GiB) must be below --budget (1GiB)"),
])
def test_alloc_cost_refuses_bad_options_with_what_is_allowed(flags, says, capsys):
    with pytest.raises(SystemExit):
        alloc_cost.main(flags)
    assert says in capsys.readouterr().err


def _row(step_s: float, predicted_s: float) -> dict:
    return {"status": "ok", "measured_step_s": step_s, "predicted_step_s": predicted_s}


def test_per_block_costs_are_each_forced_decision_against_every_block_kept():
    rows = {"every block keep": _row(0.100, 0.110), "every block move": _row(0.340, 0.550),
            "every block rebuild": {"status": "does not fit"}, "the planner's plan": _row(0.120, 0.130)}
    costs = decision_costs.per_block_costs(rows, blocks=24)
    assert set(costs) == {"move"}
    assert costs["move"]["measured_ms"] == pytest.approx(10.0)
    assert costs["move"]["predicted_ms"] == pytest.approx(1e3 * 0.44 / 24)


def test_per_block_costs_without_every_block_kept_are_none():
    rows = {"every block recompute": _row(0.15, 0.16), "the planner's plan": _row(0.14, 0.15)}
    assert decision_costs.per_block_costs(rows, blocks=24) == {}


def test_the_gpu_waits_for_the_host_by_what_a_phase_takes_beyond_its_time_with_the_host_ahead():
    phases = {"forward_gpu_ms": 45.2, "backward_gpu_ms": 79.0, "optimizer_gpu_ms": 2.7}
    ahead = {"forward_gpu_ms": 33.0, "backward_gpu_ms": 79.0, "optimizer_gpu_ms": 2.7}
    assert decision_costs.waits_for_host(phases, ahead) == {"forward_waits_ms": pytest.approx(12.2),
                                                            "backward_waits_ms": 0.0}
