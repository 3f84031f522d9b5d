"""The group programs' runner: a :class:`~hetspmd.plan.groups.GroupPlan` run for the front
(:class:`~hetspmd.runtime.step.ParallelStep`) by :class:`~hetspmd.runtime.grouped.GroupedStep`, which places,
calls and explains the programs; this module binds a call's arguments to it, as the single program's runner
binds them to its one program."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd.errors import HetSpmdError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.groups import GroupPlan
from hetspmd.runtime.binding import Arguments
from hetspmd.runtime.grouped import GroupedStep
from hetspmd.runtime.placement import GroupedBatch, check_live, global_abstract
from hetspmd.runtime.runner import Trace, priced_here


@dataclasses.dataclass
class GroupRunner:
  """A group plan run for ``front``: ``runtime`` holds its programs."""

  front: Any
  runtime: GroupedStep
  grouped = True

  @classmethod
  def of(cls, front: Any, plan: GroupPlan, runtime: GroupedStep | None = None) -> "GroupRunner":
    """``runtime``: the plan's, already built by the search's probe; else made here."""
    clock = front.rebalancer.group_clock if front.rebalancer is not None else None
    runtime = runtime or GroupedStep.across_processes(front.fn, plan, batch_stats=front.batch_stats,
                                                      donate_state=front.donate_state)
    runtime.clock = clock
    return cls(front, runtime)

  @property
  def plan(self) -> GroupPlan:
    return self.runtime.plan

  @property
  def program_count(self) -> int:
    return self.runtime.program_count

  @property
  def _programs(self) -> dict:
    """The built programs (shared with the runners that adopted them: :meth:`adopt`)."""
    return self.runtime._built

  def adopt(self, other: "GroupRunner") -> bool:
    """Run ``other``'s programs where they run this plan (:meth:`GroupedStep.adopt`)."""
    return self.runtime.adopt(other.runtime)

  # --- placing ------------------------------------------------------------------

  def check_state(self, state: Any) -> None:
    """Each group's programs check the state they are built for."""

  def placed_objects(self, state: Any) -> Any:
    return state  # the first call places them

  def shard_state(self, state: Any) -> Any:
    if self.runtime.execution.hybrid:  # split before the first call where example_batch tells which leaves
      self._trace_for_state(state)
    return self.runtime.shard_state(state)

  def state_shardings(self, state: Any) -> Any:
    """Under state shares, or a hybrid plan, the layout comes from the step's trace (which leaves are optimizer
    state, which are held split): of its first call, or of ``example_batch`` for a ``step(state, batch)``."""
    self._trace_for_state(state)
    return self.runtime.state_shardings(state)

  def shard_batch(self, batch: Any) -> GroupedBatch:
    """The groups' microbatch buffers and the tail's, for the step's one batch argument."""
    return self.runtime.shard_batch((batch,))

  def batch_sizes(self) -> set[int]:
    return {len(self.process_examples())}

  def process_examples(self) -> np.ndarray:
    return self.runtime.process_examples()

  def _trace_for_state(self, state: Any) -> None:
    """The step traced on ``example_batch``, where the state's layout comes from the trace and there is none yet."""
    front, plan = self.front, self.plan
    if ((plan.state_shares or self.runtime.execution.hybrid) and front.example_batch is not None and not self.runtime.traced
        and front.batch_argnums in (None, (1,))):
      self._trace_groups(state)

  def _trace_groups(self, state: Any) -> None:
    """The group programs built from ``example_batch`` at the global batch, the step called as
    ``step(state, batch)``: which state leaves are optimizer state, and so where each one is held."""
    trace = self.front.example_trace()
    try:
      self.runtime.prepare(trace.f, state, global_abstract(trace.batch, self.plan.global_batch), trace.rest,
                           static=trace.static)
    except HetSpmdError:
      raise
    except TypeError as e:
      if jx.is_concreteness_error(e):
        raise
      raise HetSpmdError(f"example_batch traces the step as step(state, batch), which this step is not ({e}): call "
                         "the step once first, then ask for state_shardings") from None

  # --- running ------------------------------------------------------------------

  def call(self, args: tuple, kwargs: dict) -> Any:
    """One step: the step as ``f(state, batch, rest, kwargs)``, with the batch arguments (or the one placed by
    :meth:`shard_batch`)."""
    from flax import nnx

    front = self.front
    parts = Arguments.of(front, args)
    check_live(parts.state, parts.batch)
    placed = len(parts.batch) == 1 and isinstance(parts.batch[0], GroupedBatch)
    trace = Trace.of(front, parts.function(front.fn, len(args)), parts.batch, (parts.rest, kwargs), parts.graphdef)
    out = self.runtime.run(trace.f, parts.state, parts.batch[0] if placed else parts.batch, trace.rest,
                           graphdef=parts.graphdef, static=trace.static)
    if parts.graph_args:
      new_state, out = out
      nnx.update(tuple(args[i] for i in parts.graph_args), new_state)
    return out

  def prepared(self, args: tuple, kwargs: dict) -> Callable[[], None]:
    """A call that runs the group programs once on the call's arguments and waits for them, for timing the plan
    whole (:mod:`hetspmd.runtime.verifying`): on a copy of the state (never the caller's own buffers), each call
    taking the new state the call before made, as a training loop feeds it; the batch placed once; nothing
    written back, and no group clock reads it. Nothing runs here (the first call builds the programs)."""
    front = self.front
    parts = Arguments.of(front, args)
    trace = Trace.of(front, parts.function(front.fn, len(args)), parts.batch, (parts.rest, kwargs), parts.graphdef)
    placed = self.runtime.shard_batch(parts.batch)
    copy = lambda: jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, parts.state)
    structure, held = jax.tree.structure(parts.state), [copy()]

    def fed() -> None:
      clock, self.runtime.clock = self.runtime.clock, None
      try:
        out = self.runtime.run(trace.f, held[0], placed, trace.rest, graphdef=parts.graphdef, static=trace.static)
      finally:
        self.runtime.clock = clock
      returned = isinstance(out, tuple) and out and (parts.graph_args or jax.tree.structure(out[0]) == structure)
      if returned:
        held[0] = out[0]
      elif any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(held[0])):
        held[0] = copy()  # donated with no new state handed back: a fresh copy, timed with the call
      jax.block_until_ready(out)

    return fed

  def lower(self, args: tuple, kwargs: dict) -> Any:
    raise HetSpmdError("under a group plan the step runs as several programs (one per group, the exchange, the "
                       "updates): there is no one program to lower; step.explain() describes them and "
                       "step.memory_analysis() measures each")

  def needed_bytes(self, args: tuple, kwargs: dict) -> dict[Any, int]:
    """Per device of this process the plan runs on, the search's priced peak bytes (the plan's
    ``predicted_per_device`` ``memory_bytes``; none where it has no price: its programs are built by their
    first call, so XLA cannot say before it)."""
    return priced_here([d for g in self.plan.groups for d in g.devices],
                       dict(self.plan.predicted_per_device).get("memory_bytes"))

  def memory_analysis(self) -> dict[str, Any]:
    return self.runtime.memory_analysis()

  def explain(self, notes: list[str]) -> str:
    return "\n".join([self.runtime.explain()] + notes)
