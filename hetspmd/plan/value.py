"""Plans: what runs where, as a frozen value and a versioned JSON file.

A :class:`Plan` fixes the mesh (axis names, shape, the JAX device ids in mesh
order), the global batch, the microbatch size and how many microbatches each
position of the weighted ``data`` axis runs, a ``PartitionSpec`` per train
state leaf (by path), the ZeRO stage and the remat policy. ``plan_for``
builds one from a cluster with device-speed-proportional counts; the planner
fills in the predicted figures.

Loading checks the schema version; binding a plan to devices or to a state
that differ from the ones it was made for raises :class:`HetSpmdError`
saying what differs.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetspmd._format import quantity
from hetspmd._pytree import leaves_with_paths
from hetspmd._version import __version__
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, REMAT_POLICIES, STAGE_AXIS, ZERO_STAGES, Spec
from hetspmd.plan.state_layout import shards_axis

SCHEMA_VERSION = 4  # 2: zero_shards; 3: grad_reduce_dtype, overlap_reduction (older files load as float32, off);
# 4: stages (older files load without)
READABLE_SCHEMAS = (1, 2, 3, 4)



# Uneven counts of at most one microbatch still get two buffer slots, one of them empty: given one slot, XLA:CPU
# turns each position's microbatch slice into a static one and fuses the step otherwise, and the step ran 2.5-4x
# slower (gpt2-tiny on 8 CPU devices: counts (1, 1, 0, ...) of 32 in 125 ms with one slot, 51 ms with two). The
# loop still runs each position's own count (a loop in lockstep the longest), so the empty slot costs only its
# bytes.
LEAST_UNEVEN_SLOTS = 2


@dataclasses.dataclass(frozen=True)
class Plan:
  """A parallel execution plan for one train step on one set of devices."""

  axis_names: tuple[str, ...]
  mesh_shape: tuple[int, ...]
  device_ids: tuple[int, ...]
  global_batch: int
  microbatch: int
  microbatch_counts: tuple[int, ...]
  state_specs: tuple[tuple[str, Spec], ...] = ()
  zero_stage: int = 0
  # > 0: ZeRO shards a leaf none of whose dimensions divides by the data positions over groups of this many
  # consecutive positions instead (the data axis seen as groups x shards); see zero_shards_for
  zero_shards: int = 0
  remat: str = "none"
  # the dtype gradients are reduced over data in (GRAD_REDUCE_DTYPES); accumulation stays float32
  grad_reduce_dtype: str = "float32"
  # the last microbatch runs outside the loop, so each gradient's reduction can start as it is ready
  overlap_reduction: bool = False
  # with the overlap, the last pass runs this many microbatches as one batch of ``k * microbatch`` examples: a
  # longer backward pass to hide the reduction under, while the loop's small microbatches carry the weighting
  overlap_microbatches: int = 1
  # layers per pipeline stage along the ``stage`` axis (hetspmd.lowering.staged); () for none
  stages: tuple[int, ...] = ()
  # microbatches each position's batch buffer holds, when above the largest count (0: the largest count): room
  # that rebalancing leaves so that later counts run the same program (hetspmd.runtime.rebalancing)
  slots: int = 0
  device_kinds: tuple[str, ...] = ()
  predicted: tuple[tuple[str, float], ...] = ()
  predicted_per_position: tuple[tuple[str, tuple[float, ...]], ...] = ()
  version: str = __version__
  schema: int = SCHEMA_VERSION

  def __post_init__(self):
    _check_plan(self)

  def _overlap_text(self) -> str:
    if not self.overlap_reduction:
      return ""
    if self.overlap_microbatches == 1:
      return " (overlapped with the last microbatch)"
    return (f" (overlapped with the last {self.overlap_microbatches} microbatches, run as one batch of "
            f"{self.overlap_microbatches * self.microbatch})")

  def replace(self, **changes: Any) -> "Plan":
    return dataclasses.replace(self, **changes)

  # --- views -------------------------------------------------------------------

  @property
  def data_axis(self) -> str:
    return self.axis_names[0]

  @property
  def data_size(self) -> int:
    return self.mesh_shape[0]

  @property
  def max_count(self) -> int:
    """Microbatch slots of each position's buffer: the largest count, or :attr:`slots` where above it; two
    where the counts differ and none is above one on a data-only mesh (:data:`LEAST_UNEVEN_SLOTS`)."""
    most = max(max(self.microbatch_counts), self.slots)
    if most == 1 and not self.is_uniform and not self.stages and self.mesh_shape[1] == 1:
      return LEAST_UNEVEN_SLOTS
    return most

  @property
  def is_uniform(self) -> bool:
    return len(set(self.microbatch_counts)) == 1

  def examples_per_position(self) -> tuple[int, ...]:
    return tuple(c * self.microbatch for c in self.microbatch_counts)

  def spec_for(self, path: str) -> PartitionSpec:
    for p, spec in self.state_specs:
      if p == path:
        return PartitionSpec(*spec)
    raise HetSpmdError(f"the plan has no PartitionSpec for state leaf {path!r}")

  # --- binding -----------------------------------------------------------------

  def mesh(self, devices: Sequence[Any] | None = None) -> Mesh:
    """The JAX mesh over this plan's devices (axis types Auto, set explicitly)."""
    visible = {d.id: d for d in (jax.devices() if devices is None else devices)}
    missing = [i for i in self.device_ids if i not in visible]
    if missing:
      raise HetSpmdError(
          f"the plan was made for JAX devices {list(self.device_ids)}; devices {missing} are not present "
          f"(visible: {sorted(visible)}). Make a plan for this device set.")
    grid = np.empty(len(self.device_ids), dtype=object)
    grid[:] = [visible[i] for i in self.device_ids]
    return Mesh(grid.reshape(self.mesh_shape), self.axis_names, axis_types=(AxisType.Auto,) * len(self.axis_names))

  def check_state(self, state: Any) -> None:
    """Raises if ``state``'s leaf paths or shapes do not fit this plan."""
    leaves = leaves_with_paths(state)
    have = {p for p, _ in leaves}
    want = {p for p, _ in self.state_specs}
    if have != want:
      extra, missing = sorted(have - want), sorted(want - have)
      raise HetSpmdError(
          "the state does not match the plan: "
          + (f"leaves not in the plan: {extra[:5]}{' ...' if len(extra) > 5 else ''}; " if extra else "")
          + (f"leaves the plan expects but the state lacks: {missing[:5]}{' ...' if len(missing) > 5 else ''}"
             if missing else ""))
    sizes = self._axis_sizes()
    for path, leaf in leaves:
      spec = self.spec_for(path)
      shape = np.shape(leaf)
      if len(spec) > len(shape):
        raise HetSpmdError(f"state leaf {path!r} has shape {shape} but the plan shards {len(spec)} dimensions ({spec})")
      for dim, entry in enumerate(spec):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        unknown = [a for a in axes if a not in sizes]
        if unknown:
          raise HetSpmdError(f"state leaf {path!r} is split over {unknown[0]!r}, which is not an axis of the plan: "
                             f"its axes are {sorted(sizes)}"
                             + (" (data_shards needs zero_shards > 0)" if unknown[0] == shards_axis(self.data_axis)
                                else ""))
        parts = math.prod(sizes[a] for a in axes)
        if shape[dim] % parts:
          raise HetSpmdError(f"state leaf {path!r} dimension {dim} of size {shape[dim]} does not split "
                             f"evenly over {axes} ({parts} parts)")

  def _axis_sizes(self) -> dict[str, int]:
    sizes = dict(zip(self.axis_names, self.mesh_shape))
    if self.zero_shards:
      sizes[shards_axis(self.data_axis)] = self.zero_shards
    return sizes

  def state_mesh(self, mesh: Mesh) -> Mesh:
    """The mesh the state's shardings use: ``mesh``, or with ``zero_shards`` its data axis as groups × shards.

    Both hold the same devices in the same order, so one program takes
    arrays sharded over either.
    """
    if not self.zero_shards:
      return mesh
    data = self.data_axis
    shape = (self.data_size // self.zero_shards, self.zero_shards) + tuple(self.mesh_shape[1:])
    return Mesh(mesh.devices.reshape(shape), (f"{data}_groups", shards_axis(data)) + tuple(self.axis_names[1:]),
                axis_types=(AxisType.Auto,) * len(shape))

  def _state_spec(self, path: str) -> PartitionSpec:
    """:meth:`spec_for` on :meth:`state_mesh`: the whole data axis is its groups and shards axes."""
    spec = self.spec_for(path)
    if not self.zero_shards:
      return spec
    whole = (f"{self.data_axis}_groups", shards_axis(self.data_axis))

    def entry(e):
      axes = (e,) if isinstance(e, str) else tuple(e or ())
      out = tuple(a for axis in axes for a in (whole if axis == self.data_axis else (axis,)))
      return None if not out else out[0] if len(out) == 1 else out
    return PartitionSpec(*(entry(e) for e in spec))

  def data_split_leaves(self, state: Any) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """``(path, shape, dim)`` of every state leaf split along ``data`` alone, at ``dim`` (ZeRO's shards)."""
    out = []
    for path, leaf in leaves_with_paths(state):
      spec = self.spec_for(path)
      if self.data_axis in spec:
        out.append((path, tuple(np.shape(leaf)), tuple(spec).index(self.data_axis)))
    return tuple(out)

  def state_shardings(self, mesh: Mesh, state: Any) -> Any:
    """A pytree of ``NamedSharding`` matching ``state``."""
    self.check_state(state)
    paths = iter([p for p, _ in leaves_with_paths(state)])
    state_mesh = self.state_mesh(mesh)
    return jax.tree.map(lambda _: NamedSharding(state_mesh, self._state_spec(next(paths))), state)

  # --- files -------------------------------------------------------------------

  def to_json(self) -> dict[str, Any]:
    return {
        "schema": self.schema,
        "hetspmd_version": self.version,
        "mesh": {"axes": list(self.axis_names), "shape": list(self.mesh_shape), "device_ids": list(self.device_ids),
                 "device_kinds": list(self.device_kinds)},
        "global_batch": self.global_batch,
        "microbatch": self.microbatch,
        "microbatch_counts": list(self.microbatch_counts),
        "zero_stage": self.zero_stage,
        "zero_shards": self.zero_shards,
        "remat": self.remat,
        "grad_reduce_dtype": self.grad_reduce_dtype,
        "overlap_reduction": self.overlap_reduction,
        "overlap_microbatches": self.overlap_microbatches,
        "stages": list(self.stages),
        "slots": self.slots,
        "state_specs": {path: [list(e) if isinstance(e, tuple) else e for e in spec] for path, spec in self.state_specs},
        "predicted": dict(self.predicted),
        "predicted_per_position": {k: list(v) for k, v in self.predicted_per_position},
    }

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "Plan":
    if not isinstance(data, dict):
      raise InvalidValueError(f"a plan JSON is an object with keys schema, mesh, global_batch, ... (as hetspmd "
                              f"search --out writes it), got a {type(data).__name__}")
    try:
      schema = int(data["schema"])
      if schema not in READABLE_SCHEMAS:
        raise InvalidValueError(f"plan schema {schema} is not supported; this hetspmd reads schemas "
                                f"{list(READABLE_SCHEMAS)}")
      mesh = data["mesh"]
      return cls(
          axis_names=tuple(mesh["axes"]), mesh_shape=tuple(mesh["shape"]), device_ids=tuple(mesh["device_ids"]),
          device_kinds=tuple(mesh.get("device_kinds", ())), global_batch=int(data["global_batch"]),
          microbatch=int(data["microbatch"]), microbatch_counts=tuple(data["microbatch_counts"]),
          zero_stage=int(data["zero_stage"]), zero_shards=int(data.get("zero_shards", 0)), remat=str(data["remat"]),
          grad_reduce_dtype=str(data.get("grad_reduce_dtype", "float32")),
          overlap_reduction=_json_bool(data.get("overlap_reduction", False), "overlap_reduction"),
          overlap_microbatches=_json_int(data.get("overlap_microbatches", 1), "overlap_microbatches"),
          stages=tuple(int(n) for n in data.get("stages", ())),
          slots=_json_int(data.get("slots", 0), "slots"),
          state_specs=tuple((p, tuple(tuple(e) if isinstance(e, list) else e for e in spec))
                            for p, spec in data["state_specs"].items()),
          predicted=tuple((k, float(v)) for k, v in data.get("predicted", {}).items()),
          predicted_per_position=tuple((k, tuple(map(float, v)))
                                       for k, v in data.get("predicted_per_position", {}).items()),
          version=str(data.get("hetspmd_version", "")), schema=schema)
    except KeyError as e:
      raise InvalidValueError(f"plan JSON lacks the key {e.args[0]!r}") from None
    except HetSpmdError:
      raise
    except (TypeError, ValueError, AttributeError) as e:  # a value of the wrong type: "4" for a list, a list for 4
      raise InvalidValueError(f"plan JSON holds a value of the wrong type ({e}); write plans with hetspmd search "
                              "--out or Plan.save") from None

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

  @classmethod
  def load(cls, path: str | Path) -> "Plan":
    try:
      return cls.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
      raise InvalidValueError(f"plan file {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise InvalidValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None
    except OSError as e:  # a directory, no permission
      raise InvalidValueError(f"cannot read plan file {str(path)!r}: {e.strerror or e}") from None

  def summary(self, reduced_in: str | None = None) -> str:
    """``reduced_in``: the dtype(s) the step's gradients really cross ``data`` in, when the step is known
    (``grad_reduce_dtype="float32"`` casts nothing: a float64 gradient crosses in float64)."""
    lines = [f"mesh {dict(zip(self.axis_names, self.mesh_shape))}, global batch {self.global_batch} = "
             f"{sum(self.microbatch_counts)} microbatches of {self.microbatch}, ZeRO-{self.zero_stage}"
             f"{f' (over groups of {self.zero_shards} where a leaf does not split {self.data_size} ways)' if self.zero_shards else ''}, "
             f"remat {self.remat}, gradients reduced in {reduced_in or self.grad_reduce_dtype}"
             f"{self._overlap_text()}"
             f"{f', pipeline stages of {list(self.stages)} layers' if self.stages else ''}"]
    groups = np.asarray(self.device_ids).reshape(self.data_size, -1)
    kinds = np.asarray(self.device_kinds or ["?"] * len(self.device_ids), dtype=object).reshape(self.data_size, -1)
    for i, count in enumerate(self.microbatch_counts):
      share = count / sum(self.microbatch_counts)
      lines.append(f"  {self.data_axis}[{i}] devices {list(map(int, groups[i]))} ({', '.join(dict.fromkeys(kinds[i]))}): "
                   f"{count} microbatches ({share:.0%}) {'#' * round(share * 40)}")
    for key, value in self.predicted:
      lines.append(f"  predicted {key}: {quantity(key, value)}")
    return "\n".join(lines)


# --- checks ------------------------------------------------------------------


def _check_plan(plan: Plan) -> None:
  """Refuses a plan whose fields do not fit together, saying which and what would."""
  if len(plan.axis_names) != len(plan.mesh_shape):
    raise InvalidValueError(f"plan axes {plan.axis_names} and mesh shape {plan.mesh_shape} differ in length")
  if math.prod(plan.mesh_shape) != len(plan.device_ids) or len(set(plan.device_ids)) != len(plan.device_ids):
    raise InvalidValueError(
        f"plan mesh {plan.mesh_shape} needs {math.prod(plan.mesh_shape)} distinct devices, got {plan.device_ids}")
  if len(plan.microbatch_counts) != plan.mesh_shape[0]:
    raise InvalidValueError(f"plan has {len(plan.microbatch_counts)} microbatch counts for "
                            f"{plan.mesh_shape[0]} positions of the {plan.axis_names[0]!r} axis")
  if any(c < 0 for c in plan.microbatch_counts) or not any(plan.microbatch_counts):
    raise InvalidValueError(f"microbatch counts must be non-negative and not all zero, got {plan.microbatch_counts}")
  if isinstance(plan.slots, bool) or not isinstance(plan.slots, int) or plan.slots < 0:
    raise InvalidValueError(f"plan slots must be a non-negative integer (0: the largest count), got {plan.slots!r}")
  if plan.slots and plan.stages:
    raise InvalidValueError("a staged plan's buffers hold its largest count: slots must be 0")
  if plan.microbatch < 1:
    raise InvalidValueError(f"microbatch must be a positive integer, got {plan.microbatch}")
  if sum(plan.microbatch_counts) * plan.microbatch != plan.global_batch:
    raise InvalidValueError(
        f"microbatch counts {list(plan.microbatch_counts)} x microbatch {plan.microbatch} cover "
        f"{sum(plan.microbatch_counts) * plan.microbatch} examples, not the global batch of {plan.global_batch}")
  if plan.zero_stage not in ZERO_STAGES:
    raise InvalidValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {plan.zero_stage}")
  if plan.zero_shards and not (1 < plan.zero_shards < plan.data_size and plan.data_size % plan.zero_shards == 0):
    raise InvalidValueError(f"zero_shards must be 0 or a divisor of the {plan.data_size} data positions between 2 "
                            f"and {plan.data_size - 1}, got {plan.zero_shards}")
  if plan.zero_shards and plan.zero_stage == 0:
    raise InvalidValueError(f"zero_shards={plan.zero_shards} needs ZeRO stage 1 or 3, got ZeRO-0")
  if plan.remat not in REMAT_POLICIES:
    raise InvalidValueError(f"remat policy must be one of {REMAT_POLICIES}, got {plan.remat!r}")
  if plan.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
    raise InvalidValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got {plan.grad_reduce_dtype!r}"
                            + (" (float16 has too little range for unscaled gradients)"
                               if plan.grad_reduce_dtype == "float16" else ""))
  if plan.grad_reduce_dtype != "float32" and math.prod(
      n for a, n in zip(plan.axis_names[1:], plan.mesh_shape[1:]) if a != STAGE_AXIS) > 1:
    raise InvalidValueError(f"grad_reduce_dtype={plan.grad_reduce_dtype!r} needs a data-only mesh (every axis but "
                            f"{plan.data_axis!r} of size 1), got mesh {dict(zip(plan.axis_names, plan.mesh_shape))}; "
                            "reduce in float32 or drop the model axis")
  if not isinstance(plan.overlap_reduction, bool):
    raise InvalidValueError(f"overlap_reduction must be True or False, got {plan.overlap_reduction!r}")
  _check_overlap_microbatches(plan)
  if plan.stages:
    _check_stages(plan)
  for key, values in plan.predicted_per_position:
    if len(values) != plan.mesh_shape[0]:
      raise InvalidValueError(f"predicted {key!r} has {len(values)} values for {plan.mesh_shape[0]} data positions")
  if plan.schema not in READABLE_SCHEMAS:
    raise InvalidValueError(f"plan schema {plan.schema} is not supported; this hetspmd reads schemas "
                            f"{list(READABLE_SCHEMAS)}")

def _check_overlap_microbatches(plan: Plan) -> None:
  k = plan.overlap_microbatches
  if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
    raise InvalidValueError(f"overlap_microbatches must be a positive integer, got {k!r}")
  if k > 1 and not plan.overlap_reduction:
    raise InvalidValueError(f"overlap_microbatches={k} fuses the last microbatches of the overlapped pass; it needs "
                            "overlap_reduction=True (or overlap_microbatches=1)")
  if k > 1 and k > min(plan.microbatch_counts):
    raise InvalidValueError(f"overlap_microbatches={k} needs every data position to run at least {k} microbatches, "
                            f"got counts {list(plan.microbatch_counts)}; lower it to {min(plan.microbatch_counts)} "
                            "or less, or give every position that many")

def _check_stages(plan: Plan) -> None:
  sizes = dict(zip(plan.axis_names, plan.mesh_shape))
  if any(not isinstance(n, int) or n < 1 for n in plan.stages):
    raise InvalidValueError(f"every pipeline stage needs a positive number of layers, got stages={plan.stages}")
  if sizes.get(STAGE_AXIS) != len(plan.stages) or len(sizes) != 2:
    raise InvalidValueError(f"{len(plan.stages)} pipeline stages need a mesh of ({plan.data_axis!r}, {STAGE_AXIS!r}) "
                            f"with {len(plan.stages)} along {STAGE_AXIS!r}, got mesh {sizes}")
  if plan.zero_stage or plan.overlap_reduction:
    raise InvalidValueError("pipeline stages run with ZeRO-0 and without the overlapped reduction")


# --- building plans ------------------------------------------------------------


def _json_bool(value: Any, key: str) -> bool:
  if not isinstance(value, bool):
    raise InvalidValueError(f"plan JSON's {key!r} must be true or false, got {value!r}")
  return value


def _json_int(value: Any, key: str) -> int:
  if not isinstance(value, int) or isinstance(value, bool):
    raise InvalidValueError(f"plan JSON's {key!r} must be an integer, got {value!r}")
  return value


