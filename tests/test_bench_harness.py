"""bench/harness.py on the CPU: how a run is started and how it can end, the frontier search,
protocol records with their run_id and ratios, and derived policies. Runs are small Python
scripts standing in for train.py."""
import json
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import harness  # noqa: E402

from um_alloc.policy import load_policy  # noqa: E402

SUMMARY = {"device": "fake", "date": "2026-11-22T07:45:13+00:00", "workload": "w", "method": "um_alloc",
           "policy": "best.yaml", "batch": 32, "step_s_median": 0.25, "samples_per_s": 128.0,
           "device_used_delta_bytes": 3 << 30, "gpu_page_faults": 7, "htod_bytes": 1, "dtoh_bytes": 2,
           "loss_first": 10.5, "loss_last": 9.5}


def stand_in(tmp_path: Path, body: str) -> Path:
    """A script run as train.py would be: its arguments end with --json PATH."""
    script = tmp_path / "stand_in.py"
    script.write_text("import json, os, sys, time\njson_path = sys.argv[-1]\n" + textwrap.dedent(body))
    return script


def test_run_ids_name_the_benchmark_and_its_start():
    start = datetime(2026, 11, 22, 7, 45, 13, tzinfo=timezone.utc)
    assert harness.new_run_id("bench_budget", start) == "bench_budget-20261122-074513"
    assert harness.new_run_id("compare_peers").startswith("compare_peers-20")


def test_a_run_gets_its_arguments_the_json_path_and_this_checkout_first_on_the_path(tmp_path):
    script = stand_in(tmp_path, """
        json.dump({"argv": sys.argv[1:], "path": os.environ["PYTHONPATH"], "extra": os.environ["EXTRA"]},
                  open(json_path, "w"))
    """)
    run = harness.Run("r", "", ["--batch-size", "8"], script=script, env={"EXTRA": "yes"})
    summary, status, note = harness.run_train(run, timeout=60)
    assert (status, note) == ("ok", "")
    assert summary["argv"][:3] == ["--batch-size", "8", "--json"] and summary["argv"][3].endswith("summary.json")
    assert summary["path"].split(":")[0] == str(harness.ROOT) and summary["extra"] == "yes"


@pytest.mark.parametrize("body, status", [
    ("sys.stderr.write('CUDA out of memory\\n'); sys.exit(3)", "oom"),
    # torchrun exits 1 whatever its worker's status: train.py's message says out of memory
    ("sys.stderr.write('train.py: out of GPU memory: CUDA out of memory\\n'); sys.exit(1)", "oom"),
    ("sys.stderr.write('Traceback: boom\\n'); sys.exit(1)", "failed (exit 1)"),
    ("sys.exit(0)", "failed (exit 0)"),  # exit 0 but no summary written
    # the launcher prints its summary after the script's error: the note still names the error
    ("sys.stderr.write('x: CUDA out of memory\\n' + 'summary\\n' * 5); sys.exit(3)", "oom"),
    ("time.sleep(30)", "timeout"),
])
def test_a_run_that_ends_without_a_summary_says_how(tmp_path, body, status, capsys):
    summary, got, note = harness.run_train(harness.Run("r", "", [], script=stand_in(tmp_path, body)), timeout=3)
    assert summary is None and got == status
    assert {"oom": "CUDA out of memory", "timeout": "ran past 3 s"}.get(status, "") in note
    assert f"[r] {status}" in capsys.readouterr().out


