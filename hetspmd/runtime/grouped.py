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

Across processes (``jax.distributed``), every group's devices are one
process's, and each process dispatches only its own groups' programs and its
own devices' updates; the exchange program spans them all, and the
parameters an update makes reach every device through one uniform program
that adds each device's row (the value on its maker, zeros elsewhere). Every
process passes the whole global batch.

It takes functional steps, ``step(state, batch, *rest) -> outputs`` (a Linen
``TrainState``), and NNX steps that update their objects in place,
``step(model, optimizer, ..., batch)``, with one microbatch loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hetspmd import lowering
from hetspmd.autodiff import SAVED, remat_policy
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.lowering import groups as group_lowering
from hetspmd.lowering.program import Program
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd._pytree import leaves_with_paths
from hetspmd.plan.groups import GroupPlan, assign_owners, relay_axis, relays
from hetspmd.plan.state_layout import role_of
from hetspmd.runtime.binding import distinct_leaves, hashable, is_dynamic, is_graph_node
from hetspmd.runtime.group_wrappers import (DATA, Donating, assembled, constrained, donating, group_mesh,
                                            less_held, model_split, narrowed, new_values, relayed, reordered,
                                            returns_state, scatter_program, spread, widened)



@dataclasses.dataclass
class GroupedStep:
  """A functional train step bound to a :class:`GroupPlan`; call it as ``step(state, batch, *rest)`` with the
  global batch (host arrays leading with ``plan.global_batch``)."""

  fn: Callable[..., Any]
  plan: GroupPlan
  example_batch: Any = None
  batch_stats: str = "exact"
  donate_state: bool = False
  _built: dict = dataclasses.field(default_factory=dict)
  _owners: dict = dataclasses.field(default_factory=dict)  # {state path: device} of the held leaves
  _last: dict = dataclasses.field(default_factory=dict)  # {program name: (program, abstract arguments)}

  def __post_init__(self):
    if self.batch_stats not in ("exact", "local"):
      raise InvalidValueError(f"batch_stats must be 'exact' or 'local', got {self.batch_stats!r}")
    by_id = {d.id: d for d in jax.devices()}
    missing = [d for d in self.plan.devices if d not in by_id]
    if missing:
      raise InvalidValueError(f"the group plan names devices {missing} that JAX does not have (it has ids "
                              f"{sorted(by_id)})")
    self.devices = [by_id[d] for d in self.plan.devices]
    self.mesh = Mesh(np.array(self.devices), (DATA,))
    self.group_meshes = [group_mesh([by_id[d] for d in g.devices], g.model) for g in self.plan.groups]
    here = jax.process_index()
    for g, mesh in enumerate(self.group_meshes):
      processes = sorted({d.process_index for d in mesh.devices.flat})
      if len(processes) > 1:
        raise InvalidValueError(f"group {g} holds devices of processes {processes}: each group's program runs in "
                                "one process, so a group's devices must all be one process's")
    self.local = [any(d.process_index == here for d in mesh.devices.flat) for mesh in self.group_meshes]
    if not any(self.local):
      raise InvalidValueError(f"the group plan gives process {here} no devices: every process runs at least one "
                              "group")
    # each loop's counts and first examples, placed once: (this process's group meshes'..., the tail's)
    on = lambda mesh, values: jax.device_put(np.asarray(values, np.int32), NamedSharding(mesh, P(DATA)))
    self._loops = [(on(mesh, g.positions), on(mesh, starts)) if local else None
                   for g, mesh, starts, local in zip(self.plan.groups, self.group_meshes, self.plan.starts(),
                                                     self.local)]
    self._tail = (on(self.mesh, [self.plan.tail_count] * len(self.devices)), on(self.mesh, self.plan.tail_starts()))
    self._sum_rows = jax.jit(lambda rows: [r.sum(axis=0) for r in rows],
                             out_shardings=NamedSharding(self.mesh, P()))

  def state_shardings(self, state: Any) -> Any:
    """The shardings the state lives in between steps (to restore a checkpoint into, as
    ``ParallelStep.state_shardings``): replicated on every device of the plan, except, under state shares, each
    held optimizer-state leaf whole on the one device that updates it."""
    owners = self._owners_of(state) if self.plan.state_shares else {}
    replicated = NamedSharding(self.mesh, P())
    return jax.tree.unflatten(jax.tree.structure(state), [
        jax.sharding.SingleDeviceSharding(owners[path]) if path in owners else replicated
        for path, _ in leaves_with_paths(state)])

  def shard_state(self, state: Any) -> Any:
    """``state`` placed as :meth:`state_shardings` says. Under state shares, before the step has been traced
    (no call yet, no ``example_batch``), the optimizer-state leaves stay where they are until the first call
    places each on its device."""
    if self.plan.state_shares and not self._owners and self.example_batch is None:
      return jax.tree.unflatten(jax.tree.structure(state), [
          x if role_of(path, _traced_dtype(x)) == "opt_state" else _on(self.mesh, x)
          for path, x in leaves_with_paths(state)])
    placed = []
    for x, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(self.state_shardings(state))):
      device = next(iter(sharding.device_set))
      if isinstance(sharding, NamedSharding):
        placed.append(_on(self.mesh, x))
      elif device.process_index == jax.process_index():
        placed.append(jax.device_put(x, sharding))
      else:
        placed.append(_elsewhere(jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x)), device))
    return jax.tree.unflatten(jax.tree.structure(state), placed)

  @property
  def traced(self) -> bool:
    """Whether the step has been traced (a call, or :meth:`prepare`): the held leaves' devices are known."""
    return bool(self._built)

  def _owners_of(self, state: Any) -> dict:
    """``{path: device}`` of the held optimizer-state leaves, which come from the step's trace: of the first call,
    or of ``example_batch``."""
    if not self._owners:
      if self.example_batch is None:
        raise HetSpmdError("under state_shares the device holding each optimizer-state leaf comes from the step's "
                           "trace: call the step once first, or pass example_batch=batch (to parallelize or "
                           "run_groups)")
      leaves, tree = jax.tree.flatten((state, self.example_batch, ()))
      self._built_for(self.fn, None, state, leaves, tree, len(jax.tree.leaves(self.example_batch)))
    return self._owners

  def resident_bytes(self, state: Any) -> dict[int, int]:
    """Bytes of ``state`` each device of the plan (by JAX id) holds between steps."""
    out = {d.id: 0 for d in self.devices}
    for x in jax.tree.leaves(state):
      for shard in getattr(x, "addressable_shards", ()):
        if shard.device.id in out:
          out[shard.device.id] += shard.data.nbytes
    return out

  def explain(self) -> str:
    lines = [self.plan.summary()]
    if not self.plan.state_shares:
      lines.append("  state replicated on every device (ZeRO-0); each group's program runs its loop, one uniform "
                   "program over every device reduces and updates")
      return "\n".join(lines)
    three = self.plan.zero_stage == 3
    lines.append(("  each device sends the parameters it holds to every device; " if three else "  ") +
                 "each group's program runs its loop; one uniform program over every device reduces the sums and "
                 "computes what reads no held leaf; each device's own program updates its held leaves" +
                 (" and keeps the parameters it made" if three else " and sends the parameters it made to every "
                  "device"))
    for built in self._built.values():
      if built.units is not None:
        by_device = {d.id: 0 for d in self.devices}
        for path, device in built.owner_paths.items():
          by_device[device.id] += 1
        lines.append(f"  {len(built.units.units)} state unit(s) over {len(built.owner_paths)} held leaves; leaves "
                     f"held per device: {by_device}")
        total = sum(built.held_bytes) or 1
        if built.casts:
          names = sorted({str(d) for d in built.casts.values()})
          lines.append(f"  {len(built.casts)} of {len(built.params)} parameters sent as their {', '.join(names)} "
                       "casts (the step reads them only so); each device updates the ones it holds as they are")
        lines.append(("  parameter and optimizer-state" if three else "  optimizer-state") +
                     " bytes held per device (of its share): " + ", ".join(
            f"{d.id}: {b:,} ({b / total / share:.2f}x)" if share else f"{d.id}: {b:,}"
            for d, b, share in zip(self.devices, built.held_bytes, self.plan.state_shares)))
    return "\n".join(lines)

  def __call__(self, *args: Any) -> Any:
    """``step(state, batch, *rest)`` for a functional step; for NNX in place, ``step(*objects and batch)``: the
    objects' state is split out (as ``nnx.jit`` does), and updated in place after the step."""
    from flax import nnx

    graph = [i for i, a in enumerate(args) if is_graph_node(a)]
    if not graph:
      if len(args) < 2:
        raise InvalidValueError("a functional step is called as step(state, batch, *rest)")
      return self.run(self.fn, args[0], args[1], args[2:])
    batch_at = next((i for i, a in enumerate(args) if i not in graph and (isinstance(a, GroupedBatch) or (
        jax.tree.leaves(a) and all(np.shape(x)[:1] == (self.plan.global_batch,) for x in jax.tree.leaves(a))))),
                    None)
    if batch_at is None:
      raise InvalidValueError(f"no argument of the step is a batch of {self.plan.global_batch} examples")
    objects = tuple(args[i] for i in graph)
    graphdef, state = nnx.split(objects)
    rest_at = [i for i in range(len(args)) if i not in graph and i != batch_at]

    def pure(state, batch, *rest):
      merged = nnx.merge(graphdef, state)
      call = list(args)
      for i, o in zip(graph, merged):
        call[i] = o
      call[batch_at] = batch
      for i, r in zip(rest_at, rest):
        call[i] = r
      out = self.fn(*call)
      return nnx.state(merged), out

    new_state, out = self.run(pure, state, args[batch_at], tuple(args[i] for i in rest_at), graphdef=graphdef)
    nnx.update(objects, new_state)
    return out

  def shard_batch(self, batch: Any) -> "GroupedBatch":
    """``batch`` (the global batch, on every process) placed for this plan ahead of the step: this process's
    groups' microbatch buffers and the tail's. Pass it to the step in the batch's place, as
    ``ParallelStep.shard_batch``'s result."""
    self._check_batch(batch)
    leaves, tree = jax.tree.flatten(batch)
    return GroupedBatch(jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x))
                                                  for x in leaves]),
                        {g: self._buffers(g, leaves) for g, loop in enumerate(self._loops) if loop is not None},
                        self._tail_buffers(leaves) if self.plan.tail_count else [None] * len(leaves))

  def _check_batch(self, batch: Any) -> None:
    for x in jax.tree.leaves(batch):
      if np.shape(x)[:1] != (self.plan.global_batch,):
        raise InvalidValueError(f"every batch array must lead with the plan's global batch of "
                                f"{self.plan.global_batch}, got shape {np.shape(x)}")

  def prepare(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, *, graphdef: Any = None,
              static: Any = ()) -> "_Built":
    """Traces ``fn(state, batch, *rest)`` and builds its programs (compiled on first run); raises
    :class:`HetSpmdError` for a step group programs do not run. ``static``: a key for values already bound into
    ``fn`` (:func:`static_bound`)."""
    fn, rest, found = static_bound(fn, rest)
    return self._prepared(fn, state, batch, rest, (graphdef, static, found))

  def _prepared(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, key: Any) -> "_Built":
    """:meth:`prepare` of a step whose ``rest`` holds arrays only; ``key``: what else tells its programs apart
    (the NNX graph, the values bound into ``fn``)."""
    batch = batch.abstract if isinstance(batch, GroupedBatch) else batch
    leaves, tree = jax.tree.flatten((state, batch, rest))
    self._check_batch(batch)
    return self._built_for(fn, key, state, leaves, tree, len(jax.tree.leaves(batch)))

  def run(self, fn: Callable[..., Any], state: Any, batch: Any, rest: tuple, *, graphdef: Any = None,
          static: Any = ()) -> Any:
    """One step of ``fn(state, batch, *rest)`` (``batch``: the global batch, or placed by :meth:`shard_batch`);
    ``graphdef``: the NNX objects' whose state ``state`` is, ``static``: a key for the values bound into ``fn``
    (both part of the programs' cache key). Leaves of ``rest`` that are not arrays are bound as constants."""
    placed = batch if isinstance(batch, GroupedBatch) else None
    batch = placed.abstract if placed is not None else batch
    fn, rest, found = static_bound(fn, rest)
    leaves, tree = jax.tree.flatten((state, batch, rest))
    n_state, n_batch = len(jax.tree.leaves(state)), len(jax.tree.leaves(batch))
    built = self._prepared(fn, state, batch, rest, (graphdef, static, found))
    batch_leaves = leaves[n_state:n_state + n_batch]
    given = distinct_leaves(leaves[:n_state]) if self.donate_state else leaves[:n_state]  # each buffer donated once
    state_leaves = [self._placed(built, i, x) for i, x in enumerate(given)]
    masters = {i: state_leaves[i] for i in built.casts}  # the parameters the programs take as casts, as held
    if built.params:
      state_leaves = self._gathered(built, state_leaves)
    others = leaves[n_state + n_batch:]
    free = [i for i in range(n_state) if i not in built.owner]  # the state leaves every device has
    placed = placed or self.shard_batch(jax.tree.unflatten(jax.tree.structure(batch), batch_leaves))
    joined, earlier, examples = self._loops_of(built, [state_leaves[i] for i in free], placed.groups, others)
    tail = placed.tail
    common = [_on(self.mesh, state_leaves[i]) for i in free] + tail + [_on(self.mesh, x) for x in others]
    results = self._call("exchange", built.exchange, common, joined, *self._tail, earlier, examples)
    if built.units is None:
      return jax.tree.unflatten(built.out_tree, results)
    results, sums = (results, (joined, earlier)) if built.needs is not None else results
    outputs: list[Any] = [None] * built.out_tree.num_leaves
    for o, x in zip(built.units.common, results):
      outputs[o] = x
    self._update(built, outputs, state_leaves, n_batch, [_on(self.mesh, x) for x in others], sums, masters=masters)
    return jax.tree.unflatten(built.out_tree, outputs)

  def _loops_of(self, built: "_Built", state: list, buffers: dict, others: list):
    """Each loop's group programs (this process's groups, ``buffers``: each one's microbatch buffers), every loop
    but the last reduced by its uniform combine program for the next: the last loop's partials and the rows of
    the step's per-example outputs as global arrays, and the earlier loops' reduced cuts."""
    earlier: dict = {}
    loops = len(built.combines) + 1
    for s in range(loops):
      partials, examples = [], []
      for g, (mesh, programs, loop) in enumerate(zip(self.group_meshes, built.programs, self._loops)):
        if loop is not None:  # this process's groups only
          inputs = [_on(mesh, x) for x in state] + buffers[g] + [_on(mesh, x) for x in others]
          name = f"group {g}" + (f", loop {s}" if loops > 1 else "")
          mine, rows = self._call(name, programs[s], inputs, *loop, jax.tree.map(functools.partial(_on, mesh),
                                                                                  earlier))
          partials.append(mine)
          examples.append(rows)
      joined = [[self._rows([p[k][j] for p in partials]) for j in range(len(partials[0][k]))]
                for k in range(len(partials[0]))]
      if s < loops - 1:
        earlier.update(self._call(f"combine loop {s}", built.combines[s], joined))
    return joined, earlier, [self._rows([e[k] for e in examples]) for k in range(len(examples[0]))]

  def _update(self, built: "_Built", outputs: list, state_leaves: list, n_batch: int, others: list, sums, *,
              masters: dict) -> None:
    """Each of this process's devices' update program on its held leaves (the rest of the state and ``sums``: its
    own copies; ``masters``: the parameters sent as casts, each as it is held, which its maker's update reads); a
    held leaf's new value stays on the device, every other output is sent to every device."""
    kept = built.kept
    made: dict[int, Any] = {}
    calls = []
    reduced = self._scattered(built, sums[0]) if built.relay else {}
    for device, (outs, program) in built.updates.items():
      if device.process_index != jax.process_index():
        for o in outs:  # made in another process: this process's handle on it has no shard here
          if o in kept:
            outputs[o] = _elsewhere(built.out_avals[o], device)
        continue
      mine = functools.partial(_shard_on, device=device)
      made_here = {i for i, (maker, _) in built.params.items() if maker == device and i in masters}
      inputs = [state_leaves[i] if i in built.owner else mine(masters[i] if i in made_here else state_leaves[i])
                for i in range(len(state_leaves)) if built.owner.get(i, device) == device]
      inputs += [None] * n_batch + [mine(x) for x in others]
      if built.needs is None:  # the reduced sums: this device's copies
        given = (jax.tree.map(mine, sums),)
      else:  # every device's rows of the sums its units read, and the earlier loops' totals
        given = (self._rows_on(device, built.needs[device], sums[0], reduced, built.relay), jax.tree.map(mine, sums[1]))
      calls.append((f"update on device {device.id}", outs, program, inputs, given))
    # every donating update compiled before any runs (one not yet called): one that fails leaves the state whole
    for name, _, program, inputs, given in calls:
      if isinstance(program, Donating) and self._last.get(name, (None,))[0] is not program:
        program.lower(inputs, *given).compile()  # into jax.jit's cache: the call below compiles nothing new
    for name, outs, program, inputs, given in calls:
      for o, x in zip(outs, self._call(name, program, inputs, *given)):
        if o in kept:
          outputs[o] = x
        else:
          made[o] = x
    sent = self._send(built, made)
    for o in sent:
      outputs[o] = sent[o]

  def _rows_on(self, device: Any, needed: tuple[int, ...], partials: list, reduced: dict, axes: dict) -> list:
    """Per partial value (the last loop's, flattened) that the update on ``device`` reads (``needed``), else None:
    every device's row of it copied there, or, for a value ``reduced`` holds (split along ``axes[j]``), its sum
    over the devices made whole there, one row."""
    flat = [x for part in partials for x in part]
    rows = {j: [s.data for s in sorted(flat[j].addressable_shards, key=lambda s: s.index[0].start or 0)]
            for j in needed if j not in reduced}
    moved = jax.device_put(rows, device)
    summed = [j for j in needed if j in reduced]
    moved.update(zip(summed, ([x] for x in assembled([reduced[j] for j in summed], [axes[j] for j in summed],
                                                    device))))
    return [moved.get(j) for j in range(len(flat))]

  def _scattered(self, built: "_Built", partials: list) -> dict:
    """``{partial value: its sum over the devices, split evenly over them}`` for the values ``built.relay`` names,
    by one reduce-scatter program."""
    flat = [x for part in partials for x in part]
    order = sorted(built.relay)
    return dict(zip(order, self._call("reduce-scatter", built.scatter, [flat[j] for j in order])))

  def _send(self, built: "_Built", made: dict[int, Any]) -> dict[int, Any]:
    """The outputs of the update programs that every device needs, on every device."""
    owner = {o: device for device, (outs, _) in built.updates.items() for o in outs if o not in built.kept}
    return self._broadcast("send", owner, made, {o: built.out_avals[o] for o in owner})

  def _gathered(self, built: "_Built", state_leaves: list) -> list:
    """``state_leaves`` with each parameter ZeRO-3 holds on one device (between steps) on every device, for the
    step's programs: cast first, on its device, where the programs take its cast (``built.casts``); a parameter
    already replicated (a first call) stays where it is, cast there."""
    casts = built.casts
    held = {i: device for i, (device, _) in built.params.items()
            if isinstance(state_leaves[i], jax.Array) and state_leaves[i].sharding.device_set == {device}}
    local = {i: state_leaves[i] for i, device in held.items() if device.process_index == jax.process_index()}
    by_device: dict[Any, list[int]] = {}
    for i in local:
      if i in casts:
        by_device.setdefault(held[i], []).append(i)
    for mine in by_device.values():  # one program per device casts its parameters
      local.update(zip(mine, _cast([local[i] for i in mine], tuple(casts[i].name for i in mine))))
    sent = self._broadcast("gather", held, local, {
        i: jax.ShapeDtypeStruct(np.shape(state_leaves[i]), casts.get(i, _traced_dtype(state_leaves[i])))
        for i in held})
    return [sent[i] if i in sent else _narrowed(x, casts[i]) if i in casts else x for i, x in enumerate(state_leaves)]

  def _broadcast(self, name: str, owner: dict, local: dict, avals: dict) -> dict:
    """``{key: value}`` on every device, for each ``key`` of ``owner`` whose value lives on ``owner[key]``
    (``local``: this process's values; ``avals``: every value's shape and dtype). In one process each is copied
    from its device, or where one device holds much more than the rest (:func:`hetspmd.plan.groups.relays`)
    sent in two hops (:func:`relayed`); across processes, one uniform program adds rows that are the value on
    its device and zeros on every other."""
    replicated = NamedSharding(self.mesh, P())
    if jax.process_count() == 1:
      if relays(self.plan.state_shares):
        return relayed(local, self.mesh)
      return {k: jax.device_put(x, replicated) for k, x in local.items()}
    order = sorted(owner)
    rows = []
    for k in order:
      aval = avals[k]
      pieces = [local[k] if owner[k] == d else jnp.zeros(aval.shape, aval.dtype, device=d) for d in self.devices
                if d.process_index == jax.process_index()]
      rows.append(jax.make_array_from_single_device_arrays((len(self.devices),) + tuple(aval.shape),
                                                           NamedSharding(self.mesh, P(DATA)),
                                                           [x[None] for x in pieces]))
    return dict(zip(order, self._call(name, self._sum_rows, rows))) if order else {}

  def _call(self, name: str, program: Callable[..., Any], *args: Any) -> Any:
    """``program(*args)``, its arguments' shapes and shardings kept for :meth:`memory_analysis` (once per
    program: a program's arguments keep their shapes)."""
    if self._last.get(name, (None,))[0] is not program:
      self._last[name] = (program, jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x,
          args))
    return program(*args)

  def memory_analysis(self) -> dict[str, Any]:
    """Each program of the last call (by name: ``group 0``, ``exchange``, ``update on device 3``) and XLA's
    ``Compiled.memory_analysis()`` of it: argument, output and temporary bytes per device."""
    if not self._last:
      raise HetSpmdError("memory_analysis describes the programs of the last call: call the step first")
    return {name: program.lower(*args).compile().memory_analysis() for name, (program, args) in self._last.items()}

  def _placed(self, built: "_Built", i: int, x: Any) -> Any:
    """State leaf ``i`` where the plan keeps it: a held optimizer-state leaf whole on its owner (a handle with no
    shard here when another process holds it); any other as it is (the programs place it)."""
    if i not in built.owner:
      return x
    device = built.owner[i]
    if isinstance(x, jax.Array) and x.sharding.device_set == {device}:
      return x
    if device.process_index != jax.process_index():
      return _elsewhere(jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x)), device)
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))

  def _built_for(self, fn, extra_key, state, leaves, tree, n_batch) -> "_Built":
    key = (tree, extra_key, tuple((np.shape(x), str(_traced_dtype(x))) for x in leaves))
    if key not in self._built:
      self._built[key] = self._build(fn, state, tree, leaves, n_batch)
      self._owners = self._built[key].owner_paths
    return self._built[key]

  def _build(self, fn, state, tree, leaves, n_batch) -> "_Built":
    n_state = len(jax.tree.leaves(state))
    progs, shapes = self._traced(fn, tree, leaves, n_state, n_batch)
    prog = progs[self.plan.tail_remat]  # the exchange program's trace
    out_tree = jax.tree.structure(shapes)
    new_value_of = new_values(state, out_tree)
    units, owner, params = self._units(prog, state, new_value_of) if self.plan.state_shares else (None, {}, {})
    donated = frozenset(new_value_of.values()) if self.donate_state and returns_state(prog, new_value_of) else ()
    held = tuple(sorted(owner))
    loops = prog.analysis.loops
    casts = _narrow_reads(progs, units, params)
    wide = {i: jx.aval_dtype(prog.invars[i]) for i in casts}  # what the step reads them as
    programs = [self._group_programs(progs, group, mesh, state, held, wide)
                for group, mesh in zip(self.plan.groups, self.group_meshes)]
    combines = [jax.jit(group_lowering.combine_program(prog, s), out_shardings=NamedSharding(self.mesh, P()))
                for s in range(loops - 1)]
    tail = None
    if self.plan.tail_count:
      count = self.plan.tail_count
      tail = lowering.Layout(self.mesh, DATA, self.plan.tail_microbatch, count, (count,) * len(self.devices),
                             reduce_dtype=self.plan.reduce_dtype, overlap=True)
    # under shares, with no tail and in one process, each device reduces the sums its units read itself (the rows
    # it needs are copied to it, or their sums' even parts): no device keeps a reduced gradient it does not update
    to_owner = units is not None and not self.plan.tail_count and jax.process_count() == 1
    order = np.asarray(self.plan.example_slots(), np.int32) if group_lowering.per_example_outputs(prog) else None
    run = group_lowering.exchange_program(prog, tail, units.common if units else None, sums=not to_owner,
                                          order=order)
    # replicated outputs: each group program reads its devices' copies of the new state (no transfer between processes)
    entries = leaves_with_paths(state)
    free = [i for i in range(len(entries)) if i not in owner]
    exchange = donating(less_held(prog, held, widened(wide, run)),
                        [k for k, i in enumerate(free) if i in donated and units is None],
                        out_shardings=NamedSharding(self.mesh, P()))
    updates = {}
    for device in self.devices:
      outs = tuple(sorted(o for ins, unit_outs in (units.units if units else ()) if owner[ins[0]] == device
                          for o in unit_outs))
      if outs:
        mine = {i for i in held if owner[i] == device}
        update = (group_lowering.owner_update_program(prog, outs, len(self.devices)) if to_owner else
                  group_lowering.update_program(prog, outs))
        reads = [i for i in range(len(entries)) if owner.get(i, device) == device]  # its inputs' state leaves
        others = tuple(i for i in held if i not in mine)
        made = {i for i in casts if params[i][0] == device}  # read as held (not as cast): its new value's buffer
        updates[device] = (outs, donating(less_held(prog, others, widened(wide, update)),
                                          [k for k, i in enumerate(reads) if i in mine | made and i in donated]))
    readers = group_lowering.partial_readers(prog) if to_owner else ()
    needs = {device: tuple(j for j, r in enumerate(readers) if r & set(outs)) for device, (outs, _) in updates.items()}
    relay = _relayed_sums(prog, needs, len(self.devices)) if to_owner and relays(self.plan.state_shares) else {}
    holder = {**owner, **{i: device for i, (device, _) in params.items()}}
    held_bytes = tuple(sum(_nbytes(entries[i][1]) for i, d in holder.items() if d == device)
                       for device in self.devices)
    return _Built(programs, exchange, updates, out_tree, units, owner, {entries[i][0]: d for i, d in holder.items()},
                  tuple(jax.tree.leaves(shapes)), held_bytes, combines, params, needs if to_owner else None, casts,
                  relay, scatter_program(self.mesh, tuple(relay[j] for j in sorted(relay))) if relay else None)

  def _group_programs(self, progs: dict[str, Program], group: Any, mesh: Mesh, state: Any,
                      held: tuple[int, ...], wide: dict) -> list:
    """``group``'s program of each loop, ``jax.jit`` over its ``mesh``: its own trace's loop (its remat policy's,
    from ``progs``; the parameters ``wide`` names taken as their casts), its partial sums laid out and narrowed as
    the exchange program takes them, one row per device."""
    prog, own = progs[self.plan.tail_remat], progs[group.remat]
    loops = prog.analysis.loops
    layout = lowering.Layout(mesh, DATA, group.microbatch, group.max_count, group.positions)
    order = None if own is prog else group_lowering.sums_order(prog, own)
    split = model_split(state, group, mesh)
    # the gradients leave the last loop in the plan's reduce dtype (with a tail, the tail's reduction narrows them)
    mask = None if self.plan.tail_count else group_lowering.narrowed(prog, self.plan.reduce_dtype)
    out = []
    for s in range(loops):
      loop = group_lowering.group_program(own, layout, s, self.plan.example_width)
      run = reordered(order, less_held(own, held, widened(wide, constrained(split, loop))))
      run = spread(prog, s, group.model, narrowed(mask if s == loops - 1 else None, self.plan.reduce_dtype, run))
      out.append(jax.jit(run, out_shardings=NamedSharding(mesh, P(tuple(mesh.axis_names)))))
    return out

  def _traced(self, fn, tree, leaves, n_state: int, n_batch: int) -> tuple[dict[str, Program], Any]:
    """The step's analysed program under each remat policy the plan uses (its groups' and the tail's), and its
    output shapes."""
    batch_inputs = tuple(range(n_state, n_state + n_batch))
    avals = [jax.ShapeDtypeStruct(np.shape(x), _traced_dtype(x)) for x in leaves]
    floats = tuple(i for i, x in enumerate(leaves[:n_state]) if jnp.issubdtype(_traced_dtype(x), jnp.floating))

    def flat(*xs):  # one function per trace: JAX caches a trace by its function, which does not see the policy
      state, batch, rest = jax.tree.unflatten(tree, xs)
      return fn(state, batch, *rest)

    progs, shapes = {}, None
    policies = list(dict.fromkeys([self.plan.tail_remat] + [g.remat for g in self.plan.groups]))
    for policy in policies:
      # beside checkpointed groups, "none" is traced checkpointed too, saving everything: the same cuts
      with remat_policy(SAVED if policy == "none" and len(policies) > 1 else policy):
        closed, shapes = jx.make_closed_jaxpr(functools.partial(flat), *avals, return_shape=True)
      progs[policy] = Program(analyse(closed, batch_inputs, self.plan.global_batch, batch_stats=self.batch_stats,
                                      float_state_inputs=floats), batch_inputs)
      group_lowering.check(progs[policy], tail=bool(self.plan.tail_count))
    if len(progs) > 1 and progs[self.plan.tail_remat].analysis.loops > 1:
      raise HetSpmdError(f"this step needs {progs[self.plan.tail_remat].analysis.loops} microbatch loops, whose "
                         f"sums feed one another: give every group the same remat policy (the plan has "
                         f"{', '.join(progs)})")
    return progs, shapes

  def _units(self, prog: Program, state: Any, new_value_of: dict[int, int]):
    """The update's state units, the device holding each held optimizer-state leaf (by flat state index) and,
    under ZeRO-3, each parameter a unit makes (``{state index: (device, output)}``); ``new_value_of``:
    :func:`hetspmd.runtime.group_wrappers.new_values`."""
    entries = leaves_with_paths(state)
    held = [i for i, (path, leaf) in enumerate(entries)
            if np.ndim(leaf) >= 1 and np.size(leaf) > 1 and role_of(path, _traced_dtype(leaf)) == "opt_state"]
    units = group_lowering.state_units(prog, held, new_value_of)
    made = [{new_value_of[o]: o for o in outs if o in new_value_of and new_value_of[o] not in held}
            if self.plan.zero_stage == 3 else {} for _, outs in units.units]  # the parameters each unit makes
    sizes = [sum(_nbytes(entries[i][1]) for i in (*ins, *params)) for (ins, _), params in zip(units.units, made)]
    owners = [self.devices[d] for d in assign_owners(sizes, self.plan.state_shares)]
    return (units, {i: owners[u] for u, (ins, _) in enumerate(units.units) for i in ins},
            {i: (owners[u], o) for u, params in enumerate(made) for i, o in params.items()})

  def _buffers(self, g: int, batch_leaves):
    """Group ``g``'s padded microbatch buffers ``[positions * max_count, microbatch, ...]`` of each batch array."""
    group, mesh = self.plan.groups[g], self.group_meshes[g]
    starts = self.plan.starts()[g]
    out = []
    for x in batch_leaves:
      x = np.asarray(x)
      buf = np.zeros((len(group.positions) * group.max_count, group.microbatch) + x.shape[1:], x.dtype)
      for i, (c, s) in enumerate(zip(group.positions, starts)):
        rows = x[s:s + c * group.microbatch].reshape((c, group.microbatch) + x.shape[1:])
        buf[i * group.max_count:i * group.max_count + c] = rows
      out.append(jax.device_put(buf, NamedSharding(mesh, P(DATA))))
    return out

  def _tail_buffers(self, batch_leaves):
    """The tail's microbatch buffers ``[devices * tail_count, tail_microbatch, ...]`` over every device."""
    plan, count, size = self.plan, self.plan.tail_count, self.plan.tail_microbatch
    out = []
    for x in batch_leaves:
      x = np.asarray(x)
      rows = [x[s:s + count * size].reshape((count, size) + x.shape[1:]) for s in plan.tail_starts()]
      out.append(jax.device_put(np.concatenate(rows), NamedSharding(self.mesh, P(DATA))))
    return out

  def _rows(self, parts):
    """One global array over every device from each of this process's groups' rows (one per device, the same
    shape), no copy."""
    shards = [s for part in parts for s in sorted(part.addressable_shards, key=lambda s: s.index[0].start or 0)]
    by_device = {s.device: s.data for s in shards}
    row = shards[0].data.shape
    return jax.make_array_from_single_device_arrays((len(self.devices),) + tuple(row[1:]),
                                                    NamedSharding(self.mesh, P(DATA)),
                                                    [by_device[d] for d in self.devices if d in by_device])


