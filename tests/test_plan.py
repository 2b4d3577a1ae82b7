"""The scheduler's planning on synthetic and recorded traces (CPU only)."""
import pytest
import torch

from um_alloc.scheduler import PlanError, Trace, TraceRecorder, auto_window, make_plan
from um_alloc.scheduler.plan import SWAP_IN, SWAP_OUT, WAIT_OUT, check_plan
from um_alloc.scheduler.trace import Function, Variable

MiB = 1 << 20


def chain(layers: int, act: int = 8 * MiB, param: int = 2 * MiB) -> Trace:
    """Forward f_1..f_n, each reading the previous activation and making one; backward in reverse.

    Variables: params 0..n-1, activations n..2n (activation n is the input)."""
    variables = {i: Variable(i, param, "parameter") for i in range(layers)}
    variables.update({layers + i: Variable(layers + i, act) for i in range(layers + 1)})
    functions = [Function(f"forward:{i}", (i, layers + i, layers + i + 1)) for i in range(layers)]
    functions += [Function(f"backward:{i}", (i, layers + i, layers + i + 1)) for i in reversed(range(layers))]
    return Trace(functions, variables)


def simulate_peak(trace: Trace) -> int:
    return make_plan(trace, budget=1 << 50, window=1 << 40).peak_bytes


def ops(plan, kind):
    return [op for lists in (plan.before, plan.after) for ops_ in lists for op in ops_ if op.kind == kind]


def test_a_budget_that_holds_everything_needs_no_swaps():
    trace = chain(8)
    plan = make_plan(trace, budget=simulate_peak(trace), window=16 * MiB)
    assert ops(plan, SWAP_OUT) == [] and ops(plan, SWAP_IN) == []


def test_tight_budget_is_respected_and_every_swap_out_comes_back():
    trace = chain(16)
    budget = simulate_peak(trace) // 3
    plan = make_plan(trace, budget=budget, window=24 * MiB)
    assert plan.peak_bytes <= budget
    outs, ins = {op.var for op in ops(plan, SWAP_OUT)}, {op.var for op in ops(plan, SWAP_IN)}
    assert outs and ins <= outs  # only what went out comes back
    assert plan.swap_in_bytes <= plan.swap_out_bytes
    check_plan(trace, plan)  # the independent replay agrees


def test_dead_variables_are_freed_not_swapped():
    # the last backward function's variables are never used again: no swap-out after it
    trace = chain(6)
    plan = make_plan(trace, budget=simulate_peak(trace) // 2, window=16 * MiB)
    assert plan.after[-1] == []
    # a variable used exactly once is never swapped out
    once = Trace([Function("f0", (0,)), Function("f1", (1,))], {0: Variable(0, 64 * MiB), 1: Variable(1, 64 * MiB)})
    assert ops(make_plan(once, budget=64 * MiB, window=MiB), SWAP_OUT) == []


def test_variables_needed_inside_the_window_stay():
    trace = chain(8)
    wide = make_plan(trace, budget=simulate_peak(trace), window=1 << 40)
    assert ops(wide, SWAP_OUT) == []  # the whole step is one window: nothing leaves


def test_small_variables_are_not_swapped():
    trace = chain(12, act=8 * MiB, param=2 * MiB)
    plan = make_plan(trace, budget=simulate_peak(trace) // 2, window=24 * MiB, min_swap_size=4 * MiB)
    assert all(trace.variables[op.var].tag != "parameter" for op in ops(plan, SWAP_OUT))


def test_infeasible_budget_names_the_function_and_the_bytes():
    trace = chain(4)
    with pytest.raises(PlanError, match=r"function 0 \(forward:0\) would run with \d+ bytes.*budget of 4194304"):
        make_plan(trace, budget=4 * MiB, window=MiB)


def test_wait_outs_precede_the_swap_ins_that_need_the_room():
    trace = chain(16)
    plan = make_plan(trace, budget=simulate_peak(trace) // 3, window=24 * MiB)
    waited = set()
    for before in plan.before:
        for op in before:
            if op.kind == WAIT_OUT:
                waited.add(op.var)
            if op.kind == SWAP_IN:
                assert op.var in waited  # a swap-in follows its own swap-out's completion


def test_auto_window_follows_the_link_and_stays_in_bounds():
    trace = chain(16)
    trace.compute_s = 0.1
    budget = simulate_peak(trace) // 2
    slow, fast = auto_window(trace, budget, 1e9), auto_window(trace, budget, 50e9)
    largest = max(sum(trace.variables[v].bytes for v in set(f.uses)) for f in trace.functions)
    assert largest <= fast <= slow <= budget // 2
    assert auto_window(Trace(trace.functions, trace.variables), budget) == max(largest, budget // 8)
    make_plan(trace, budget, "auto", link_bytes_per_s=20e9)  # and the plan it gives is valid


def test_trace_round_trips_through_json(tmp_path):
    trace = chain(3)
    trace.compute_s = 0.25
    trace.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert again.functions == trace.functions and again.variables == trace.variables
    assert again.compute_s == 0.25


def test_bad_traces_and_arguments_are_refused():
    bad = Trace([Function("f", (0, 7))], {0: Variable(0, 10)})
    with pytest.raises(ValueError, match="unknown variables \\[7\\]"):
        make_plan(bad, budget=100)
    with pytest.raises(ValueError, match="budget must be > 0"):
        make_plan(chain(2), budget=0)
    with pytest.raises(ValueError, match="window must be 'auto' or a size"):
        make_plan(chain(2), budget=1 << 30, window="big")


def test_recorder_traces_a_real_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    x = torch.randn(16, 32)
    with TraceRecorder(model) as recorder:
        model(x).square().mean().backward()
    trace = recorder.trace
    names = [f.name for f in trace.functions]
    assert names[:3] == ["forward:0", "forward:1", "forward:2"]
    assert {"backward:0", "backward:2"} <= set(names[3:])
    first_linear = trace.functions[0]
    weight_bytes = 64 * 32 * 4
    assert any(trace.variables[v].bytes == weight_bytes for v in first_linear.uses)
    # the saved activations of forward are used again in backward
    fwd_vars = {v for f in trace.functions[:3] for v in f.uses}
    bwd_vars = {v for f in trace.functions[3:] for v in f.uses}
    assert fwd_vars & bwd_vars
    make_plan(trace, budget=simulate_peak(trace), window=4096)  # plannable as recorded