def test_a_child_returns_its_last_json_line_or_raises(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("print('warming up')\nprint('{\"x\": 1}')\n")
    assert harness.run_child([str(good)], timeout=60) == {"x": 1}
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit('no GPU')\n")
    with pytest.raises(RuntimeError, match="no GPU"):
        harness.run_child([str(bad)], timeout=60)


def test_a_run_under_torchrun_starts_its_processes_with_the_launch_flags(tmp_path):
    script = stand_in(tmp_path, """
        rank = os.environ["RANK"]
        if rank == "0":
            json.dump({"world": os.environ["WORLD_SIZE"]}, open(json_path, "w"))
    """)
    run = harness.Run("r", "", [], script=script, launch=harness.torchrun(2))
    summary, status, _ = harness.run_train(run, timeout=120)
    assert status == "ok" and summary == {"world": "2"}


@pytest.mark.parametrize("smallest, start, k, probes", [
    (19, 21, 19, [21, 20, 19, 18]),   # fits at the start: down until it does not
    (19, 17, 19, [17, 18, 19]),       # does not fit: up until it does
    (0, 1, 0, [1, 0]),                # down to no layer at all
    (None, 23, None, [23, 24]),       # not even every layer
])
def test_the_checkpointing_frontier_is_the_smallest_k_that_fits(smallest, start, k, probes):
    tried = []

    def fits(layers):
        tried.append(layers)
        return {"k": layers} if smallest is not None and layers >= smallest else None
    found, summary, seen = harness.smallest_fitting(fits, start, 24)
    assert found == k and tried == probes and seen == sorted(probes)
    assert summary == (None if k is None else {"k": k})


def test_a_known_run_is_not_made_again():
    tried = []
    found, _, seen = harness.smallest_fitting(lambda k: tried.append(k) or {"k": k}, 24, 24, known={24: {"k": 24}})
    assert tried == list(range(23, -1, -1)) and found == 0 and 24 in seen


def test_importable_says_why_not():
    assert harness.importable("json") is None
    assert harness.importable("no_such_module_here.sub").startswith("no_such_module_here is not importable here")


@pytest.mark.parametrize("fits, start, limit, largest, probes", [
    (13, 8, 512, 13, [8, 16, 12, 14, 13]),        # doubles, then bisects between fit and failure
    (5, 32, 512, 5, [32, 16, 8, 4, 6, 5]),        # the start already fails: halves
    (10**6, 8, 40, 40, [8, 16, 32, 40]),          # everything fits: stops at the limit
    (0, 4, 512, 0, [4, 2, 1]),                    # not even batch 1
])
def test_the_frontier_search_finds_the_largest_batch_that_fits(fits, start, limit, largest, probes):
    tried = []

    def probe(batch):
        tried.append(batch)
        return batch <= fits
    assert harness.largest_batch(probe, start, limit) == largest
    assert tried == probes


def test_a_record_has_the_protocol_fields_the_run_id_and_the_ratio_to_stock():
    record = harness.protocol_record(SUMMARY, run_id="bench-1", stock_samples_per_s=256.0, budget_bytes=16 << 30,
                                     method="offload", extra=1)
    assert list(record)[:len(harness.PROTOCOL_FIELDS)] == list(harness.PROTOCOL_FIELDS)
    assert record["run_id"] == "bench-1" and record["method"] == "offload" and record["extra"] == 1
    assert record["ratio_vs_stock"] == 0.5 and record["budget_bytes"] == 16 << 30
    assert record["highwater_bytes"] == 3 << 30 and record["gpu_page_faults"] == 7
    failed = harness.protocol_record(None, run_id="bench-1", stock_samples_per_s=256.0, budget_bytes=1,
                                     method="reactive", status="oom")
    assert failed["run_id"] == "bench-1" and failed["method"] == "reactive" and failed["status"] == "oom"
    assert failed["samples_per_s"] is None and failed["ratio_vs_stock"] is None


@pytest.mark.parametrize("value, base, expected", [(2.0, 4.0, 0.5), (None, 4.0, None), (2.0, None, None),
                                                   (2.0, 0.0, None)])
def test_ratio_is_none_where_a_run_is_missing(value, base, expected):
    assert harness.ratio(value, base) == expected


def test_records_go_to_the_folder_asked_for(tmp_path):
    path = harness.write_result("budget_16GiB_b32_stock", {"run_id": "x"}, tmp_path / "out")
    assert path == tmp_path / "out" / "budget_16GiB_b32_stock.json"
    assert json.loads(path.read_text()) == {"run_id": "x"}


def test_a_derived_policy_changes_the_scheduler_only_and_validates(tmp_path):
    none = harness.raw_policy("none.yaml")
    reactive = harness.with_scheduler(none, budget="8GiB", evict_live=True)
    assert none.get("scheduler", {}).get("budget") is None  # the original is left alone
    assert reactive["scheduler"]["evict_live"] is True and reactive.get("tags") == none.get("tags")
    path = harness.write_policy(tmp_path, "reactive", reactive, "none.yaml, reactive budget")
    policy = load_policy(path)
    assert policy.scheduler.evict_live and policy.scheduler.budget == 8 << 30
    assert path.read_text().startswith("# reactive: none.yaml, reactive budget (generated by")
    bad = harness.with_scheduler(none, evict_live=True, offload_activations=True)
    assert "needs a hard budget" in harness.validation_error(bad, "x.yaml", "x")


def test_a_table_row_carries_the_run_id_also_for_a_run_that_did_not_run():
    run = harness.Run("um_best", "best", [])
    skipped = harness.row(run, None, "skipped", run_id="cmp-1")
    assert skipped["run_id"] == "cmp-1" and skipped["status"] == "skipped" and skipped["samples_per_s"] is None
    ok = harness.row(run, {**SUMMARY, "activation_offload": {"out_bytes": 5}}, "ok", run_id="cmp-1")
    assert ok["offload_out_bytes"] == 5 and ok["highwater_bytes"] == 3 << 30
    assert ok["gpu_page_faults"] is None  # tables show per-step means; this run has no counters
    assert harness.provenance([skipped, ok]) == "run_id cmp-1, on fake, 2026-11-22T07:45:13+00:00."


def test_a_comparison_runs_its_plan_under_one_run_id_and_fails_when_nothing_ran(tmp_path, capsys):
    import argparse

    seen = []

    def plan(args, out):
        return [harness.Run("a", "", []), harness.Run("b", "", [], skip="not in --only")]

    def execute(runs, run_id):
        seen.append(run_id)
        return [harness.row(r, None, "skipped" if r.skip else "oom", run_id=run_id) for r in runs]

    def report(rows, out, args):
        (out / "t.md").write_text("| the table |\n")
        return [out / "t.md"]

    args = argparse.Namespace(out=str(tmp_path), dry_run=True)
    assert harness.compare("cmp", args, plan=plan, execute=execute, report=report, table="t.md") == 0
    assert seen == [] and "cmp: 1 runs, 1 skipped ->" in capsys.readouterr().out
    args.dry_run = False
    assert harness.compare("cmp", args, plan=plan, execute=execute, report=report, table="t.md") == 1  # none ok
    assert seen[0].startswith("cmp-20") and "| the table |" in capsys.readouterr().out
