"""The calls of one step under a group plan: the groups' loops, the owners' updates and the parameters they send.

Each function dispatches programs :func:`hetspmd.lowering.group_build.build`
made, through ``call(name, program, *args)`` (the runtime's, which keeps
each program's arguments for ``memory_analysis``), and moves values with
:mod:`hetspmd.lowering.transfers`. JAX dispatches asynchronously, so the
groups' programs run at the same time.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from hetspmd._dtypes import traced_dtype
from hetspmd.errors import HetSpmdError
from hetspmd.lowering import transfers
from hetspmd.lowering.group_build import GroupMeshes, GroupPrograms
from hetspmd.lowering.group_stages import Donating


@dataclasses.dataclass(frozen=True)
class PerGroup:
  """A parameter held on one device (``held``, its owner's array) as each group's program takes it (``groups``:
  ``{group: array on its mesh}``): its parts where the group shards it, whole elsewhere
  (:attr:`hetspmd.lowering.group_build.GroupPrograms.parted`)."""

  held: Any
  groups: dict


def run_loops(built: GroupPrograms, meshes: GroupMeshes, counts: tuple, call: Callable[..., Any], *,
              state: list, buffers: dict, others: list):
  """Each loop's group programs (this process's groups: ``counts`` placed, else None; ``buffers``: each one's
  microbatch buffers; ``state``: the state leaves every device has), every loop
  but the last reduced by its uniform combine program for the next: the last loop's partials as global arrays
  (the sums groups hand their owners as parts, ``built.part_sums``, as :class:`~hetspmd.lowering.transfers.Pieces`)
  and the rows of the step's per-example outputs, and the earlier loops' reduced cuts."""
  earlier: dict = {}
  loops = len(built.combines) + 1
  given = {}  # each of this process's groups' inputs, placed once for every loop
  for g, (mesh, placed) in enumerate(zip(meshes.groups, counts)):
    if placed is not None:
      on = functools.partial(transfers.on, mesh)
      inputs = [x.groups[g] if isinstance(x, PerGroup) else on(x) for x in state] + buffers[g] + [on(x) for x in others]
      split = built.shards[g] if built.shards else None
      if split is not None and any(not isinstance(state[k], PerGroup) for k in split.at):  # split over its devices
        inputs = _split(inputs, split.at, split.program, functools.partial(call, f"shard group {g}"))
      given[g] = inputs
  for s in range(loops):
    partials, examples = [], []
    for g, (mesh, programs, placed) in enumerate(zip(meshes.groups, built.loops, counts)):
      if placed is not None:  # this process's groups only
        on = functools.partial(transfers.on, mesh)
        name = f"group {g}" + (f", loop {s}" if loops > 1 else "")
        mine, per_example = call(name, programs[s], given[g], *placed, jax.tree.map(on, earlier))
        partials.append(mine)
        examples.append(per_example)
    first = list(itertools.accumulate((len(part) for part in partials[0]), initial=0))  # flat position of each
    if s == loops - 1 and meshes.parts is not None and built.part_sums:
      _check_parts_agree(built, [x for part in partials[0] for x in part])
    joined = [[_joined(built, meshes, [p[k][j] for p in partials], first[k] + j if s == loops - 1 else None)
               for j in range(len(partials[0][k]))] for k in range(len(partials[0]))]
    if s < loops - 1:
      earlier.update(call(f"combine loop {s}", built.combines[s], joined))
  return joined, earlier, [transfers.global_rows([e[k] for e in examples], meshes.mesh) for k in range(len(examples[0]))]

_AGREED: dict[int, Any] = {}  # id -> GroupPrograms whose processes' parts were found to agree


def _check_parts_agree(built: GroupPrograms, flat: list) -> None:
  """A hybrid plan over several processes: once per set of programs, that every process's groups split each sum
  handed over as parts alike (each process sees only its own groups' parts; a mismatch would give the exchange
  program pieces of different shapes). Every process raises the same error, so none waits on the others."""
  if jax.process_count() == 1 or _AGREED.get(id(built)) is built:
    return
  kept = sorted(built.part_sums)
  width = max((len(s) for s in built.part_sums.values()), default=0) + 1
  mine = np.full((len(kept), width), -1, np.int64)
  for r, j in enumerate(kept):
    row = tuple(flat[j].shape[1:])
    mine[r, :len(row)] = row
  every = np.asarray(multihost_utils.process_allgather(mine))
  differ = [kept[r] for r in range(len(kept)) if not (every[:, r] == every[0, r]).all()]
  if differ:
    raise HetSpmdError(f"the groups of this hybrid plan split {len(differ)} sum(s) into parts of different shapes "
                       f"across processes (the first of shape {tuple(built.part_sums[differ[0]])}): give every group "
                       "the same remat policy")
  _AGREED[id(built)] = built


def _joined(built: GroupPrograms, meshes: GroupMeshes, pieces: list, j: int | None) -> Any:
  """One partial value from this process's groups' rows of it (``j``: its flat position among the last loop's,
  else None): a global array of every device's row, or a sum groups hand over as parts (``built.part_sums``):
  to their owners as :class:`~hetspmd.lowering.transfers.Pieces`, in a hybrid plan one row per group split over
  its devices (:func:`~hetspmd.lowering.transfers.part_rows`)."""
  if j is not None and j in built.part_sums:
    if meshes.parts is None:
      return transfers.Pieces(tuple(pieces), built.part_sums[j])
    parts = transfers.part_rows(pieces, meshes.parts, built.part_sums[j])
    if parts is not None:
      return parts
  return transfers.global_rows(pieces, meshes.mesh)


def _split(inputs: list, at: tuple, program: Callable[..., Any], call: Callable[..., Any]) -> list:
  """``inputs`` with those ``at`` (positions) replaced by their parts, split over the group by ``program``."""
  parts = dict(zip(at, call(program, [inputs[k] for k in at])))
  return [parts.get(k, x) for k, x in enumerate(inputs)]


def run_updates(built: GroupPrograms, outputs: list, inputs: list, sums: Any, masters: dict, *, mesh: Mesh,
                shares: tuple, call: Callable[..., Any], called: dict, one_process: bool) -> None:
  """Each of this process's devices' update program on its held leaves, its outputs set in ``outputs`` (``call``:
  runs a named program; ``called``: ``{name: (program, ...)}`` of those run before); ``inputs``: the step's flat inputs, the
  batch's None; ``sums``: the reduced sums, or the rows and earlier totals each owner reduces itself;
  ``masters``: the parameters sent as casts, each as it is held, which its maker's update reads); a held
  leaf's new value stays on the device, every other output is sent to every device."""
  made: dict[int, Any] = {}
  calls = []
  flat = [x for part in sums[0] for x in part] if built.needs is not None else []
  reduced = (dict(zip(sorted(built.relay), call("reduce-scatter", built.scatter,
                                                       [flat[j] for j in sorted(built.relay)])))
             if built.relay else {})
  for device, (outs, program) in built.updates.items():
    if device.process_index != jax.process_index():
      for o in outs:  # made in another process: this process's handle on it has no shard here
        if o in built.kept:
          outputs[o] = transfers.elsewhere(built.out_avals[o], device)
      continue
    mine = functools.partial(transfers.shard_on, device=device)
    made_here = {i for i, (maker, _) in built.params.items() if maker == device and i in masters}
    given = [x if i in built.owner else mine(masters[i] if i in made_here else x.held if isinstance(x, PerGroup) else x)
             for i, x in enumerate(inputs)
             if built.owner.get(i, device) == device and not (i in built.parted and built.params[i][0] != device)]
    if built.needs is None:  # the reduced sums: this device's copies
      extra = (jax.tree.map(mine, sums),)
    else:  # every device's rows of the sums its units read, and the earlier loops' totals
      extra = (transfers.rows_on(device, built.needs[device], flat, reduced, built.relay),
               jax.tree.map(mine, sums[1]))
    calls.append((f"update on device {device.id}", outs, program, given, extra))
  # every donating update compiled before any runs (one not yet called): one that fails leaves the state whole
  for name, _, program, given, extra in calls:
    if isinstance(program, Donating) and called.get(name, (None,))[0] is not program:
      program.lower(given, *extra).compile()  # into jax.jit's cache: the call below compiles nothing new
  for name, outs, program, given, extra in calls:
    for o, x in zip(outs, call(name, program, given, *extra)):
      if o in built.kept:
        outputs[o] = x
      else:
        made[o] = x
  owner = {o: device for device, (outs, _) in built.updates.items() for o in outs if o not in built.kept}
  sent = transfers.broadcast(owner, made, {o: built.out_avals[o] for o in owner}, mesh, shares,
                             functools.partial(call, "send"), one_process=one_process)
  for o in sent:
    outputs[o] = sent[o]