@dataclasses.dataclass(frozen=True)
class GroupedBatch:
  """A global batch placed for a group plan (:meth:`GroupedStep.shard_batch`): its shapes (``abstract``), this
  process's groups' microbatch buffers (by group) and the tail's buffers over every device."""

  abstract: Any
  groups: dict
  tail: list
  placed_for_groups = True  # (a class attribute) a step's batch argument placed ahead, as a ShardedBatch is


def _relayed_sums(prog: Program, needs: dict, n: int) -> dict[int, tuple[int, int]]:
  """``{partial value: (axis, size)}`` of the values the updates read that reach their owners in two hops,
  reduce-scattered over the ``n`` devices along :func:`hetspmd.plan.groups.relay_axis`, then made whole on the
  owner: the sums. (A ``max`` or ``min``, a scalar or an empty value is copied to its owner row by row.)"""
  wanted = set().union(*needs.values()) if needs else set()
  out = {}
  for j, (reduce, shape) in enumerate(group_lowering.partial_values(prog)):
    axis = relay_axis(shape, n)
    if j in wanted and reduce == "sum" and axis is not None:
      out[j] = (axis, shape[axis])
  return out


@dataclasses.dataclass(frozen=True)
class _Built:
  """The programs of one argument structure: each group's loop, the exchange, each device's update (under
  state shares: ``{device: (outputs, program)}``), the output tree, the state units and the device holding each
  held optimizer-state leaf (by flat state index and by path)."""

  programs: list
  exchange: Any
  updates: dict
  out_tree: Any
  units: Any
  owner: dict
  owner_paths: dict
  out_avals: tuple = ()
  held_bytes: tuple = ()  # per device of the plan: the bytes of the state leaves it holds
  combines: list = dataclasses.field(default_factory=list)  # per loop but the last: its uniform combine program
  params: dict = dataclasses.field(default_factory=dict)  # ZeRO-3: {state index: (device, output)} per parameter
  needs: dict | None = None  # each device reducing its own sums: {device: the partial values its units read}
  casts: dict = dataclasses.field(default_factory=dict)  # ZeRO-3: {state index: dtype} of parameters sent as casts
  relay: dict = dataclasses.field(default_factory=dict)  # {partial value: (axis, size)} reduce-scattered, then sent
  scatter: Any = None  # the reduce-scatter program of the values ``relay`` names (in index order)

  @property
  def kept(self) -> frozenset:
    """The update programs' outputs that stay on the device that made them: held leaves' new values (and, under
    ZeRO-3, the parameters')."""
    return self.units.kept_outputs | {o for _, o in self.params.values()}


