"""Per-device step cost: FLOPs and bytes per primitive, fusion, and the :class:`StepProfile` the planner prices plans with."""
