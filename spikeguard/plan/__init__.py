"""Planning: operator catalogue, cost model, forecast and the planner every stage calls."""
