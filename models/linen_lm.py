"""A Flax Linen decoder LM (not yet written)."""


def workloads():
  return []
