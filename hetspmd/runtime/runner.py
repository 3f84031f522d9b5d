"""What a plan form's runner does for the front (:class:`~hetspmd.runtime.step.ParallelStep`).

``parallelize`` binds a call and resolves the plan; from there one runner per
plan form does the rest through the one interface below, as every optax
transform is the same pair of functions: the single program
(:class:`~hetspmd.runtime.single.SingleRunner`) and the group programs
(:class:`~hetspmd.runtime.group_runner.GroupRunner`). The front picks one
from a table keyed by the plan's type (``step.RUNNERS``), nowhere else.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, Sequence

import jax

from hetspmd.runtime.binding import static_bound


def priced_here(ids: Sequence[int], priced: Sequence[float] | None) -> dict[Any, int]:
  """Per device of this process among ``ids`` (JAX ids, in the plan's order), its priced bytes: ``priced`` holds
  one value per run of ``len(ids) // len(priced)`` consecutive devices (a device's, or a data position's); empty
  where the plan has no price or the two do not line up."""
  if not priced or len(ids) % len(priced):
    return {}
  mine, each = {d.id: d for d in jax.local_devices()}, len(ids) // len(priced)
  return {mine[i]: int(priced[k // each]) for k, i in enumerate(ids) if i in mine}


@dataclasses.dataclass(frozen=True)
class Trace:
  """What a plan is made from: the step as ``f(state, batch, rest, kwargs)``
  (:func:`~hetspmd.runtime.binding.positional_function`), one call's batch arguments (a tuple) and the rest
  (``(rest, kwargs)``); ``graphdef``: the NNX objects' whose state the state is."""

  f: Callable[..., Any]
  batch: tuple
  rest: tuple
  graphdef: Any = None
  static: Any = ()  # a key for the values bound into f

  @classmethod
  def of(cls, front: Any, f: Callable[..., Any], batch: tuple, rest: tuple, graphdef: Any = None) -> "Trace":
    """``f`` as ``front`` traces it, the leaves of ``rest`` that are not arrays (a config, a schedule) bound into
    it first (:func:`~hetspmd.runtime.binding.static_bound`), as the single program binds them."""
    f, rest, static = static_bound(f, rest)
    return cls(front.traced(f), batch, rest, graphdef, static)

  def state_batch(self) -> Callable[[Any, Any], Any]:
    """The step as ``f(state, batch)`` for the search's profile, ``batch`` the tuple of batch arguments."""
    return lambda state, batch: self.f(state, batch, *self.rest)


class Runner(Protocol):
  """One plan form's runtime, bound to its front (the :class:`~hetspmd.runtime.step.ParallelStep`, which holds
  the step, its options and how it traces) and to the plan it runs."""

  plan: Any
  grouped: bool  # what it reports; the front never branches on it

  def check_state(self, state: Any) -> None:
    """Refuses a state the plan was not made for (before any placement)."""

  def placed_objects(self, state: Any) -> Any:
    """NNX objects' state where the first call leaves it, as ``nnx.jit`` would."""

  def shard_state(self, state: Any) -> Any:
    """``state`` placed on the plan's devices."""

  def state_shardings(self, state: Any) -> Any:
    """Where the state lives between steps (to restore a checkpoint into)."""

  def shard_batch(self, batch: Any) -> Any:
    """The step's batch argument placed ahead of the step: what the step takes in the batch's place (the single
    program also takes a tuple of several batch arguments, as a call binds them)."""

  def batch_sizes(self) -> set[int]:
    """The leading sizes this process's batch arguments may have."""

  def process_examples(self) -> Any:
    """The global batch's examples this process feeds, in the order it feeds them (an integer array)."""

  def call(self, args: tuple, kwargs: dict) -> Any:
    """One step on a call's arguments (``nnx.cached_partial``'s objects first, static ones marked)."""

  def lower(self, args: tuple, kwargs: dict) -> Any:
    """The ``jax.stages.Lowered`` program of these arguments, where the form has one program."""

  def explain(self, notes: list[str]) -> str:
    """The plan, how it runs and the front's ``notes`` (lines), in words."""

  def memory_analysis(self) -> dict[str, Any]:
    """Each program of the last call, by name, and XLA's ``Compiled.memory_analysis()`` of it."""

  def needed_bytes(self, args: tuple, kwargs: dict) -> dict[Any, int]:
    """Per device of this process, the bytes a step on these arguments takes (empty where not known before it
    runs)."""

