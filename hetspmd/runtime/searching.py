"""``plan="search"`` for a parallelized step: the step profiled on its batch, searched, and its plan made.

:func:`searched_plan` profiles the step (:func:`hetspmd.passes.profile.profile_step`), runs the search
(:func:`hetspmd.planner.ranking.search`) with what the step allows (remat ``"none"`` and ``"layers"`` for any
step, the loss-checkpointing policies too where it uses ``hetspmd.value_and_grad``, exact batch statistics' extra forward work, a fused overlapped pass only without
per-microbatch statistics), and turns the best into a runnable plan: a single program, or a group plan whose
programs are built before anything is placed (a group plan that does not run the step falls back to the single
program, and says why).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd import lowering
from hetspmd._dtypes import traced_dtype
from hetspmd.autodiff import recording_calls
from hetspmd.errors import HetSpmdError, TraceError
from hetspmd.hardware.cluster import Cluster
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.passes.profile import PROFILE_BATCHES, profile_step, with_batch
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, STEP_REMAT_POLICIES
from hetspmd.plan.state_layout import auto_state_specs
from hetspmd.planner.building import plan_from
from hetspmd.planner.grouping import to_group_plan
from hetspmd.planner.ranking import (GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN, SEARCHED_REMAT, chosen_group_plan,
                                     search, searches_group_plans)
from hetspmd.runtime.grouped import GroupedStep


@dataclasses.dataclass(frozen=True)
class Searched:
  """The search's plan for a step: the plan, a group plan's runtime (its programs built), and why the plan is or
  is not a group plan (for ``explain()``)."""

  plan: Any
  runtime: Any = None
  note: str = ""


def searched_plan(step: Any, cluster: Cluster, state: Any, trace: Any) -> Searched:
  """The search's best plan for ``step`` (a ``ParallelStep``) traced as ``trace`` (a :class:`~hetspmd.runtime.runner.Trace`: the
  step as ``f(state, batch, rest, kwargs)``, the batch it is called with), and for a group plan its runtime (its
  programs built: the plan is final before anything is placed on its devices)."""
  fn, batch = trace.state_batch(), trace.batch
  considered = searches_group_plans(cluster, step.specs, jax.process_count())
  with recording_calls() as calls:  # the loss-checkpointing policies are applied by hetspmd.value_and_grad only
    profile = step_traced(lambda: profile_step(fn, state, batch), batch)
  result = search(cluster, profile, step.global_batch, top=1,
                  remat_policies=SEARCHED_REMAT if calls else STEP_REMAT_POLICIES,
                  recompute=_recompute(step.batch_stats, fn, state, batch),
                  grad_reduce_dtypes=(GRAD_REDUCE_DTYPES if step.grad_reduce_dtype == "search"
                                      else (step.grad_reduce_dtype,)),
                  fuse_overlap=not _per_microbatch_statistics(step.batch_stats, fn, state, batch),
                  groups=step.group_plans and considered)
  plan = plan_from(result.plans[0], cluster, state, result.ideal_throughput)
  if step.specs:
    chosen = auto_state_specs(state, plan.axis_names, plan.mesh_shape, plan.zero_stage, specs=step.specs,
                              model_specs=dict(plan.state_specs), zero_shards=plan.zero_shards)
    plan = plan.replace(state_specs=chosen)
  grouped = chosen_group_plan(result, GROUP_PLAN_MARGIN)
  note = _group_verdict(step.group_plans, cluster, result, grouped is not None, considered)
  if grouped is None:
    return Searched(plan, None, note)
  runtime = GroupedStep.across_processes(step.fn, to_group_plan(cluster, grouped, result.ideal_throughput),
                                         batch_stats=step.batch_stats, donate_state=step.donate_state)
  try:  # a step group programs do not run (a loop reading optimizer state in shares) runs as one program
    runtime.prepare(trace.f, state, global_abstract(trace.batch, step.global_batch), trace.rest,
                    graphdef=trace.graphdef, static=trace.static)
  except HetSpmdError as e:
    return Searched(plan, None, f"the search's group plan does not run this step, so it runs as one program: {e}")
  return Searched(runtime.plan, runtime, note)


def global_abstract(batch: Any, global_batch: int) -> Any:
  """``batch``'s arrays as abstract values leading with ``global_batch``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct((global_batch,) + tuple(np.shape(x)[1:]), traced_dtype(x)),
                      batch)


