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
import hashlib
import json
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from hetspmd import lowering
from hetspmd._dtypes import traced_dtype
from hetspmd.autodiff import recording_calls
from hetspmd.errors import HetSpmdError, PlanDoesNotFitError, TraceError
from hetspmd.hardware.cluster import Cluster
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.passes.profile import profile_step, step_fingerprint
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, STEP_REMAT_POLICIES
from hetspmd.plan.groups import GroupPlan
from hetspmd.plan.state_layout import auto_state_specs, group_conflict, group_model_dims
from hetspmd.planner.building import plan_from
from hetspmd.planner.group_execution import holds_every_process, process_of
from hetspmd.planner.grouping import to_group_plan
from hetspmd.planner.pricing import Evaluated
from hetspmd.planner.ranking import (GROUP_PLAN_CONDITIONS, GROUP_PLAN_MARGIN, SEARCHED_REMAT, SearchResult,
                                     group_plan_alone, ideal_throughput, search,
                                     searches_group_plans)
from hetspmd.planner.stages import search_stages
from hetspmd.runtime.grouped import GroupedStep
from hetspmd.runtime.placement import global_abstract


@dataclasses.dataclass(frozen=True)
class Searched:
  """The search's plan for a step: the plan, a group plan's runtime (its programs built), and why the plan is or
  is not a group plan (for ``explain()``)."""

  plan: Any
  runtime: Any = None
  note: str = ""
  runners_up: tuple = ()  # the next ranked single programs' runnable plans, best first (``top`` > 1)


@dataclasses.dataclass(frozen=True)
class Priced:
  """What the search priced for a traced step, and which of it ``parallelize(plan="search")`` runs.

  ``result``: the ranked single programs, baselines and (where priced) the homogeneous equivalent and best group
  plan; None where no single program fits, and then ``group_plan`` is the best group plan alone.
  ``choice``: the plan ``parallelize(plan="search")`` runs on this pool from ``processes`` processes (the best
  single program, or the group plan where it is priced :data:`GROUP_PLAN_MARGIN` times ahead and group plans
  run there); None where it runs none (no single program fits, and group plans do not run there). ``note``: why
  the choice is, or is not, a group plan. ``remat_policies``: the policies priced (the step's remat rule)."""

  result: SearchResult | None
  group_plan: Evaluated | None
  stage_plans: tuple
  choice: Evaluated | None
  note: str
  processes: int
  remat_policies: tuple[str, ...]
  ideal_throughput: float
  trace_seconds: float
  error: str = ""  # why no single program fits, where none does

  @property
  def grouped(self) -> bool:
    """Whether the choice is the group plan."""
    return self.choice is not None and self.choice is self.group_plan


