"""The planner's choices on synthetic calibrations: no GPU, no model, only the model of a step."""
from dataclasses import replace

import pytest

from um_alloc.planner.planning import (SAFE, Calibration, Decision, PlanInfeasible, Segment, UnitCost, evaluate,
                                       make_plan, pool_repeats)
from um_alloc.sizes import format_size, parse_size, size_text

MiB, GiB = 1 << 20, 1 << 30


def transformer(blocks: int = 8, saved: int = 800 * MiB, selective: int = 300 * MiB, inputs: int = 64 * MiB,
                static: int = 5 * GiB, loss: int = 2 * GiB, rate: float = 50e9) -> Calibration:
    """A step like a transformer's, measured in the safe mode: an embedding gap, `blocks` blocks,
    a head gap; the forward holds units as they finish, the tail holds them all, backward lets
    each go as it passes."""
    units = [UnitCost("embeddings", "gap", 1e-3, saved_bytes=100 * MiB, hide_s=0.1)]
    for i in range(blocks):
        units.append(UnitCost(f"layer.{i}", "block", forward_s=2e-3, recompute_s=2e-3, matmul_s=1.5e-3,
                              saved_bytes=saved, selective_bytes=selective, input_bytes=inputs,
                              hide_s=2e-3 * min(i + 1, blocks - i)))
    units.append(UnitCost("head", "gap", 1e-3, saved_bytes=200 * MiB, hide_s=0.0))
    n = len(units)
    segments = [Segment(f"forward {j}", static + 256 * MiB, tuple(range(j))) for j in range(n)]
    segments.append(Segment("loss", static + loss, tuple(range(n))))
    segments += [Segment(f"backward {j}", static + saved, tuple(range(j))) for j in range(n - 1, -1, -1)]
    segments.append(Segment("optimizer", static + 512 * MiB, ()))
    return Calibration(tuple(units), tuple(segments), step_s=0.1, link_bytes_per_s=rate)


def test_a_budget_that_holds_everything_keeps_everything():
    cal = transformer()
    plan = make_plan(cal, 40 * GiB)
    assert set(plan.decisions) == {Decision.KEEP}
    assert plan.predicted_step_s == pytest.approx(cal.base_step_s())
    assert plan.moved_bytes == 0
    assert plan.predicted_peak_bytes <= plan.limit_bytes


@pytest.mark.parametrize("budget_gib", [8, 9, 10, 11, 12, 14, 16])
def test_the_predicted_peak_stays_within_the_budget(budget_gib):
    plan = make_plan(transformer(), budget_gib * GiB)
    assert plan.predicted_peak_bytes <= plan.limit_bytes <= budget_gib * GiB - 512 * MiB


def test_more_budget_never_predicts_a_slower_step():
    cal = transformer(blocks=12)
    steps = [make_plan(cal, b * 256 * MiB).predicted_step_s for b in range(32, 96)]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(steps, steps[1:]))
    assert steps[0] > steps[-1]


def test_an_infeasible_budget_is_refused_with_the_smallest_that_fits():
    cal = transformer()
    with pytest.raises(PlanInfeasible) as refused:
        make_plan(cal, 6 * GiB)
    smallest = refused.value.smallest_bytes
    assert smallest == cal.smallest_peak() + 512 * MiB
    assert "smallest budget that fits is" in str(refused.value)
    make_plan(cal, smallest)  # that figure is enough
    held = replace(cal, fragmentation_bytes=300 * MiB, reserved_bytes=128 * MiB)
    with pytest.raises(PlanInfeasible) as refused:
        make_plan(held, 6 * GiB)
    assert ("940.0 MiB more is needed beside it (512.0 MiB of margin, 300.0 MiB the allocator held beyond "
            "live bytes as it measured, 128.0 MiB of copy stages)") in str(refused.value)


