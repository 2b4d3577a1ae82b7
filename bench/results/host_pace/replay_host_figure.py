"""The recorded plans that rebuild, priced again with the unit-by-itself host figure the records
predate (UnitCost.alone_forward_cpu_s), set as a share of each unit's alone_forward_s.

    python bench/results/host_pace/replay_host_figure.py

An estimate, not a measurement: the share stands in for the host's time a calibration now reads.
The kept forward's host time against its GPU time was 0.4-0.6 in GPT-2-medium's plain-loop steps
on two H200 machines (step_probe.py), 0.7 on a slower one (../copy_groups/), and 0.54 for
BERT-Large on another (../decision_costs/, --host-lead). Prints, per record whose calibration
timed its units by themselves and whose plan or units rebuild, the prediction's error against the
measured step with today's model (no host figure: the checks charged whole) and at each share."""
from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent))

from replay_predictions import RESULTS, planner_records  # noqa: E402

from um_alloc.planner.planning import Decision, calibration_from_dict, evaluate  # noqa: E402

SHARES = (None, 0.5, 0.7, 0.9)


def errors(record: dict) -> dict | None:
    try:
        cal = calibration_from_dict(record["calibration"])
    except (TypeError, KeyError, ValueError):  # a field renamed since (replay_predictions skips these too)
        return None
    decisions = tuple(Decision(u["decision"]) for u in record["plan"]["units"])
    measured = record.get("planner_measured_step_s") or record.get("step_s_median")
    if (record.get("lengths") or not measured or len(decisions) != len(cal.units)
            or not any(u.alone_forward_s > 0 for u in cal.units) or Decision.REBUILD not in decisions):
        return None
    margin = {} if record.get("margin_bytes") is None else {"margin_bytes": record["margin_bytes"]}
    out = {}
    for share in SHARES:
        priced = cal if share is None else replace(cal, units=tuple(
            replace(u, alone_forward_cpu_s=share * u.alone_forward_s) for u in cal.units))
        out[share] = evaluate(priced, decisions, record["plan"]["budget_bytes"], **margin).predicted_step_s / measured - 1
    return out


def main() -> None:
    rows = []
    for path, record, _ in planner_records([RESULTS]):
        found = errors(record)
        if found is not None:
            rows.append((str(path.relative_to(RESULTS)), found))
            print(f"{rows[-1][0][-64:]:<65}" + "  ".join(
                f"{'today' if s is None else s}: {100 * e:+.0f}%" for s, e in found.items()))
    for share in SHARES:
        errs = [abs(found[share]) for _, found in rows]
        print(f"{'today' if share is None else f'share {share}'}: median |error| {100 * statistics.median(errs):.1f}%, "
              f"{sum(e <= 0.15 for e in errs)} of {len(errs)} within 15%")


if __name__ == "__main__":
    main()
