"""The block planner: under a GPU budget, keep, recompute or move each block's activations.

record (record.py: a measured step, as plain data) → plan (planning.py: a decision per unit, the
fastest within the budget) → replay (replay.py: module hooks carry the decisions out), over the
units blocks.py finds; director.py ties them to a model.
"""
from .blocks import Unit, block_modules, find_units
from .director import STRATEGIES, BlockPlanner, plan, planner_of
from .planning import Calibration, Decision, Plan, PlanInfeasible, Segment, UnitCost, evaluate, make_plan

__all__ = ["BlockPlanner", "plan", "planner_of", "STRATEGIES", "Decision", "Plan", "PlanInfeasible", "Calibration",
           "UnitCost", "Segment", "make_plan", "evaluate", "Unit", "find_units", "block_modules"]
