"""Pure reuse decisions: the reuse planner and P/D placement."""