def test_the_budget_an_infeasible_plan_asks_for_is_one_a_user_writes_and_fits():
    """The smallest budget just over a round figure reads as that figure at one decimal ("5.5 GiB"
    for 5.52): the message also names a round budget above it, which fits."""
    cal = transformer()
    with pytest.raises(PlanInfeasible) as refused:
        make_plan(cal, 6 * GiB)
    asked = refused.value.smallest_bytes
    rounded = -(-asked // (256 * MiB)) * 256 * MiB
    written = size_text(rounded)
    assert f"ask for {written} or more" in str(refused.value)
    assert parse_size(written, key="budget", source="test") == rounded >= asked
    make_plan(cal, rounded)


def test_a_block_backward_never_reaches_keeps_its_forward_in_the_base_step():
    """The first layers of a partial fine-tune: frozen, their input needing no gradient, so the
    safe step never recomputed them. The kept step still runs their forward once."""
    cal = transformer()
    frozen = {"layer.0", "layer.1"}
    never_rerun = replace(cal, step_s=cal.step_s - 2 * 2e-3,  # their recomputations did not run
                          units=tuple(replace(u, recompute_s=0.0) if u.name in frozen else u for u in cal.units))
    assert never_rerun.base_step_s() == pytest.approx(cal.base_step_s())
    assert never_rerun.hide_scale() == pytest.approx(cal.hide_scale())
    plan = make_plan(never_rerun, 12 * GiB)
    assert all(c == 0.0 for u, c in zip(plan.units, plan.costs) if u.name in frozen)


def test_a_block_backward_never_reaches_holds_nothing_and_runs_as_it_is():
    """Frozen first layers: nothing is saved for them and nothing holds their input, so keeping
    them costs no memory, and the plan neither wraps them nor moves their input."""
    cal = transformer(blocks=12)
    frozen = {f"layer.{i}" for i in range(6)}
    never_rerun = replace(cal, units=tuple(replace(u, recompute_s=0.0, saved_bytes=0, selective_bytes=0)
                                           if u.name in frozen else u for u in cal.units))
    budget = 12 * GiB
    plan = make_plan(never_rerun, budget)
    assert [d for u, d in zip(plan.units, plan.decisions) if u.name in frozen] == [Decision.KEEP] * 6
    assert all(u.retained(d) == 0 and u.moved(d) == 0
               for u in never_rerun.units if u.name in frozen for d in Decision)
    # What the frozen layers' inputs would have taken goes to the layers that train: the same
    # plan for them as where those inputs were never counted at all.
    uncounted = replace(never_rerun, units=tuple(replace(u, input_bytes=0) if u.name in frozen else u
                                                 for u in never_rerun.units))
    assert plan.decisions == make_plan(uncounted, budget).decisions


def test_a_frozen_blocks_kept_forward_sheds_the_safe_modes_wrapper_as_the_recomputed_ones_do():
    """A block backward never reached ran its forward once, inside the safe mode's wrapper; the
    recomputed blocks show how much faster a forward runs without it."""
    cal = transformer(blocks=4)
    wrapped = replace(cal, units=tuple(replace(u, forward_s=3e-3, recompute_s=1e-3) if u.kind == "block" else u
                                       for u in cal.units))
    frozen = replace(wrapped, step_s=wrapped.step_s - 1e-3,  # its recomputation did not run
                     units=tuple(replace(u, recompute_s=0.0) if u.name == "layer.0" else u for u in wrapped.units))
    kept = dict(zip((u.name for u in frozen.units), frozen.kept_forward_s()))
    assert kept["layer.0"] == pytest.approx(1e-3) and kept["layer.1"] == pytest.approx(1e-3)
    # Its one forward, less the wrapper, stays in the base, as a recomputed block's kept forward does.
    assert frozen.base_step_s() == pytest.approx(wrapped.base_step_s())


def test_a_gaps_forward_that_waited_for_its_copies_out_leaves_the_base_what_they_took():
    """A stem whose saved tensors the safe step moved: its GPU time ran past the host's by about
    the copy's length, which a plan that keeps it does not spend. A host-bound gap's copies hid
    under the host's time, so its forward stays whole."""
    cal = transformer()
    rate, moved = cal.link_bytes_per_s, 100 * MiB  # the embeddings gap's saved bytes
    link = moved / rate

    def with_embeddings(**figures):
        return replace(cal, units=tuple(replace(u, **figures) if u.name == "embeddings" else u for u in cal.units))

    host_bound = with_embeddings(forward_s=1e-3, forward_cpu_s=1.5e-3)
    stalled = with_embeddings(forward_s=1e-3 + link + 2e-3, forward_cpu_s=1e-3)
    slowed = with_embeddings(forward_s=1e-3 + 0.5 * link, forward_cpu_s=1e-3)
    assert host_bound.base_step_s() == pytest.approx(cal.base_step_s())
    # The same safe step, whose forward of the gap took longer: up to the link's time comes off.
    longer = lambda c, by: replace(c, step_s=c.step_s + by)  # noqa: E731
    assert longer(stalled, link + 2e-3).base_step_s() == pytest.approx(cal.base_step_s() + 2e-3)
    assert longer(slowed, 0.5 * link).base_step_s() == pytest.approx(cal.base_step_s())


def test_memory_in_use_that_grew_after_measuring_lifts_every_peak_by_as_much():
    """The optimizer's state made after the measured steps (gradient accumulation) is in use all
    through the step: the plan keeps less, and a budget it no longer fits is refused."""
    cal = transformer()
    grown = cal.with_more_in_use(2 * GiB)
    assert grown.start_live_bytes == cal.start_live_bytes + 2 * GiB
    assert [s.peak_bytes for s in grown.segments] == [s.peak_bytes + 2 * GiB for s in cal.segments]
    before, after = make_plan(cal, 12 * GiB), make_plan(grown, 12 * GiB)
    kept = lambda plan: sum(u.retained(d) for u, d in zip(plan.units, plan.decisions))  # noqa: E731
    assert kept(after) < kept(before)
    assert after.predicted_peak_bytes <= after.limit_bytes
    assert evaluate(grown, before.decisions, 12 * GiB).predicted_peak_bytes == before.predicted_peak_bytes + 2 * GiB
    with pytest.raises(PlanInfeasible):
        make_plan(grown, cal.smallest_budget(512 * MiB))


def test_the_safe_mode_is_what_a_budget_at_the_floor_gets():
    cal = transformer()
    plan = make_plan(cal, cal.smallest_budget(512 * MiB))
    assert plan.predicted_peak_bytes == cal.smallest_peak()
    assert all(u.retained(d) == 0 for u, d in zip(cal.units, plan.decisions))


def test_cheap_choices_come_first_selective_before_recompute():
    """Between the floor and everything kept, a selective recompute (cost 0.5 ms, 300 MiB kept)
    beats a full one (2 ms) wherever its bytes fit."""
    cal = transformer(rate=1.0)  # no link: nothing moves
    plan = make_plan(cal, 10 * GiB)
    used = set(plan.decisions)
    assert Decision.SELECTIVE in used or Decision.SELECTIVE_MOVED in used
    assert Decision.MOVE not in used
    assert plan.predicted_step_s < evaluate(cal, tuple(SAFE[u.kind] for u in cal.units), 10 * GiB).predicted_step_s


def test_moves_stay_within_what_the_compute_around_them_hides():
    cal = transformer(rate=50e9)
    plan = make_plan(cal, 8 * GiB)  # tight: recomputing alone does not fit
    for unit, decision in zip(cal.units, plan.decisions):
        assert unit.moved(decision) <= 0.7 * cal.link_bytes_per_s * unit.hide_s or decision is SAFE[unit.kind]
    forward = sum(u.forward_s for u in cal.units)
    assert 0 < plan.moved_bytes <= 0.7 * cal.link_bytes_per_s * forward


def test_nothing_moves_where_recomputing_fits():
    """Copies out cost their whole time on the link (compute reusing their memory waits for them),
    so a plan moves only what it cannot fit by recomputing."""
    for budget in (9, 11, 13):
        assert make_plan(transformer(rate=50e9), budget * GiB).moved_bytes == 0


def test_a_forced_plan_is_evaluated_as_given():
    cal = transformer()
    forced = tuple(Decision.RECOMPUTE if u.kind == "block" else Decision.KEEP for u in cal.units)
    plan = evaluate(cal, forced, 16 * GiB)
    assert plan.decisions == forced
    assert plan.predicted_step_s == pytest.approx(cal.base_step_s() + 8 * 2e-3)
    assert "recompute" in plan.table() and plan.to_dict()["decisions"] == {"keep": 2, "recompute": 8}


def test_the_table_says_how_far_a_plan_run_past_its_limit_passes_it():
    cal = transformer()
    plan = evaluate(cal, tuple(Decision.KEEP for _ in cal.units), 16 * GiB)
    within = replace(plan, limit_bytes=plan.predicted_peak_bytes)
    past = replace(plan, limit_bytes=plan.predicted_peak_bytes - GiB)
    assert f"peak {format_size(plan.predicted_peak_bytes)} of {format_size(plan.predicted_peak_bytes)} (budget 16.0 GiB)" \
        in within.table()
    assert f"peak {format_size(plan.predicted_peak_bytes)}, 1.0 GiB past its limit of " \
           f"{format_size(plan.predicted_peak_bytes - GiB)} (budget 16.0 GiB)" in past.table()


def test_a_large_unit_held_only_late_leaves_the_earlier_units_their_room():
    """What the loss keeps is held from the forward's end only: it must not take room from blocks
    in segments that do not hold it (the plan fills the budget up to the binding segment)."""
    cal = transformer(blocks=8)
    units = cal.units + (UnitCost("(outside the units)", "gap", 0.0, saved_bytes=3 * GiB, hide_s=0.0),)
    rest = len(units) - 1
    segments = tuple(s if s.label != "loss" else Segment("loss", 5 * GiB, tuple(range(rest + 1)))
                     for s in cal.segments) + (Segment("backward start", 8 * GiB, tuple(range(rest))),)
    cal = Calibration(units, segments, cal.step_s, cal.link_bytes_per_s)
    plan = make_plan(cal, 14 * GiB)
    assert plan.decisions[rest] is Decision.KEEP  # moving 3 GiB with no compute around it would wait
    assert plan.limit_bytes - plan.predicted_peak_bytes < 800 * MiB  # less than one more kept block


def test_copies_out_that_outrun_the_forward_close_by_cost_their_excess():
    """A whole block moved in one burst: the link takes longer than this block's and the next one's
    forward, and compute that reuses the memory waits for the rest; a small input moves for free."""
    cal = transformer(blocks=8, saved=800 * MiB, inputs=64 * MiB, rate=50e9)
    leads = cal.leads()
    block, lead = cal.units[4], leads[4]
    assert lead == pytest.approx(4e-3)  # its kept forward and the next block's
    burst = (block.saved_bytes + block.input_bytes) / 50e9
    back = burst - block.hide_s  # copies back: beyond the compute around it
    assert block.cost_s(Decision.MOVE, 50e9, 1.0, lead) == pytest.approx(back + burst - lead, abs=1e-5)
    assert block.cost_s(Decision.RECOMPUTE_MOVED, 50e9, 1.0, lead) == pytest.approx(2e-3, abs=1e-5)
    plan = make_plan(cal, 11 * GiB)
    assert Decision.MOVE not in plan.decisions[1:-1]  # recomputing a block is cheaper than waiting for it
    assert plan.costs and sum(plan.costs) + cal.base_step_s() == pytest.approx(plan.predicted_step_s)


def test_a_recomputation_costs_the_hosts_time_where_the_host_sets_the_backwards_pace():
    # BERT-Large on an H100: the host issues a block's backward about as fast as the GPU runs it,
    # so the recomputation's extra host time is added in full.
    host_bound = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3, recompute_cpu_s=2.0e-3,
                          backward_s=2.9e-3, backward_cpu_s=2.8e-3)
    assert host_bound.cost_s(Decision.RECOMPUTE) == pytest.approx(1.9e-3)
    # A large batch: the GPU's backward leaves the host time to spare, which hides its extra part.
    gpu_bound = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3, recompute_cpu_s=2.0e-3,
                         backward_s=9e-3, backward_cpu_s=2.8e-3)
    assert gpu_bound.cost_s(Decision.RECOMPUTE) == pytest.approx(1.2e-3)
    # Without the host's clock, the GPU's time.
    unmeasured = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3)
    assert unmeasured.cost_s(Decision.RECOMPUTE) == pytest.approx(1.2e-3)


