"""bench/bench_budget.py, profile_offload.py and the micro-batch/scale search on the CPU: which
train.py run each method is, that train.py accepts it, the records of one invocation, the
transfer bound, and failures. Runs on a GPU are replaced by a stand-in runner."""
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_budget  # noqa: E402
import bench_microbatch  # noqa: E402
import harness  # noqa: E402
import profile_offload  # noqa: E402

from bert_example import options  # noqa: E402
from um_alloc.policy import load_policy  # noqa: E402

GiB = 1 << 30


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture
def planned(tmp_path):
    args = bench_budget.parse_args(["--budget", "10GiB", "--window", "2GiB"])
    return {run.name: run.train_args for run in bench_budget.runs(args, tmp_path)}


def test_every_method_is_a_train_py_run_with_phases_and_link_rates(planned):
    assert list(planned) == list(bench_budget.METHODS) and "planned" not in planned
    for argv in planned.values():
        assert {"--phase-times", "--link-rates"} <= set(argv) and value(argv, "--dropout") == "0"
        assert value(argv, "--batch-size") == "32" and value(argv, "--warmup-steps") == "3"
    assert "--memory-limit" not in planned["stock"] and "--budget" not in planned["stock"]
    for method in ("save_on_cpu", "checkpointing", "offload_stock"):
        assert value(planned[method], "--allocator") == "stock" and value(planned[method], "--memory-limit") == "10GiB"
    assert value(planned["save_on_cpu"], "--offload") == "save_on_cpu" and "--checkpointing" in planned["checkpointing"]
    assert value(planned["offload_stock"], "--offload") == "activations"
    for method in ("reactive", "offload", "offload_hostopt", "offload_moveall"):
        assert value(planned[method], "--allocator") == "um" and value(planned[method], "--budget") == "10GiB"
    for method in ("offload", "offload_hostopt", "offload_moveall", "offload_stock"):
        assert value(planned[method], "--offload-window") == "2GiB"
    assert "--no-rebuild" in planned["offload_moveall"] and "--no-rebuild" not in planned["offload"]
    assert value(planned["offload"], "--policy") == value(planned["offload_moveall"], "--policy") == "offload.yaml"


def test_reactive_says_evict_live_and_hostopt_offloads_activations(planned):
    reactive = load_policy(value(planned["reactive"], "--policy"))
    assert reactive.scheduler.evict_live and not reactive.scheduler.offload_activations
    assert dict(reactive.tags) == dict(load_policy("none.yaml").tags)
    hostopt = load_policy(value(planned["offload_hostopt"], "--policy"))
    assert hostopt.scheduler.offload_activations and not hostopt.scheduler.evict_live
    assert dict(hostopt.tags) == dict(load_policy("host_optimizer.yaml").tags)


def test_train_py_accepts_every_method_before_any_cuda_work(planned):
    import torch

    parser = options.build_parser()
    for argv in planned.values():
        options.check_args(parser, parser.parse_args(argv))  # a refusal would exit
    assert not torch.cuda.is_initialized()


def test_unknown_methods_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench_budget.parse_args(["--methods", "stock,planned"])
    assert "--methods: unknown planned; allowed: stock, save_on_cpu" in capsys.readouterr().err


def summary(method: str, step_s: float, moved: int | None = None) -> dict:
    out = {"device": "fake", "date": "2026-11-22", "workload": "bert-large-mlm-seq512-bf16-synthetic",
           "method": "stock" if method in ("stock", "save_on_cpu") else "um_alloc", "policy": None, "batch": 32,
           "step_s_median": step_s, "samples_per_s": 32 / step_s, "device_used_delta_bytes": 10 * GiB,
           "loss_first": 10.6, "loss_last": 9.1, "step_s": [step_s] * 8,
           "phase_s_median": {"forward": 0.03, "backward": 0.06, "optimizer": 0.01},
           "link_rates": {"d2h_GBps": 50.0, "h2d_GBps": 40.0}}
    if moved is not None:
        out["activation_offload"] = {"out_bytes": moved, "in_bytes": moved, "rebuilt_bytes": GiB}
    return out


def stand_in(results: dict):
    def runner(run, timeout):
        return results.get(run.name, (None, "oom", "out of memory"))
    return runner


