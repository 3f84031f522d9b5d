"""A group plan's programs for one argument structure: traced, analysed and built once, held in one value.

:func:`build` traces the step under each remat policy the plan uses, finds
where the state lives (:class:`HeldLeaf`: one record per leaf that lives
whole on one device between steps), and builds every program a call runs:
each group's loop (a named chain of :mod:`hetspmd.lowering.group_stages`),
the uniform combine and exchange programs, each device's update and the
reduce-scatter of the sums that reach their owners in two hops. The runtime
(:class:`hetspmd.runtime.grouped.GroupedStep`) places, calls and explains
what it returns (:class:`GroupPrograms`).
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

from hetspmd._dtypes import nbytes, traced_dtype
from hetspmd._pytree import leaves_with_paths, new_state_leaves
from hetspmd.autodiff import SAVED, remat_policy
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.lowering import groups as group_lowering
from hetspmd.lowering.group_stages import (DATA, chain, constrained, donating, group_mesh, less_held, model_split,
                                           narrowed, reordered, returns_state, spread, widened)
from hetspmd.lowering.program import Layout, Program
from hetspmd.lowering.param_shards import shard_program
from hetspmd.lowering.transfers import scatter_program
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.plan.execution import Execution
from hetspmd.plan.groups import GroupPlan, assign_owners, relay_axis, relays
from hetspmd.plan.options import STEP_REMAT_POLICIES
from hetspmd.plan.state_layout import parameter_paths, role_of


GROUP, PART = "group", "part"  # a hybrid plan's mesh axes: its groups, and the devices of each


@dataclasses.dataclass(frozen=True)
class GroupMeshes:
  """Where a group plan runs: its devices (in the plan's order) on one ``data`` axis, and each group's mesh."""

  devices: tuple
  mesh: Mesh
  groups: tuple
  execution: Execution  # how the plan runs on these processes, decided once
  # a hybrid plan's (Execution.hybrid, or parts_exchange) devices as (group, part): each group's devices a row, in
  # the plan's order
  parts: Mesh | None = None

  @classmethod
  def of(cls, plan: GroupPlan) -> "GroupMeshes":
    """The plan's meshes over JAX's devices and how the plan runs on them (:class:`Execution`); a plan naming
    devices JAX lacks, or a group over several processes that does not shard its parameters, is refused."""
    by_id = {d.id: d for d in jax.devices()}
    missing = [d for d in plan.devices if d not in by_id]
    if missing:
      raise InvalidValueError(f"the group plan names devices {missing} that JAX does not have (it has ids "
                              f"{sorted(by_id)})")
    devices = tuple(by_id[d] for d in plan.devices)
    groups = tuple(group_mesh([by_id[d] for d in g.devices], g.model) for g in plan.groups)
    for g, mesh in enumerate(groups):
      processes = sorted({d.process_index for d in mesh.devices.flat})
      if len(processes) > 1 and not plan.groups[g].shard_params:
        raise InvalidValueError(f"group {g} holds devices of processes {processes}: a group whose devices run their "
                                "own trip counts runs in one process, so its devices must all be one process's "
                                "(or let it shard its parameters: Group(shard_params=True) runs over several)")
    execution = Execution.of(plan, {d.id: d.process_index for d in devices})
    parts = (Mesh(np.array([[by_id[d] for d in g.devices] for g in plan.groups]), (GROUP, PART))
             if execution.hybrid or execution.parts_exchange else None)
    return cls(devices, Mesh(np.array(devices), (DATA,)), groups, execution, parts)

  def held_split(self, axis: int) -> NamedSharding:
    """A hybrid plan's held leaf split along ``axis`` over each group's devices, each group its own copy."""
    return NamedSharding(self.parts, P(*([None] * axis), PART))


@dataclasses.dataclass(frozen=True)
class HeldLeaf:
  """A state leaf that lives whole on one device between steps: an optimizer-state leaf under state shares
  (``role="opt_state"``), or under ZeRO-3 a parameter its update unit makes (``role="param"``: ``output`` is the
  step output that is its new value, and ``cast`` the dtype the programs take it as where the step reads it only
  through that cast, else None)."""

  index: int  # flat state index
  path: str
  device: Any
  role: str
  nbytes: int
  output: int | None = None
  cast: Any = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class GroupPrograms:
  """The programs of one argument structure and where its state lives."""

  loops: list  # per group: its program of each microbatch loop
  combines: list  # per loop but the last: its uniform combine program
  exchange: Any  # the uniform program: reduces, then runs what reads no held leaf (or everything)
  updates: dict  # under state shares: {device: (outputs, program)}
  out_tree: Any
  out_avals: tuple
  units: Any  # the update's state units (None without state shares)
  held: tuple = ()  # one HeldLeaf per leaf that lives on one device
  needs: dict | None = None  # each device reducing its own sums: {device: the partial values its units read}
  relay: dict = dataclasses.field(default_factory=dict)  # {partial value: (axis, size)} reduce-scattered, then sent
  scatter: Any = None  # the reduce-scatter program of the values ``relay`` names (in index order)
  group_stages: tuple = ()  # per group: its last loop's stage names, innermost first
  # per group: None, or the parameters it takes split over its devices (Group.shard_params): SplitParams
  shards: tuple = ()
  # ZeRO-3: {state index: {group: axis}} of the parameters held on one device that reach the groups which shard
  # them as parts only (whole to the other groups' devices); neither the exchange nor another owner's update
  # takes them (:func:`_parted`)
  parted: dict = dataclasses.field(default_factory=dict)
  # {flat partial value: its shape} of the sums groups sharding their parameters hand their owners as parts
  # (hetspmd.lowering.transfers.Pieces): under shares, one process, one loop and no tail, those the exchange
  # program does not read
  part_sums: dict = dataclasses.field(default_factory=dict)
  # a hybrid plan (GroupPlan.hybrid): {state index: axis} of the leaves each group holds split over its devices
  # between steps (GroupMeshes.parts), each group its own copy
  held_split: dict = dataclasses.field(default_factory=dict)
  # the exchange program puts per-example outputs (logits) in global order from the plan's counts, as built
  ordered: bool = False

  @property
  def stages(self) -> tuple[str, ...]:
    """Every stage any group's program uses, in chain order."""
    return tuple(dict.fromkeys(name for names in self.group_stages for name in names))

  @functools.cached_property
  def owner(self) -> dict:
    """``{state index: device}`` of the held optimizer-state leaves."""
    return {h.index: h.device for h in self.held if h.role == "opt_state"}

  @functools.cached_property
  def params(self) -> dict:
    """ZeRO-3: ``{state index: (device, output)}`` of the parameters the update units make."""
    return {h.index: (h.device, h.output) for h in self.held if h.role == "param"}

  @functools.cached_property
  def casts(self) -> dict:
    """ZeRO-3: ``{state index: dtype}`` of the parameters sent as their casts."""
    return {h.index: h.cast for h in self.held if h.cast is not None}

  @functools.cached_property
  def owner_paths(self) -> dict:
    """``{state path: device}`` of every held leaf."""
    return {h.path: h.device for h in self.held}

  def held_bytes(self, devices: tuple) -> tuple[int, ...]:
    """Per device of ``devices``: the bytes of the state leaves it holds."""
    return tuple(sum(h.nbytes for h in self.held if h.device == d) for d in devices)

  @functools.cached_property
  def kept(self) -> frozenset:
    """The update programs' outputs that stay on the device that made them: held leaves' new values (and, under
    ZeRO-3, the parameters')."""
    return self.units.kept_outputs | {o for _, o in self.params.values()}


@dataclasses.dataclass(frozen=True)
class SplitParams:
  """The parameters a group takes split over its devices (:attr:`hetspmd.plan.groups.Group.shard_params`): their
  positions among its program's inputs, the program that splits them from whole copies
  (:func:`hetspmd.lowering.param_shards.shard_program`), and the bytes a device holds and gathers of them."""

  at: tuple[int, ...]
  program: Any
  sizes: Any  # hetspmd.lowering.groups.ShardBytes


@dataclasses.dataclass(frozen=True)
class _Step:
  """What :func:`build` reads of the step and its arguments."""

  fn: Callable[..., Any]
  state: Any
  tree: Any  # of (state, batch, rest)
  leaves: list
  n_batch: int

  @property
  def n_state(self) -> int:
    return len(jax.tree.leaves(self.state))


def build(fn: Callable[..., Any], plan: GroupPlan, meshes: GroupMeshes, state: Any, leaves: list, tree: Any, *,
          n_batch: int, batch_stats: str = "exact", donate_state: bool = False) -> GroupPrograms:
  """Every program of ``fn(state, batch, *rest)`` (``leaves``/``tree``: its flattened arguments, ``n_batch`` of
  them the batch's) under ``plan`` on ``meshes``."""
  step, execution = _Step(fn, state, tree, leaves, n_batch), meshes.execution
  progs, shapes = _traced(step, plan, batch_stats)
  prog = progs[plan.tail_remat]  # the exchange program's trace
  out_tree = jax.tree.structure(shapes)
  new_value_of = new_state_leaves(state, out_tree)
  units, held = _held(prog, progs, plan, meshes, state, new_value_of) if plan.state_shares else (None, ())
  donated = frozenset(new_value_of.values()) if donate_state and returns_state(prog, new_value_of) else frozenset()
  owner = {h.index: h.device for h in held if h.role == "opt_state"}
  held_inputs = tuple(sorted(owner))
  wide = {h.index: jx.aval_dtype(prog.invars[h.index]) for h in held if h.cast is not None}  # as the step reads them
  # under shares, with no tail and in one process, each device reduces the sums its units read itself (the rows
  # it needs are copied to it, or their sums' even parts): no device keeps a reduced gradient it does not update
  to_owner = units is not None and execution.owners_reduce
  splits = [_shards(progs[group.remat], group, state, held_inputs, wide) for group in plan.groups]
  # there, a group sharding its parameters hands the owners its parts of the sums the exchange program does not read;
  # in a hybrid plan every group hands the exchange program its parts of every sum, and holds its state split;
  # beside unsharded groups of their size, those hand over the same parts (Execution.parts_exchange)
  held_split = _held_split(state, splits, len(plan.groups[0].devices)) if execution.hybrid else {}
  kept = (group_lowering.part_sums(prog, units.common) if to_owner and any(splits) else
          group_lowering.part_sums(prog, ()) if execution.hybrid or execution.parts_exchange else {})
  loops, stages, shards = [], [], []
  free = [i for i in range(step.n_state) if i not in owner]
  for group, mesh, split in zip(plan.groups, meshes.groups, splits):
    programs, names = _group_loops(progs, plan, group, mesh, state, held=held_inputs, wide=wide, shards=split,
                                   kept=kept, parts=execution.parts_exchange)
    loops.append(programs)
    stages.append(names)
    shards.append(SplitParams(tuple(free.index(i) for i in split), shard_program(mesh, tuple(split.values())),
                              group_lowering.shard_bytes(progs[group.remat], split, len(group.devices)))
                  if split else None)
  combines = [jax.jit(group_lowering.combine_program(prog, s), out_shardings=NamedSharding(meshes.mesh, P()))
              for s in range(prog.analysis.loops - 1)]
  parted = _parted(prog, execution, units, held, splits)
  exchange = _exchange(prog, plan, meshes, units, owner, wide, n_state=step.n_state, donated=donated,
                       to_owner=to_owner, parted=parted, split=_split_outputs(held_split, new_value_of, meshes))
  updates = (_updates(prog, meshes, units, held, wide, n_state=step.n_state, donated=donated, to_owner=to_owner,
                      parted=parted) if units else {})
  readers = group_lowering.partial_readers(prog) if to_owner else ()
  needs = {device: tuple(j for j, r in enumerate(readers) if r & set(outs)) for device, (outs, _) in updates.items()}
  relay = _relayed_sums(prog, needs, len(meshes.devices), kept) if to_owner and relays(plan.state_shares) else {}
  return GroupPrograms(loops=loops, combines=combines, exchange=exchange, updates=updates, out_tree=out_tree,
                       out_avals=tuple(jax.tree.leaves(shapes)), units=units, held=held,
                       needs=needs if to_owner else None, relay=relay, group_stages=tuple(stages), shards=tuple(shards),
                       parted=parted, part_sums=kept, held_split=held_split,
                       ordered=bool(group_lowering.per_example_outputs(prog)),
                       scatter=scatter_program(meshes.mesh, tuple(relay[j] for j in sorted(relay))) if relay else None)


def _parted(prog: Program, execution: Execution, units: Any, held: tuple, splits: list) -> dict[int, dict[int, int]]:
  """ZeRO-3 in one process, one loop and no tail: ``{state index: {group: axis}}`` of the parameters held on one
  device (or their casts, where the programs take those) that groups sharding their parameters take split
  (``splits``: each group's ``{state index: axis}``), and that neither the exchange program's outputs nor any update but their maker's
  read: those reach each such group as its parts alone, and the other groups' devices whole."""
  if not execution.zero3_parts or units is None or prog.analysis.loops > 1:
    return {}
  maker = {h.index: h.output for h in held if h.role == "param"}
  wanted = [i for i in maker if any(i in split for split in splits)]
  if not wanted:
    return {}
  by_output = group_lowering.inputs_read(prog, wanted)
  read = {i for o in units.common for i in by_output[o]}
  for _, outs in units.units:  # an update reads its own parameters; another's must not
    read |= {i for o in outs for i in by_output[o] if maker[i] not in outs}
  return {i: {g: split[i] for g, split in enumerate(splits) if i in split} for i in wanted if i not in read}


def _held_split(state: Any, splits: list, g: int) -> dict[int, int]:
  """A hybrid plan: ``{flat state index: axis}`` of the leaves each group holds split over its ``g`` devices between
  steps: the parameters every group takes split (``splits``) along one axis that ``g`` divides, and each other
  floating leaf of such a parameter's shape (an optimizer's moments) along the same axis. (A parameter split with
  padding stays whole between steps: a ``jax.Array`` cannot be split unevenly.)"""
  leaves = jax.tree.leaves(state)
  common = set.intersection(*(set(split.items()) for split in splits))
  out = {i: a for i, a in sorted(common) if np.shape(leaves[i])[a] % g == 0}
  axes: dict[tuple, int] = {}
  for i, a in out.items():
    axes.setdefault(np.shape(leaves[i]), a)
  for i, x in enumerate(leaves):
    if i not in out and np.shape(x) in axes and jnp.issubdtype(traced_dtype(x), jnp.floating):
      out[i] = axes[np.shape(x)]
  return out


def _split_outputs(held_split: dict, new_value_of: dict, meshes: GroupMeshes) -> dict[int, NamedSharding]:
  """``{flat output: sharding}`` of the step's outputs that are new values of leaves held split (``held_split``):
  split over each group's devices (:attr:`GroupMeshes.parts`), each group its own copy."""
  return {o: meshes.held_split(held_split[i]) for o, i in new_value_of.items() if i in held_split}


def _exchange(prog: Program, plan: GroupPlan, meshes: GroupMeshes, units: Any, owner: dict, wide: dict, *,
              n_state: int, donated: frozenset, to_owner: bool, parted: dict, split: dict) -> Any:
  """The uniform program over every device: the last loop's sums reduced (unless each owner reduces its own),
  the tail's loop, and the step's outputs that read no held leaf (every output without shares); it reads the
  replicated state's leaves, whose buffers it may take where it makes the whole new state. ``split``: ``{flat
  output: sharding}`` of the outputs it leaves split (a hybrid plan's state: XLA partitions the update)."""
  tail = None
  if plan.tail_count:
    count = plan.tail_count
    tail = Layout(meshes.mesh, DATA, plan.tail_microbatch, count, (count,) * len(meshes.devices),
                  reduce_dtype=plan.grad_reduce_dtype, overlap=True)
  order = np.asarray(plan.example_slots(), np.int32) if group_lowering.per_example_outputs(prog) else None
  run = group_lowering.exchange_program(prog, tail, units.common if units else None, sums=not to_owner, order=order)
  free = [i for i in range(n_state) if i not in owner]
  at = [k for k, i in enumerate(free) if i in donated and units is None]
  run, _ = chain(run, ("widen", functools.partial(widened, wide)),
                 ("hold", functools.partial(less_held, prog, tuple(sorted({*owner, *parted})))))
  replicated = NamedSharding(meshes.mesh, P())
  if split:  # the update on the parts each group holds, partitioned by XLA
    return donating(run, at, out_shardings=[split.get(o, replicated) for o in range(len(prog.outvars))])
  return donating(run, at, out_shardings=replicated)


def _updates(prog: Program, meshes: GroupMeshes, units: Any, held: tuple, wide: dict, *, n_state: int,
             donated: frozenset, to_owner: bool, parted: dict) -> dict:
  """``{device: (outputs, program)}``: each device's program that updates the units it holds (reducing their sums
  itself where ``to_owner``), donating the held leaves (and parameters read as held) whose new values it makes."""
  owner = {h.index: h.device for h in held if h.role == "opt_state"}
  maker = {h.index: h.device for h in held if h.role == "param"}
  casts = {h.index for h in held if h.cast is not None}
  updates = {}
  for device in meshes.devices:
    outs = tuple(sorted(o for ins, unit_outs in units.units if owner[ins[0]] == device for o in unit_outs))
    if not outs:
      continue
    mine = {i for i in owner if owner[i] == device}
    update = (group_lowering.owner_update_program(prog, outs, len(meshes.devices)) if to_owner else
              group_lowering.update_program(prog, outs))
    # not its inputs: others' held leaves, and the parameters others make that reach groups as parts
    others = tuple(sorted({i for i in owner if i not in mine} | {i for i in parted if maker[i] != device}))
    reads = [i for i in range(n_state) if i not in others]  # its inputs' state leaves
    made = {i for i in casts if maker[i] == device}  # read as held (not as cast): its new value's buffer
    at = [k for k, i in enumerate(reads) if i in mine | made and i in donated]
    update, _ = chain(update, ("widen", functools.partial(widened, wide)),
                      ("hold", functools.partial(less_held, prog, others)))
    updates[device] = (outs, donating(update, at))
  return updates


def _shards(own: Program, group: Any, state: Any, held: tuple[int, ...], wide: dict) -> dict[int, int]:
  """``{flat state input: axis}`` of the parameters a group with ``shard_params`` takes split over its devices
  (:func:`hetspmd.lowering.groups.shardable`; not held optimizer-state leaves; a parameter taken as its cast is
  split as the cast); none for a
  group without."""
  if not group.shard_params:
    return {}
  floats = [i for i, x in enumerate(jax.tree.leaves(state))
            if jnp.issubdtype(traced_dtype(x), jnp.floating) and i not in held]
  return group_lowering.shardable(own, floats, len(group.devices))


def _group_loops(progs: dict[str, Program], plan: GroupPlan, group: Any, mesh: Mesh, state: Any, *,
                 held: tuple[int, ...], wide: dict, shards: dict, kept: dict, parts: bool = False
                 ) -> tuple[list, tuple]:
  """``group``'s program of each loop, ``jax.jit`` over its ``mesh``, and its stages' names: its own trace's loop
  (its remat policy's, from ``progs``; ``shards``: the parameters it takes split over its devices, FSDP-style, in
  lockstep, the sums ``kept`` names, as the exchange program's trace numbers them, left as parts; ``parts``: a
  group that does not shard hands those over as the same parts), its partial sums laid out and narrowed as the
  exchange program takes them, one row per device."""
  prog, own = progs[plan.tail_remat], progs[group.remat]
  loops = prog.analysis.loops
  layout = Layout(mesh, DATA, group.microbatch, group.max_count, group.positions, lockstep=group.shard_params,
                  counts_at_run=group.slots > 0)
  order = None if own is prog else group_lowering.sums_order(prog, own)
  kept = frozenset(kept if order is None else (order[0][j] for j in kept))  # as its own trace numbers them
  split = model_split(state, group, mesh)
  # the gradients leave the last loop in the plan's reduce dtype (with a tail, the tail's reduction narrows them)
  mask = None if plan.tail_count else group_lowering.narrowed(prog, plan.grad_reduce_dtype)
  out, names = [], ()
  for s in range(loops):
    stages = (("constrain", functools.partial(constrained, split)),
              ("widen", functools.partial(widened, wide)),
              ("hold", functools.partial(less_held, own, held)),
              ("reorder", functools.partial(reordered, order)),
              ("narrow", functools.partial(narrowed, mask if s == loops - 1 else None, plan.grad_reduce_dtype)),
              ("spread", functools.partial(spread, prog, s, group.model)))
    # beside sharded groups, its gradients reduce-scattered in the reduce dtype they then cross in
    narrow = ({j if order is None else order[0][j]: plan.grad_reduce_dtype
               for j, flag in enumerate(f for part in mask for f in part) if flag}
              if parts and not shards and mask is not None and s == loops - 1 else None)
    run, names = chain(group_lowering.group_program(own, layout, s, plan.example_width, shards, kept, parts=parts,
                                                    narrow=narrow), *stages)
    out.append(jax.jit(run, out_shardings=NamedSharding(mesh, P(tuple(mesh.axis_names)))))
  return out, ("loop",) + names


def _traced(step: _Step, plan: GroupPlan, batch_stats: str) -> tuple[dict[str, Program], Any]:
  """The step's analysed program under each remat policy the plan uses (its groups' and the tail's), and its
  output shapes."""
  leaves, n_state = step.leaves, step.n_state
  batch_inputs = tuple(range(n_state, n_state + step.n_batch))
  avals = [jax.ShapeDtypeStruct(np.shape(x), traced_dtype(x)) for x in leaves]
  floats = tuple(i for i, x in enumerate(leaves[:n_state]) if jnp.issubdtype(traced_dtype(x), jnp.floating))

  def flat(*xs):  # one function per trace: JAX caches a trace by its function, which does not see the policy
    state, batch, rest = jax.tree.unflatten(step.tree, xs)
    return step.fn(state, batch, *rest)

  progs, shapes = {}, None
  policies = list(dict.fromkeys([plan.tail_remat] + [g.remat for g in plan.groups]))
  # beside groups whose loss is checkpointed, "none" is traced checkpointed too, saving everything: the same cuts
  # ("layers" rewrites the traced step and checkpoints no loss: beside it, "none" is traced as it is)
  checkpointed = any(p not in STEP_REMAT_POLICIES for p in policies)
  for policy in policies:
    with remat_policy(SAVED if policy == "none" and checkpointed else policy):
      closed, shapes = jx.make_closed_jaxpr(functools.partial(flat), *avals, return_shape=True)
    progs[policy] = Program(analyse(closed, batch_inputs, plan.global_batch, batch_stats=batch_stats,
                                    float_state_inputs=floats, remat=policy,
                                    param_paths=parameter_paths(step.state)), batch_inputs)
    group_lowering.check(progs[policy], tail=bool(plan.tail_count))
  if len(progs) > 1 and progs[plan.tail_remat].analysis.loops > 1:
    raise HetSpmdError(f"this step needs {progs[plan.tail_remat].analysis.loops} microbatch loops, whose "
                       f"sums feed one another: give every group the same remat policy (the plan has "
                       f"{', '.join(progs)})")
  return progs, shapes


def _held(prog: Program, progs: dict[str, Program], plan: GroupPlan, meshes: GroupMeshes, state: Any,
          new_value_of: dict[int, int]) -> tuple[Any, tuple[HeldLeaf, ...]]:
  """The update's state units and one :class:`HeldLeaf` per leaf that lives on one device: each optimizer-state
  leaf a unit reads, and, under ZeRO-3, each parameter it makes (``new_value_of``: :func:`hetspmd._pytree.new_state_leaves`)."""
  entries = leaves_with_paths(state)
  opt = [i for i, (path, leaf) in enumerate(entries)
         if np.ndim(leaf) >= 1 and np.size(leaf) > 1 and role_of(path, traced_dtype(leaf)) == "opt_state"]
  units = group_lowering.state_units(prog, opt, new_value_of)
  made = [{new_value_of[o]: o for o in outs if o in new_value_of and new_value_of[o] not in opt}
          if plan.zero_stage == 3 else {} for _, outs in units.units]  # the parameters each unit makes
  sizes = [sum(nbytes(entries[i][1]) for i in (*ins, *params)) for (ins, _), params in zip(units.units, made)]
  owners = [meshes.devices[d] for d in assign_owners(sizes, plan.state_shares)]
  casts = _narrow_reads(progs, units, {i: o for params in made for i, o in params.items()})
  held = [HeldLeaf(i, entries[i][0], owners[u], "opt_state", nbytes(entries[i][1]))
          for u, (ins, _) in enumerate(units.units) for i in ins]
  held += [HeldLeaf(i, entries[i][0], owners[u], "param", nbytes(entries[i][1]), output=o, cast=casts.get(i))
           for u, params in enumerate(made) for i, o in params.items()]
  return units, tuple(sorted(held, key=lambda h: h.index))


def _narrow_reads(progs: dict[str, Program], units: Any, made: dict[int, int]) -> dict[int, Any]:
  """ZeRO-3: ``{state index: dtype}`` of the parameters (``made``: ``{state index: output}``) every trace in
  ``progs`` reads, outside the update that makes them, only through casts to ``dtype``
  (:func:`hetspmd.lowering.groups.narrow_reads`)."""
  if not made:
    return {}
  unit_of = {o: frozenset(outs) for _, outs in units.units for o in outs}
  made_by = {i: unit_of[o] for i, o in made.items()}
  found = [group_lowering.narrow_reads(p, made_by) for p in progs.values()]
  return {i: d for i, d in found[0].items() if all(f.get(i) == d for f in found[1:])}


def _relayed_sums(prog: Program, needs: dict, n: int, kept: dict) -> dict[int, tuple[int, int]]:
  """``{partial value: (axis, size)}`` of the values the updates read that reach their owners in two hops,
  reduce-scattered over the ``n`` devices along :func:`hetspmd.plan.groups.relay_axis`, then made whole on the
  owner: the sums. (A ``max`` or ``min``, a scalar or an empty value is copied to its owner row by row, and so
  are the sums ``kept`` names: groups sharding their parameters hand those over as parts.)"""
  wanted = set().union(*needs.values()) if needs else set()
  out = {}
  for j, (reduce, shape) in enumerate(group_lowering.partial_values(prog)):
    axis = relay_axis(shape, n)
    if j in wanted and j not in kept and reduce == "sum" and axis is not None:
      out[j] = (axis, shape[axis])
  return out