def test_a_selective_recomputation_saves_gpu_time_but_not_the_hosts():
    unit = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3, matmul_s=0.9e-3,
                    recompute_cpu_s=2.0e-3, backward_s=2.9e-3, backward_cpu_s=2.8e-3)
    assert unit.cost_s(Decision.SELECTIVE) == pytest.approx(unit.cost_s(Decision.RECOMPUTE))
    roomy = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3, matmul_s=0.9e-3,
                     recompute_cpu_s=2.0e-3, backward_s=9e-3, backward_cpu_s=2.8e-3)
    assert roomy.cost_s(Decision.SELECTIVE) == pytest.approx(0.3e-3)


def test_a_rebuild_costs_the_hosts_time_of_finding_it_in_forward_and_the_gpus_in_backward():
    # BERT-Large on an H100: a block's rebuilds take 0.36 ms of GPU time and 0.86 ms of the host's,
    # which hides under the kept block's backward; finding them in forward takes the host 0.67 ms.
    unit = UnitCost("layer", "block", forward_s=1.2e-3, recompute_s=1.2e-3, recompute_cpu_s=1.2e-3,
                    backward_s=2.9e-3, backward_cpu_s=2.8e-3, saved_bytes=700 * MiB, input_bytes=64 * MiB,
                    rebuildable_bytes=290 * MiB, rebuild_s=0.36e-3, rebuild_cpu_s=0.86e-3,
                    rebuild_forward_cpu_s=0.67e-3)
    assert unit.cost_s(Decision.REBUILD) == pytest.approx(0.67e-3 + 0.36e-3)
    assert unit.retained(Decision.REBUILD) == unit.retained(Decision.KEEP) - 290 * MiB
    cal = transformer(blocks=8)
    units = tuple(replace(u, rebuildable_bytes=300 * MiB, rebuild_s=0.3e-3) if u.kind == "block" else u
                  for u in cal.units)
    plan = make_plan(replace(cal, units=units), 11 * GiB)
    assert Decision.REBUILD in plan.decisions
    assert plan.predicted_step_s < make_plan(cal, 11 * GiB).predicted_step_s


