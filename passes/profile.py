"""``profile_step``: a step function → its :class:`~hetspmd.passes.costing.step_cost.StepProfile`.

The step is traced at two batch sizes (:data:`PROFILE_BATCHES`); the per-node
costs are fitted as linear in the batch, and the tensor-parallel strategy
spaces of the model-axis sizes the search tries (:data:`MODEL_SIZES`) are built
once, for every search over the profile to reuse.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hetspmd.errors import HetSpmdError
from hetspmd.passes.costing import step_cost
from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.passes.frontend.tracing import trace
from hetspmd.passes.sharding import strategies


MODEL_SIZES = (2, 4, 8)       # model-axis sizes whose strategy spaces profile_step prepares


PROFILE_BATCHES = (2, 4)


def with_batch(batch: Any, size: int) -> Any:
  """``batch`` as ``ShapeDtypeStruct``s with ``size`` examples (every leaf's leading axis)."""
  def resize(x):
    shape = tuple(np.shape(x))
    if not shape:
      raise HetSpmdError("every batch leaf needs a leading batch axis; got a scalar")
    return jax.ShapeDtypeStruct((size,) + shape[1:], x.dtype)

  return jax.tree.map(resize, batch)


def profile_step(fn: Callable[..., Any], state: Any, batch: Any) -> StepProfile:
  """Traces ``fn(state, batch)`` at two batch sizes, fits the per-node costs, prepares the strategy spaces."""
  small, large = PROFILE_BATCHES
  graphs = [trace(fn, state, with_batch(batch, b)) for b in PROFILE_BATCHES]
  return with_strategy_spaces(step_cost.step_profile(graphs[0], graphs[1], small, large))


def with_strategy_spaces(profile: StepProfile, sizes: Sequence[int] = MODEL_SIZES) -> StepProfile:
  """``profile`` with the tensor-parallel strategy spaces of ``sizes`` built (the search reuses them)."""
  spaces = {m: strategies.strategy_space(profile, m) for m in sizes}
  return dataclasses.replace(profile, strategy_spaces={**profile.strategy_spaces, **spaces})
