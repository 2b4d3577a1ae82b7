"""bench/replay_predictions.py on the CPU: recorded plans priced again by today's cost model."""
import json
import sys
from pathlib import Path

import pytest

from test_planner_plan import GiB, transformer
from um_alloc.planner.planning import calibration_to_dict, evaluate, make_plan

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
import replay_predictions  # noqa: E402


def planner_record(measured_s: float, **extra) -> dict:
    cal = transformer()
    plan = make_plan(cal, 14 * GiB)
    return {"method": "planner", "model": "synthetic", "batch": 8, "run_id": "zoo-1",
            "calibration": calibration_to_dict(cal), "plan": {**plan.to_dict(), "predicted_step_s": 0.5},
            "planner_measured_step_s": measured_s, "margin_bytes": 512 << 20, **extra}


def test_a_recorded_plan_is_priced_today_against_its_measured_step_and_stocks(tmp_path, capsys):
    cal = transformer()
    decisions = make_plan(cal, 14 * GiB).decisions
    today = evaluate(cal, decisions, 14 * GiB).predicted_step_s
    stock = {"method": "stock", "batch": 8, "step_s_median": 0.09}
    (tmp_path / "run.json").write_text(json.dumps([stock, planner_record(measured_s=today / 1.25)]))
    out = tmp_path / "replay.json"
    assert replay_predictions.main([str(tmp_path), "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    (row,) = written["rows"]
    assert row["predicted_s"] == pytest.approx(today) and row["recorded_s"] == 0.5  # today's price, and then's
    assert row["error"] == pytest.approx(0.25) and row["stock_s"] == 0.09
    assert row["kept_s"] == pytest.approx(cal.base_step_s())
    assert row["stalled_s"] is None  # the calibration timed no waits for copies back
    assert written["summary"]["within_15_percent"] == 0 and written["summary"]["predicted_too_slow"] == 1
    assert "1 records of one input shape: median |error| 25.0%" in capsys.readouterr().out


def test_a_summary_train_py_wrote_is_read_through_its_planners_figures(tmp_path):
    """bert_example/train.py --json keeps BlockPlanner.to_dict() under "planner"."""
    record = planner_record(measured_s=0.2)
    planner = {"calibration": record["calibration"], "plan": record["plan"], "measured_step_s": 0.2,
               "margin_bytes": record["margin_bytes"]}
    summary = {"workload": "bert-large", "method": "um_alloc", "batch": 160, "step_s_median": 0.25,
               "planner": planner}
    (tmp_path / "train.json").write_text(json.dumps(summary))
    out = tmp_path / "replay.json"
    assert replay_predictions.main([str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["model"], row["batch"], row["measured_s"]) == ("bert-large", 160, 0.2)  # the planner's clock
    assert row["recorded_s"] == 0.5


def test_the_decisions_costs_are_priced_on_stocks_step_too(tmp_path, capsys):
    """Where the file holds stock's step, the plan's decisions' costs on it, in place of the base,
    make a second error: what the base alone gets wrong shows."""
    cal = transformer()
    today = evaluate(cal, make_plan(cal, 14 * GiB).decisions, 14 * GiB).predicted_step_s
    decisions_s = today - cal.base_step_s()
    measured = 0.2
    stock = {"method": "stock", "batch": 8, "step_s_median": measured - decisions_s}  # base = stock: no error
    unmatched = {"method": "stock", "batch": 16, "step_s_median": 0.1}  # another batch's: not this record's
    (tmp_path / "with_stock.json").write_text(json.dumps([stock, unmatched, planner_record(measured_s=measured)]))
    (tmp_path / "without.json").write_text(json.dumps([planner_record(measured_s=measured)]))
    out = tmp_path / "replay.json"
    assert replay_predictions.main([str(tmp_path), "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    rows = {Path(r["file"]).stem: r for r in written["rows"]}
    with_stock, without = rows["with_stock"], rows["without"]
    assert with_stock["error_on_stock"] == pytest.approx(0.0, abs=1e-12)
    assert without["error_on_stock"] is None
    assert written["summary"]["on_stock"] == {"records": 1, "median_abs_error": pytest.approx(0.0, abs=1e-12),
                                              "within_15_percent": 1}
    assert "on stock's measured step for the base: median |error| 0.0%, 1 within 15% (the 1 records" \
        in capsys.readouterr().out


def test_the_waits_for_copies_back_a_calibration_timed_are_shown_beside_its_base(tmp_path, capsys):
    record = planner_record(measured_s=0.5)
    record["calibration"]["copy_stalls_s"] = 0.0123
    (tmp_path / "run.json").write_text(json.dumps([record]))
    out = tmp_path / "replay.json"
    assert replay_predictions.main([str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["stalled_s"] == 0.0123 and row["kept_s"] == pytest.approx(transformer().base_step_s())
    assert capsys.readouterr().out.splitlines()[2].endswith("    12.3")


def test_runs_of_changing_shapes_are_marked_and_unreadable_calibrations_skipped(tmp_path, capsys):
    changing = planner_record(measured_s=1.0, lengths=[512, 256])
    renamed = planner_record(measured_s=1.0)
    renamed["calibration"]["segments"][0]["renamed_field"] = 1
    (tmp_path / "a.json").write_text(json.dumps([changing]))
    (tmp_path / "b.json").write_text(json.dumps(renamed))
    (tmp_path / "c.json").write_text("not json")  # a file of another kind is passed over
    assert replay_predictions.main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "*: inputs of changing shapes" in printed and "0 records of one input shape" not in printed
    assert f"skipped 1 whose calibration today's Calibration cannot read: {tmp_path / 'b.json'}" in printed


def test_a_path_that_does_not_exist_is_refused_and_no_record_is_a_failure(tmp_path, capsys):
    with pytest.raises(SystemExit):
        replay_predictions.parse_args([str(tmp_path / "missing")])
    assert replay_predictions.main([str(tmp_path)]) == 1
    assert "no planner record with a calibration" in capsys.readouterr().out


def test_records_whose_units_were_timed_by_themselves_are_summed_up_apart(tmp_path, capsys):
    record = planner_record(measured_s=0.2)
    timed = json.loads(json.dumps(record))
    for unit in timed["calibration"]["units"]:
        unit["alone_forward_s"], unit["alone_backward_s"] = 1e-4, 2e-4
    (tmp_path / "before.json").write_text(json.dumps([record]))
    (tmp_path / "timed.json").write_text(json.dumps([timed]))
    out = tmp_path / "replay.json"
    assert replay_predictions.main([str(tmp_path), "--json", str(out)]) == 0
    written = json.loads(out.read_text())
    rows = {Path(r["file"]).stem: r for r in written["rows"]}
    assert rows["timed"]["alone"] and not rows["before"]["alone"]
    assert rows["timed"]["kept_s"] < rows["before"]["kept_s"]  # the base gave up what the units took beyond
    (error,) = [rows["timed"]["error"]]
    assert written["summary"]["alone"] == {"records": 1, "median_abs_error": pytest.approx(abs(error)),
                                           "within_15_percent": int(abs(error) <= 0.15)}
    assert "of them, 1 whose units were timed by themselves: median |error|" in capsys.readouterr().out

