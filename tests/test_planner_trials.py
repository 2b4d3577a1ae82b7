"""Trying the runners-up (um_alloc.planner.trials): which plans are tried, what is measured, which
stays; and the director's wiring on the CPU."""
from dataclasses import replace

import pytest
import torch

from um_alloc.planner import BlockPlanner, Decision
from um_alloc.planner import director as director_module
from um_alloc.planner.planning import checkpointing_plan, evaluate, make_plan
from um_alloc.planner.trials import ALTERNATIVE_WITHIN, STEPS_PER_CANDIDATE, PlanTrials, runners_up
from test_planner_plan import GiB, MiB, transformer
from test_planner_replay import tiny_bert

DEFAULT = frozenset({Decision.KEEP, Decision.REBUILD, Decision.MOVE, Decision.RECOMPUTE, Decision.RECOMPUTE_MOVED})


class ScriptedClock:
    """Step starts at the times given: the intervals between them are the steps' times."""

    def __init__(self, starts):
        self._starts = iter(starts)

    def mark(self):
        return next(self._starts)

    def seconds(self, start, end):
        return end - start


def rebuilding():
    """A calibration whose plan at 11 GiB rebuilds: cheap rebuilds of 300 MiB a block."""
    cal = transformer(blocks=8)
    units = tuple(replace(u, rebuildable_bytes=300 * MiB, rebuild_s=0.3e-3) if u.kind == "block" else u
                  for u in cal.units)
    return replace(cal, units=units)


def starts_of(step_times):
    """Step starts for steps of the given times, the first at 0, and the mark after the last."""
    starts = [0.0]
    for seconds in step_times:
        starts.append(starts[-1] + seconds)
    return starts


def two_plans():
    cal = rebuilding()
    return make_plan(cal, 11 * GiB), make_plan(cal, 11 * GiB, allowed=DEFAULT - {Decision.REBUILD})


def test_candidates_run_three_steps_at_a_time_in_turn_and_back_and_the_fastest_measured_stays():
    a, b = two_plans()
    # a: 0.2 s a step, the first of each visit slow (left out); b: 0.1 s, its first slow too.
    times = [5.0, 0.2, 0.2] + [1.0] + [0.1] * 5 + [3.0, 0.2, 0.2]
    trials = PlanTrials([a, b], torch.device("cpu"), steps=3, clock=ScriptedClock(starts_of(times)))
    ran = [trials.begin_step() for _ in range(13)]
    assert ran[:3] == [a] * 3 and ran[3:9] == [b] * 6 and ran[9:12] == [a] * 3
    assert ran[12] is b and trials.done and trials.chosen is b and trials.total_steps == 12
    assert [t.measured_step_s for t in trials.tried] == pytest.approx([0.2, 0.1])
    assert trials.begin_step() is b  # no more marks are taken: the scripted clock has none left
    assert "(kept)" in trials.summary().split("] [")[1]
    assert trials.summary().startswith("tried [the model's fastest, ")
    assert [t["kept"] for t in trials.to_list()] == [False, True]
    assert trials.to_list()[0]["made"] == "the model's fastest"


def test_three_candidates_are_visited_in_order_then_in_reverse():
    a, b = two_plans()
    c = replace(b, made="c")
    trials = PlanTrials([a, b, c], torch.device("cpu"), steps=2, clock=ScriptedClock(starts_of([0.1] * 12)))
    assert [trials.begin_step() for _ in range(12)] == [a, a, b, b, c, c, c, c, b, b, a, a]
    assert all(t.measured_step_s is None for t in trials.tried) and not trials.done


def test_a_drift_steady_over_the_trial_does_not_decide_it():
    """Each step 2% slower than the one before, whichever runs: b, 5% faster than a, stays,
    though a ran first (run a's three steps then b's three, a's would have measured faster:
    1.03 s against 1.04)."""
    a, b = two_plans()
    order = [a] * 3 + [b] * 6 + [a] * 3
    times = [(1.0 if plan is a else 0.95) * (1 + 0.02 * k) for k, plan in enumerate(order)]
    trials = PlanTrials([a, b], torch.device("cpu"), steps=3, clock=ScriptedClock(starts_of(times)))
    for _ in range(13):
        trials.begin_step()
    assert trials.chosen is b


def test_a_slow_first_step_alone_does_not_lose_the_trial():
    a, b = two_plans()
    times = [9.0, 0.1, 0.1] + [0.15] * 6 + [9.0, 0.1, 0.1]  # a: 9 s, then 0.1 s a step; b: 0.15 s
    trials = PlanTrials([a, b], torch.device("cpu"), steps=3, clock=ScriptedClock(starts_of(times)))
    for _ in range(13):
        trials.begin_step()
    assert trials.chosen is a


