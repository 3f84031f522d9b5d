"""``hetspmd.search``: price every plan form for a step, called as ``parallelize`` would call it, on any pool.

``search(step, *args, cluster=..., global_batch=..., **kwargs)`` binds ``args`` and ``kwargs`` exactly as a
call of ``parallelize(step, ...)`` binds them (NNX objects in place, a Linen ``TrainState``, ``pmap``-era
collectives, static arguments, ``jax.jit``/``nnx.jit``-wrapped steps), at abstract shapes where they are
abstract (``jax.ShapeDtypeStruct``s, models from ``nnx.eval_shape``): nothing is allocated. It prices single
programs, the baselines, the homogeneous equivalent, group plans and stage plans, and says which plan
``parallelize(plan="search")`` runs: the same remat rule, the same margin for a group plan, for the processes
that run the pool. The result prints as ``hetspmd search``'s table, gives its JSON, explains and saves its
choice.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax

from hetspmd import report
from hetspmd import search_report
from hetspmd.errors import InvalidValueError
from hetspmd.hardware.calibration import Calibration
from hetspmd.hardware.cluster import Cluster
from hetspmd.passes import _jax_adapter as jx
from hetspmd.plan.groups import GroupPlan
from hetspmd.plan.value import Plan
from hetspmd.planner.grouping import to_group_plan
from hetspmd.runtime.binding import is_dynamic, is_graph_node, unbound
from hetspmd.runtime.placement import global_abstract
from hetspmd.runtime.searching import Priced, device_processes, single_plan
from hetspmd.runtime.step import parallelize

_MISSING = object()


@dataclasses.dataclass(frozen=True, repr=False)
class StepSearch:
  """What :func:`search` found for a step on a pool. ``print`` shows the table ``hetspmd search`` prints;
  :meth:`to_json` gives its ``--json`` object; :attr:`best` is the plan ``parallelize(plan="search")`` runs,
  ready to run or :meth:`save`; :attr:`priced` holds every priced plan
  (:class:`~hetspmd.runtime.searching.Priced`)."""

  subject: search_report.Subject
  cluster: Cluster
  priced: Priced
  state: Any  # the train state's abstract values (what a single program's plan is made for)
  specs: Any = None

  # --- what was priced ---------------------------------------------------------------------

  @property
  def plans(self) -> tuple:
    """The ranked single programs, best first (empty where none fits)."""
    return () if self.priced.result is None else self.priced.result.plans

  @property
  def baselines(self) -> dict:
    return {} if self.priced.result is None else self.priced.result.baselines

  @property
  def group_plan(self):
    """The best group plan priced (None where none fits)."""
    return self.priced.group_plan

  @property
  def stage_plans(self) -> tuple:
    return self.priced.stage_plans

  @property
  def ideal_throughput(self) -> float:
    return self.priced.ideal_throughput

  @property
  def heterogeneity_tax(self) -> float | None:
    return None if self.priced.result is None else self.priced.result.heterogeneity_tax

  @property
  def homogeneous_equivalent(self):
    """The best plan of the pool with every device its mean (None where no single program fits)."""
    return None if self.priced.result is None else self.priced.result.homogeneous_equivalent

  @property
  def throughput_vs_homogeneous(self) -> float | None:
    return None if self.priced.result is None else self.priced.result.throughput_vs_homogeneous

  @property
  def search_seconds(self) -> float | None:
    """The search's seconds after tracing (:attr:`Priced.trace_seconds`: the tracing's)."""
    return None if self.priced.result is None else self.priced.result.search_seconds

  @property
  def candidates(self) -> int:
    return 0 if self.priced.result is None else self.priced.result.candidates

  @property
  def form(self) -> str | None:
    """``"single program"`` or ``"group plan"``: what ``parallelize(plan="search")`` runs (None: it runs no plan
    here, and :attr:`best` is the group plan that fits)."""
    return search_report.choice_form(self.priced)

  # --- the choice ----------------------------------------------------------------------------

  @functools.cached_property
  def best(self) -> Plan | GroupPlan:
    """The plan ``parallelize(plan="search")`` runs, as a value ``parallelize(plan=...)`` takes (devices by JAX
    id where the cluster is bound to JAX's devices, else by cluster position). Where it runs none (no single
    program fits, and group plans do not run from this many processes), the group plan that fits."""
    priced, ideal = self.priced, self.priced.ideal_throughput
    chosen = priced.choice if priced.choice is not None else priced.group_plan
    if chosen is priced.group_plan:
      return to_group_plan(self.cluster, chosen, ideal)
    return single_plan(chosen, self.cluster, self.state, ideal, self.specs)

  @property
  def best_group_plan(self) -> GroupPlan | None:
    """The best group plan priced, as a value ``parallelize(plan=...)`` runs (None where none fits), whether or
    not it is the choice."""
    g = self.priced.group_plan
    return None if g is None else to_group_plan(self.cluster, g, self.priced.ideal_throughput)

  def explain(self) -> str:
    """The best plan in words, as ``hetspmd explain`` shows its file, and why it is the choice."""
    best = self.best
    text = report.explain_group_text(best) if isinstance(best, GroupPlan) else report.explain_text(best)
    return text + "\n\n" + search_report.choice_line(self.priced)

  def save(self, path: str | os.PathLike) -> None:
    """Writes :attr:`best` to ``path``, the file ``parallelize(plan=path)`` runs (``hetspmd explain`` reads it)."""
    self.best.save(path)

  def to_json(self) -> dict[str, Any]:
    """``hetspmd search --json``'s object (the same keys)."""
    return search_report.to_json(self.subject, self.cluster, self.priced)

  def __str__(self) -> str:
    return search_report.table(self.subject, self.cluster, self.priced)

  def __repr__(self) -> str:
    best = self.plans[0] if self.plans else self.group_plan
    return (f"StepSearch({self.subject.name!r} on {self.cluster}: {len(self.plans)} plan(s), best "
            f"{best.throughput:.4g} samples/s; parallelize(plan='search') runs {self.form or 'no plan'})")


