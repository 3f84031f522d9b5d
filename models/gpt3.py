"""GPT-3-style decoders (not yet written)."""


def workloads():
  return []
