"""Vision Transformers (not yet written)."""


def workloads():
  return []