def gather_params(built: GroupPrograms, state_leaves: list, meshes: GroupMeshes, shares: tuple,
                  call: Callable[..., Any]) -> list:
  """``state_leaves`` with each parameter ZeRO-3 holds on one device (between steps) on every device, for the
  step's programs: cast first, on its device, where the programs take its cast (``built.casts``); a parameter
  already replicated (a first call) stays where it is, cast there. A parameter groups take as parts
  (``built.parted``) reaches each group's devices as that group takes it (:class:`PerGroup`)."""
  mesh = meshes.mesh
  casts = built.casts
  held = {i: device for i, (device, _) in built.params.items()
          if isinstance(state_leaves[i], jax.Array) and state_leaves[i].sharding.device_set == {device}}
  local = transfers.cast_where_held({i: state_leaves[i] for i, device in held.items()
                                     if device.process_index == jax.process_index()}, casts)
  avals = {i: jax.ShapeDtypeStruct(np.shape(state_leaves[i]), casts.get(i, traced_dtype(state_leaves[i])))
           for i in held}
  parted = {i: device for i, device in held.items() if i in built.parted}
  sent = transfers.broadcast({i: d for i, d in held.items() if i not in parted},
                             {i: x for i, x in local.items() if i not in parted}, avals, mesh, shares,
                             functools.partial(call, "gather"), one_process=meshes.execution.one_process)
  sent.update({i: PerGroup(state_leaves[i], _per_group(local[i], built.parted[i], meshes))  # cast, where cast
               for i in parted if i in local})
  return [sent[i] if i in sent else transfers.cast_value(x, casts[i]) if i in casts else x
          for i, x in enumerate(state_leaves)]


def held_parts(built: GroupPrograms, state_leaves: list, meshes: GroupMeshes) -> list:
  """``state_leaves`` with each leaf a hybrid plan holds split (``built.held_split``) as each group's program takes
  it (:class:`PerGroup`: the group's own shards, no copy), split first where it comes whole (a first call); the
  others as they are."""
  def placed(i, x):
    if i not in built.held_split:
      return x
    axis = built.held_split[i]
    x = transfers.split_on(x, meshes.held_split(axis))
    return PerGroup(x, {g: transfers.group_part(x, mesh, axis) for g, mesh in enumerate(meshes.groups)
                        if any(d.process_index == jax.process_index() for d in mesh.devices.flat)})

  return [placed(i, x) for i, x in enumerate(state_leaves)]


def _per_group(x: Any, axes: dict, meshes: GroupMeshes) -> dict:
  """``{group: array}`` of ``x`` (whole on one device) for each group's program: split along ``axes[group]`` where
  the group shards it (only each part crosses to its device), else whole on every device of the group."""
  return {g: transfers.parts_on(x, mesh, axes[g]) if g in axes else transfers.on(mesh, x)
          for g, mesh in enumerate(meshes.groups)}
