"""bench/pool_trace.py on the CPU: a host pool traced through UM_POOL_TRACE replays to the same
per-step peaks, and names the request that made it hold more than its live bytes."""
import sys
from pathlib import Path

import pytest

from um_alloc.pool import ChunkPool

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pool_trace  # noqa: E402

MiB = 1 << 20


def fragmenting_step(pool: ChunkPool) -> tuple[int, int]:
    """A step whose freed hole is too short for its next request: (live peak, held peak)."""
    pool.set_budget(64 * MiB, evict_live=False)
    pool.set_step_arenas(True)
    pool.reset_device_peak()
    first, middle, last = pool.malloc(6 * MiB), pool.malloc(4 * MiB), pool.malloc(6 * MiB)
    pool.free(middle)
    wider = pool.malloc(8 * MiB)  # the 4 MiB hole does not hold it: new chunks are backed
    peaks = pool.device_live()[1], pool.device_held()[1]
    for block in (first, last, wider):
        pool.free(block)
    pool.set_step_arenas(False)
    return peaks


def traced(tmp_path, monkeypatch) -> tuple[Path, tuple[int, int]]:
    monkeypatch.setenv("UM_POOL_TRACE", str(tmp_path / "pool"))
    with ChunkPool.host(arena_size=64 * MiB) as pool:
        peaks = fragmenting_step(pool)
    (path,) = tmp_path.glob("pool.*")
    return path, peaks


def test_a_traced_step_replays_to_the_pools_own_peaks_and_names_the_request_that_grew_it(tmp_path, monkeypatch,
                                                                                          capsys):
    path, (live_peak, held_peak) = traced(tmp_path, monkeypatch)
    assert held_peak > live_peak  # the layout cost more than the live bytes
    replay = pool_trace.Replay(growth_of=1)
    (step,) = replay.run(pool_trace.read_lines(path))
    assert (step.live_peak, step.held_peak) == (live_peak, held_peak) and replay.refused == 0
    assert [size for size, *_ in step.growth] == [6 * MiB, 4 * MiB, 6 * MiB, 8 * MiB]
    held_before, held_after, live_before = step.growth[-1][1:]
    # The 4 MiB hole lies between two live blocks: the 8 MiB backs all new chunks beside it.
    assert held_after - held_before == 8 * MiB and held_before - live_before == 4 * MiB
    pool_trace.main([str(path), "--growth", "1"])
    out = capsys.readouterr().out
    assert "8.0 MiB: held 16.0 MiB -> 24.0 MiB, live 12.0 MiB, held and free when it came 4.0 MiB" in out


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("UM_POOL_TRACE", raising=False)
    monkeypatch.chdir(tmp_path)
    with ChunkPool.host(arena_size=64 * MiB) as pool:
        fragmenting_step(pool)
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_is_not_a_trace_is_refused_with_what_it_lacks(tmp_path):
    stray = tmp_path / "notes.txt"
    stray.write_text("a 0x10 4096 4 1 (nil)\n")
    with pytest.raises(SystemExit, match="does not start with the pool's configuration"):
        pool_trace.Replay().run(pool_trace.read_lines(stray))
    with pytest.raises(SystemExit):
        pool_trace.main([str(tmp_path / "absent")])
