"""Tables, charts, the nsys export conversion and the step timeline, on the CPU."""
import csv
import json
import sqlite3
from pathlib import Path

import pytest
import torch

from um_alloc.profile import aggregate, charts, nsys, tables
from um_alloc.profile.timeline import StepTimeline

FIXTURES = Path(__file__).parent / "fixtures"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def is_png(path) -> bool:
    data = Path(path).read_bytes()
    return data.startswith(PNG_MAGIC) and len(data) > 2000


# --- tables ------------------------------------------------------------------------------------

def test_markdown_shows_units_and_not_measured_as_na():
    rows = [{"name": "best", "htod_bytes": 3 * 2**30, "gpu_page_faults": 1234.0, "step_s_median": 0.0721},
            {"name": "stock", "htod_bytes": None, "gpu_page_faults": None, "step_s_median": 0.07}]
    text = tables.markdown(rows, [("name", "run", "text"), ("htod_bytes", "HtoD", "bytes"),
                                  ("gpu_page_faults", "GPU faults", "count"), ("step_s_median", "step", "seconds")])
    assert text.splitlines()[0] == "| run | HtoD | GPU faults | step |"
    assert "| best | 3.00 GiB | 1,234 | 72.1 ms |" in text
    assert "| stock | n/a | n/a | 70.0 ms |" in text


def test_csv_keeps_raw_numbers_and_empty_for_not_measured(tmp_path):
    rows = [{"name": "a", "htod_bytes": 4096}, {"name": "b", "htod_bytes": None}]
    csv_path, md_path = tables.write_tables(rows, tmp_path, "t", csv_columns=[("name", "name", "text"),
                                            ("htod_bytes", "htod_bytes", "bytes")],
                                            md_columns=[("name", "run", "text")], title="T", notes=["a note"])
    assert list(csv.reader(csv_path.open())) == [["name", "htod_bytes"], ["a", "4096"], ["b", ""]]
    assert md_path.read_text().startswith("## T\n") and "- a note" in md_path.read_text()


def test_counts_line_splits_bytes_by_cause():
    counts = aggregate.totals(json.loads((FIXTURES / "um_records_small.json").read_text())["records"])
    line = tables.counts_line(counts)
    assert line.startswith("GPU faults 11, CPU faults 1, HtoD 2.20 MiB (fault 64.00 KiB, prefetch 2.00 MiB")
    assert "DtoH 3.00 MiB (prefetch 1.00 MiB, eviction 2.00 MiB)" in line and "remote maps 1" in line
    assert tables.counts_line(dict.fromkeys(aggregate.COUNTER_FIELDS)) == "not measured"


# --- charts ------------------------------------------------------------------------------------

def test_bar_and_migration_charts_are_pngs_also_with_missing_values(tmp_path):
    rows = [aggregate.totals(json.loads((FIXTURES / "um_records_small.json").read_text())["records"]),
            dict.fromkeys(aggregate.COUNTER_FIELDS)]
    bars = charts.bar_chart(["a", "b"], [0.07, None], tmp_path / "step.png", title="t", ylabel="s", kind="seconds")
    ratio = charts.bar_chart(["a", "b"], [1.0, 0.6], tmp_path / "r.png", title="t", ylabel="x", kind="ratio",
                             reference=1.0)
    migrated = charts.migrated_bytes_chart(["a", "b"], rows, tmp_path / "m.png", title="t")
    assert all(is_png(p) for p in (bars, ratio, migrated))


def test_timeline_chart_with_and_without_fault_data(tmp_path):
    from um_alloc.tag_names import TAGS

    # every tag, as the real timeline has: each needs a colour of its own
    samples = [{"t_ns": 1000 * i, "label": str(i), "phase": "forward" if i < 5 else "backward",
                "bytes": {tag: (k + i) * 2**18 for k, tag in enumerate(TAGS)}} for i in range(10)]
    data = {"step": 3, "t0_ns": 0, "t1_ns": 9000, "source": "live_bytes", "tags": list(TAGS),
            "budget_bytes": 8 * 2**20, "budget_label": "budget", "faults_ns": [1500, 2500, 7000], "samples": samples}
    assert is_png(charts.timeline_chart(data, tmp_path / "with.png"))
    assert is_png(charts.timeline_chart({**data, "faults_ns": None, "budget_bytes": None}, tmp_path / "none.png"))
    assert is_png(charts.timeline_chart({**data, "tags": [], "samples": []}, tmp_path / "empty.png"))


# --- nsys export -------------------------------------------------------------------------------

@pytest.fixture
def nsys_export(tmp_path) -> Path:
    path = tmp_path / "run.sqlite"
    with sqlite3.connect(path) as conn:
        conn.executescript((FIXTURES / "nsys_um_small.sql").read_text())
    return path


def test_nsys_export_gives_the_same_counters(nsys_export):
    counts = nsys.counts(nsys_export)
    expected = {"gpu_page_faults": 7, "gpu_fault_pages": 3, "cpu_page_faults": 2, "htod_bytes": 2162688,
                "htod_fault_bytes": 65536, "htod_speculative_bytes": 2031616, "htod_prefetch_bytes": 65536,
                "htod_transfers": 3, "dtoh_bytes": 1048576, "dtoh_eviction_bytes": 1048576, "dtod_bytes": 4096,
                "um_records": 10}
    assert {k: counts[k] for k in expected} == expected  # the ordinary memcpy (copyKind 1) is left out
    assert all(counts[k] is None for k in nsys.NOT_EXPORTED)
    records = nsys.read_records(nsys_export)
    assert [r["start"] for r in records] == sorted(r["start"] for r in records)


