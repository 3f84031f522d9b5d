"""The front end: a step function → its jaxpr → the :class:`~hetspmd.passes.ir.Graph` (roles, layers, the layer stack)."""