def _group_verdict(group_plans: bool, cluster: Cluster, result: Any, chosen: bool, considered: bool) -> str:
  """Why the search's plan is, or is not, a group plan."""
  if result.group_plan is not None:
    ratio = result.group_plan.throughput / result.plans[0].throughput
    return (f"chosen by the search: priced {ratio:.2f}x the best single program" if chosen else
            f"the best group plan was priced {ratio:.2f}x this plan") + (
                f" (group plans run at {GROUP_PLAN_MARGIN:.2f}x or more)")
  if group_plans and not considered and len(cluster.kinds) > 1:
    return f"group plans were not priced: the search prices them {GROUP_PLAN_CONDITIONS}"
  return ""


def _recompute(batch_stats: str, fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> float:
  """With exact batch statistics, the extra forward work of their loops (1.0 otherwise)."""
  if batch_stats != "exact":
    return 1.0
  analysis, inputs = _profile_analysis(fn, state, batch, "exact")
  return lowering.recompute_factor(analysis, inputs)


def _per_microbatch_statistics(batch_stats: str, fn: Callable[[Any, Any], Any], state: Any, batch: Any) -> bool:
  """Whether the step normalises by statistics of each microbatch (BatchNorm, ``batch_stats="local"``),
  which a fused overlapped pass would compute over several microbatches at once."""
  if batch_stats != "local":
    return False
  analysis, _ = _profile_analysis(fn, state, batch, "local")
  return any(c.local for c in analysis.cuts)


def step_traced(run: Callable[[], Any], batch: Any, leading: int = 1, global_batch: int | None = None) -> Any:
  """``run()``, which traces the user's step on ``batch``. A ``TypeError`` there (JAX's for operands of other
  shapes or dtypes: a batch that is not what the step expects) becomes a :class:`TraceError` (a ``TypeError``
  too) that shows the batch as the step saw it, the step's own error chained; any other error the step raises
  stays its own, with that batch added as a note. ``leading``: the batch's leading axes that stand for
  ``global_batch`` examples (2 for placed microbatch buffers)."""
  try:
    return run()
  except HetSpmdError:
    raise
  except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
    def shape(x):
      dims = tuple(np.shape(x)[leading:]) if global_batch else tuple(np.shape(x))
      return f"{np.dtype(traced_dtype(x)).name}{list(((global_batch,) if global_batch else ()) + dims)}"
    shown = jax.tree.map(shape, batch)
    shown = shown[0] if isinstance(shown, tuple) and len(shown) == 1 else shown  # one batch argument
    where = f"when traced on the batch {shown}"
    advice = ("Check the batch's keys and shapes (and example_batch's, for plan='search') against what the step "
              "reads, and the state against what it was made from")
    if not isinstance(e, TypeError):
      e.add_note(f"hetspmd: the step raised this {where}. {advice}")
      raise
    raise TraceError(f"the step raised {type(e).__name__} {where}: {str(e).rstrip('.')}. {advice}") from e


def _profile_analysis(fn: Callable[[Any, Any], Any], state: Any, batch: Any, batch_stats: str):
  """The microbatch analysis of ``fn`` traced at the profile's batch size, and its batch inputs."""
  size = PROFILE_BATCHES[-1]
  closed = jx.make_closed_jaxpr(fn, jx.to_abstract(state), with_batch(batch, size))
  leaves = jax.tree.leaves(state)
  inputs = range(len(leaves), len(leaves) + len(jax.tree.leaves(batch)))
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(traced_dtype(x), jnp.floating)]  # statistics live here
  return analyse(closed, inputs, size, batch_stats=batch_stats, float_state_inputs=floats), inputs