def test_a_rebuilds_checks_in_forward_cost_only_what_the_gpu_leaves_the_host_to_spare():
    # GPT-2-medium on one H200: a block's kept forward issued in 1.0 ms of the host's time, done by
    # the GPU 1.7 ms after it began; the checks take the host 0.4 ms, the rebuilds the GPU 0.44 ms.
    found = dict(rebuildable_bytes=64 * MiB, rebuild_s=0.44e-3, rebuild_forward_cpu_s=0.4e-3)
    roomy = UnitCost("layer", "block", forward_s=2.2e-3, recompute_s=1.4e-3, alone_forward_s=1.7e-3,
                     alone_forward_cpu_s=1.0e-3, **found)
    assert roomy.cost_s(Decision.REBUILD) == pytest.approx(0.44e-3)
    tight = replace(roomy, alone_forward_cpu_s=1.5e-3)  # 0.2 ms to spare: the other 0.2 land
    assert tight.cost_s(Decision.REBUILD) == pytest.approx(0.2e-3 + 0.44e-3)
    host_bound = replace(roomy, alone_forward_cpu_s=1.9e-3)
    assert host_bound.cost_s(Decision.REBUILD) == pytest.approx(0.4e-3 + 0.44e-3)
    unread = replace(roomy, alone_forward_cpu_s=0.0)  # a calibration that did not read the host's clock
    assert unread.cost_s(Decision.REBUILD) == pytest.approx(0.4e-3 + 0.44e-3)


