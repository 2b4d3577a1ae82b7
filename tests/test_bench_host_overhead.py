"""bench/host_overhead.py on the CPU, as it runs there: every method trains as plain autograd does
on a two-layer model, and the record says what each added to plain's step."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import host_overhead  # noqa: E402

pytest.importorskip("transformers")


@pytest.mark.parametrize("model", ["gpt2", "llama", "bert"])
def test_every_method_trains_as_plain_and_the_record_names_what_each_added(tmp_path, model, capsys):
    assert host_overhead.main(["--model", model, "--layers", "2", "--hidden", "16", "--steps", "2",
                               "--warmup", "4", "--repeats", "1", "--out", str(tmp_path)]) == 0
    record = json.loads(next(tmp_path.glob("host_overhead-*.json")).read_text())
    rows = {row["method"]: row for row in record["methods"]}
    assert list(rows) == list(host_overhead.METHODS)
    assert all(row["equal_to_plain"] for row in rows.values())
    assert rows["plain"]["added_ms"] == 0
    assert rows["planner_rebuild"]["decisions"]["rebuild"] == 2  # both layers rebuilt, not kept
    assert rows["planner_one_node"]["decisions"]["recompute"] == 2
    assert all(row["added_ms"] == pytest.approx(row["step_ms"] - rows["plain"]["step_ms"]) for row in rows.values())
    assert record["layers"] == 2 and record["run_id"].startswith("host_overhead-")
    assert "planner_one_node" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [(["--warmup", "2"], "--warmup 2"), (["--layers", "0"], "--layers must")])
def test_bad_counts_are_refused_with_what_is_allowed(flags, says, capsys):
    with pytest.raises(SystemExit):
        host_overhead.parse_args(flags)
    assert says in capsys.readouterr().err
