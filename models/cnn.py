"""VGG19 and ResNet-50 (not yet written)."""


def workloads():
  return []
