"""The planner: data-axis communication and memory, candidate pricing, ranking against the baselines, stage search, plan building."""