def static_bound(fn: Callable[..., Any], rest: tuple) -> tuple[Callable[..., Any], tuple, Any]:
  """``fn(state, batch, *rest)`` with the leaves of ``rest`` that are not arrays or numbers (a string, a config,
  a function) bound as constants, as the single program takes them: ``(fn(state, batch, arrays), (arrays,),
  a key for the bound values and where they were)``; ``fn`` and ``rest`` as they are when there are none."""
  leaves, tree = jax.tree.flatten(rest)
  fixed = {i: x for i, x in enumerate(leaves) if not is_dynamic(x)}
  if not fixed:
    return fn, rest, ()

  def bound(state, batch, arrays):
    given = iter(arrays)
    return fn(state, batch, *jax.tree.unflatten(tree, [fixed[i] if i in fixed else next(given)
                                                       for i in range(len(leaves))]))

  return bound, ([x for x in leaves if is_dynamic(x)],), (tree, hashable(tuple(fixed.items())))


def _narrow_reads(progs: dict[str, Program], units: Any, params: dict) -> dict[int, Any]:
  """ZeRO-3: ``{state index: dtype}`` of the parameters every trace in ``progs`` reads, outside the update that
  makes them, only through casts to ``dtype`` (:func:`hetspmd.lowering.groups.narrow_reads`)."""
  if not params:
    return {}
  unit_of = {o: frozenset(outs) for _, outs in units.units for o in outs}
  made_by = {i: unit_of[o] for i, (_, o) in params.items()}
  found = [group_lowering.narrow_reads(p, made_by) for p in progs.values()]
  return {i: d for i, d in found[0].items() if all(f.get(i) == d for f in found[1:])}