def test_twin_blocks_share_the_median_of_their_times_and_others_keep_their_own():
    cal = transformer(blocks=5)
    hiccup = [replace(u, recompute_cpu_s=10e-3 if u.name == "layer.2" else 1e-3) for u in cal.units]
    hiccup[1] = replace(hiccup[1], backward_s=7e-3, hide_s=0.5)
    groups = [None] + ["Layer"] * 5 + [None]
    pooled = pool_repeats(replace(cal, units=tuple(hiccup)), groups)
    blocks = [u for u in pooled.units if u.kind == "block"]
    assert {u.recompute_cpu_s for u in blocks} == {1e-3}
    assert {u.backward_s for u in blocks} == {0.0}
    assert pooled.units[1].hide_s == 0.5  # where a unit sits is its own
    assert pooled.units[0] == hiccup[0]
    # Two of a kind, or twins that hold other bytes, are left as measured.
    pairs = pool_repeats(replace(cal, units=tuple(hiccup)), [None, "B", "B", "A", "A", "B", None])
    assert pairs.units[3].recompute_cpu_s == 10e-3  # layer.2, one of the two As
    assert pairs.units[1].backward_s == 0.0         # the Bs pooled
    other = replace(hiccup[3], saved_bytes=hiccup[3].saved_bytes * 2)
    mixed = pool_repeats(replace(cal, units=(*hiccup[:3], other, *hiccup[4:])), groups)
    assert mixed.units[3].recompute_cpu_s == other.recompute_cpu_s
    assert mixed.units[2].recompute_cpu_s == 1e-3


def test_memory_held_beyond_live_is_the_steps_own(tmp_path):
    """Chunks a larger batch left backed are reused by the next step: they are not counted as held
    beyond live, where chunks the step itself backs beyond its live peak are."""
    import torch
    from um_alloc.planner.record import MemoryProbe
    from um_alloc.pool import ChunkPool

    mib = 1 << 20
    pool = ChunkPool.host(2 * mib, 16 * mib)
    probe = MemoryProbe(torch.device("cpu"))
    probe._pool = pool
    big = [pool.malloc(2 * mib) for _ in range(4)]   # a larger batch: 8 MiB backed
    for ptr in big:
        pool.free(ptr)
    probe.begin_step()
    small = pool.malloc(2 * mib)                     # the next step fits in what is backed
    live, peak = probe.look()
    assert probe.held_beyond_live(peak) == 0
    pool.free(small)
    pool.close()