def test_a_trial_needs_two_plans_and_two_steps_each():
    plan = make_plan(rebuilding(), 11 * GiB)
    with pytest.raises(ValueError, match="1 candidate"):
        PlanTrials([plan], torch.device("cpu"))
    with pytest.raises(ValueError, match="steps=1"):
        PlanTrials([plan, plan], torch.device("cpu"), steps=1)


def test_a_plan_that_rebuilds_is_tried_against_the_best_without_rebuilds():
    cal = rebuilding()
    best = make_plan(cal, 11 * GiB)
    assert Decision.REBUILD in best.decisions
    asked = []

    def make(allowed):
        asked.append(allowed)
        return make_plan(cal, 11 * GiB, allowed=allowed)

    candidates = runners_up(best, make, DEFAULT)
    assert asked[0] == DEFAULT - {Decision.REBUILD}
    assert candidates[0] is best and len(candidates) >= 2
    assert Decision.REBUILD not in candidates[1].decisions
    assert (best.made, candidates[1].made) == ("the model's fastest", "the model's fastest without rebuilds")
    assert candidates[1].predicted_peak_bytes <= candidates[1].limit_bytes


def test_no_runner_up_where_the_plan_uses_nothing_uncertain_or_none_fits_or_it_is_far_slower():
    cal = transformer()
    kept = make_plan(cal, 40 * GiB)  # everything kept
    assert runners_up(kept, lambda allowed: pytest.fail("nothing to try"), DEFAULT) == [kept]
    best = make_plan(rebuilding(), 11 * GiB)
    assert runners_up(best, lambda allowed: None, DEFAULT) == [best]
    far = replace(best, decisions=tuple(Decision.KEEP for _ in best.decisions),
                  predicted_step_s=best.predicted_step_s * (ALTERNATIVE_WITHIN + 0.01))
    assert runners_up(best, lambda allowed: far, DEFAULT) == [best]
    assert runners_up(best, lambda allowed: best, DEFAULT) == [best]  # the same plan is not tried twice


def test_checkpointings_plan_recomputes_the_fewest_first_blocks_that_fit():
    cal = transformer(blocks=8)
    plan = checkpointing_plan(cal, 11 * GiB)
    k = plan.decisions.count(Decision.RECOMPUTE)
    assert 0 < k < 8
    assert plan.decisions == (Decision.KEEP,) + (Decision.RECOMPUTE,) * k + (Decision.KEEP,) * (9 - k)
    assert plan.made == f"checkpointing's: the first {k} blocks recomputed" and plan.to_dict()["made"] == plan.made
    assert plan.predicted_peak_bytes <= plan.limit_bytes
    one_fewer = tuple(Decision.KEEP if j == k else d for j, d in enumerate(plan.decisions))
    fewer = evaluate(cal, one_fewer, 11 * GiB)
    assert fewer.predicted_peak_bytes > fewer.limit_bytes
    assert set(checkpointing_plan(cal, 40 * GiB).decisions) == {Decision.KEEP}


def test_checkpointings_plan_counts_from_the_first_block_backward_reaches():
    """Frozen first layers (backward never reaches them, nothing is saved for them) stay as they
    are; the recomputed blocks are the first trained ones, as a user would checkpoint them."""
    cal = transformer(blocks=8)
    frozen = tuple(replace(u, recompute_s=0.0) if u.name in ("layer.0", "layer.1") else u for u in cal.units)
    cal = replace(cal, units=frozen)
    plan = checkpointing_plan(cal, 11 * GiB)
    k = plan.decisions.count(Decision.RECOMPUTE)
    assert k > 0 and plan.decisions[1:3] == (Decision.KEEP, Decision.KEEP)
    assert plan.decisions[3:3 + k] == (Decision.RECOMPUTE,) * k
    assert set(plan.decisions[3 + k:]) == {Decision.KEEP}


def test_no_checkpointing_plan_where_every_block_recomputed_does_not_fit():
    cal = transformer(blocks=8, inputs=256 * MiB)
    every = tuple(Decision.RECOMPUTE if u.kind == "block" else Decision.KEEP for u in cal.units)
    tight = evaluate(cal, every, 9 * GiB)
    assert tight.predicted_peak_bytes > tight.limit_bytes
    assert make_plan(cal, 9 * GiB).moved_bytes > 0  # a plan that moves inputs fits
    assert checkpointing_plan(cal, 9 * GiB) is None


def test_checkpointings_plan_is_tried_beside_the_best_where_keeping_and_recomputing_are_allowed():
    cal = transformer(blocks=8)
    best = make_plan(cal, 11 * GiB)
    first = replace(checkpointing_plan(cal, 11 * GiB), predicted_step_s=best.predicted_step_s * 1.1)
    assert first.decisions != best.decisions
    assert runners_up(best, lambda allowed: None, DEFAULT, first) == [best, first]
    assert runners_up(best, lambda allowed: None, DEFAULT - {Decision.RECOMPUTE}, first) == [best]
    assert runners_up(best, lambda allowed: None, DEFAULT - {Decision.KEEP}, first) == [best]
    assert runners_up(best, lambda allowed: None, DEFAULT, None) == [best]
    assert runners_up(best, lambda allowed: None, DEFAULT, best) == [best]
    far = replace(first, predicted_step_s=best.predicted_step_s * (ALTERNATIVE_WITHIN + 0.01))
    assert runners_up(best, lambda allowed: None, DEFAULT, far) == [best]


