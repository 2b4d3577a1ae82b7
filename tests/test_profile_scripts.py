"""The comparison scripts, train.py's --profile/--timeline/--offload/--checkpointing, the
`python -m um_alloc.profile` runner and the overhead benchmark's arithmetic, on the CPU. Runs of
train.py on a GPU are replaced by a stand-in runner that returns summaries."""
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from um_alloc.policy import load_policy
from um_alloc.profile import aggregate

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_profile_overhead  # noqa: E402
import compare_peers  # noqa: E402
import compare_policies  # noqa: E402

from bert_example.train import main as train_main  # noqa: E402

TINY = ["--device", "cpu", "--allocator", "stock", "--model", "tiny", "--seq-len", "32", "--batch-size", "4",
        "--dropout", "0", "--no-bf16"]


def fake_summary(name: str, step_s: float, faults: int) -> dict:
    counts = {**aggregate.empty_counts(), "gpu_page_faults": faults, "htod_bytes": faults * 65536,
              "htod_fault_bytes": faults * 65536}
    return {"device": "fake", "date": "2026-11-22", "workload": "w", "method": "um_alloc", "policy": name,
            "batch": 8, "step_s_median": step_s, "samples_per_s": 8 / step_s, "device_used_delta_bytes": 2**30,
            "peak_bytes": 2**29, "loss_first": 10.0, "loss_last": 9.0,
            "um_counters": {"available": True, "timed_mean": counts}}


def fake_runner(times: dict):
    calls = []

    def runner(run, timeout):
        calls.append(run)
        if run.name not in times:
            return None, "oom", "out of memory at 8 GiB"
        return fake_summary(run.name, times[run.name], faults=int(times[run.name] * 1000)), "ok", ""
    runner.calls = calls
    return runner


# --- compare_policies --------------------------------------------------------------------------

def test_policy_plan_runs_the_default_set_and_lists_budget_ablations_as_skipped(tmp_path):
    args = compare_policies.parse_args(["--dry-run", "--memory-limit", "8GiB", "--out", str(tmp_path)])
    runs = compare_policies.plan(args, tmp_path)
    names = [r.name for r in runs]
    assert names[:5] == ["none", "worst", "best", "advice_only", "prefetch_only"]
    assert names[5:] == ["offload", "checkpoint", "planner_off", "evict_reactive", "evict_host_mapped",
                         "window_256MiB", "window_1GiB", "window_4GiB"]
    assert [r.name for r in runs if not r.skip] == names[:5]
    assert all(r.skip.startswith("needs --budget") for r in runs[5:])
    best = runs[2].train_args
    assert best[best.index("--policy") + 1] == "best.yaml" and "--profile" in best
    assert best[best.index("--memory-limit") + 1] == "8GiB" and best[best.index("--allocator") + 1] == "um"
    assert not (tmp_path / "policies").exists()  # a dry run writes nothing


def test_budget_ablations_change_one_thing_each_and_every_policy_gets_the_budget(tmp_path):
    args = compare_policies.parse_args(["--budget", "4GiB", "--out", str(tmp_path)])
    runs = {r.name: r for r in compare_policies.plan(args, tmp_path)}
    assert not any(r.skip for r in runs.values())
    policy = {name: load_policy(r.train_args[r.train_args.index("--policy") + 1]) for name, r in runs.items()}
    assert all(p.scheduler.budget == 4 * 2**30 for p in policy.values())
    best = load_policy("best")
    assert policy["best"].scheduler.strategy == "auto" and not policy["best"].scheduler.evict_live
    for name in ("advice_only", "prefetch_only", "evict_host_mapped"):  # best's scheduler: the planner
        assert policy[name].scheduler.strategy == "auto" and not policy[name].scheduler.offload_activations
    assert policy["offload"].scheduler.strategy == "offload" and policy["offload"].scheduler.offload_activations
    assert policy["checkpoint"].scheduler.strategy == "checkpoint"
    assert policy["planner_off"].scheduler.strategy == "none" and not policy["planner_off"].scheduler.evict_live
    assert policy["evict_reactive"].scheduler.evict_live and policy["evict_reactive"].scheduler.strategy == "none"
    assert policy["evict_host_mapped"].tags["optimizer_state"].preferred_location == "cpu"
    for size in ("256MiB", "1GiB", "4GiB"):
        window = policy[f"window_{size}"]
        assert window.scheduler.schedule_window == {"256MiB": 2**28, "1GiB": 2**30, "4GiB": 2**32}[size]
        assert window.scheduler.offload_activations and dict(window.tags) == dict(best.tags)
    for name in ("offload", "checkpoint", "planner_off", "evict_reactive"):
        assert dict(policy[name].tags) == dict(best.tags)
    assert dict(load_policy("offload").tags) == dict(best.tags)  # the shipped offload.yaml: best's hints too
    assert policy["worst"].tags["parameter"].preferred_location == "cpu"
    assert "--memory-limit" not in runs["best"].train_args
    assert policy["none"].scheduler.evict_live and not policy["best"].scheduler.evict_live  # reactive: explicit


