"""Tensor-parallel sharding: per-primitive propagation, strategy spaces over the ``model`` axis, the ILP that picks them."""
