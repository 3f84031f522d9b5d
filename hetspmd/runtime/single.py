"""The single program's runner: one ``jax.jit`` program per argument structure, over the plan's mesh.

* the step is traced at the global batch, and :mod:`hetspmd.passes.batch_axis.analysis`
  finds which equations are per-example and where they reduce over the batch;
* :mod:`hetspmd.lowering.weighted` builds the weighted program: per device a loop over
  its own microbatch count, one reduction over ``data``, the rest once;
* state leaves carry the plan's ``NamedSharding``s (tensor parallel along
  ``model``, ZeRO along ``data``) in and out; the batch arrives as a padded
  microbatch buffer sharded over ``data`` plus each position's count
  (:func:`hetspmd.runtime.placement.shard_batch`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from hetspmd import lowering
from hetspmd.autodiff import remat_policy
from hetspmd.errors import HetSpmdError
from hetspmd.passes import _jax_adapter as jx
from hetspmd.passes.batch_axis.analysis import analyse
from hetspmd.plan.value import Plan
from hetspmd.runtime.binding import Call, distinct_leaves, is_dynamic
from hetspmd.runtime.placement import (ShardedBatch, check_live, positions_array, process_examples,
                                       shard_batch)
from hetspmd.runtime.runner import priced_here
from hetspmd.runtime.searching import step_traced


@dataclasses.dataclass
class SingleRunner:
  """A :class:`~hetspmd.plan.value.Plan` run as one program; ``front``: the
  :class:`~hetspmd.runtime.step.ParallelStep` it runs for (the step, its options, how it traces)."""

  front: Any
  plan: Plan
  grouped = False
  _mesh: Any = dataclasses.field(init=False, repr=False)
  _programs: dict = dataclasses.field(init=False, repr=False, default_factory=dict)  # one per argument structure
  _analysis: Any = dataclasses.field(init=False, repr=False, default=None)  # the last build's
  _starts_array: Any = dataclasses.field(init=False, repr=False, default=None)
  _lockstep: bool | None = dataclasses.field(init=False, repr=False, default=None)  # from the first program
  _devices: frozenset = dataclasses.field(init=False, repr=False)  # the mesh's (the state must lie on them)
  _last: tuple | None = dataclasses.field(init=False, repr=False, default=None)  # (program, abstract arguments)
  _examples: np.ndarray = dataclasses.field(init=False, repr=False)  # this process's, in the order it feeds them

  @classmethod
  def of(cls, front: Any, plan: Plan, runtime: None = None) -> "SingleRunner":
    return cls(front, plan)

  def __post_init__(self):
    self._mesh = self.plan.mesh()
    self._devices = frozenset(self._mesh.devices.flat)
    self._examples = process_examples(self.plan, self._mesh)

  @property
  def lockstep(self) -> bool | None:
    """Whether the microbatch loop runs in lockstep (decided from the first compiled program; None before)."""
    return self._lockstep

  @property
  def analysis(self) -> Any:
    """The step's batch-axis analysis of the last program built (None before a call)."""
    return self._analysis

  @property
  def program_count(self) -> int:
    return len(self._programs)

  def adopt(self, other: "SingleRunner") -> bool:
    """Run ``other``'s programs where they run this plan: the same plan but its microbatch counts, which those
    programs read at run time (the same buffers: ``max_count``, slots included; neither uniform, whose loop
    runs its count as a constant; no per-example output ordered by the counts when traced). Then new counts compile nothing. Whether it
    did."""
    mine, theirs = self.plan, other.plan
    same = (theirs.replace(microbatch_counts=mine.microbatch_counts, slots=mine.slots) == mine
            and mine.max_count == theirs.max_count and not mine.is_uniform and not theirs.is_uniform)
    if not same or other._analysis is None or lowering.counts_fixed_when_traced(other._analysis) or mine.stages:
      return False
    self._programs, self._analysis, self._lockstep, self._last = (other._programs, other._analysis,
                                                                  other._lockstep, other._last)
    return True

  # --- placing ------------------------------------------------------------------

  def check_state(self, state: Any) -> None:
    self.plan.check_state(state)

  def placed_objects(self, state: Any) -> Any:
    return self.shard_state(state)

  def shard_state(self, state: Any) -> Any:
    return jax.device_put(state, self.state_shardings(state))

  def state_shardings(self, state: Any) -> Any:
    return self.plan.state_shardings(self._mesh, state)

  def shard_batch(self, batch: Any) -> ShardedBatch:
    return shard_batch(self.plan, self._mesh, batch)

  def batch_sizes(self) -> set[int]:
    return {len(self.process_examples())}

  def process_examples(self) -> np.ndarray:
    return self._examples

  # --- running ------------------------------------------------------------------

  def call(self, args: tuple, kwargs: dict) -> Any:
    # The hot path: split NNX objects, place the batch, run the cached program, write NNX objects back.
    call = Call.bind(self.front, args, kwargs, self.shard_batch)
    compiled = self._executable(call)
    state, others = call.dynamic
    check_live(state, others, self._devices)
    outputs = compiled(distinct_leaves(state) if self.front.donate_state else state, others, call.batch.counts,
                       self._starts())
    return call.finish(outputs)

  def prepared(self, args: tuple, kwargs: dict, here: Callable[[list], list] | None = None,
               held: list | None = None) -> Callable[[], None]:
    """A call that runs the program once on the call's arguments and waits for it, the state and other
    arguments moved with ``here`` (onto this plan's devices; None: a copy of the state placed as the plan
    places it, the other arguments as a call passes them), nothing written back. For timing a kind
    (:mod:`hetspmd.runtime.calibrating`) as the step runs: where the program donates the state, it takes a copy
    of it (never the caller's own buffers; ``held``, a list shared by the calls of one state's shape, holds it),
    and each call the new state the call before made, as a training loop feeds it (on CPU a donated state's
    program measured up to a fifth slower than one that keeps it); it runs once here (given ``here``; else the
    caller runs it first), so that the timed calls find the program compiled for the state it makes. Else the
    outputs are dropped."""
    call = Call.bind(self.front, args, kwargs, self.shard_batch)
    compiled = self._executable(call)
    given, others = call.dynamic
    n_batch = len(call.batch_inputs)
    if here is None:  # placed as the plan places it; a donating program's copy never aliases the caller's buffers
      # (leaf by leaf, each placed value dropped once copied; device_put(may_alias=False) still hands a replicated
      # sharding the caller's buffer on the device it came from, JAX 0.10.2)
      shardings = self._dynamic_shardings(call)
      copy = lambda: [jnp.copy(jax.device_put(x, s)) for x, s in zip(given, shardings)]
      state = copy() if compiled.donates else [jax.device_put(x, s) for x, s in zip(given, shardings)]
    else:
      state, others = here(given), others[:n_batch] + here(others[n_batch:])
      copy = lambda: jax.tree.map(jnp.copy, state)
    counts, starts = call.batch.counts, self._starts()
    if not compiled.donates:
      return lambda: jax.block_until_ready(compiled(state, others, counts, starts))
    held = [] if held is None else held
    if not held:  # placed here: the copy itself (one state on the devices, as the plan's price counts)
      held.append(state if here is None else copy())
    signature = [(np.shape(x), jnp.result_type(x)) for x in jax.tree.leaves(state)]
    structure = jax.tree.structure(state)
    state = None if here is None else state  # the copy is held[0] alone: the program donates it

    def fed() -> None:
      outputs = compiled(held[0], others, counts, starts)
      made = jax.tree.leaves(call.new_state(outputs))  # the state's array leaves, in the order the program takes
      same = [(np.shape(x), jnp.result_type(x)) for x in made] == signature
      # (a new state found elsewhere among the outputs than first: a fresh copy, timed with the call)
      held[0] = jax.tree.unflatten(structure, made) if same else copy()
      jax.block_until_ready(outputs)

    if here is not None:  # a whole plan's timing warms it itself, once every process has prepared it
      fed()
    return fed

  def _dynamic_shardings(self, call: Call) -> list:
    """The plan's sharding of each of the call's state leaves that the program takes (its arrays)."""
    shardings = jax.tree.leaves(self.state_shardings(call.state))
    return [s for x, s in zip(jax.tree.leaves(call.state), shardings) if is_dynamic(x)]

  def lower(self, args: tuple, kwargs: dict) -> Any:
    call = Call.bind(self.front, args, kwargs, self.shard_batch)
    return self._executable(call).lower(*call.dynamic, call.batch.counts, self._starts())

  def needed_bytes(self, args: tuple, kwargs: dict) -> dict[Any, int]:
    """Per device of this process the plan runs on, the search's priced peak bytes (the plan's
    ``predicted_per_position`` ``memory_bytes``, each data position's for its devices); none where the plan has
    no price. (XLA's memory analysis would need the program compiled ahead, and a compiled ``Lowered`` is not
    the executable a call then runs: it would compile twice.)"""
    return priced_here(self.plan.device_ids, dict(self.plan.predicted_per_position).get("memory_bytes"))

  def memory_analysis(self) -> dict[str, Any]:
    if self._last is None:
      raise HetSpmdError("memory_analysis describes the program of the last call: call the step first")
    program, arguments = self._last
    return {"program": program.lower(*arguments).compile().memory_analysis()}

  def explain(self, notes: list[str]) -> str:
    plan = self.plan
    if plan.stages:
      mode = (f"pipeline stages of {list(plan.stages)} layers along 'stage', lockstep GPipe ticks (one "
              "ppermute each), every stage running its own layers of the step's layer scan")
    elif self._lockstep:
      mode = ("microbatch accumulation in lockstep: every position runs the largest count, padding masked "
              "(XLA placed a collective-permute or all-to-all inside the loop)")
    else:
      mode = "weighted microbatch accumulation (per-device trip counts)"
    wire = (lowering.program.wire_dtypes(self._analysis, plan.grad_reduce_dtype)
            if self._analysis is not None else [])
    lines = [plan.summary(" and ".join(wire) or None), f"  execution: {mode}"] + notes
    if self._analysis is not None:
      lines += _analysis_lines(self._analysis, plan)
    return "\n".join(lines)

  def _starts(self):
    if self._starts_array is None:
      starts = np.concatenate([[0], np.cumsum(self.plan.examples_per_position())[:-1]]).astype(np.int32)
      self._starts_array = positions_array(self._mesh, self.plan, starts)
    return self._starts_array

  def _executable(self, call: Call):
    key = call.key
    if key not in self._programs:
      self._programs[key] = self._build(call)
    return self._programs[key]

  def _build(self, call: Call):
    plan, mesh, front = self.plan, self._mesh, self.front
    state_shardings = plan.state_shardings(mesh, call.state)  # checks the state against the plan first
    with remat_policy(plan.remat):
      closed, out_tree = step_traced(lambda: call.trace(plan.global_batch), call.batch.data, leading=2,
                                      global_batch=plan.global_batch)
    analysis = analyse(closed, call.batch_inputs, plan.global_batch, batch_stats=front.batch_stats,
                       float_state_inputs=call.float_state_inputs, remat=plan.remat, param_paths=call.param_paths)
    self._analysis = analysis
    layout = lowering.Layout(mesh, plan.data_axis, plan.microbatch, plan.max_count, plan.microbatch_counts,
                             data_split=plan.data_split_leaves(call.state), reduce_dtype=plan.grad_reduce_dtype,
                             overlap=plan.overlap_reduction, overlap_microbatches=plan.overlap_microbatches,
                             stages=plan.stages,
                             clock=front.rebalancer.clock_for(mesh) if front.rebalancer is not None else None)

    donates = front.donate_state and call.returns_state(out_tree, analysis.jaxpr)
    batch_inputs, call = call.batch_inputs, call.skeleton()  # the programs kept hold no argument alive

    def make(lockstep: bool):
      program = lowering.build(analysis, batch_inputs, dataclasses.replace(layout, lockstep=lockstep))

      def run(state, others, counts, starts):  # only the state's buffers may be donated
        outputs = program(call.inputs((state, others)), counts, starts)
        return call.constrain(jax.tree.unflatten(out_tree, outputs), state_shardings)

      return jax.jit(run, donate_argnums=(0,) if donates else (), compiler_options=_compiler_options(plan, mesh))

    programs: dict = {}

    def program(lockstep: bool):
      if lockstep not in programs:
        programs[lockstep] = make(lockstep)
      return programs[lockstep]

    def run(state, others, counts, starts):
      if self._lockstep is None:
        # a stage plan's ticks are lockstep by construction: its positions' counts only mask work
        self._lockstep = not plan.is_uniform and not plan.stages and _loop_needs_lockstep(
            program(False).lower(state, others, counts, starts))
      chosen = program(bool(self._lockstep))
      if self._last is None or self._last[0] is not chosen:  # a program's arguments keep their shapes
        self._last = (chosen, jax.tree.map(_abstract, (state, others, counts, starts)))
      return chosen(state, others, counts, starts)

    run.lower = lambda *a: program(bool(self._lockstep)).lower(*a)
    run.donates = donates  # the state's buffers (prepared feeds each call's new state back)
    return run