def with_copies_ahead(cal: Calibration, window: int) -> Calibration:
    """The same step, each backward segment of the safe step also holding `window` bytes of its
    copies back ahead of use (its transfer window), as calibration measures them."""
    return replace(cal, segments=tuple(replace(s, peak_bytes=s.peak_bytes + window, ahead_bytes=window)
                                       if s.label.startswith("backward") else s for s in cal.segments))


def test_the_safe_steps_copies_back_are_not_charged_to_a_plan_that_moves_nothing():
    cal, windowed = transformer(), with_copies_ahead(transformer(), 512 * MiB)
    recompute = tuple(Decision.RECOMPUTE if u.kind == "block" else Decision.KEEP for u in cal.units)
    safe = tuple(SAFE[u.kind] for u in cal.units)
    assert evaluate(windowed, recompute, 16 * GiB).predicted_peak_bytes == \
        evaluate(cal, recompute, 16 * GiB).predicted_peak_bytes
    # The safe step moves at least its window of what each backward segment holds: its own peak.
    assert evaluate(windowed, safe, 16 * GiB).predicted_peak_bytes == windowed.smallest_peak()
    for budget in (9, 11, 13):  # budgets where nothing moves: the same plans as without the window
        assert make_plan(windowed, budget * GiB).decisions == make_plan(cal, budget * GiB).decisions


def test_a_plan_that_moves_less_than_the_window_is_charged_for_what_it_moves():
    units = (UnitCost("a", "block", 1e-3, 1e-3, saved_bytes=400 * MiB, input_bytes=100 * MiB, hide_s=1.0),
             UnitCost("b", "block", 1e-3, 1e-3, saved_bytes=400 * MiB, input_bytes=100 * MiB, hide_s=1.0))
    segments = (Segment("loss", 3 * GiB, (0, 1)),
                Segment("backward b", 3 * GiB + 150 * MiB, (0, 1), ahead_bytes=150 * MiB))
    cal = Calibration(units, segments, step_s=0.1, link_bytes_per_s=50e9)
    both_moved = evaluate(cal, (Decision.RECOMPUTE_MOVED, Decision.RECOMPUTE_MOVED), 16 * GiB)
    one_moved = evaluate(cal, (Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED), 16 * GiB)
    none_moved = evaluate(cal, (Decision.RECOMPUTE, Decision.RECOMPUTE), 16 * GiB)
    assert both_moved.predicted_peak_bytes == 3 * GiB + 150 * MiB       # 200 MiB moved: no relief
    assert one_moved.predicted_peak_bytes == 3 * GiB + 150 * MiB + 100 * MiB - 50 * MiB  # 100 moved: 50 off
    assert none_moved.predicted_peak_bytes == 3 * GiB + 200 * MiB       # the whole window off


@pytest.mark.parametrize("budget_gib", [8, 9, 10, 12])
def test_with_copies_ahead_the_plan_still_keeps_the_peak_it_predicts_within_the_budget(budget_gib):
    windowed = with_copies_ahead(transformer(rate=50e9), 512 * MiB)
    plan = make_plan(windowed, budget_gib * GiB)
    assert plan.predicted_peak_bytes <= plan.limit_bytes
    assert make_plan(windowed, (budget_gib + 1) * GiB).predicted_step_s <= plan.predicted_step_s + 1e-12


@pytest.mark.parametrize("hide_fraction", [0.0, 0.7])
def test_no_compute_to_hide_copies_under_an_unmeasured_link_allows_no_moves_and_plans(hide_fraction):
    """A link nothing measured is infinitely fast (the CPU); where the modelled backward is zero
    (a short step on a loaded host) or moves may hide under nothing, the room for moves is none,
    not infinity times zero."""
    cal = replace(transformer(), link_bytes_per_s=float("inf"))
    cal = replace(cal, step_s=sum(u.forward_s for u in cal.units) * cal.hide_scale())  # backward: none
    plan = make_plan(cal, 12 * GiB, hide_fraction=hide_fraction)
    assert plan.moved_bytes == 0 and plan.predicted_peak_bytes <= plan.limit_bytes
