"""Today's cost model on recorded measurements: every planner record in bench/results that holds
its calibration and its plan, priced again by um_alloc.planner.planning and set against the step
time measured with that plan.

    python bench/replay_predictions.py                                  # every record under bench/results
    python bench/replay_predictions.py bench/results/zoo_new_models --json replay.json

Records are a benchmark's (bench_planner, bench_trainer, bench_zoo, ...) or a summary that
`bert_example/train.py --json` or `python -m um_alloc run --json` wrote under the planner.

planning.py is pure data (no torch, no GPU), so a change to the cost model can be judged here, on
every model, budget and host a benchmark has measured, before a GPU runs it. Per record:

  predicted   the plan's step as planning.evaluate() prices its decisions today
  recorded    the plan's step as the planner priced it when it ran
  measured    the median of the plan's own steps (the planner's figure; else the record's median)
  error       predicted / measured - 1
  kept        the model's step with every unit kept (Calibration.base_step_s()), before any
              decision's cost
  stock       stock's measured step at the same batch, where the record's file holds one: what
              a step that keeps everything took without a budget
  stalled     what the measuring step's GPU stood waiting for copies back (Calibration.copy_stalls_s),
              where the record's calibration timed it: part of what the base leaves out, or not

The summary counts apart the records whose calibration also timed each distinct unit by itself
(planner/alone.py), which the base uses; older records hold no such times.

The summary also prices each plan from stock's measured step in place of the base, where the file
holds it: the same decisions' costs on a base no calibration can give (stock's step needs the
memory the budget denies), which shows how much of the error is the base's and how much the
decisions' prices.

Plans are priced as recorded: the decisions stay, so a change that would choose other decisions
shows in the prices of these ones only. A run of inputs of changing shapes (`--lengths`) records
the plan of one input against the steps of all: its rows are marked and left out of the summary.
A record whose calibration today's Calibration cannot read (a field renamed since) is counted as
skipped, with its file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from um_alloc.planner.planning import Decision, calibration_from_dict, evaluate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WITHIN = 0.15  # the aim: every prediction within 15% of the measured step


def planner_records(paths: list[Path]):
    """(file, record, stock's step at its batch or None) for every record with a calibration and a
    plan, in the JSON files under `paths` (files or folders), in path order."""
    files = sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.json")))
    for path in files:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        records = [_with_planner_fields(r) for r in (data if isinstance(data, list) else [data]) if isinstance(r, dict)]
        stock = {r.get("batch"): r["step_s_median"] for r in records
                 if r.get("method") == "stock" and r.get("step_s_median")}
        for r in records:
            if r.get("calibration") and isinstance(r.get("plan"), dict) and r["plan"].get("units"):
                yield path, r, stock.get(r.get("batch"))


def _with_planner_fields(record: dict) -> dict:
    """A benchmark's record as it is; a summary that train.py or the launcher wrote (its planner's
    figures under "planner", as BlockPlanner.to_dict() gives them) with those figures where a
    benchmark's record keeps them."""
    planner = record.get("planner")
    if record.get("calibration") or not isinstance(planner, dict):
        return record
    return {**record, "calibration": planner.get("calibration"), "plan": planner.get("plan"),
            "planner_measured_step_s": planner.get("measured_step_s"), "margin_bytes": planner.get("margin_bytes")}


def replay(record: dict, stock_step_s: float | None = None) -> dict | None:
    """The record's plan priced today, or None where its calibration cannot be read today."""
    try:
        cal = calibration_from_dict(record["calibration"])
    except (TypeError, KeyError, ValueError):
        return None
    decisions = tuple(Decision(u["decision"]) for u in record["plan"]["units"])
    if len(decisions) != len(cal.units):
        return None
    margin = record.get("margin_bytes")
    plan = evaluate(cal, decisions, record["plan"]["budget_bytes"],
                    **({} if margin is None else {"margin_bytes": margin}))
    measured = record.get("planner_measured_step_s") or record.get("step_s_median")
    return {"model": record.get("model") or record.get("workload"), "batch": record.get("batch"),
            "run_id": record.get("run_id"), "predicted_s": plan.predicted_step_s,
            "recorded_s": record["plan"].get("predicted_step_s"), "measured_s": measured,
            "error": plan.predicted_step_s / measured - 1 if measured else None,
            "kept_s": cal.base_step_s(), "stock_s": stock_step_s, "one_input": not record.get("lengths"),
            "stalled_s": cal.copy_stalls_s or None,
            "alone": any(u.alone_forward_s > 0 for u in cal.units),
            "error_on_stock": _error_on_stock(plan.predicted_step_s - cal.base_step_s(), stock_step_s, measured)}