@functools.partial(jax.jit, static_argnums=1)
def _cast(xs: list, dtypes: tuple[str, ...]) -> list:
  """``xs`` cast to ``dtypes``, in one program (on the device that holds them)."""
  return [x.astype(d) for x, d in zip(xs, dtypes)]


def _narrowed(x: Any, dtype: Any) -> Any:
  """``x`` (a device array, or a host value) cast to ``dtype`` where it lives."""
  return x.astype(dtype) if isinstance(x, jax.Array) else np.asarray(x).astype(dtype)


def _shard_on(x: Any, device: Any) -> Any:
  """``device``'s own copy of a replicated array (no copy made)."""
  if x is None:
    return None
  if not isinstance(x, jax.Array):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))
  for shard in x.addressable_shards:
    if shard.device == device:
      return shard.data
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(device))


def _elsewhere(aval: Any, device: Any) -> Any:
  """This process's handle on an array that lives whole on ``device`` of another process."""
  return jax.make_array_from_single_device_arrays(tuple(aval.shape), jax.sharding.SingleDeviceSharding(device), [],
                                                  dtype=aval.dtype)


def _nbytes(x: Any) -> int:
  return int(np.size(x)) * np.dtype(_traced_dtype(x)).itemsize


def _traced_dtype(x: Any) -> Any:
  """The dtype ``x`` is traced with (a Python scalar: JAX's default for it)."""
  return x.dtype if hasattr(x, "dtype") else jnp.asarray(x).dtype


def _on(mesh: Mesh, x: Any) -> Any:
  """``x`` (a host value or a replicated array) replicated on ``mesh``'s devices, made from this process's
  pieces: its own per-device buffers where it has them (no copy), a copy of one of them (or of the host value)
  on this process's other devices of ``mesh``. (``jax.device_put`` of a single-device array onto devices of
  several processes does not give a usable array.)"""
  sharding = NamedSharding(mesh, P())
  if isinstance(x, jax.Array) and not x.is_fully_replicated:
    return jax.device_put(x, sharding)  # sharded: one process holds it all
  have = {s.device: s.data for s in x.addressable_shards} if isinstance(x, jax.Array) else {}
  here = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  source = next(iter(have.values()), None) if have else np.asarray(x)
  pieces = [have[d] if d in have else jax.device_put(source, d) for d in here]
  return jax.make_array_from_single_device_arrays(np.shape(x), sharding, pieces)


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