def test_one_invocation_writes_records_with_one_run_id_and_ratios_to_its_stock(tmp_path):
    results = {"stock": (summary("stock", 0.1), "ok", ""), "save_on_cpu": (summary("save_on_cpu", 0.8), "ok", ""),
               "offload": (summary("offload", 0.2, moved=4 * 10**9), "ok", "")}
    argv = ["--budget", "16GiB", "--methods", "stock,save_on_cpu,offload,reactive", "--out", str(tmp_path)]
    records = bench_budget.main(argv, runner=stand_in(results))
    written = {p.name: json.loads(p.read_text()) for p in tmp_path.iterdir()}
    assert set(written) == {f"budget_16GiB_b32_{m}.json" for m in ("stock", "save_on_cpu", "offload", "reactive")}
    assert len({r["run_id"] for r in written.values()}) == 1
    assert next(iter(written.values()))["run_id"].startswith("bench_budget-")
    for record in written.values():
        assert set(harness.PROTOCOL_FIELDS) <= set(record)
    assert records["stock"]["ratio_vs_stock"] == 1.0 and records["stock"]["budget_bytes"] is None
    assert records["offload"]["ratio_vs_stock"] == pytest.approx(0.5) and records["offload"]["budget_bytes"] == 16 * GiB
    assert records["offload"]["method"] == "offload" and records["offload"]["policy"] == "offload.yaml"
    assert records["reactive"]["status"] == "oom" and records["reactive"]["samples_per_s"] is None
    assert records["reactive"]["raw"] is None and records["reactive"]["transfer_bound"] is None
    assert records["save_on_cpu"]["transfer_bound"] is None  # nothing an activation offload moved


def test_the_transfer_bound_reads_stock_phases_and_both_link_rates():
    stock = summary("stock", 0.1)
    run = summary("offload", 0.25, moved=4 * 10**9)
    run["link_rates"] = {"d2h_GBps": 20.0, "h2d_GBps": 20.0}
    bound = bench_budget.transfer_bound(run, stock)
    # at the link: max(0.03, 4e9 / 50e9) + max(0.06, 4e9 / 40e9) + 0.01
    assert bound["link"]["bound_s"] == pytest.approx(0.08 + 0.10 + 0.01)
    assert bound["link"]["efficiency"] == pytest.approx(0.19 / 0.25)
    assert bound["allocator"]["bound_s"] == pytest.approx(0.2 + 0.2 + 0.01)
    assert bound["bytes_rebuilt"] == GiB and bound["compute_only_s"]["backward"] == 0.06
    assert bench_budget.transfer_bound(run, None) is None
    assert "efficiency 0.76" in bench_budget.bound_line(bound)


def test_without_stock_there_are_no_ratios(tmp_path):
    results = {"offload": (summary("offload", 0.2, moved=10**9), "ok", "")}
    records = bench_budget.main(["--methods", "stock,offload", "--out", str(tmp_path)], runner=stand_in(results))
    assert records["offload"]["ratio_vs_stock"] is None and records["offload"]["transfer_bound"] is None
    assert records["stock"]["status"] == "oom"


def test_profile_offload_sums_busy_time_per_kind_and_finds_idle_gaps():
    events = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000, "args": {"stream": 7}},
              {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 4000, "dur": 1000, "args": {"stream": 7}},
              {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 500, "dur": 2000,
               "args": {"stream": 9, "bytes": 2 * 10**6}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 10}]
    out = profile_offload.analyse({"traceEvents": events})
    assert out["span_s"] == pytest.approx(5e-3)
    assert out["by_kind"]["kernel"]["n"] == 2 and out["by_kind"]["kernel"]["dur_s"] == pytest.approx(2e-3)
    assert out["by_kind"]["DtoH"]["rate_GBps"] == pytest.approx(1.0) and out["by_kind"]["DtoH"]["streams"] == ["9"]
    assert out["kernel_gaps"] == [(pytest.approx(1e-3), pytest.approx(3e-3))]
    assert out["kernel_idle_s"] == pytest.approx(3e-3)


def test_a_timed_run_steps_down_from_a_batch_that_fails_at_the_edge(monkeypatch):
    tried = []

    def train(args, allocator, batch, steps, warmup, extra=(), label=None):
        tried.append(batch)
        return {"batch": batch, "samples_per_s": 1.0, "step_s_median": 1.0, "peak_reserved_bytes": 0,
                "device_used_delta_bytes": 0, "loss_first": 1.0, "loss_last": 1.0} if batch <= 11 else None
    monkeypatch.setattr(bench_microbatch, "train", train)
    args = bench_microbatch.parse_args(["--quick"])
    assert bench_microbatch.timed_run(args, "stock", 13)["batch"] == 11 and tried == [13, 12, 11]
    tried.clear()
    assert bench_microbatch.search(args, "stock", 8, 512) == 11 and tried == [8, 16, 12, 10, 11]
    monkeypatch.setattr(bench_microbatch, "train", lambda *a, **k: None)
    with pytest.raises(RuntimeError, match="cannot train even batch 1"):
        bench_microbatch.search(args, "stock", 2, 512)
