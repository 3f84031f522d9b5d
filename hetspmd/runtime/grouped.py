"""A step run as a schedule of group programs (:class:`hetspmd.plan.groups.GroupPlan`).

Per call: each group's program (:func:`hetspmd.lowering.groups.group_program`,
``jax.jit`` over a mesh of the group's devices, its own microbatch size and
counts) is dispatched in turn; JAX runs them asynchronously, so the groups
compute at the same time. Their per-device partial sums are assembled into
global arrays over every device without a copy
(``jax.make_array_from_single_device_arrays``: every device's row has the
same shape), and one uniform program over every device
(:func:`hetspmd.lowering.groups.exchange_program`) combines them and runs the
rest of the step: the optimizer update on the state, replicated on every
device, and the metrics. Per-example outputs (logits among the metrics) come
out of the group programs as each device's examples, padded to the plan's
``example_width``, and the exchange program puts them in the global batch's
order (``GroupPlan.example_slots``), replicated on every device.

Under a plan with ``state_shares`` (ZeRO-1 by memory) each large
optimizer-state leaf lives whole and unpadded on one device
(:func:`hetspmd.plan.groups.assign_owners` over the update's state units,
:func:`hetspmd.lowering.groups.state_units`). The exchange program then
computes only what reads no held leaf (metrics, a step count); each device's
own program (``jax.jit`` on that device) updates its leaves and makes their
parameters, which are sent to every device (``jax.device_put``; where some
devices hold much more than the rest, :func:`hetspmd.plan.groups.relays`,
in two hops: split evenly over the devices, then gathered by one program).
Without a tail, in one process, each device's update program
(:func:`hetspmd.lowering.groups.owner_update_program`) reduces the sums its
units read from every device's rows, copied to it, or, where some devices
hold much more than the rest, takes them whole from one reduce-scatter
program's even parts; otherwise the exchange program reduces every sum onto
every device (:func:`hetspmd.lowering.groups.update_program`). Under ZeRO-3
the device keeps the parameters it made, and sends them at the start of the
next step.

A group with a model axis runs its program over a ``data`` x ``model`` mesh of
its devices, the parameters its ``model_dims`` name split over ``model``, and
makes its rows (one per data position) one per device for the uniform
programs: the row on the position's first device, zeros (a maximum's or
minimum's copies) on the others.

Across processes (``jax.distributed``), a group whose devices run their own
trip counts is one process's, and a group that shards its parameters (its
devices in lockstep) is one program that every process holding some of its
devices calls: plain FSDP over several hosts is one such group. Each process
dispatches only the programs of the groups it holds devices of, and its own
devices' updates; the exchange program spans them all, and the parameters an
update makes reach every device through one uniform program that adds each
device's row (the value on its maker, zeros elsewhere). Each process passes
only the examples its devices run (:meth:`GroupedStep.process_examples`).

It takes functional steps, ``step(state, batch, *rest) -> outputs`` (a Linen
``TrainState``), and NNX steps that update their objects in place,
``step(model, optimizer, ..., batch)``, with one microbatch loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd._dtypes import traced_dtype
from hetspmd._pytree import leaves_with_paths
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.lowering import transfers
from hetspmd.lowering.group_build import GroupMeshes, GroupPrograms, build
from hetspmd.lowering.group_features import explained
from hetspmd.lowering.group_stages import DATA
from hetspmd.plan.execution import Execution
from hetspmd.plan.groups import GroupPlan, split_by_process
from hetspmd.plan.state_layout import role_of
from hetspmd.runtime import group_calls as calls
from hetspmd.runtime.binding import (batch_arguments, distinct_leaves, is_graph_node, positional_function,
                                     static_bound)
from hetspmd.runtime.placement import (GroupedBatch, check_global_batch, check_process_batch, global_abstract,
                                       group_buffers, tail_buffers)


@dataclasses.dataclass
class GroupedStep:
  """A functional train step bound to a :class:`GroupPlan`; call it as ``step(state, batch, *rest)`` with this
  process's examples (:meth:`process_examples`; the global batch in one process). It places values, calls the programs
  :func:`hetspmd.lowering.group_build.build` makes (once per argument structure) and explains them."""

  fn: Callable[..., Any]
  plan: GroupPlan
  example_batch: Any = None
  batch_stats: str = "exact"
  donate_state: bool = False
  clock: Any = None  # a GroupClock (hetspmd.runtime.rebalancing): each group program's time, as it runs
  _meshes: GroupMeshes = dataclasses.field(init=False, repr=False)
  _local: tuple = dataclasses.field(init=False, repr=False)  # per group: whether this process runs it
  _counts: tuple = dataclasses.field(init=False, repr=False)  # per group: (counts, starts) placed, or None
  _tail: tuple = dataclasses.field(init=False, repr=False)  # the tail's (counts, starts) over every device
  _examples: np.ndarray = dataclasses.field(init=False, repr=False)  # this process's, ascending
  _built: dict = dataclasses.field(init=False, repr=False, default_factory=dict)  # {argument key: GroupPrograms}
  _latest: GroupPrograms | None = dataclasses.field(init=False, repr=False, default=None)
  _last: dict = dataclasses.field(init=False, repr=False, default_factory=dict)  # {name: (program, arguments)}

  def __post_init__(self):
    if self.batch_stats not in ("exact", "local"):
      raise InvalidValueError(f"batch_stats must be 'exact' or 'local', got {self.batch_stats!r}")
    self._meshes = GroupMeshes.of(self.plan)
    here = jax.process_index()
    self._local = tuple(any(d.process_index == here for d in mesh.devices.flat) for mesh in self._meshes.groups)
    if not any(self._local):
      raise InvalidValueError(f"the group plan gives process {here} no devices: every process runs at least one "
                              "group")
    on = lambda mesh, values: jax.device_put(np.asarray(values, np.int32), NamedSharding(mesh, P(DATA)))
    self._counts = tuple((on(mesh, g.positions), on(mesh, starts)) if local else None
                         for g, mesh, starts, local in zip(self.plan.groups, self._meshes.groups, self.plan.starts(),
                                                           self._local))
    mesh = self._meshes.mesh
    self._tail = (on(mesh, [self.plan.tail_count] * mesh.size), on(mesh, self.plan.tail_starts()))
    self._examples = self.plan.examples_of(d.id for d in jax.local_devices())

  @classmethod
  def across_processes(cls, fn: Callable[..., Any], plan: GroupPlan, **options: Any) -> "GroupedStep":
    """``plan``'s runtime in this run's processes: a group whose devices run their own trip counts runs in one
    process, so one spanning several is cut (:func:`~hetspmd.plan.groups.split_by_process`); a group that shards
    its parameters runs over its devices in every process holding some."""
    process_of = {d.id: d.process_index for d in jax.devices()}
    if all(d in process_of for d in plan.devices):  # else __post_init__ says which devices JAX lacks
      plan = split_by_process(plan, process_of)
    return cls(fn, plan, **options)

  @property
  def devices(self) -> tuple:
    return self._meshes.devices

  @property
  def execution(self) -> Any:
    """How the plan runs on this run's processes (:class:`~hetspmd.plan.execution.Execution`), decided once:
    the programs are built from it."""
    return self._meshes.execution

  @property
  def mesh(self) -> Any:
    """Every device of the plan on one ``data`` axis (the uniform programs' mesh)."""
    return self._meshes.mesh

  @property
  def program_count(self) -> int:
    """How many argument structures have their programs built."""
    return len(self._built)

  def adopt(self, other: "GroupedStep") -> bool:
    """Run ``other``'s programs where they run this plan: the same plan but its groups' counts, every group with
    slots (its programs read its counts when they run: :attr:`~hetspmd.plan.groups.Group.slots`) and the same
    buffers. Then new counts compile nothing, but for programs that put per-example outputs in order from the
    counts when built: those are kept per set of counts. Whether it did."""
    same = (_same_but_counts(self.plan, other.plan) and self.fn is other.fn
            and (self.batch_stats, self.donate_state) == (other.batch_stats, other.donate_state))
    if not same or not other._built:
      return False
    self._built, self._latest, self._last = other._built, other._latest, other._last
    return True

  @property
  def traced(self) -> bool:
    """Whether the step has been traced (a call, or :meth:`prepare`): the held leaves' devices are known."""
    return self._latest is not None

  def state_shardings(self, state: Any) -> Any:
    """The shardings the state lives in between steps (to restore a checkpoint into, as
    ``ParallelStep.state_shardings``): replicated on every device of the plan, except, under state shares, each
    held leaf whole on the one device that updates it, and in a hybrid plan (:attr:`GroupPlan.hybrid`) each leaf
    it holds split, split over each group's devices (known once the step is traced: a call, or
    ``example_batch``; before that, replicated, and the first call splits them)."""
    owners = self._owners(state) if self.plan.state_shares else {}
    split = self._held_split(state) if self.execution.hybrid else {}
    replicated = NamedSharding(self.mesh, P())
    return jax.tree.unflatten(jax.tree.structure(state), [
        jax.sharding.SingleDeviceSharding(owners[path]) if path in owners else
        self._meshes.held_split(split[i]) if i in split else replicated
        for i, (path, _) in enumerate(leaves_with_paths(state))])

  def _held_split(self, state: Any) -> dict:
    """A hybrid plan: ``{flat state index: axis}`` of the leaves held split, from the step's trace (empty before
    one, without ``example_batch``)."""
    if self._latest is None:
      if self.example_batch is None:
        return {}
      self._programs(self.fn, state, self.example_batch, (), None)
    return self._latest.held_split

  def shard_state(self, state: Any) -> Any:
    """``state`` placed as :meth:`state_shardings` says. Under state shares, before the step has been traced
    (no call yet, no ``example_batch``), the optimizer-state leaves stay where they are until the first call
    places each on its device."""
    if self.plan.state_shares and not self.traced and self.example_batch is None:
      return jax.tree.unflatten(jax.tree.structure(state), [
          x if role_of(path, traced_dtype(x)) == "opt_state" else transfers.on(self.mesh, x)
          for path, x in leaves_with_paths(state)])
    placed = []
    for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(self.state_shardings(state))):
      if isinstance(sharding, NamedSharding) and sharding.spec != P():  # a hybrid plan's split leaf
        placed.append(transfers.split_on(x, sharding))
      elif isinstance(sharding, NamedSharding):
        placed.append(transfers.on(self.mesh, x))
      else:
        device = next(iter(sharding.device_set))
        placed.append(transfers.held_on(x, device, jax.ShapeDtypeStruct(np.shape(x), traced_dtype(x))))
    return jax.tree.unflatten(jax.tree.structure(state), placed)

  def resident_bytes(self, state: Any) -> dict[int, int]:
    """Bytes of ``state`` each device of the plan (by JAX id) holds between steps."""
    out = {d.id: 0 for d in self.devices}
    for x in jax.tree.leaves(state):
      for shard in getattr(x, "addressable_shards", ()):
        if shard.device.id in out:
          out[shard.device.id] += shard.data.nbytes
    return out

  def explain(self) -> str:
    lines = [self.plan.summary()] + self.execution.lines()
    if self._latest is not None:
      chains = self._latest.group_stages
      lines += (["  each group's program: " + " -> ".join(chains[0])] if len(set(chains)) == 1 else
                [f"  group {g}'s program: " + " -> ".join(names) for g, names in enumerate(chains)])
    lines += _sharded_lines(self.plan, self._latest, self.execution)
    lines += explained(self.plan, self.execution, self._latest)  # each feature's own lines (group_features)
    for built in self._built.values():
      if built.units is not None:
        lines += _held_lines(built, self.devices, self.plan.state_shares, self.plan.zero_stage == 3)
    return "\n".join(lines)

  def __call__(self, *args: Any) -> Any:
    """``step(state, batch, *rest)`` for a functional step; for NNX in place, ``step(*objects and batch)``: the
    objects' state is split out (as ``nnx.jit`` does), and updated in place after the step."""
    from flax import nnx

    graph = tuple(i for i, a in enumerate(args) if is_graph_node(a))
    if not graph:
      if len(args) < 2:
        raise InvalidValueError("a functional step is called as step(state, batch, *rest)")
      return self.run(self.fn, args[0], args[1], args[2:])
    batch_at = batch_arguments(args, graph, self.plan.global_batch, {len(self.process_examples())})[0]
    objects = tuple(args[i] for i in graph)
    graphdef, state = nnx.split(objects)
    f = positional_function(self.fn, len(args), graph_args=graph, graphdef=graphdef, batch_argnums=(batch_at,),
                            state_argnum=None)
    rest = tuple(a for i, a in enumerate(args) if i not in graph and i != batch_at)
    new_state, out = self.run(lambda state, batch, *rest: f(state, (batch,), rest, {}), state, args[batch_at], rest,
                              graphdef=graphdef)
    nnx.update(objects, new_state)
    return out

  def process_examples(self) -> np.ndarray:
    """The global batch's examples this process feeds, ascending (every example in one process): its devices'
    data positions' and tail examples (:meth:`~hetspmd.plan.groups.GroupPlan.examples_of`)."""
    return self._examples

  def shard_batch(self, batch: Any) -> GroupedBatch:
    """``batch`` (this process's examples, :meth:`process_examples`, in that order: the global batch in one
    process) placed for this plan ahead of the step: this process's groups' microbatch buffers and the tail's.
    Pass it to the step in the batch's place, as ``ParallelStep.shard_batch``'s result."""
    plan, examples = self.plan, self.process_examples()
    check_process_batch(batch, len(examples), plan.global_batch)
    leaves, mine = jax.tree.leaves(batch), {d.id for d in jax.local_devices()}
    row = lambda start, devices: int(np.searchsorted(examples, start)) if mine.intersection(devices) else None
    starts = [[row(s, g.devices[p * g.model:(p + 1) * g.model]) for p, s in enumerate(firsts)]
              for g, firsts in zip(plan.groups, plan.starts())]
    groups = {g: group_buffers(plan.groups[g], starts[g], self._meshes.groups[g], leaves)
              for g, local in enumerate(self._local) if local}
    tail = (tail_buffers(plan.tail_count, plan.tail_microbatch,
                         [row(s, (d,)) for d, s in zip(plan.devices, plan.tail_starts())], self.mesh, leaves)
            if plan.tail_count else [None] * len(leaves))
    return GroupedBatch(global_abstract(batch, plan.global_batch), groups, tail)

  def prepare(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, *, graphdef: Any = None,
              static: Any = ()) -> GroupPrograms:
    """Traces ``fn(state, batch, *rest)`` and builds its programs (compiled on first run); raises
    :class:`HetSpmdError` for a step group programs do not run. ``static``: a key for values already bound into
    ``fn`` (:func:`hetspmd.runtime.binding.static_bound`)."""
    fn, rest, found = static_bound(fn, rest)
    return self._programs(fn, state, batch, rest, (graphdef, static, found))

  def run(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, *, graphdef: Any = None,
          static: Any = ()) -> Any:
    """One step of ``fn(state, batch, *rest)`` (``batch``: this process's examples, or placed by
    :meth:`shard_batch`);
    ``graphdef``: the NNX objects' whose state ``state`` is, ``static``: a key for the values bound into ``fn``
    (both part of the programs' cache key). Leaves of ``rest`` that are not arrays are bound as constants."""
    placed = batch if isinstance(batch, GroupedBatch) else self.shard_batch(batch)
    batch = placed.abstract
    fn, rest, found = static_bound(fn, rest)
    built = self._programs(fn, state, batch, rest, (graphdef, static, found))
    leaves = jax.tree.leaves((state, batch, rest))
    n_state, n_batch = len(jax.tree.leaves(state)), len(jax.tree.leaves(batch))
    given = distinct_leaves(leaves[:n_state]) if self.donate_state else leaves[:n_state]  # each buffer donated once
    state_leaves = [self._placed(built, i, x) for i, x in enumerate(given)]
    masters = {i: state_leaves[i] for i in built.casts}  # the parameters the programs take as casts, as held
    if built.params:
      state_leaves = calls.gather_params(built, state_leaves, self._meshes, self.plan.state_shares, self._call)
    if built.held_split:
      state_leaves = calls.held_parts(built, state_leaves, self._meshes)
    others = leaves[n_state + n_batch:]
    free = [i for i in range(n_state) if i not in built.owner]  # the state leaves every device has
    joined, earlier, examples = calls.run_loops(built, self._meshes, self._counts, self._call,
                                                state=[state_leaves[i] for i in free], buffers=placed.groups,
                                                others=others)
    everywhere = [transfers.on(self.mesh, x) for x in others]  # the rest, on every device of the plan
    held = lambda x: x.held if isinstance(x, calls.PerGroup) else transfers.on(self.mesh, x)  # split: as it is
    common = [held(state_leaves[i]) for i in free if i not in built.parted] + placed.tail + everywhere
    results = self._call("exchange", built.exchange, common, transfers.without_pieces(joined), *self._tail, earlier,
                         examples)
    if built.units is None:
      return jax.tree.unflatten(built.out_tree, results)
    results, sums = (results, (joined, earlier)) if built.needs is not None else results
    outputs: list[Any] = [None] * built.out_tree.num_leaves
    for o, x in zip(built.units.common, results):
      outputs[o] = x
    inputs = state_leaves + [None] * n_batch + everywhere
    calls.run_updates(built, outputs, inputs, sums, masters, mesh=self.mesh, shares=self.plan.state_shares,
                      one_process=self.execution.one_process,
                      call=self._call, called=self._last)
    return jax.tree.unflatten(built.out_tree, outputs)

  def memory_analysis(self) -> dict[str, Any]:
    """Each program of the last call (by name: ``group 0``, ``exchange``, ``update on device 3``) and XLA's
    ``Compiled.memory_analysis()`` of it: argument, output and temporary bytes per device."""
    if not self._last:
      raise HetSpmdError("memory_analysis describes the programs of the last call: call the step first")
    return {name: program.lower(*args).compile().memory_analysis() for name, (program, args) in self._last.items()}

  def _owners(self, state: Any) -> dict:
    """``{path: device}`` of the held leaves, which come from the step's trace: of the first call, or of
    ``example_batch``."""
    if self._latest is None:
      if self.example_batch is None:
        raise HetSpmdError("under state_shares the device holding each optimizer-state leaf comes from the step's "
                           "trace: call the step once first, or pass example_batch=batch (to parallelize or "
                           "run_groups)")
      self._programs(self.fn, state, self.example_batch, (), None)
    return self._latest.owner_paths

  def _programs(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, key: Any) -> GroupPrograms:
    """The programs of ``fn(state, batch, *rest)`` (``rest``: arrays only), built on the first call with this
    argument structure; ``key``: what else tells its programs apart (the NNX graph, the values bound into ``fn``)."""
    batch = batch.abstract if isinstance(batch, GroupedBatch) else batch
    check_global_batch(batch, self.plan.global_batch)
    leaves, tree = jax.tree.flatten((state, batch, rest))
    full = (tree, key, tuple((np.shape(x), str(traced_dtype(x))) for x in leaves))
    counted = (full, tuple(g.counts for g in self.plan.groups))  # programs that order outputs by the counts
    built = self._built.get(full) or self._built.get(counted)
    if built is None:
      built = build(fn, self.plan, self._meshes, state, leaves, tree, n_batch=len(jax.tree.leaves(batch)),
                    batch_stats=self.batch_stats, donate_state=self.donate_state)
      self._built[counted if built.ordered else full] = built  # runners that adopted these programs share them
    self._latest = built
    return self._latest

  def _call(self, name: str, program: Callable[..., Any], *args: Any) -> Any:
    """``program(*args)``, its arguments' shapes and shardings kept for :meth:`memory_analysis` (once per
    program: a program's arguments keep their shapes)."""
    fresh = self._last.get(name, (None,))[0] is not program
    if fresh:
      self._last[name] = (program, jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
          args))
    out = program(*args)
    # a one-loop group's program, timed as it runs; not on its first call, which runs beside the compiles of the
    # programs dispatched after it
    if self.clock is not None and not fresh and name.startswith("group ") and name[6:].isdigit():
      g = int(name[6:])
      # a lockstep group runs its longest count (hetspmd.lowering.loop._DeviceLoop.trips), never its spare slots
      self.clock.watch(g, args, out, max(self.plan.groups[g].counts))
    return out

  def _placed(self, built: GroupPrograms, i: int, x: Any) -> Any:
    """State leaf ``i`` where the plan keeps it: a held optimizer-state leaf whole on its owner (a handle with no
    shard here when another process holds it); any other as it is (the programs place it)."""
    if i not in built.owner:
      return x
    return transfers.held_on(x, built.owner[i], jax.ShapeDtypeStruct(np.shape(x), traced_dtype(x)))