def test_generated_ablations_split_best_into_advice_and_prefetch(tmp_path):
    args = compare_policies.parse_args(["--out", str(tmp_path)])
    compare_policies.plan(args, tmp_path)
    advice = load_policy(tmp_path / "policies" / "advice_only.yaml")
    prefetch = load_policy(tmp_path / "policies" / "prefetch_only.yaml")
    best = load_policy("best")
    for tag, a in best.tags.items():
        assert advice.tags[tag].preferred_location == a.preferred_location and not advice.tags[tag].prefetch
        assert prefetch.tags[tag].prefetch == a.prefetch and prefetch.tags[tag].preferred_location == "none"
        assert not prefetch.tags[tag].accessed_by and not prefetch.tags[tag].read_mostly


def test_extra_policy_files_run_and_broken_ones_are_listed(tmp_path):
    good, bad = tmp_path / "mine.yaml", tmp_path / "broken.yaml"
    good.write_text("tags:\n  parameter: {prefetch: true}\n")
    bad.write_text("tags:\n  parameter: {prefetch: maybe}\n")
    args = compare_policies.parse_args([str(good), str(bad), "--dry-run", "--only", "best,mine,broken"])
    runs = {r.name: r for r in compare_policies.plan(args, tmp_path)}
    assert runs["mine"].skip is None and runs["best"].skip is None and runs["none"].skip == "not in --only"
    assert runs["broken"].skip.startswith("does not load:") and "prefetch" in runs["broken"].skip


def test_policy_comparison_writes_table_and_charts(tmp_path):
    args = compare_policies.parse_args(["--memory-limit", "8GiB", "--out", str(tmp_path)])
    runs = compare_policies.plan(args, tmp_path)
    runner = fake_runner({"none": 0.080, "best": 0.072, "advice_only": 0.078, "prefetch_only": 0.074})
    rows = compare_policies.execute(runs, timeout=10, runner=runner)
    assert [r.name for r in runner.calls] == ["none", "worst", "best", "advice_only", "prefetch_only"]
    rows = compare_policies.execute(runs, timeout=10, runner=runner, run_id="compare_policies-1")
    assert {r["run_id"] for r in rows} == {"compare_policies-1"}
    paths = compare_policies.report(rows, tmp_path, args)
    table = {r["name"]: r for r in csv.DictReader((tmp_path / "policies.csv").open())}
    assert float(table["best"]["ratio_vs_none"]) == pytest.approx(0.080 / 0.072)
    assert table["worst"]["status"] == "oom" and table["planner_off"]["status"] == "skipped"
    assert float(table["best"]["gpu_page_faults"]) == 72.0 and table["best"]["run_id"] == "compare_policies-1"
    md = (tmp_path / "policies.md").read_text()
    assert "run_id compare_policies-1, on fake, 2026-11-22." in md
    assert "| run | status | median step | samples/s | vs none |" in md and "GPU faults /step" in md
    assert "| best | ok | 72.0 ms | 111.1 | 1.111 |" in md
    names = {Path(p).name for p in paths}
    assert {"step_time.png", "throughput.png", "gpu_page_faults.png", "migrated_bytes.png", "highwater.png",
            "policies.csv", "policies.md", "results.json"} <= names
    assert all(Path(p).stat().st_size > 0 for p in paths)


# --- compare_peers -----------------------------------------------------------------------------

def test_peer_plan_gives_every_method_but_stock_the_budget(tmp_path):
    args = compare_peers.parse_args(["--memory-limit", "16GiB", "--profile"])
    runs = {r.name: r for r in compare_peers.plan(args, tmp_path, rmm_status="rmm is not importable here (x)")}
    assert list(runs) == ["stock", "stock_save_on_cpu", "stock_checkpointing", "rmm_managed_pool",
                          "um_reactive", "um_best"]
    assert "--memory-limit" not in runs["stock"].train_args
    for name in ("stock_save_on_cpu", "stock_checkpointing", "rmm_managed_pool"):
        assert runs[name].train_args[runs[name].train_args.index("--memory-limit") + 1] == "16GiB"
    for name, base in (("um_reactive", "none"), ("um_best", "best")):
        args_ = runs[name].train_args
        policy = load_policy(args_[args_.index("--policy") + 1])
        assert policy.scheduler.budget == 16 * 2**30 and "--memory-limit" not in args_
        assert dict(policy.tags) == dict(load_policy(base).tags)
        assert policy.scheduler.evict_live == (name == "um_reactive")  # the reactive budget is asked for
    assert all("--profile" in r.train_args for r in runs.values())
    assert "--offload" in runs["stock_save_on_cpu"].train_args and "--checkpointing" in runs["stock_checkpointing"].train_args
    assert runs["rmm_managed_pool"].skip.startswith("rmm is not importable")
    assert runs["rmm_managed_pool"].script.name == "rmm_train.py"