def test_a_runner_up_that_is_checkpointings_plan_too_is_tried_once_and_named_both_ways():
    cal = transformer(blocks=8)
    best = make_plan(cal, 11 * GiB)
    first = checkpointing_plan(cal, 11 * GiB)
    assert first.decisions != best.decisions
    candidates = runners_up(replace(best, decisions=best.decisions[:-1] + (Decision.REBUILD,)),
                            lambda allowed: replace(first, made="made"), DEFAULT, first)
    assert len(candidates) == 2 and candidates[1].decisions == first.decisions
    assert candidates[1].made == f"the model's fastest without rebuilds, which is {first.made}"


def test_the_planner_tries_its_runners_up_then_keeps_the_fastest(monkeypatch):
    """On the CPU every plan keeps everything; the wiring is what is tested: the candidates run
    in turn from the first planned step, the table and to_dict report them, force() ends them."""
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    made = []

    def two_candidates(best, make, allowed, checkpointing):
        assert checkpointing.decisions.count(Decision.RECOMPUTE) == 0  # 1 GiB holds the tiny model
        other = replace(best, predicted_step_s=best.predicted_step_s * 1.1)
        made.append((best, other))
        return [best, other]

    monkeypatch.setattr(director_module, "runners_up", two_candidates)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(5))
    ran = []
    for step in range(2 + 2 * STEPS_PER_CANDIDATE + 2):
        model(input_ids=ids, labels=ids).loss.backward()
        ran.append(planner.plan)
        if step == 2:
            assert "trying" not in planner.table() and "tried [" in planner.table()
    best, other = made[0]
    assert ran[:2] == [None, None]
    assert ran[2:5] == [best] * 3 and ran[5:11] == [other] * 6 and ran[11:14] == [best] * 3
    assert ran[14] is ran[15] and ran[14] in (best, other)
    trials = planner.to_dict()["trials"]
    assert [t["kept"] for t in trials].count(True) == 1
    assert all(t["measured_step_s"] > 0 for t in trials)
    planner.force("keep")
    assert "trials" not in planner.to_dict() and planner.to_dict()["plan"]["made"] == "forced"
    planner.remove()


def test_an_interval_another_inputs_step_ran_in_is_left_out():
    a, b = two_plans()
    # a: 0.1 s a step, but one interval holds another input's 5 s step; b: 0.15 s a step.
    times = [0.1, 0.1, 5.1] + [0.15] * 6 + [0.1] * 3
    follows = [True] * 3 + [False] + [True] * 9   # the mark that ends the 5.1 s interval
    trials = PlanTrials([a, b], torch.device("cpu"), steps=3, clock=ScriptedClock(starts_of(times)))
    for f in follows:
        trials.begin_step(f)
    assert [t.measured_step_s for t in trials.tried] == pytest.approx([0.1, 0.15])
    assert trials.chosen is a


@pytest.mark.parametrize("clean_b, chosen", [(True, "b"), (False, "a")])
def test_a_candidate_with_no_clean_interval_is_not_chosen_and_without_any_the_plan_stays(clean_b, chosen):
    a, b = two_plans()
    plans = {"a": a, "b": b}
    times = [1.0] * 3 + [0.1] * 6 + [1.0] * 3
    # No interval of a's follows a step of its own input; b's do where clean_b.
    follows = [True, True, False, False] + [True] + [clean_b] * 5 + [True, False, False]
    trials = PlanTrials([a, b], torch.device("cpu"), steps=3, clock=ScriptedClock(starts_of(times)))
    for f in follows:
        trials.begin_step(f)
    assert trials.tried[0].measured_step_s is None
    assert trials.chosen is plans[chosen]
    assert "not measured" in trials.summary()


def test_alternating_inputs_measure_nothing_and_each_keeps_its_plan(monkeypatch):
    model = tiny_bert(dropout=0.0).float()
    planner = BlockPlanner(model, "1GiB")
    monkeypatch.setattr(director_module, "runners_up", lambda best, make, allowed, checkpointing: [
        best, replace(best, predicted_step_s=best.predicted_step_s * 1.1)])
    generator = torch.Generator().manual_seed(6)
    for step in range(2 * (2 + 2 * STEPS_PER_CANDIDATE + 1)):
        ids = torch.randint(0, 97, (4, 16 if step % 2 else 8), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
    trials = planner.to_dict()["trials"]
    assert [t["measured_step_s"] for t in trials] == [None, None]
    assert [t["kept"] for t in trials] == [True, False]
    planner.remove()