def price_step(step: Any, cluster: Cluster, state: Any, trace: Any, *, processes: int, top: int = 1,
               every_form: bool = False, overlap: bool = True,
               progress: Callable[[str], None] | None = None) -> Priced:
  """The search over ``step`` (a ``ParallelStep``: its options) traced as ``trace`` on ``state``, and its choice
  for a pool run from ``processes`` processes. ``parallelize(plan="search")`` prices what it may run: the
  single programs, and group plans where they run (:func:`searches_group_plans`). ``every_form``
  (``hetspmd.search``, ``hetspmd search``): group plans, the homogeneous equivalent and stage plans too, the
  choice made by the same rule."""
  fn, batch = trace.state_batch(), trace.batch
  if cluster.calibration is not None:  # measured on this step, not another
    cluster.calibration.check_step(step_traced(lambda: step_fingerprint(fn, state, batch), batch))
  # hetspmd.search prices a pool as parallelize would run it: bound to JAX's devices there
  considered = searches_group_plans(step.specs, cluster.jax_device_ids is not None or every_form)
  runs_groups = step.group_plans and considered
  say = progress or (lambda message: None)
  say("tracing the step at two batch sizes")
  start = time.perf_counter()
  with recording_calls() as calls:  # the loss-checkpointing policies are applied by hetspmd.value_and_grad only
    profile = step_traced(lambda: profile_step(fn, state, batch), batch)
  traced = time.perf_counter() - start
  policies = SEARCHED_REMAT if calls else STEP_REMAT_POLICIES
  dtypes = GRAD_REDUCE_DTYPES if step.grad_reduce_dtype == "search" else (step.grad_reduce_dtype,)
  groups = runs_groups or every_form
  ideal = ideal_throughput(cluster, profile, step.global_batch)
  whole = device_processes(cluster) if processes > 1 else None  # a job's processes all run: the choice holds each
  covers = lambda e: whole is None or holds_every_process(e.device_positions, whole)
  options = dict(remat_policies=policies, grad_reduce_dtypes=dtypes, overlap=overlap,
                 recompute=_recompute(step.batch_stats, profile, state, batch),
                 fuse_overlap=not _per_microbatch_statistics(step.batch_stats, profile, state, batch))
  try:  # a bound pool's ranking holds only plans its running processes can run; a described pool's, every plan
    result = search(cluster, profile, step.global_batch, top=top, progress=progress, homogeneous=every_form,
                    groups=groups, every_process=whole if cluster.jax_device_ids is not None else None, **options)
  except PlanDoesNotFitError as e:
    alone = group_plan_alone(cluster, profile, step.global_batch, remat_policies=policies, grad_reduce_dtypes=dtypes,
                             progress=progress, recompute=options["recompute"],
                             every_process=whole if cluster.jax_device_ids is not None else None) if groups else None
    if alone is None:
      raise
    runs = runs_groups and covers(alone)
    note = ("no single program fits, so the group plan runs" if runs else
            "no single program fits; the group plan fits, but it leaves a process without devices" if runs_groups
            else f"no single program fits; the group plan fits, but the search runs group plans {GROUP_PLAN_CONDITIONS}")
    return Priced(None, alone, (), alone if runs else None, note, processes, policies, ideal, traced, str(e))
  stages = tuple(search_stages(cluster, profile, step.global_batch, top=3, grad_reduce_dtypes=dtypes,
                               progress=progress)) if every_form else ()
  best = next((p for p in result.plans if covers(p)), None) or _covering(cluster, profile, step.global_batch,
                                                                          whole, options)
  group = result.group_plan if result.group_plan is not None and covers(result.group_plan) else None
  grouped = (group if runs_groups and group is not None and (
      best is None or group.throughput >= GROUP_PLAN_MARGIN * best.throughput) else None)
  note = _group_verdict(step.group_plans, cluster, result, best, grouped is not None, considered,
                        conflict=group_conflict(step.specs))
  if best is not result.plans[0] and best is not None:
    faster = best.step_seconds / result.plans[0].step_seconds
    note = ("the best plan" + (f" ({faster:.2f}x this one's speed)" if faster >= 1.005 else "")
            + f" leaves a process without devices; from {processes} processes the best that gives each some runs"
            + (f"; {note}" if note else ""))
  return Priced(result, result.group_plan, stages, grouped or best, note, processes, policies,
                result.ideal_throughput, traced,
                "" if grouped or best else "no plan that fits gives every one of the job's processes devices")


def device_processes(cluster: Cluster) -> tuple[int, ...]:
  """Each device's process, by cluster position: JAX's where the cluster is bound to its devices, else as the
  cluster describes them (:func:`~hetspmd.planner.group_execution.process_of`)."""
  if cluster.jax_device_ids is None:
    return process_of(cluster)
  index = {d.id: d.process_index for d in jax.devices()}
  return tuple(index.get(i, 0) for i in cluster.jax_device_ids)


def _covering(cluster: Cluster, profile: Any, global_batch: int, whole: Any, options: dict) -> Any:
  """The best single program that gives every process devices (None where none fits)."""
  try:
    return search(cluster, profile, global_batch, top=1, every_process=whole, **options).plans[0]
  except PlanDoesNotFitError:
    return None


