"""One conformance suite for the chunk pool, run against each backend.

The host backend runs everywhere (CI has no GPU); the managed backend runs the same tests on a
CUDA device and is skipped elsewhere. Streams are opaque handles to the pool: on the host
backend any integers do; on the managed backend they are real CUDA streams.
"""
import random
import threading

import pytest

MiB = 1 << 20
CHUNK = 2 * MiB


@pytest.fixture(params=["host", pytest.param("managed", marks=pytest.mark.gpu)])
def backend(request):
    if request.param == "managed":
        request.getfixturevalue("cuda_device")
    return request.param


@pytest.fixture
def make_pool(backend):
    from um_alloc.pool import ChunkPool

    pools = []

    def make(arena=16 * MiB, cap=2**64 - 1, chunk=CHUNK):
        if backend == "host":
            pool = ChunkPool.host(chunk, arena, cap)
        else:
            pool = ChunkPool.managed(0, chunk, arena, cap)
        pools.append(pool)
        return pool

    yield make
    for p in pools:
        p.close()


@pytest.fixture
def streams(backend):
    """Two distinct stream handles."""
    if backend == "host":
        return 101, 202
    import torch

    keep = [torch.cuda.Stream(), torch.cuda.Stream()]
    streams.keep = keep
    return keep[0].cuda_stream, keep[1].cuda_stream


@pytest.fixture
def keep_second_stream_busy(backend):
    """Work on the second stream that outlasts the test's reuse (about a second on a GPU); on the
    host backend nothing ever runs, so no point recorded on a stream is known to be reached."""
    def busy():  # after the streams fixture made streams.keep
        if backend == "managed":
            import torch

            with torch.cuda.stream(streams.keep[1]):
                torch.cuda._sleep(2_000_000_000)
    return busy


def test_large_requests_take_whole_chunks(make_pool):
    pool = make_pool()
    p = pool.malloc(3 * MiB)
    info = pool.block_at(p)
    assert (info.size, info.requested, info.is_small) == (4 * MiB, 3 * MiB, False)
    s = pool.raw_stats()
    assert s["tags"]["activation"]["held_bytes"] == 4 * MiB
    assert s["internal_waste_bytes"] == 1 * MiB < s["internal_waste_bound_bytes"] == CHUNK
    assert p % CHUNK == pool.block_at(p).base % CHUNK  # chunk-aligned within its arena


def test_small_requests_share_a_chunk_per_tag(make_pool):
    pool = make_pool()
    a, b = pool.malloc(1000), pool.malloc(1000)
    c = pool.malloc(1000, tag="parameter")
    assert pool.block_at(a).is_small and pool.block_at(b).size == 1024
    assert abs(a - b) < CHUNK  # same chunk
    assert abs(c - a) >= 1024 and pool.raw_stats()["small_chunks"] == 2  # its own chunk
    assert pool.block_at(c + 999).tag == "parameter"


def test_freed_block_is_reused_at_the_same_address(make_pool):
    pool = make_pool()
    p = pool.malloc(4 * MiB)
    pool.free(p)
    assert pool.malloc(4 * MiB) == p
    assert pool.raw_stats()["arena_count"] == 1


def test_free_chunks_serve_other_sizes(make_pool):
    pool = make_pool(arena=4 * MiB)
    small = [pool.malloc(64 * 1024) for _ in range(20)]  # fill one chunk and part of another
    for p in small:
        pool.free(p)
    big = pool.malloc(4 * MiB)  # only fits if both small chunks went back to the runs
    assert pool.raw_stats()["arena_count"] == 1
    assert pool.block_at(big).size == 4 * MiB


def test_neighbouring_free_runs_merge(make_pool):
    pool = make_pool(arena=6 * MiB)
    a, b, c = (pool.malloc(2 * MiB) for _ in range(3))
    pool.free(a)
    pool.free(b)
    assert pool.malloc(4 * MiB) == min(a, b)
    assert pool.raw_stats()["arena_count"] == 1


def test_random_workload_keeps_waste_under_its_bound(make_pool):
    pool = make_pool(arena=64 * MiB)
    rng = random.Random(0)
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            victim = rng.choice(list(live))
            del live[victim]
            pool.free(victim)
        else:
            n = rng.choice([rng.randint(1, 8192), rng.randint(1, 3 * MiB), rng.randint(1, 20 * MiB)])
            live[pool.malloc(n, tag=rng.choice(["activation", "input", "other"]))] = n
        s = pool.raw_stats()
        assert s["live_bytes_total"] == sum(live.values())
        assert s["internal_waste_bytes"] < s["internal_waste_bound_bytes"] or not live
        assert s["fragmentation_bytes"] == s["reserved_bytes"] - s["live_bytes_total"]
    addresses = sorted((p, n) for p, n in live.items())
    assert all(p1 + n1 <= p2 for (p1, n1), (p2, _) in zip(addresses, addresses[1:])), "overlap"