def _error_on_stock(decisions_s: float, stock_step_s: float | None, measured_s: float | None) -> float | None:
    """The error of a prediction whose base is stock's measured step: `decisions_s` is what the
    plan's decisions add to the base."""
    if not stock_step_s or not measured_s:
        return None
    return (stock_step_s + decisions_s) / measured_s - 1


def summary(rows: list[dict]) -> dict:
    """Over the records of one input shape with a measured step, and the same over those whose
    calibration timed its units by themselves (`alone`)."""
    errors = [r["error"] for r in rows if r["error"] is not None and r["one_input"]]
    alone = [r["error"] for r in rows if r["error"] is not None and r["one_input"] and r.get("alone")]
    kept_over_stock = [r["kept_s"] / r["stock_s"] for r in rows if r["stock_s"] and r["one_input"]]
    on_stock = [r["error_on_stock"] for r in rows if r.get("error_on_stock") is not None and r["one_input"]]
    return {"records": len(errors), "median_abs_error": statistics.median(map(abs, errors)) if errors else None,
            "within_15_percent": sum(abs(e) <= WITHIN for e in errors),
            "predicted_too_slow": sum(e > 0 for e in errors),
            "alone": {"records": len(alone), "median_abs_error": statistics.median(map(abs, alone)) if alone else None,
                      "within_15_percent": sum(abs(e) <= WITHIN for e in alone)},
            "median_kept_over_stock": statistics.median(kept_over_stock) if kept_over_stock else None,
            "on_stock": {"records": len(on_stock),
                         "median_abs_error": statistics.median(map(abs, on_stock)) if on_stock else None,
                         "within_15_percent": sum(abs(e) <= WITHIN for e in on_stock)}}


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{1e3 * seconds:.1f}"


def print_table(rows: list[dict], skipped: list[str]) -> None:
    head = f"{'file':<58}{'model':<14}{'batch':>6}{'predicted':>10}{'recorded':>9}{'measured':>9}{'error':>8}" \
           f"{'kept':>8}{'stock':>8}{'stalled':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        error = "" if r["error"] is None else f"{100 * r['error']:+.0f}%" + ("" if r["one_input"] else "*")
        print(f"{r['file'][-57:]:<58}{str(r['model'])[:13]:<14}{str(r['batch']):>6}{_ms(r['predicted_s']):>10}"
              f"{_ms(r['recorded_s']):>9}{_ms(r['measured_s']):>9}{error:>8}{_ms(r['kept_s']):>8}"
              f"{_ms(r['stock_s']):>8}{_ms(r['stalled_s']):>8}")
    s = summary(rows)
    if s["median_abs_error"] is not None:
        print(f"\n{s['records']} records of one input shape: median |error| {100 * s['median_abs_error']:.1f}%, "
              f"{s['within_15_percent']} within 15%, {s['predicted_too_slow']} predicted too slow")
    alone = s["alone"]
    if alone["median_abs_error"] is not None:
        print(f"of them, {alone['records']} whose units were timed by themselves: median |error| "
              f"{100 * alone['median_abs_error']:.1f}%, {alone['within_15_percent']} within 15%")
    if s["median_kept_over_stock"] is not None:
        print(f"the model's step with everything kept, over stock's measured step: {s['median_kept_over_stock']:.2f} "
              "(median, where the file holds stock's step at the batch)")
    on_stock = s["on_stock"]
    if on_stock["median_abs_error"] is not None:
        print(f"the same decisions' costs on stock's measured step for the base: median |error| "
              f"{100 * on_stock['median_abs_error']:.1f}%, {on_stock['within_15_percent']} within 15% "
              f"(the {on_stock['records']} records whose file holds stock's step)")
    if not all(r["one_input"] for r in rows):
        print("*: inputs of changing shapes, one input's plan against every step; not in the summary")
    if skipped:
        print(f"skipped {len(skipped)} whose calibration today's Calibration cannot read: {', '.join(skipped)}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path, default=[RESULTS], help="JSON files or folders (default: "
                   "bench/results)")
    p.add_argument("--json", type=Path, help="also write the rows and the summary here")
    args = p.parse_args(argv)
    missing = [str(path) for path in args.paths if not path.exists()]
    if missing:
        p.error(f"no such file or folder: {', '.join(missing)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    rows, skipped = [], []
    for path, record, stock in planner_records(args.paths):
        row = replay(record, stock)
        if row is None:
            skipped.append(str(path))
        else:
            rows.append({"file": str(path), **row})
    if not rows and not skipped:
        print(f"no planner record with a calibration under {', '.join(map(str, args.paths))}")
        return 1
    print_table(rows, skipped)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "skipped": skipped, "summary": summary(rows)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
