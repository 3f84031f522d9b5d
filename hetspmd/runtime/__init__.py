"""The runtime: parallelize / ParallelStep, call binding and the Flax adapter."""
