"""Lowering: a Plan and a step's microbatch analysis → one jitted SPMD program (weighted loop or lockstep stages)."""