def test_peer_comparison_alternates_rounds_and_reports_ratios_to_stock(tmp_path):
    args = compare_peers.parse_args(["--rounds", "2", "--out", str(tmp_path)])
    runs = compare_peers.plan(args, tmp_path, rmm_status=None)
    times = {"stock": 0.07, "stock_save_on_cpu": 0.15, "stock_checkpointing": 0.10, "rmm_managed_pool": 0.07,
             "um_reactive": 0.09, "um_best": 0.072}
    runner = fake_runner(times)
    rows = compare_peers.execute(runs, rounds=2, timeout=10, runner=runner)
    assert [r.name for r in runner.calls] == [r.name for r in runs] * 2  # alternating, not grouped
    compare_peers.report(rows, tmp_path, args)
    table = {r["name"]: r for r in csv.DictReader((tmp_path / "peers.csv").open())}
    assert float(table["stock"]["ratio_vs_stock"]) == 1.0
    assert float(table["um_best"]["ratio_vs_stock"]) == pytest.approx(0.07 / 0.072)
    assert table["um_best"]["rounds"] == "2"
    assert (tmp_path / "ratio_vs_stock.png").stat().st_size > 0 and "| vs stock |" in (tmp_path / "peers.md").read_text()


def test_rmm_wrapper_takes_the_limit_out_of_the_arguments():
    import rmm_train

    assert rmm_train.split_limit(["--steps", "3", "--memory-limit", "16GiB", "--profile"]) == \
        ("16GiB", ["--steps", "3", "--profile"])
    assert rmm_train.split_limit(["--memory-limit=8GiB"]) == ("8GiB", [])


# --- train.py ----------------------------------------------------------------------------------

def test_train_profile_without_cupti_runs_and_says_so(tmp_path, capsys):
    summary = train_main(TINY + ["--steps", "3", "--profile", "--timeline", str(tmp_path / "t.png"),
                                 "--json", str(tmp_path / "s.json")])
    counters = summary["um_counters"]
    assert counters["available"] is False and counters["reason"]
    assert len(counters["per_step"]) == 3 and summary["gpu_page_faults"] is None and summary["htod_bytes"] is None
    assert summary["timeline"]["step"] == 2 and (tmp_path / "t.png").stat().st_size > 0
    written = json.loads((tmp_path / "s.json").read_text())
    assert written["um_counters"]["timed_steps"] == 1 and written["timeline"]["png"] == str(tmp_path / "t.png")
    assert "UM counters: CUPTI unavailable:" in capsys.readouterr().out


def test_train_without_profile_adds_no_counters():
    summary = train_main(TINY + ["--steps", "1"])
    assert "um_counters" not in summary and summary["offload"] is None and summary["checkpointing"] is False


def test_save_on_cpu_trains_like_the_plain_run_with_its_hooks_on(monkeypatch):
    import torch

    plain = train_main(TINY + ["--steps", "3"])["losses"]
    calls, original = [], torch.autograd.graph.save_on_cpu

    def spy(**kwargs):
        calls.append(kwargs)
        return original(**kwargs)
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", spy)
    offloaded = train_main(TINY + ["--steps", "3", "--offload", "save_on_cpu"])["losses"]
    assert offloaded == pytest.approx(plain, rel=1e-5)
    assert calls == [{"pin_memory": False}] * 3  # pinned only on CUDA


def test_checkpointing_trains_like_the_plain_run_and_recomputes_in_backward(tmp_path):
    plain = train_main(TINY + ["--steps", "2"])["losses"]
    summary = train_main(TINY + ["--steps", "2", "--checkpointing", "--timeline", str(tmp_path / "t.png")])
    assert summary["losses"] == pytest.approx(plain, rel=1e-5)
    phases = {s["phase"] for s in json.loads((tmp_path / "t.json").read_text())["samples"]}
    assert "recompute" in phases  # forwards ran again inside backward


# --- python -m um_alloc.profile ----------------------------------------------------------------

def test_profile_runner_marks_a_step_per_optimizer_step(tmp_path):
    script = tmp_path / "train_sgd.py"
    script.write_text("import sys, torch\n"
                      "model = torch.nn.Linear(4, 1)\n"
                      "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                      "for _ in range(int(sys.argv[1])):\n"
                      "    model(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n")
    out = tmp_path / "counts.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "um_alloc.profile", "--json", str(out), str(script), "3"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "3 marked steps" in done.stderr and "running without counters" in done.stderr
    assert len(json.loads(out.read_text())["per_step"]) == 3


# --- bench_profile_overhead --------------------------------------------------------------------

def test_overhead_is_the_ratio_of_median_step_times():
    plain = [{"step_s_median": s} for s in (0.100, 0.104, 0.102)]
    profiled = [{"step_s_median": s, "um_counters": {"available": True, "timed_mean": {"um_records": n}}}
                for s, n in ((0.110, 900), (0.106, 1100), (0.108, 1000))]
    figures = bench_profile_overhead.summarize_policy({False: plain, True: profiled})
    assert figures["ratio"] == pytest.approx(0.108 / 0.102)
    assert figures["overhead_pct"] == pytest.approx(100 * (0.108 / 0.102 - 1))
    assert figures["um_records_per_step"] == 1000 and figures["counters_available"] is True