def _same_but_counts(mine: GroupPlan, theirs: GroupPlan) -> bool:
  """Whether two group plans differ in their groups' counts alone, every group with slots (its programs read
  its counts when they run) and the same buffers."""
  blank = lambda plan: ([dataclasses.replace(g, counts=(0,) * len(g.counts)) for g in plan.groups],
                        [getattr(plan, f.name) for f in dataclasses.fields(plan) if f.compare and f.name != "groups"])
  return (blank(mine) == blank(theirs) and all(g.slots for g in mine.groups)
          and [g.max_count for g in mine.groups] == [g.max_count for g in theirs.groups])

def _sharded_lines(plan: GroupPlan, built: GroupPrograms | None, execution: Execution) -> list[str]:
  """:meth:`GroupedStep.explain`'s lines on the groups that shard their parameters (FSDP within the group)."""
  lines = []
  for g, group in enumerate(plan.groups):
    if not group.shard_params:
      continue
    split = built.shards[g] if built is not None and built.shards else None
    what = (f"{len(split.at)} parameter leaves" if split else "no parameter (none read only by its loop)"
            if built is not None else "the parameters its loop reads (known once traced)")
    lines.append(f"  group {g} shards its parameters over its {len(group.devices)} devices (FSDP): {what} split "
                 f"evenly (zero-padded along one axis), each gathered for each equation that reads it (forward and "
                 f"backward apart; a layer scan's a slice per iteration), each microbatch's gradient sums "
                 f"reduce-scattered into parts; its devices run {max(group.counts)} microbatch(es) in lockstep (the "
                 "ones a device lacks masked); " + _handed(built, execution))
    sizes = split.sizes if split is not None else None
    if sizes is not None:
      lines.append(f"    per device: {_mb(sizes.held)} of the parameters held in its loop (of {_mb(sizes.whole)} "
                   f"whole), at most {_mb(sizes.gathered)} gathered at once (two readers' copies in a row), "
                   f"its part of the gradient sums; activations as one microbatch of {group.microbatch} makes them "
                   "(memory_analysis() measures each program)")
      lines.append(f"    on GPUs, to overlap them with compute, start JAX with XLA_FLAGS=\"{sizes.xla_gpu_flags()}\"")
  return lines