def test_nsys_copy_kinds_come_from_the_exports_enum_table_when_it_names_them(nsys_export):
    with sqlite3.connect(nsys_export) as conn:
        conn.execute("CREATE TABLE ENUM_CUDA_MEMCPY_OPER (id INTEGER PRIMARY KEY, name TEXT, label TEXT)")
        conn.executemany("INSERT INTO ENUM_CUDA_MEMCPY_OPER VALUES (?, ?, ?)",
                         [(1, "HTOD", "Host-to-Device"), (12, "UNIFIED_HTOD", "Unified Host-to-Device")])
        kinds = nsys.unified_copy_kinds(conn, {"ENUM_CUDA_MEMCPY_OPER"})
    assert kinds == {12: "BYTES_TRANSFER_HTOD"}
    assert nsys.unified_copy_kinds(None, set()) == nsys.UM_COPY_KINDS


def test_an_export_without_um_tables_counts_zero_and_a_missing_file_says_how_to_make_one(tmp_path):
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).close()
    assert nsys.counts(empty)["gpu_page_faults"] == 0
    with pytest.raises(FileNotFoundError, match="nsys export --type sqlite"):
        nsys.read_records(tmp_path / "missing.sqlite")


def test_nsys_cli_writes_the_shared_table(nsys_export, tmp_path, capsys):
    assert nsys.main([str(nsys_export), "--name", "best", "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader((tmp_path / "out" / "nsys_faults.csv").open()))
    assert rows[0]["name"] == "best" and rows[0]["gpu_page_faults"] == "7" and rows[0]["thrashing_events"] == ""
    md = (tmp_path / "out" / "nsys_faults.md").read_text()
    assert "| run | GPU faults | CPU faults | HtoD |" in md and "| best | 7 | 2 | 2.06 MiB |" in md


# --- timeline ----------------------------------------------------------------------------------

class FakeCounters:
    """now() and kept records, as UMCounters gives them."""
    available = True

    def __init__(self):
        self.clock, self.windows = 0, []

    def now(self):
        self.clock += 1000
        return self.clock

    def keep_records(self, on):
        self.windows.append(on)

    def records(self, start, end):
        return [{"kind": "GPU_PAGE_FAULT", "start": start + 10, "value": 1},
                {"kind": "BYTES_TRANSFER_HTOD", "start": start + 20, "value": 4096},
                {"kind": "GPU_PAGE_FAULT", "start": end - 10, "value": 2}]


def test_step_timeline_samples_forward_backward_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    live = {"parameter": 100, "activation": 0}

    def sampler():
        live["activation"] += 10
        return dict(live)

    counters = FakeCounters()
    with StepTimeline(model, optimizer, counters=counters, step=7, sampler=(sampler, "live_bytes"),
                      budget=(200, "budget")) as timeline:
        model(torch.randn(4, 8)).square().mean().backward()
        optimizer.step()
    data = timeline.result()
    phases = [s["phase"] for s in data["samples"]]
    assert phases[0] == "forward" and "backward" in phases and phases[-2:] == ["optimizer", "optimizer"]
    assert sum(p == "forward" for p in phases) == 1 + 2 * 3  # step begin, then before/after each leaf
    assert data["faults_ns"] == [data["t0_ns"] + 10, data["t1_ns"] - 10] and counters.windows == [True, False]
    assert data["tags"] == ["parameter", "activation"] and data["budget_bytes"] == 200
    saved = timeline.save(tmp_path / "step.png")
    assert is_png(saved["png"]) and json.loads(Path(saved["json"]).read_text())["step"] == 7
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks  # hooks removed
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_budget_line_is_the_scheduler_budget_else_a_cap_that_was_asked_for(monkeypatch):
    import importlib

    import um_alloc
    from um_alloc.install import Installation
    from um_alloc.policy import load_policy
    from um_alloc.pool import ChunkPool
    from um_alloc.profile.timeline import default_budget

    install_module = importlib.import_module("um_alloc.install")  # um_alloc.install is also the function
    GiB = 2**30

    def installed(policy, cap):
        inst = Installation(load_policy(policy), 0, cap, 80 * GiB, 70 * GiB, 1 * GiB)
        monkeypatch.setattr(install_module, "_installation", inst)

    installed({"scheduler": {"budget": "8GiB"}}, 60 * GiB)
    assert default_budget() == (8 * GiB, "scheduler.budget")
    pool = ChunkPool.host(2 << 20, 16 << 20)  # stands in for the installed device's pool
    monkeypatch.setattr(ChunkPool, "for_device", classmethod(lambda cls, device: pool))
    um_alloc.set_limit_lms("6GiB")  # the line follows the budget kept now
    assert default_budget() == (6 * GiB, "scheduler.budget")
    pool.close()
    installed({"scheduler": {"budget": 0.5}}, 60 * GiB)
    assert default_budget() == (40 * GiB, "scheduler.budget")
    installed("none", 16 * GiB)  # --memory-limit 16GiB
    assert default_budget() == (16 * GiB, "pool.max_reserved (the memory limit)")
    installed("none", 68 * GiB)  # auto: 70 GiB free - 2 GiB margin
    assert default_budget() == (None, None)


def test_timeline_without_matplotlib_keeps_the_data(tmp_path, monkeypatch):
    from um_alloc.profile import charts as charts_module

    def no_matplotlib(*args, **kwargs):
        raise RuntimeError("charts need matplotlib (No module named 'matplotlib'): pip install 'um_alloc[plot]'")
    monkeypatch.setattr(charts_module, "_figure", no_matplotlib)
    model = torch.nn.Linear(2, 1)
    with StepTimeline(model, sampler=(lambda: {"all": 1}, "x"), budget=(None, None)) as timeline:
        model(torch.randn(1, 2)).sum().backward()
    info = timeline.save(tmp_path / "t.png")
    assert info["png"] is None and "matplotlib" in info["error"] and Path(info["json"]).is_file()
