"""BERT and BERT-MoE (not yet written)."""


def workloads():
  return []