def searched_plan(step: Any, cluster: Cluster, state: Any, trace: Any, top: int = 1) -> Searched:
  """The search's best plan for ``step`` (a ``ParallelStep``) traced as ``trace`` (a :class:`~hetspmd.runtime.runner.Trace`: the
  step as ``f(state, batch, rest, kwargs)``, the batch it is called with), and for a group plan its runtime (its
  programs built: the plan is final before anything is placed on its devices). Across processes, every process
  must have found the same plan (the same pool, step and batch shapes): one that did not is refused here rather
  than left to wait in a collective the others never run. ``top``: single programs ranked (the choice's
  runners-up, for :mod:`hetspmd.runtime.verifying`)."""
  searched = _searched_plan(step, cluster, state, trace, top)
  if jax.process_count() > 1:
    check_same_plan(searched.plan, *searched.runners_up)  # the runners-up too: a verification times them
  return searched


def check_same_plan(*plans: Any) -> None:
  """Refuses plans that not every process holds (compared by a digest of their JSON, gathered from each)."""
  text = json.dumps([plan.to_json() for plan in plans], sort_keys=True)
  digest = np.frombuffer(hashlib.sha256(text.encode()).digest()[:8], np.int64)
  every = np.asarray(multihost_utils.process_allgather(digest)).ravel()
  if len(set(every.tolist())) > 1:
    raise HetSpmdError(f"the processes searched different plans ({len(set(every.tolist()))} distinct; this is process "
                       f"{jax.process_index()}): give every process the same cluster (Cluster.from_devices(jax.devices())"
                       ", all processes' devices), the same step and the same example_batch shapes, or search once and "
                       "load the saved plan in every process (plan='plan.json')")


def _searched_plan(step: Any, cluster: Cluster, state: Any, trace: Any, top: int) -> Searched:
  """:func:`searched_plan` in this process."""
  priced = price_step(step, cluster, state, trace, processes=jax.process_count(), top=top)
  if priced.choice is None:
    raise PlanDoesNotFitError(priced.error)
  runnable = lambda e: single_plan(e, cluster, state, priced.ideal_throughput, step.specs)
  if not priced.grouped:
    return Searched(runnable(priced.choice), None, priced.note,
                    tuple(runnable(e) for e in _runners_up(priced, priced.choice, cluster)[:top - 1]))
  try:  # a step group programs do not run (a loop reading optimizer state in shares) runs as one program
    group_plan = kept_specs(to_group_plan(cluster, priced.choice, priced.ideal_throughput), state, step.specs)
    runtime = GroupedStep.across_processes(step.fn, group_plan, batch_stats=step.batch_stats,
                                           donate_state=step.donate_state)
    runtime.prepare(trace.f, state, global_abstract(trace.batch, step.global_batch), trace.rest,
                    graphdef=trace.graphdef, static=trace.static)
  except HetSpmdError as e:
    if priced.result is None:
      raise PlanDoesNotFitError(f"{priced.error}; and the group plan that fits does not run this step: {e}") from e
    first = priced.result.plans[0]
    return Searched(runnable(first), None, f"the search's group plan does not run this step, so it runs as one "
                    f"program: {e}", tuple(runnable(e) for e in _runners_up(priced, first, cluster)[:top - 1]))
  return Searched(runtime.plan, runtime, priced.note,
                  tuple(runnable(e) for e in _runners_up(priced, priced.choice, cluster)[:top - 1]))


def _runners_up(priced: Priced, chosen: Evaluated, cluster: Cluster) -> list[Evaluated]:
  """The ranked single programs after ``chosen`` that run from the priced processes (each holds devices)."""
  if priced.result is None:
    return []
  whole = device_processes(cluster) if priced.processes > 1 else None
  return [e for e in priced.result.plans
          if e is not chosen and (whole is None or holds_every_process(e.device_positions, whole))]