def _abstract(x: Any) -> Any:
  """An argument as its shape, dtype and sharding (what lowering it again needs, no buffer kept alive)."""
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def _analysis_lines(analysis: Any, plan: Plan) -> list[str]:
  """:meth:`SingleRunner.explain`'s lines on what the step's jaxpr gave the program."""
  lines = [f"  derived from the step's jaxpr: {len(analysis.cuts)} reduction(s) over the batch, "
           f"{analysis.loops} microbatch loop(s)"]
  if analysis.local_statistics:
    lines.append(f"  batch statistics per microbatch of {plan.microbatch} (as per-device BatchNorm; "
                 "batch_stats='exact' makes them exact):")
    lines += [f"    {line}" for line in analysis.describe() if "per-microbatch" in line]
  if analysis.loops > 1:
    lines.append("  exact reductions that feed per-example work, each computed in an earlier loop:")
    lines += [f"    {line}" for line in analysis.describe() if "feeds later" in line]
  lines += [f"  note: {note}" for note in analysis.notes]
  if plan.remat not in ("none", "layers") and not any(d is not None and d.body is not None and
                                                      jx.primitive_name(e) in ("remat2", "checkpoint")
                                                      for e, d in zip(jx.equations(analysis.jaxpr),
                                                                      analysis.decisions)):
    lines.append(f"  note: the plan's remat policy {plan.remat!r} did not reach the step (it applies "
                 "through hetspmd.value_and_grad)")
  return lines


def _compiler_options(plan: Plan, mesh: Any) -> dict[str, Any] | None:
  """XLA options the plan needs: on GPUs, an overlapped reduction needs the latency-hiding scheduler to move each
  gradient's all-reduce start up into the last microbatch's backward pass."""
  if plan.overlap_reduction and mesh.devices.flat[0].platform == "gpu":
    return {"xla_gpu_enable_latency_hiding_scheduler": True}
  return None


# Collectives whose CPU/GPU rendezvous can span every device of the program,
# not just the participating pairs: inside a loop with per-device trip counts
# they would deadlock or pair up the wrong iterations.
_GLOBAL_RENDEZVOUS = ("collective-permute", "all-to-all", "ragged-all-to-all")


def _loop_needs_lockstep(lowered: Any) -> bool:
  """Whether the compiled microbatch loop holds a collective that needs lockstep."""
  return jx.loop_body_holds(lowered, _GLOBAL_RENDEZVOUS)