def _handed(built: GroupPrograms | None, execution: Execution) -> str:
  """What a sharded group hands over after its loop, in words."""
  rows = "each device's row is its part in place, zeros elsewhere"
  if built is None or not built.part_sums:
    return rows
  if execution.owners_reduce:
    return (f"each device hands the state's owners its parts of {len(built.part_sums)} sums, which each owner "
            f"joins (of any other sum, {rows})")
  return (f"each device hands the exchange its parts of {len(built.part_sums)} sums, added across the groups "
          f"(of any other sum, {rows})")


def _mb(n: int) -> str:
  return f"{n / 1e6:.3f} MB" if n < 1e9 else f"{n / 1e9:.2f} GB"


def _held_lines(built: GroupPrograms, devices: tuple, shares: tuple, three: bool) -> list[str]:
  """:meth:`GroupedStep.explain`'s lines on where one argument structure's state lives."""
  by_device = {d.id: 0 for d in devices}
  for device in built.owner_paths.values():
    by_device[device.id] += 1
  lines = [f"  {len(built.units.units)} state unit(s) over {len(built.owner_paths)} held leaves; leaves "
           f"held per device: {by_device}"]
  held_bytes = built.held_bytes(devices)
  total = sum(held_bytes) or 1
  lines.append(("  parameter and optimizer-state" if three else "  optimizer-state") +
               " bytes held per device (of its share): " + ", ".join(
      f"{d.id}: {b:,} ({b / total / share:.2f}x)" if share else f"{d.id}: {b:,}"
      for d, b, share in zip(devices, held_bytes, shares)))
  return lines


def run_groups(fn: Callable[..., Any], plan: GroupPlan, *, example_batch: Any = None,
               batch_stats: str = "exact", donate_state: bool = False) -> GroupedStep:
  """``fn`` (a functional step, or NNX in place) run under ``plan``'s group programs. ``example_batch``: a global
  batch to trace the step on before its first call, so that :meth:`GroupedStep.state_shardings` can say where a
  plan with state shares keeps each optimizer-state leaf (to restore a checkpoint into). ``batch_stats``:
  ``"exact"`` (BatchNorm statistics over the global batch, in a loop of their own before the loop that uses
  them, as ``parallelize`` does) or ``"local"`` (each microbatch normalised with its own statistics: over the
  group's microbatch size, each microbatch's results counting by its examples). ``donate_state``: let the
  programs that make the new state reuse the given state's buffers (the state passed in is then deleted): the
  uniform program under a replicated state, each device's update program for the optimizer-state leaves it
  holds under state shares."""
  if not isinstance(plan, GroupPlan):
    raise HetSpmdError(f"run_groups needs a GroupPlan, got {type(plan).__name__}")
  return GroupedStep(fn, plan, example_batch, batch_stats, donate_state)