def single_plan(evaluated: Evaluated, cluster: Cluster, state: Any, ideal: float, specs: Any = None) -> Any:
  """The runnable :class:`~hetspmd.plan.value.Plan` of a priced single program, the leaves ``specs`` name kept
  as given."""
  plan = plan_from(evaluated, cluster, state, ideal)
  if not specs:
    return plan
  chosen = auto_state_specs(state, plan.axis_names, plan.mesh_shape, plan.zero_stage, specs=specs,
                            model_specs=dict(plan.state_specs), zero_shards=plan.zero_shards)
  return plan.replace(state_specs=chosen)


def kept_specs(plan: GroupPlan, state: Any, specs: Any) -> GroupPlan:
  """``plan`` with the parameters ``specs`` name laid out as given in each group with a model axis
  (:func:`~hetspmd.plan.state_layout.group_model_dims`); a group without one holds every parameter whole along
  ``model``, as a single program with a model axis of 1 does."""
  if not specs:
    return plan
  groups = []
  for g in plan.groups:
    if g.model > 1:
      dims = group_model_dims(state, specs, dict(g.model_dims))
      if not dims:
        raise HetSpmdError(f"the specs leave every parameter whole, and the group plan's group of "
                           f"{len(g.devices)} devices splits them over a model axis of {g.model}")
      g = dataclasses.replace(g, model_dims=tuple(sorted(dims.items())))
    groups.append(g)
  return dataclasses.replace(plan, groups=tuple(groups))


def _group_verdict(group_plans: bool, cluster: Cluster, result: Any, best: Any, chosen: bool, considered: bool,
                   *, conflict: str = "") -> str:
  """Why the search's plan is, or is not, a group plan (``best``: the single program that runs, None if none)."""
  if result.group_plan is not None and best is not None:
    ratio = result.group_plan.throughput / best.throughput
    if not (group_plans and considered):
      why = (f"the search runs them {GROUP_PLAN_CONDITIONS}" + (f" ({conflict})" if conflict else "") if group_plans else
             "parallelize(..., group_plans=False) runs single programs only")
      return f"the best group plan was priced {ratio:.2f}x this plan, but it does not run here: {why}"
    return (f"chosen by the search: priced {ratio:.2f}x the best single program's throughput" if chosen else
            f"the best group plan was priced {ratio:.2f}x this plan's throughput") + (
                f" (a group plan runs at {GROUP_PLAN_MARGIN:.2f}x or more)")
  if group_plans and not considered and len(cluster.kinds) > 1:
    why = f" ({conflict})" if conflict else ""
    return f"group plans were not priced: the search prices them {GROUP_PLAN_CONDITIONS}{why}"
  return ""


def _recompute(batch_stats: str, profile: Any, state: Any, batch: Any) -> float:
  """With exact batch statistics, the extra forward work of their loops (1.0 otherwise)."""
  if batch_stats != "exact":
    return 1.0
  analysis, inputs = _profile_analysis(profile, state, batch, "exact")
  return lowering.recompute_factor(analysis, inputs)


def _per_microbatch_statistics(batch_stats: str, profile: Any, state: Any, batch: Any) -> bool:
  """Whether the step normalises by statistics of each microbatch (BatchNorm, ``batch_stats="local"``),
  which a fused overlapped pass would compute over several microbatches at once."""
  if batch_stats != "local":
    return False
  analysis, _ = _profile_analysis(profile, state, batch, "local")
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


def _profile_analysis(profile: Any, state: Any, batch: Any, batch_stats: str):
  """The microbatch analysis of the step at the profile's larger batch size (the jaxpr its trace read), and its
  batch inputs."""
  size, graph = profile.trace_batches[-1], profile.traces[-1]
  leaves = jax.tree.leaves(state)
  inputs = range(len(leaves), len(leaves) + len(jax.tree.leaves(batch)))
  floats = [i for i, x in enumerate(leaves) if jnp.issubdtype(traced_dtype(x), jnp.floating)]  # statistics live here
  return analyse(graph.jaxpr, inputs, size, batch_stats=batch_stats, float_state_inputs=floats), inputs