def test_cap_raises_out_of_memory_and_pool_carries_on(make_pool):
    import torch

    pool = make_pool(arena=4 * MiB, cap=8 * MiB)
    a = pool.malloc(4 * MiB)
    b = pool.malloc(4 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as e:
        pool.malloc(3 * MiB, tag="parameter")
    message = str(e.value)
    assert "3.00 MiB" in message and "8.00 MiB limit" in message and "activation 8.00 MiB" in message
    assert pool.raw_stats()["num_ooms"] == 1
    pool.free(a)
    assert pool.malloc(3 * MiB) == a  # after the error, the pool still serves requests
    pool.free(b)


def test_out_of_memory_reads_as_pytorchs_to_the_tools_that_shrink_the_batch(make_pool):
    """Hugging Face's Trainer (auto_find_batch_size, through accelerate) and Lightning's batch size
    finder shrink the batch on an out-of-memory error they recognise by its words, and re-raise any
    other: um_alloc's must read as PyTorch's does."""
    import torch
    from accelerate.utils.memory import should_reduce_batch_size

    pool = make_pool(arena=4 * MiB, cap=4 * MiB)
    a = pool.malloc(4 * MiB)
    with pytest.raises(torch.OutOfMemoryError) as e:
        pool.malloc(4 * MiB)
    assert should_reduce_batch_size(e.value)
    # Lightning's is_cuda_out_of_memory (lightning.pytorch.utilities.memory), which is not a dependency here.
    assert isinstance(e.value, RuntimeError) and len(e.value.args) == 1
    assert "CUDA" in e.value.args[0] and "out of memory" in e.value.args[0]
    pool.free(a)


def test_accelerates_batch_size_finder_shrinks_the_batch_on_the_pools_out_of_memory(make_pool):
    from accelerate.utils import find_executable_batch_size

    pool = make_pool(arena=4 * MiB, cap=4 * MiB)
    tried = []

    @find_executable_batch_size(starting_batch_size=16)
    def train(batch_size):
        tried.append(batch_size)
        pool.free(pool.malloc(batch_size * MiB))  # a MiB a sample: more than 4 passes the cap
        return batch_size

    assert train() == 4  # each out of memory caught, the batch made smaller (by a tenth, in accelerate 1.x)
    assert tried[0] == 16 and tried == sorted(set(tried), reverse=True) and all(b > 4 for b in tried[:-1])


def test_cap_makes_room_by_returning_free_arenas(make_pool):
    pool = make_pool(arena=4 * MiB, cap=8 * MiB)
    a, b = pool.malloc(4 * MiB), pool.malloc(4 * MiB)
    pool.free(a)
    pool.free(b)
    big = pool.malloc(8 * MiB)  # no free run of 8 MiB; the two cached arenas must go first
    s = pool.raw_stats()
    assert s["reserved_bytes"] == 8 * MiB
    assert (s["arena_reserves"], s["arena_releases"]) == (3, 2)
    pool.free(big)


def test_empty_cache_returns_only_wholly_free_arenas(make_pool):
    pool = make_pool(arena=4 * MiB)
    keep = pool.malloc(3 * MiB)
    drop = pool.malloc(4 * MiB)
    pool.free(drop)
    assert pool.empty_cache() == 4 * MiB
    assert pool.raw_stats()["arena_count"] == 1
    assert pool.block_at(keep) is not None


def test_reuse_on_the_freeing_stream_needs_no_wait(make_pool, streams):
    s1, s2 = streams
    pool = make_pool()
    p = pool.malloc(4 * MiB, stream=s1)
    pool.free(p)
    assert pool.malloc(4 * MiB, stream=s1) == p
    assert pool.raw_stats()["stream_waits"] == 0


def test_reuse_on_another_stream_waits_on_an_event(make_pool, streams):
    s1, s2 = streams
    pool = make_pool()
    p = pool.malloc(4 * MiB, stream=s1)
    pool.free(p)
    assert pool.malloc(4 * MiB, stream=s2) == p
    assert pool.raw_stats()["stream_waits"] == 1


def test_record_stream_makes_the_owner_wait(make_pool, streams, keep_second_stream_busy):
    s1, s2 = streams
    pool = make_pool()
    p = pool.malloc(4 * MiB, stream=s1)
    pool.record_stream(p, s2)
    keep_second_stream_busy()
    pool.free(p)
    assert pool.malloc(4 * MiB, stream=s1) == p
    assert pool.raw_stats()["stream_waits"] == 1


def test_record_stream_marks_the_side_stream_at_free(make_pool, streams, keep_second_stream_busy):
    s1, s2 = streams
    pool = make_pool()
    plain = pool.malloc(4 * MiB, stream=s1)
    pool.free(plain)
    assert pool.raw_stats()["free_events"] == 0  # one stream: reuse on it needs no point
    shared = pool.malloc(4 * MiB, stream=s1)
    pool.record_stream(shared, s2)
    keep_second_stream_busy()
    pool.free(shared)
    assert pool.raw_stats()["free_events"] == 1
    assert pool.malloc(4 * MiB, stream=s1) == shared
    assert pool.raw_stats()["stream_waits"] == 1  # on that point


def test_merged_free_runs_keep_every_side_streams_point(make_pool, streams, keep_second_stream_busy):
    s1, s2 = streams
    pool = make_pool(arena=8 * MiB)
    left, right = pool.malloc(4 * MiB, stream=s1), pool.malloc(4 * MiB, stream=s1)
    pool.record_stream(left, s2)
    keep_second_stream_busy()
    pool.free(left)
    pool.free(right)  # merges with left: the whole run still waits for s2
    assert pool.malloc(8 * MiB, stream=s1) == left
    assert pool.raw_stats()["stream_waits"] == 1


def test_a_run_a_side_stream_still_uses_gives_way_to_an_idle_one_of_its_size(make_pool, streams,
                                                                            keep_second_stream_busy):
    s1, s2 = streams
    pool = make_pool(arena=12 * MiB)
    busy, spacer, idle = (pool.malloc(4 * MiB, stream=s1) for _ in range(3))  # the whole arena
    pool.record_stream(busy, s2)
    keep_second_stream_busy()
    pool.free(busy)  # the first of two equal fits, but s2 may still read it
    pool.free(idle)
    assert pool.malloc(4 * MiB, stream=s1) == idle
    assert pool.raw_stats()["stream_waits"] == 0
    assert pool.malloc(4 * MiB, stream=s1) == busy  # nothing else fits: it waits, on the GPU
    assert pool.raw_stats()["stream_waits"] == 1
    pool.free(spacer)


@pytest.mark.parametrize("idle_mib, taken", [(8, "idle"), (12, "busy")])
def test_a_busy_run_gives_way_to_an_idle_one_at_most_twice_the_request(make_pool, streams, keep_second_stream_busy,
                                                                       idle_mib, taken):
    s1, s2 = streams
    pool = make_pool(arena=(12 + idle_mib) * MiB)
    busy, _ = pool.malloc(4 * MiB, stream=s1), pool.malloc(4 * MiB, stream=s1)  # each with a live neighbour
    idle, _ = pool.malloc(idle_mib * MiB, stream=s1), pool.malloc(4 * MiB, stream=s1)
    pool.record_stream(busy, s2)
    keep_second_stream_busy()
    pool.free(busy)  # the best fit for 4 MiB, but s2 may still read it
    pool.free(idle)
    got = pool.malloc(4 * MiB, stream=s1)
    assert got == {"idle": idle, "busy": busy}[taken]  # a larger idle run is cut only up to twice
    assert pool.raw_stats()["stream_waits"] == (taken == "busy")


def test_advice_is_applied_once_per_chunk_and_undone_for_other_tags(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool()
    pool.set_tag_policy("parameter", TagAdvice(preferred_location="gpu", prefetch=True))
    p = pool.malloc(4 * MiB, tag="parameter")
    s = pool.raw_stats()
    assert (s["advise_calls"], s["prefetch_calls"], s["prefetch_bytes"]) == (1, 1, 4 * MiB)
    assert pool.block_at(p).residency == "gpu"
    pool.free(p)
    pool.malloc(4 * MiB, tag="parameter")  # same chunks, same hints: no new calls
    s = pool.raw_stats()
    assert (s["advise_calls"], s["prefetch_calls"]) == (1, 1)
    assert pool.backend_error() == ""


def test_retag_moves_accounting_and_applies_hints(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool()
    pool.set_tag_policy("input", TagAdvice(read_mostly=True))
    p = pool.malloc(3 * MiB)
    pool.retag(p + 100, "input")  # any address inside the allocation
    s = pool.raw_stats()
    assert s["tags"]["input"]["live_bytes"] == 3 * MiB and s["tags"]["activation"]["live_bytes"] == 0
    assert s["tags"]["input"]["held_bytes"] == 4 * MiB and s["advise_calls"] == 1
    assert pool.ranges_for_tag("input") == [(p, 3 * MiB)]
    assert pool.ranges_for_tag("activation") == []


def test_bad_calls_give_clear_errors(make_pool):
    from um_alloc.pool import ChunkPool

    pool = make_pool()
    with pytest.raises(RuntimeError, match="did not hand out"):
        pool.free(12345)
    with pytest.raises(ValueError, match="allowed: parameter, gradient"):
        pool.malloc(10, tag="weights")
    assert pool.block_at(4096) is None
    with pytest.raises(RuntimeError, match="power of two"):
        ChunkPool.host(chunk_size=3 * MiB)
    with pytest.raises(RuntimeError, match="multiple of chunk_size"):
        ChunkPool.host(chunk_size=2 * MiB, arena_size=3 * MiB)


def test_threads_share_a_pool_safely(make_pool):
    pool = make_pool(arena=64 * MiB)
    errors = []

    def work(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(2000):
                if mine and rng.random() < 0.5:
                    pool.free(mine.pop(rng.randrange(len(mine))))
                else:
                    mine.append(pool.malloc(rng.choice([512, 5000, 3 * MiB])))
            for p in mine:
                pool.free(p)
        except Exception as e:  # surfaced below; a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = pool.raw_stats()
    assert s["live_bytes_total"] == 0 and s["large_blocks"] == s["small_blocks"] == 0


def test_retag_many_counts_what_it_found(make_pool):
    pool = make_pool()
    ptrs = [pool.malloc(3 * MiB), pool.malloc(1000)]
    assert pool.retag_many(ptrs + [4096], "gradient") == 2  # 4096 is not the pool's
    s = pool.raw_stats()
    assert s["tags"]["gradient"]["live_bytes"] == 3 * MiB + 1000
    assert s["tags"]["activation"]["live_bytes"] == 0


# ---- GPU residency and the reactive budget ------------------------------------------------------

def test_residency_follows_allocations_and_frees(make_pool):
    pool = make_pool()
    p = pool.malloc(3 * MiB, tag="parameter")
    s = pool.raw_stats()
    assert s["tags"]["parameter"]["resident_bytes"] == 4 * MiB == s["resident_bytes_total"]
    pool.free(p)  # freed pages stay on the GPU until evicted: they still count
    s = pool.raw_stats()
    assert s["tags"]["parameter"]["resident_bytes"] == 0 and s["resident_free_bytes"] == 4 * MiB
    assert s["resident_bytes_total"] == 4 * MiB


def test_budget_evicts_least_recently_used_first(make_pool):
    pool = make_pool(arena=64 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=True)
    a = pool.malloc(4 * MiB)
    b = pool.malloc(4 * MiB)
    c = pool.malloc(4 * MiB)  # over budget: a, the oldest, goes to host
    s = pool.raw_stats()
    assert (s["evictions"], s["evicted_bytes"], s["resident_bytes_total"]) == (1, 4 * MiB, 8 * MiB)
    assert pool.block_at(a).residency == "host"
    assert pool.block_at(b).residency == pool.block_at(c).residency == "gpu"
    assert s["peak_resident_bytes"] <= 8 * MiB


def test_budget_evicts_free_chunks_before_newer_live_blocks(make_pool):
    pool = make_pool(arena=64 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=True)
    a = pool.malloc(4 * MiB)
    b = pool.malloc(4 * MiB)
    pool.free(a)
    d = pool.malloc(6 * MiB)  # a's 4 MiB run is too small; a (free, oldest) goes, then b
    s = pool.raw_stats()
    assert s["evictions"] == 2 and s["resident_bytes_total"] == 6 * MiB
    assert pool.block_at(b).residency == "host" and pool.block_at(d).residency == "gpu"


def test_small_and_below_min_swap_allocations_stay(make_pool):
    pool = make_pool(arena=64 * MiB)
    pool.set_budget(4 * MiB, min_swap_size=8 * MiB, evict_live=True)
    small = [pool.malloc(4096, tag=t) for t in ("input", "other")]  # two small chunks
    big = pool.malloc(4 * MiB)  # below min_swap_size: never a victim
    pool.malloc(4 * MiB)
    s = pool.raw_stats()
    assert s["evictions"] == 0 and s["over_budget_allocations"] >= 1
    assert all(pool.block_at(p).residency == "gpu" for p in small + [big])


def test_disabled_budget_evicts_nothing(make_pool):
    pool = make_pool(arena=64 * MiB)
    pool.set_budget(4 * MiB, min_swap_size=1 * MiB, enabled=False, evict_live=True)
    assert not pool.budget_enabled()
    for _ in range(4):
        pool.malloc(4 * MiB)
    s = pool.raw_stats()
    assert s["evictions"] == 0 and s["resident_bytes_total"] == 16 * MiB and s["budget_bytes"] == 4 * MiB


def test_random_workload_under_a_budget_keeps_accounting_consistent(make_pool):
    pool = make_pool(arena=32 * MiB)
    pool.set_budget(24 * MiB, min_swap_size=1 * MiB, evict_live=True)
    rng = random.Random(1)
    live = {}
    for _ in range(1500):
        if live and rng.random() < 0.45:
            victim = rng.choice(list(live))
            del live[victim]
            pool.free(victim)
        else:
            n = rng.choice([rng.randint(1, 8192), rng.randint(2 * MiB, 6 * MiB)])
            live[pool.malloc(n)] = n
        s = pool.raw_stats()
        per_tag = sum(v["resident_bytes"] for v in s["tags"].values())
        assert per_tag + s["resident_free_bytes"] == s["resident_bytes_total"] <= s["reserved_bytes"]
    assert s["evictions"] > 0 and s["peak_resident_bytes"] <= 24 * MiB + 6 * MiB


def test_migrate_moves_whole_allocations_and_keeps_residency_true(make_pool):
    pool = make_pool()
    p = pool.malloc(3 * MiB)
    small = pool.malloc(4096)
    assert pool.migrate(p + 10, to_gpu=False) == 4 * MiB  # any address inside; whole chunks
    assert pool.block_at(p).residency == "host" and pool.raw_stats()["resident_bytes_total"] == 2 * MiB
    assert pool.migrate(p, to_gpu=False) == 0  # already there
    assert pool.migrate(small, to_gpu=False) == 0  # small blocks share chunks: never moved alone
    assert pool.migrate(p, to_gpu=True) == 4 * MiB
    s = pool.raw_stats()
    assert pool.block_at(p).residency == "gpu" and s["resident_bytes_total"] == 6 * MiB
    assert s["evicted_bytes"] == 4 * MiB and s["prefetch_bytes"] == 4 * MiB


# ---- hard budgets and host-mapped tags --------------------------------------------------------

HOST_MAPPED = dict(preferred_location="cpu", accessed_by=("gpu",))


def test_hard_budget_refuses_what_live_data_cannot_make_room_for(make_pool):
    import torch

    pool = make_pool(arena=64 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    assert not pool.budget_evicts_live()
    a, b = pool.malloc(4 * MiB), pool.malloc(4 * MiB)
    with pytest.raises(torch.OutOfMemoryError, match=r"GPU-backed memory 8\.00 MiB .*8\.00 MiB budget"):
        pool.malloc(4 * MiB)
    assert pool.block_at(a).residency == pool.block_at(b).residency == "gpu"  # nothing evicted
    s = pool.raw_stats()
    assert (s["evictions"], s["num_ooms"], s["backed_bytes"], s["resident_bytes_total"]) == (0, 1, 8 * MiB, 8 * MiB)


def test_hard_budget_counts_what_the_gpu_backed_and_returns_free_arenas(make_pool):
    import torch

    pool = make_pool(arena=4 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    a, b = pool.malloc(4 * MiB), pool.malloc(4 * MiB)  # two arenas, both backed
    pool.migrate(b, to_gpu=False)  # off the GPU, but the driver keeps its GPU memory: still backed
    assert pool.raw_stats()["backed_bytes"] == 8 * MiB and pool.raw_stats()["resident_bytes_total"] == 4 * MiB
    pool.free(a)
    with pytest.raises(torch.OutOfMemoryError):
        pool.malloc(6 * MiB)  # a new arena: a's free one is returned, yet 4 + 6 > 8
    s = pool.raw_stats()
    assert (s["arena_releases"], s["backed_bytes"], s["evictions"]) == (1, 4 * MiB, 1)
    c = pool.malloc(4 * MiB)  # fits in the unbacked 6 MiB arena: 4 + 4 <= 8
    assert pool.block_at(c).residency == "gpu" and pool.raw_stats()["peak_backed_bytes"] == 8 * MiB


def test_host_mapped_tag_stays_out_of_the_budget(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=64 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(4 * MiB, min_swap_size=1 * MiB, evict_live=False)
    state = pool.malloc(12 * MiB, tag="optimizer_state")  # three times the budget: on the host
    act = pool.malloc(4 * MiB)
    s = pool.raw_stats()
    assert pool.block_at(state).residency == "host" and pool.block_at(act).residency == "gpu"
    assert s["tags"]["optimizer_state"]["resident_bytes"] == 0 and s["resident_bytes_total"] == 4 * MiB
    assert s["prefetch_bytes"] == 0 and s["evictions"] == 0  # untouched chunks: nothing to move


def test_host_mapped_allocation_moves_reused_gpu_chunks_out(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=64 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.free(pool.malloc(4 * MiB))  # a resident free run
    state = pool.malloc(4 * MiB, tag="optimizer_state")  # reuses it: its pages must leave
    s = pool.raw_stats()
    assert pool.block_at(state).residency == "host"
    assert (s["evictions"], s["evicted_bytes"], s["resident_bytes_total"]) == (1, 4 * MiB, 0)


def test_retag_to_a_host_mapped_tag_moves_the_block_out(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=64 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    p = pool.malloc(6 * MiB, tag="other")  # e.g. state made during an optimizer step
    pool.retag(p, "optimizer_state")
    s = pool.raw_stats()
    assert pool.block_at(p).residency == "host" and s["evicted_bytes"] == 6 * MiB
    assert s["resident_bytes_total"] == 0 and s["tags"]["other"]["resident_bytes"] == 0


def test_under_a_budget_reuse_prefers_free_runs_already_on_the_gpu(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=64 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(16 * MiB, min_swap_size=1 * MiB, evict_live=True)  # reactive: prefers resident runs
    a, keep, b = pool.malloc(4 * MiB), pool.malloc(2 * MiB), pool.malloc(6 * MiB)
    pool.migrate(a, to_gpu=False)
    pool.free(a)  # a's 4 MiB run is free on the host
    pool.malloc(52 * MiB, tag="optimizer_state")  # the rest of the arena, out of the way (host)
    pool.free(b)  # free runs now: a's 4 MiB (host) and b's 6 MiB (GPU)
    c = pool.malloc(4 * MiB)  # best fit by size alone is a's run; the resident one wins
    s = pool.raw_stats()
    assert pool.block_at(c).residency == "gpu" and c == b
    assert s["evictions"] == 1 and s["resident_bytes_total"] == 2 * MiB + 6 * MiB


def test_host_mapped_allocations_prefer_runs_the_gpu_never_backed(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=64 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(32 * MiB, min_swap_size=1 * MiB, evict_live=False)
    a, keep = pool.malloc(4 * MiB), pool.malloc(2 * MiB)
    pool.free(a)  # a backed 4 MiB run; the arena's untouched tail is a larger free run
    state = pool.malloc(4 * MiB, tag="optimizer_state")
    s = pool.raw_stats()
    assert state != a and pool.block_at(state).residency == "host"
    assert (s["evictions"], s["backed_bytes"]) == (0, 6 * MiB)  # a's GPU memory is left for GPU data
    assert pool.malloc(4 * MiB) == a


def test_released_arenas_leave_the_residency_accounting(make_pool):
    pool = make_pool(arena=16 * MiB)
    pool.set_budget(16 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.free(pool.malloc(12 * MiB))
    assert pool.raw_stats()["resident_bytes_total"] == 12 * MiB
    assert pool.empty_cache() == 16 * MiB
    s = pool.raw_stats()
    assert (s["resident_bytes_total"], s["resident_free_bytes"], s["reserved_bytes"], s["backed_bytes"]) == (0, 0, 0, 0)
    pool.malloc(16 * MiB)  # the whole budget again: nothing of the old arena is still counted


def test_under_a_hard_budget_host_mapped_data_takes_new_address_space_over_backed_runs(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=8 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.free(pool.malloc(8 * MiB))  # the whole first arena: free, GPU-backed
    state = pool.malloc(4 * MiB, tag="optimizer_state")
    s = pool.raw_stats()
    assert (s["arena_reserves"], s["evictions"], s["backed_bytes"]) == (2, 0, 8 * MiB)
    assert pool.block_at(state).residency == "host"
    pool.malloc(8 * MiB)  # the GPU data still gets the backed arena, within the budget


def test_memory_summary_reports_the_pools_counts(monkeypatch):
    import um_alloc.stats as stats_module
    from um_alloc.pool import ChunkPool

    pool = ChunkPool.host(CHUNK, 16 * MiB, 2**64 - 1)
    p = pool.malloc(4 * MiB, stream=1)
    pool.record_stream(p, 2)
    pool.free(p)
    assert pool.malloc(4 * MiB, stream=1) == p  # waits on the point s2 was at when p was freed
    public = stats_module.public_stats(pool.raw_stats())
    public.update(device_highwater_bytes=None, policy="test")
    monkeypatch.setattr(stats_module, "memory_stats", lambda device=None: public)
    summary = stats_module.memory_summary()
    assert "stream waits 1 (side-stream points recorded at free 1)" in summary
    assert any(line.split()[:2] == ["activation", "4.0"] for line in summary.splitlines())  # 4.0 MiB live
    pool.close()


def test_device_live_counts_gpu_tags_and_its_peak_resets(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool()
    pool.set_tag_policy("optimizer_state", TagAdvice(preferred_location="cpu", accessed_by=("gpu",)))
    large, small = pool.malloc(3 * MiB), pool.malloc(100)
    assert pool.device_live() == (3 * MiB + 100, 3 * MiB + 100)
    pool.free(large)
    assert pool.device_live() == (100, 3 * MiB + 100)
    pool.reset_device_peak()
    assert pool.device_live() == (100, 100)
    host = pool.malloc(4 * MiB, tag="optimizer_state")  # host-mapped: not GPU memory
    assert pool.device_live() == (100, 100)
    pool.retag(small, "optimizer_state")
    assert pool.device_live() == (0, 100)
    pool.retag(host, "activation")  # into GPU memory: counted, and the peak follows
    assert pool.device_live() == (4 * MiB, 4 * MiB)


def test_device_backed_counts_free_chunks_and_its_peak_starts_over(make_pool):
    pool = make_pool()
    a = pool.malloc(4 * MiB)
    pool.free(a)
    pool.reset_device_peak()
    assert pool.device_live() == (0, 0)
    backed, peak = pool.device_backed()
    assert backed == peak == pool.raw_stats()["backed_bytes"] > 0  # free, still backed


# ---- step arenas --------------------------------------------------------------------------------

def test_what_a_step_allocates_comes_from_arenas_of_its_own(make_pool):
    pool = make_pool(arena=16 * MiB)
    lasting = pool.malloc(4 * MiB)  # a parameter, say: its arena has room for the step's data
    pool.set_step_arenas(True)
    assert pool.step_arenas()
    step = pool.malloc(4 * MiB)
    assert pool.raw_stats()["arena_count"] == 2  # a step arena
    pool.set_step_arenas(False)
    state = pool.malloc(4 * MiB)  # optimizer state made after the step: back among the lasting
    assert pool.raw_stats()["arena_count"] == 2
    pool.free(step)
    assert pool.empty_cache() == 16 * MiB and pool.raw_stats()["arena_count"] == 1
    assert pool.block_at(lasting) is not None and pool.block_at(state) is not None


def test_between_steps_the_step_arenas_are_wholly_free_and_give_their_backing_back(make_pool):
    """The point of step arenas under a hard budget: a few lasting tensors made during training
    (optimizer state at the first step) no longer hold arenas the step's data backed."""
    pool = make_pool(arena=16 * MiB)
    pool.set_budget(64 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.malloc(2 * MiB)  # parameters
    pool.set_step_arenas(True)
    activations = [pool.malloc(6 * MiB) for _ in range(4)]  # forward and backward: one arena, the budget's size
    pool.set_step_arenas(False)
    state = [pool.malloc(2 * MiB) for _ in range(3)]  # the first optimizer step
    for p in activations:
        pool.free(p)
    backed = pool.raw_stats()["backed_bytes"]
    assert backed == 2 * MiB + 24 * MiB + 6 * MiB
    released = pool.empty_cache()
    s = pool.raw_stats()
    assert released == 64 * MiB and s["backed_bytes"] == 2 * MiB + 6 * MiB
    assert all(pool.block_at(p) is not None for p in state)


def test_a_small_tensor_a_step_makes_that_outlives_it_keeps_no_step_arena(make_pool):
    """The loss a loop still holds as the next step begins, a workspace made at a library's first
    call: small requests take lasting arenas, so the step arena is wholly free between steps."""
    pool = make_pool(arena=16 * MiB)
    parameter = pool.malloc(4 * MiB)
    pool.set_step_arenas(True)
    activation, loss = pool.malloc(4 * MiB), pool.malloc(4)
    pool.set_step_arenas(False)
    assert pool.raw_stats()["arena_count"] == 2
    pool.free(activation)
    assert pool.empty_cache() == 16 * MiB  # the loss, still live, is in the parameter's arena
    assert pool.raw_stats()["arena_count"] == 1
    assert pool.block_at(loss) is not None and pool.block_at(parameter) is not None


def test_under_a_hard_budget_a_request_goes_where_it_backs_the_least_new_memory(make_pool):
    """No free run is backed for all of a 4 MiB request: best fit would take the smallest run that
    fits, wholly unbacked; the pool takes the backed end of a larger run instead."""
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=16 * MiB)
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(64 * MiB, min_swap_size=1 * MiB, evict_live=False)
    host = pool.malloc(4 * MiB, tag="optimizer_state")  # chunks 0-1, never backed
    gpu, keep = pool.malloc(4 * MiB), pool.malloc(2 * MiB)  # chunks 2-3 and 4, backed
    pool.free(host)
    pool.free(gpu)  # free runs: chunks 0-3 (0-1 unbacked, 2-3 backed) and 5-7 (unbacked, the best fit)
    backed = pool.raw_stats()["backed_bytes"]
    assert backed == 6 * MiB
    again = pool.malloc(4 * MiB)
    assert again == gpu and pool.raw_stats()["backed_bytes"] == backed
    assert pool.malloc(2 * MiB) == host  # what was cut off in front is still a free run


def test_held_counts_the_backed_bytes_of_arenas_a_live_allocation_holds(make_pool):
    pool = make_pool(arena=16 * MiB)
    pool.set_budget(64 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.reset_device_peak()
    a, b = pool.malloc(4 * MiB), pool.malloc(1024)
    assert pool.device_held() == (6 * MiB, 6 * MiB)  # a's chunks and b's small chunk
    pool.free(a)
    assert pool.device_held()[0] == 6 * MiB  # free, backed, and held by b: no cudaFree returns it
    pool.free(b)
    assert pool.device_held() == (0, 6 * MiB)  # the arena is wholly free: returning it frees all
    assert pool.device_backed()[0] == 6 * MiB
    pool.reset_device_peak()
    assert pool.device_held() == (0, 0)


def test_under_a_hard_budget_a_step_arena_spans_the_budget(make_pool):
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(15 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_step_arenas(True)
    first = pool.malloc(2 * MiB)
    second = pool.malloc(10 * MiB)  # in the same arena: the budget, rounded up to whole chunks
    s = pool.raw_stats()
    assert (s["arena_count"], s["reserved_bytes"]) == (1, 16 * MiB) and second - first == 2 * MiB
    pool.set_step_arenas(False)
    pool.malloc(2 * MiB)  # lasting data: arenas of the pool's size
    assert pool.raw_stats()["reserved_bytes"] == 20 * MiB


def test_under_a_hard_budget_data_of_one_use_takes_the_others_backed_runs_rather_than_fail(make_pool):
    """An optimizer's temporaries after backward: the budget is spent on the step arena, whose
    activations are free again but whose gradients still hold it."""
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(16 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.malloc(2 * MiB)  # parameters, in a lasting arena of 4 MiB
    pool.set_step_arenas(True)
    activations, gradient = pool.malloc(10 * MiB), pool.malloc(2 * MiB)
    pool.set_step_arenas(False)
    pool.free(activations)
    scratch = pool.malloc(8 * MiB)  # no lasting room within 16 MiB: the step arena's freed run
    assert scratch == activations and pool.raw_stats()["backed_bytes"] == 2 * MiB + 12 * MiB
    small = pool.malloc(1024)  # no lasting room either: a chunk of the step arena's backed runs
    pool.free(scratch)
    pool.free(small)
    pool.free(gradient)
    pool.empty_cache()
    assert pool.raw_stats()["reserved_bytes"] == 4 * MiB  # all but the parameters' arena went back


def test_small_requests_the_budget_sends_to_a_step_arena_share_one_chunk(make_pool):
    """With the budget spent, a small request takes a chunk of the step arena's freed run; the
    next ones take the rest of that chunk, rather than a chunk each (ResNet-50's many small
    saves at the edge of its budget)."""
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(16 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.malloc(4 * MiB)  # parameters fill their lasting arena
    pool.set_step_arenas(True)
    activations, gradient = pool.malloc(10 * MiB), pool.malloc(2 * MiB)
    pool.free(activations)  # 16 MiB backed: no new backing anywhere
    smalls = [pool.malloc(1024) for _ in range(8)]
    assert pool.raw_stats()["small_chunks"] == 1
    assert all(activations <= p < activations + 10 * MiB for p in smalls)
    assert pool.raw_stats()["backed_bytes"] == 16 * MiB


def test_host_mapped_data_the_cap_keeps_from_new_space_takes_the_best_fit_not_the_most_backed(make_pool):
    from um_alloc.policy import TagAdvice

    pool = make_pool(arena=16 * MiB, cap=16 * MiB)  # one arena: no new address space
    pool.set_tag_policy("optimizer_state", TagAdvice(**HOST_MAPPED))
    pool.set_budget(64 * MiB, min_swap_size=1 * MiB, evict_live=False)
    backed, keep, partly = pool.malloc(8 * MiB), pool.malloc(2 * MiB), pool.malloc(2 * MiB)  # chunks 0-3, 4, 5
    pool.free(backed)  # free runs: chunks 0-3, all backed, and 5-7 (the best fit), only 5 backed
    pool.free(partly)
    assert pool.malloc(4 * MiB, tag="optimizer_state") == partly  # not the wholly backed run


def test_a_step_request_the_hard_budget_refuses_overflows_to_host_memory_within_its_limit(make_pool):
    """A planned step whose peak was misjudged: its large requests past the budget go to host
    memory the GPU maps, up to the overflow limit, and leave the budget as it was."""
    import torch

    pool = make_pool(arena=4 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_overflow(6 * MiB)
    pool.set_step_arenas(True)
    pool.reset_device_peak()
    kept = pool.malloc(8 * MiB)  # the budget, all of it
    over = pool.malloc(4 * MiB)
    info = pool.block_at(over)
    assert info.residency == "host" and info.tag == "activation"
    s = pool.raw_stats()
    overflow = (s["overflow_allocations"], s["overflow_bytes"], s["num_ooms"])
    assert s["backed_bytes"] == 8 * MiB and overflow == (1, 4 * MiB, 0)
    assert pool.device_live() == (12 * MiB, 12 * MiB)  # what the step asked the GPU for
    assert pool.migrate(over, to_gpu=True) == 0  # it stays where the budget put it
    with pytest.raises(torch.OutOfMemoryError, match=r"overflowed from this step: 4\.00 MiB of 6\.00 MiB allowed"):
        pool.malloc(4 * MiB)  # 4 + 4 would pass the 6 MiB limit
    pool.free(over)
    assert pool.raw_stats()["overflow_bytes"] == 0 and pool.take_overflow_peak() == 4 * MiB
    assert pool.take_overflow_peak() == 0  # each call starts over
    pool.free(kept)
    assert pool.raw_stats()["peak_backed_bytes"] == 8 * MiB


def test_of_a_request_the_hard_budget_refuses_only_what_it_cannot_back_overflows(make_pool):
    """The window the request takes keeps its backed chunks on the GPU, and backs as many more as
    the budget still allows; only the rest is hinted to host memory and counted as overflowed."""
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(12 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_overflow(64 * MiB)
    pool.malloc(2 * MiB)  # lasting: 2 MiB backed
    pool.set_step_arenas(True)
    kept, freed = pool.malloc(4 * MiB), pool.malloc(4 * MiB)  # a 12 MiB step arena's chunks 0-1 and 2-3
    pool.free(freed)  # free run: chunks 2-3 backed, 4-5 never backed; 10 MiB backed, 2 MiB of room
    over = pool.malloc(8 * MiB)
    assert over == freed
    where = [pool.block_at(over + i * CHUNK).residency for i in range(4)]
    assert where == ["gpu", "gpu", "gpu", "host"]  # backed, backed, the budget's room, overflowed
    s = pool.raw_stats()
    assert (s["overflow_allocations"], s["overflow_bytes"], s["backed_bytes"]) == (1, 2 * MiB, 12 * MiB)
    assert pool.migrate(over, to_gpu=True) == 0  # it stays where the budget put it
    pool.free(over)
    assert pool.raw_stats()["overflow_bytes"] == 0 and pool.take_overflow_peak() == 2 * MiB
    again = pool.malloc(6 * MiB)  # the same chunks for GPU data: three of them backed, all on the GPU
    assert again == freed and pool.block_at(again + 2 * CHUNK).residency == "gpu"
    assert pool.raw_stats()["backed_bytes"] == 12 * MiB and pool.raw_stats()["overflow_allocations"] == 1


def test_an_overflowed_window_keeps_its_backed_chunks_on_the_gpu_wherever_they_lie_in_it(make_pool):
    """Backed and never-backed chunks alternate in the free window (an overflowed block freed
    between two that were on the GPU): each stretch gets its own hints and residency."""
    pool = make_pool(arena=16 * MiB)
    pool.set_budget(6 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_overflow(64 * MiB)
    lasting = pool.malloc(4 * MiB)
    pool.set_step_arenas(True)
    first = pool.malloc(2 * MiB)      # chunk 0 of a step arena: the budget is spent
    second = pool.malloc(2 * MiB)     # chunk 1, in host memory
    pool.free(lasting)                # its arena goes back when the budget next wants room
    third, fourth = pool.malloc(2 * MiB), pool.malloc(2 * MiB)  # chunks 2 and 3, on the GPU
    fifth = pool.malloc(2 * MiB)      # chunk 4, in host memory
    assert [pool.block_at(p).residency for p in (first, second, third, fourth, fifth)] == \
        ["gpu", "host", "gpu", "gpu", "host"]
    for p in (first, second, third, fifth):
        pool.free(p)                  # free: chunks 0-2 (backed, never backed, backed) and 4-7
    window = pool.malloc(6 * MiB)
    assert window == first
    assert [pool.block_at(window + i * CHUNK).residency for i in range(3)] == ["gpu", "host", "gpu"]
    s = pool.raw_stats()
    assert (s["overflow_bytes"], s["backed_bytes"], s["peak_backed_bytes"]) == (2 * MiB, 6 * MiB, 6 * MiB)  # within budget


def test_an_arena_holding_only_overflowed_host_memory_is_kept_when_the_budget_wants_room(make_pool):
    """Returning a wholly free arena the GPU never backed gives the budget nothing back; it would
    cost a cudaFree now and a new arena at the next overflow, every step."""
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_overflow(64 * MiB)
    pool.malloc(4 * MiB)  # lasting: half the budget
    pool.set_step_arenas(True)
    pool.malloc(4 * MiB)  # the other half, in an 8 MiB step arena, whose last 4 MiB stay free
    first = pool.malloc(6 * MiB)  # fits no free run: a new step arena, all of it in host memory
    pool.free(first)
    pool.malloc(4 * MiB)  # the budget refuses the first arena's free run, and the new one gives nothing back
    again = pool.malloc(6 * MiB)
    s = pool.raw_stats()
    assert again == first and (s["arena_reserves"], s["arena_releases"]) == (3, 0)
    assert s["overflow_bytes"] == 10 * MiB and s["backed_bytes"] == 8 * MiB


def test_overflow_is_for_a_steps_large_requests_only(make_pool):
    """What outlasts a step (lasting arenas: optimizer state, small requests) never overflows, and
    neither does anything where overflow is off (the default)."""
    import torch

    pool = make_pool(arena=4 * MiB)
    pool.set_budget(4 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.malloc(4 * MiB)  # the budget, in a lasting arena
    pool.set_step_arenas(True)
    with pytest.raises(torch.OutOfMemoryError):
        pool.malloc(2 * MiB)  # overflow off
    pool.set_overflow(64 * MiB)
    with pytest.raises(torch.OutOfMemoryError):
        pool.malloc(1024)  # small: lasting arenas
    pool.set_step_arenas(False)
    with pytest.raises(torch.OutOfMemoryError):
        pool.malloc(2 * MiB)  # between steps
    assert pool.raw_stats()["overflow_allocations"] == 0


def test_an_overflowed_run_freed_serves_gpu_data_again_within_the_budget(make_pool):
    pool = make_pool(arena=4 * MiB)
    pool.set_budget(8 * MiB, min_swap_size=1 * MiB, evict_live=False)
    pool.set_overflow(8 * MiB)
    pool.set_step_arenas(True)
    kept = pool.malloc(8 * MiB)
    over = pool.malloc(4 * MiB)
    pool.retag(over, "other")  # a retag moves its accounting, not its pages
    assert pool.block_at(over).residency == "host" and pool.raw_stats()["backed_bytes"] == 8 * MiB
    pool.free(kept)
    pool.free(over)
    again = pool.malloc(8 * MiB)  # the budget's own backed run, on the GPU
    assert pool.block_at(again).residency == "gpu" and pool.raw_stats()["backed_bytes"] == 8 * MiB