def search(step: Callable[..., Any], *args: Any, cluster: Any = _MISSING, global_batch: int | None = None,
           top: int = 5, progress: Callable[[str], None] | None = None, overlap: bool = True, specs: Any = None,
           batch_argnums: Any = None, batch_stats: str = "local", grad_reduce_dtype: str = "float32",
           axis_name: Any = None, group_plans: bool = True, static_argnums: Any = None,
           static_argnames: Any = None, name: str | None = None, calibration: Any = None,
           **kwargs: Any) -> StepSearch:
  """Prices every plan form for ``step(*args, **kwargs)`` on ``cluster`` and says which one
  ``parallelize(step, cluster=..., plan="search", ...)`` runs.

  ``step``, ``args`` and ``kwargs`` are what a call of ``parallelize(step, ...)`` takes: the train state (a
  pytree, or NNX objects) and the batch beside any other arguments. Any of them may be abstract
  (``jax.ShapeDtypeStruct``, models from ``nnx.eval_shape``): only shapes and dtypes are read.

  Args:
    cluster: keyword only: a :class:`Cluster` (``Cluster.emulate`` or ``from_devices`` for JAX's devices, or
      any pool described, to plan for hardware not at hand), or a preset name, cluster TOML file or spec.
    global_batch: examples per step; default the leading size of the batch argument (``batch_argnums``, or the
      first argument beside the state whose arrays all lead with one size). A batch of another size (a small
      example batch) is read for its shapes, as ``parallelize``'s ``example_batch`` (a batch of several
      arguments: name them all in ``batch_argnums``).
    top: how many single programs to rank.
    progress: called with a line of text as the search goes.
    overlap: overlap gradient reductions with the last microbatch's backward pass (as every plan does).
    name: what the table calls the step (default its function's name).
    calibration: the step's measured times (a :class:`~hetspmd.hardware.calibration.Calibration` or its JSON
      file, from ``ParallelStep.calibrate``): the pool's kinds it times are priced on them. One measured on
      another step is refused.
    specs, batch_argnums, batch_stats, grad_reduce_dtype, axis_name, group_plans, static_argnums,
      static_argnames: as :func:`hetspmd.parallelize`'s.

  The earlier form ``search(fn, state, batch, cluster, global_batch=...)`` still works: a :class:`Cluster`
  passed last by position, with no ``cluster=``, is the cluster, never a step argument.
  """
  if not callable(step):
    raise InvalidValueError(f"search() needs the train step (a callable) first, got {step!r}")
  earlier = cluster is _MISSING
  args, pool = _split_cluster(args, cluster)
  _check_keywords(kwargs, earlier)
  if not isinstance(top, int) or isinstance(top, bool) or top < 1:
    raise InvalidValueError(f"top (how many plans to rank) must be a positive integer, got {top!r}")
  objects = bool(unbound(step)[1])  # an nnx.cached_partial's objects come before the call's arguments
  at = batch_index(args, batch_argnums, objects)
  size = _leading(args[at]).pop() if at is not None else None
  if global_batch is None:
    if size is None:
      raise InvalidValueError("search() could not tell the batch from the step's arguments (no argument beside "
                              "the state whose arrays all lead with one size): pass global_batch= or batch_argnums=")
    global_batch = size
  elif size is not None and size != global_batch:  # an example batch, read for its shapes: each of its arguments
    batch = {at} if batch_argnums is None else {i % len(args) for i in (
        (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums)}
    args = tuple(global_abstract(a, global_batch) if i in batch and _leads_with(a, size) else a
                 for i, a in enumerate(args))
  front = parallelize(step, cluster=pool, plan="search", global_batch=global_batch, donate_state=False, specs=specs,
                      batch_argnums=batch_argnums, batch_stats=batch_stats, grad_reduce_dtype=grad_reduce_dtype,
                      axis_name=axis_name, group_plans=group_plans, static_argnums=static_argnums,
                      static_argnames=static_argnames)
  if calibration is not None:
    pool = pool.calibrated(calibration if isinstance(calibration, Calibration) else Calibration.load(calibration))
  priced, state = front.price(pool, args, kwargs, processes=pool_processes(pool), top=top, overlap=overlap,
                              progress=progress)
  subject = search_report.Subject(name or getattr(step, "__name__", type(step).__name__), global_batch)
  return StepSearch(subject, pool, priced, jx.to_abstract(state), specs)


# hetspmd.search's keywords before it took the step's own arguments, and what took their place
_EARLIER_KEYWORDS = {"grad_reduce_dtypes": "grad_reduce_dtype='search' lets the search pick the dtype",
                     "homogeneous": "the homogeneous equivalent is always priced now",
                     "models": "every model-axis size is priced", "fuse_overlap": "batch_stats= decides it"}


def _check_keywords(kwargs: dict, earlier: bool) -> None:
  """Refuses a :class:`Cluster` among the step's keyword arguments, and (the earlier call's form) keywords
  ``search`` no longer takes, which would otherwise reach the step."""
  for key, value in kwargs.items():
    if isinstance(value, Cluster):
      raise InvalidValueError(f"search() got a Cluster as the step's keyword argument {key!r}: pass the pool as "
                              "cluster=..., and only the step's own arguments beside it")
    if earlier and key in _EARLIER_KEYWORDS:
      raise InvalidValueError(f"search() no longer takes {key}= ({_EARLIER_KEYWORDS[key]}); the call is "
                              "hetspmd.search(step, *args, cluster=..., global_batch=..., **step_kwargs)")


def _leads_with(tree: Any, size: int) -> bool:
  """Whether every array of ``tree`` leads with ``size`` (at least one axis each)."""
  leaves = [x for x in jax.tree.leaves(tree) if is_dynamic(x)]
  return bool(leaves) and all(getattr(x, "shape", ())[:1] == (size,) for x in leaves)


def _split_cluster(args: tuple, cluster: Any) -> tuple[tuple, Cluster]:
  """The step's arguments and the pool: ``cluster=``, or (the earlier form) a :class:`Cluster` passed last by
  position. A cluster among the step's arguments beside ``cluster=`` is refused: it would be passed to the step."""
  given = [i for i, a in enumerate(args) if isinstance(a, Cluster)]
  if cluster is _MISSING:
    if not given or given[-1] != len(args) - 1:
      raise InvalidValueError("search() needs the pool as a keyword: hetspmd.search(step, *args, cluster=..., "
                              "global_batch=...), the step's arguments as parallelize would take them, e.g. "
                              "hetspmd.search(train_step, state, batch, cluster='4xV100-32GB+4xP100-16GB')")
    return args[:-1], args[-1]
  if given:
    raise InvalidValueError(f"search() got a Cluster as the step's argument {given[0]} and cluster= too: pass the "
                            "pool once, as cluster=..., and only the step's own arguments by position")
  if isinstance(cluster, Cluster):
    return args, cluster
  if not isinstance(cluster, (str, os.PathLike)):
    raise InvalidValueError(f"cluster must be a Cluster, or a preset name, cluster TOML file or spec such as "
                            f"'4xV100-32GB+4xP100-16GB', got {cluster!r}")
  return args, Cluster.resolve(os.fspath(cluster))


def pool_processes(cluster: Cluster) -> int:
  """How many JAX processes run ``cluster``: this run's where it is bound to JAX's devices; else as it says
  (``processes=N``), or one per host (:func:`~hetspmd.runtime.searching.device_processes`)."""
  if cluster.jax_device_ids is not None:
    return jax.process_count()
  return len(set(device_processes(cluster)))


def batch_index(args: tuple, batch_argnums: Any = None, objects: bool = False) -> int | None:
  """Which of a call's arguments is the batch, as the search reads it: ``batch_argnums``' first, or the first
  argument beside NNX objects and a functional step's state (its first argument with arrays) whose arrays all
  lead with one size; None where none does. ``objects``: the step is an ``nnx.cached_partial`` whose NNX objects
  (its state) are bound ahead of ``args``."""
  if batch_argnums is not None:
    first = batch_argnums if isinstance(batch_argnums, int) else tuple(batch_argnums)[0]
    ok = isinstance(first, int) and -len(args) <= first < len(args) and len(_leading(args[first])) == 1
    return first % len(args) if ok else None
  plain = [i for i, a in enumerate(args) if not is_graph_node(a) and _leading(a)]
  has_state = objects or any(is_graph_node(a) for a in args)
  for i in plain[0 if has_state else 1:]:  # a functional step's state comes first
    if len(_leading(args[i])) == 1 and all(jax.numpy.ndim(x) >= 1 for x in jax.tree.leaves(args[i])
                                            if is_dynamic(x)):
      return i
  return None


def _leading(tree: Any) -> set[int]:
  """The leading sizes of ``tree``'s arrays (abstract ones too)."""
  return {x.shape[0] for x in jax.tree.leaves(tree) if is_dynamic(x) and getattr(x, "shape", ()) != ()}
