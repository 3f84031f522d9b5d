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
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from hetspmd._pytree import leaves_with_paths
from hetspmd._version import __version__
from hetspmd.hardware.cluster import Cluster
from hetspmd.errors import HetSpmdError, InvalidValueError
from hetspmd.hardware.mesh import HetMesh, enumerate_layouts

SCHEMA_VERSION = 4  # 2: zero_shards; 3: grad_reduce_dtype, overlap_reduction (older files load as float32, off);
# 4: stages (older files load without)
READABLE_SCHEMAS = (1, 2, 3, 4)
STAGE_AXIS = "stage"
ZERO_STAGES = (0, 1, 3)
# What jax.checkpoint saves of a microbatch's forward pass, from most to least: everything ("none"),
# every matmul's output ("all_dots": dots_saveable), those without batch dimensions ("dots":
# dots_with_no_batch_dims_saveable, attention's batched matmuls recomputed), nothing ("full")
REMAT_POLICIES = ("none", "all_dots", "dots", "full")
# The dtype gradients cross the data axis in: float32 (exact), or bfloat16, halving the bytes on the wire
# (the microbatch accumulation stays float32 either way; see hetspmd.lowering.weighted). Not float16: without loss
# scaling its range (6e-5 to 65504 for normal values) loses ordinary gradients to underflow and large ones
# to overflow
GRAD_REDUCE_DTYPES = ("float32", "bfloat16")

SpecEntry = None | str | tuple[str, ...]
Spec = tuple[SpecEntry, ...]


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
  device_kinds: tuple[str, ...] = ()
  predicted: tuple[tuple[str, float], ...] = ()
  predicted_per_position: tuple[tuple[str, tuple[float, ...]], ...] = ()
  version: str = __version__
  schema: int = SCHEMA_VERSION

  def __post_init__(self):
    if len(self.axis_names) != len(self.mesh_shape):
      raise InvalidValueError(f"plan axes {self.axis_names} and mesh shape {self.mesh_shape} differ in length")
    if math.prod(self.mesh_shape) != len(self.device_ids) or len(set(self.device_ids)) != len(self.device_ids):
      raise InvalidValueError(
          f"plan mesh {self.mesh_shape} needs {math.prod(self.mesh_shape)} distinct devices, got {self.device_ids}")
    if len(self.microbatch_counts) != self.mesh_shape[0]:
      raise InvalidValueError(f"plan has {len(self.microbatch_counts)} microbatch counts for "
                              f"{self.mesh_shape[0]} positions of the {self.axis_names[0]!r} axis")
    if any(c < 0 for c in self.microbatch_counts) or not any(self.microbatch_counts):
      raise InvalidValueError(f"microbatch counts must be non-negative and not all zero, got {self.microbatch_counts}")
    if self.microbatch < 1:
      raise InvalidValueError(f"microbatch must be a positive integer, got {self.microbatch}")
    if sum(self.microbatch_counts) * self.microbatch != self.global_batch:
      raise InvalidValueError(
          f"microbatch counts {list(self.microbatch_counts)} x microbatch {self.microbatch} cover "
          f"{sum(self.microbatch_counts) * self.microbatch} examples, not the global batch of {self.global_batch}")
    if self.zero_stage not in ZERO_STAGES:
      raise InvalidValueError(f"ZeRO stage must be one of {ZERO_STAGES}, got {self.zero_stage}")
    if self.zero_shards and not (1 < self.zero_shards < self.data_size and self.data_size % self.zero_shards == 0):
      raise InvalidValueError(f"zero_shards must be 0 or a divisor of the {self.data_size} data positions between 2 "
                              f"and {self.data_size - 1}, got {self.zero_shards}")
    if self.zero_shards and self.zero_stage == 0:
      raise InvalidValueError(f"zero_shards={self.zero_shards} needs ZeRO stage 1 or 3, got ZeRO-0")
    if self.remat not in REMAT_POLICIES:
      raise InvalidValueError(f"remat policy must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
      raise InvalidValueError(f"grad_reduce_dtype must be one of {GRAD_REDUCE_DTYPES}, got {self.grad_reduce_dtype!r}"
                              + (" (float16 has too little range for unscaled gradients)"
                                 if self.grad_reduce_dtype == "float16" else ""))
    if self.grad_reduce_dtype != "float32" and math.prod(
        n for a, n in zip(self.axis_names[1:], self.mesh_shape[1:]) if a != STAGE_AXIS) > 1:
      raise InvalidValueError(f"grad_reduce_dtype={self.grad_reduce_dtype!r} needs a data-only mesh (every axis but "
                              f"{self.data_axis!r} of size 1), got mesh {dict(zip(self.axis_names, self.mesh_shape))}; "
                              "reduce in float32 or drop the model axis")
    if not isinstance(self.overlap_reduction, bool):
      raise InvalidValueError(f"overlap_reduction must be True or False, got {self.overlap_reduction!r}")
    self._check_overlap_microbatches()
    if self.stages:
      self._check_stages()
    for key, values in self.predicted_per_position:
      if len(values) != self.mesh_shape[0]:
        raise InvalidValueError(f"predicted {key!r} has {len(values)} values for {self.mesh_shape[0]} data positions")
    if self.schema not in READABLE_SCHEMAS:
      raise InvalidValueError(f"plan schema {self.schema} is not supported; this hetspmd reads schemas "
                              f"{list(READABLE_SCHEMAS)}")

  def _check_overlap_microbatches(self) -> None:
    k = self.overlap_microbatches
    if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
      raise InvalidValueError(f"overlap_microbatches must be a positive integer, got {k!r}")
    if k > 1 and not self.overlap_reduction:
      raise InvalidValueError(f"overlap_microbatches={k} fuses the last microbatches of the overlapped pass; it needs "
                              "overlap_reduction=True (or overlap_microbatches=1)")
    if k > 1 and k > min(self.microbatch_counts):
      raise InvalidValueError(f"overlap_microbatches={k} needs every data position to run at least {k} microbatches, "
                              f"got counts {list(self.microbatch_counts)}; lower it to {min(self.microbatch_counts)} "
                              "or less, or give every position that many")

  def _check_stages(self) -> None:
    sizes = dict(zip(self.axis_names, self.mesh_shape))
    if any(not isinstance(n, int) or n < 1 for n in self.stages):
      raise InvalidValueError(f"every pipeline stage needs a positive number of layers, got stages={self.stages}")
    if sizes.get(STAGE_AXIS) != len(self.stages) or len(sizes) != 2:
      raise InvalidValueError(f"{len(self.stages)} pipeline stages need a mesh of ({self.data_axis!r}, {STAGE_AXIS!r}) "
                              f"with {len(self.stages)} along {STAGE_AXIS!r}, got mesh {sizes}")
    if self.zero_stage or self.overlap_reduction:
      raise InvalidValueError("pipeline stages run with ZeRO-0 and without the overlapped reduction")

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
    return max(self.microbatch_counts)

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
        "state_specs": {path: [list(e) if isinstance(e, tuple) else e for e in spec] for path, spec in self.state_specs},
        "predicted": dict(self.predicted),
        "predicted_per_position": {k: list(v) for k, v in self.predicted_per_position},
    }

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "Plan":
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
          state_specs=tuple((p, tuple(tuple(e) if isinstance(e, list) else e for e in spec))
                            for p, spec in data["state_specs"].items()),
          predicted=tuple((k, float(v)) for k, v in data.get("predicted", {}).items()),
          predicted_per_position=tuple((k, tuple(map(float, v)))
                                       for k, v in data.get("predicted_per_position", {}).items()),
          version=str(data.get("hetspmd_version", "")), schema=schema)
    except KeyError as e:
      raise InvalidValueError(f"plan JSON lacks the key {e.args[0]!r}") from None

  def save(self, path: str | Path) -> None:
    Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

  @classmethod
  def load(cls, path: str | Path) -> "Plan":
    try:
      return cls.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
      raise InvalidValueError(f"plan file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
      raise InvalidValueError(f"plan file {str(path)!r} is not valid JSON: {e}") from None

  def summary(self) -> str:
    lines = [f"mesh {dict(zip(self.axis_names, self.mesh_shape))}, global batch {self.global_batch} = "
             f"{sum(self.microbatch_counts)} microbatches of {self.microbatch}, ZeRO-{self.zero_stage}"
             f"{f' (over groups of {self.zero_shards} where a leaf does not split {self.data_size} ways)' if self.zero_shards else ''}, "
             f"remat {self.remat}, gradients reduced in {self.grad_reduce_dtype}"
             f"{self._overlap_text()}"
             f"{f', pipeline stages of {list(self.stages)} layers' if self.stages else ''}"]
    groups = np.asarray(self.device_ids).reshape(self.data_size, -1)
    kinds = np.asarray(self.device_kinds or ["?"] * len(self.device_ids), dtype=object).reshape(self.data_size, -1)
    for i, count in enumerate(self.microbatch_counts):
      share = count / sum(self.microbatch_counts)
      lines.append(f"  {self.data_axis}[{i}] devices {list(map(int, groups[i]))} ({kinds[i][0]}): "
                   f"{count} microbatches ({share:.0%}) {'#' * round(share * 40)}")
    for key, value in self.predicted:
      lines.append(f"  predicted {key}: {value:.6g}")
    return "\n".join(lines)


# --- building plans ------------------------------------------------------------


def _json_bool(value: Any, key: str) -> bool:
  if not isinstance(value, bool):
    raise InvalidValueError(f"plan JSON's {key!r} must be true or false, got {value!r}")
  return value


def _json_int(value: Any, key: str) -> int:
  if not isinstance(value, int) or isinstance(value, bool):
    raise InvalidValueError(f"plan JSON's {key!r} must be an integer, got {value!r}")
  return value


def proportional_counts(weights: Sequence[float], total: int) -> tuple[int, ...]:
  """Integer counts summing to ``total``, proportional to ``weights``.

  Largest-remainder rounding: floor each share, then give the leftover units
  to the largest remainders (ties to the earlier position).
  """
  w = np.asarray(weights, dtype=float)
  if total < 0 or len(w) == 0 or np.any(w < 0) or w.sum() <= 0:
    raise InvalidValueError(f"cannot split {total} by weights {list(weights)}")
  exact = w / w.sum() * total
  counts = np.floor(exact).astype(int)
  order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
  for i in order[: total - counts.sum()]:
    counts[i] += 1
  return tuple(int(c) for c in counts)


def default_microbatch(global_batch: int, data_size: int, per_position: int = 4) -> int:
  """The largest divisor of the global batch giving every position about ``per_position`` microbatches."""
  target = max(1, global_batch // (data_size * per_position))
  return max(d for d in range(1, target + 1) if global_batch % d == 0)


def _role_of(path: str, dtype: Any) -> str:
  from hetspmd.passes.frontend.roles import Leaf, infer_role

  return infer_role(Leaf(tuple(path.split("/")), 0, str(dtype), None), num_args=2).value


def _parts(entry: SpecEntry, sizes: Mapping[str, int]) -> int:
  return math.prod(sizes[a] for a in ((entry,) if isinstance(entry, str) else entry))


def shards_axis(data_axis: str) -> str:
  """The name of the data sub-axis of ``zero_shards`` positions (:meth:`Plan.state_mesh`)."""
  return f"{data_axis}_shards"


def _zero_role(zero_stage: int, role: str) -> bool:
  return zero_stage >= 1 and role == "opt_state" or zero_stage >= 3 and role == "param"


def zero_shards_for(state: Any, axis_names: Sequence[str], mesh_shape: Sequence[int], zero_stage: int,
                    specs: Mapping[str, Sequence[SpecEntry]] | None = None,
                    model_specs: Mapping[str, Sequence[SpecEntry]] | None = None) -> int:
  """The group size ZeRO shards a leaf over when none of its dimensions divides by all ``n`` data positions.

  The proper divisor ``k`` of ``n`` that saves the most bytes over the
  leaves :func:`auto_state_specs` (given the same ``specs`` and
  ``model_specs``) leaves unsplit along ``data``: such a leaf with a free
  dimension divisible by ``k`` is held ``k`` ways instead of whole. 0 when
  no divisor saves anything. GPT-2 XL's 1600-wide matrices on 24
  positions: ``k = 8``.
  """
  n = mesh_shape[0]
  if zero_stage < 1 or n < 4:
    return 0
  sizes = dict(zip(axis_names, mesh_shape))
  chosen = dict(auto_state_specs(state, axis_names, mesh_shape, zero_stage, specs, model_specs))
  unsplit = []  # (free dimension sizes, bytes on one device)
  for path, leaf in leaves_with_paths(state):
    spec, shape = chosen[path], tuple(np.shape(leaf))
    if not _zero_role(zero_stage, _role_of(path, getattr(leaf, "dtype", "float32"))) or any(
        e == axis_names[0] or isinstance(e, tuple) and axis_names[0] in e for e in spec):
      continue
    parts = math.prod(_parts(e, sizes) for e in spec if e is not None)
    free = [shape[d] for d in range(len(shape)) if d >= len(spec) or spec[d] is None]
    unsplit.append((free, math.prod(shape) * np.dtype(getattr(leaf, "dtype", "float32")).itemsize / parts))
  return zero_group(n, unsplit)


def zero_group(n: int, unsplit: Sequence[tuple[Sequence[int], float]]) -> int:
  """The proper divisor ``k`` of ``n`` that saves the most over leaves of ``(free dimension sizes, size)``.

  A leaf with a free dimension divisible by ``k`` is held ``k`` ways
  instead of whole; ties go to the larger ``k``; 0 when none saves anything.
  """
  best, saved = 0, 0.0
  for k in range(2, n):
    if n % k == 0:
      gain = sum(size * (1 - 1 / k) for free, size in unsplit if any(d % k == 0 for d in free))
      if gain > 0 and gain >= saved:
        best, saved = k, gain
  return best


def auto_state_specs(state: Any, axis_names: Sequence[str], mesh_shape: Sequence[int], zero_stage: int = 0,
                     specs: Mapping[str, Sequence[SpecEntry]] | None = None,
                     model_specs: Mapping[str, Sequence[SpecEntry]] | None = None,
                     zero_shards: int = 0) -> tuple[tuple[str, Spec], ...]:
  """A PartitionSpec for every state leaf.

  Along the unweighted (``model``) axes, in order of precedence: the user's
  ``specs`` (e.g. :func:`hetspmd.annotated_specs` of the model's own
  annotations), kept as given; the planner's ``model_specs``, where an entry
  that does not divide the leaf evenly is dropped and leaves they do not
  match stay whole; without ``model_specs``, the last dimension of every leaf
  of rank ≥ 2 that divides evenly. Both map path suffixes to specs (see
  :func:`hetspmd.plan.annotations.match`), so a parameter's spec also applies to
  the optimizer state that mirrors it. Along ``data`` (ZeRO), when the spec
  does not already use it: with stage ≥ 1 the first free, evenly dividing
  dimension of optimizer state; with stage 3 of parameters too. A leaf with
  no such dimension is split over the ``zero_shards`` sub-axis
  (:func:`shards_axis`) where one of its free dimensions divides by it.
  """
  from hetspmd.plan import annotations

  sizes = dict(zip(axis_names, mesh_shape))
  data, others = axis_names[0], [a for a in axis_names[1:] if sizes[a] > 1]
  if zero_shards:
    sizes[shards_axis(data)] = zero_shards
  if specs:
    annotations.check_axes(specs, axis_names)
  out = []
  for path, leaf in leaves_with_paths(state):
    shape = tuple(np.shape(leaf))
    spec: list[SpecEntry] = [None] * len(shape)
    chosen = annotations.match(path, len(shape), specs or {})
    if chosen is None and model_specs is not None:
      planned = annotations.match(path, len(shape), model_specs) or ()
      chosen = tuple(e if e is None or shape[d] % _parts(e, sizes) == 0 else None for d, e in enumerate(planned))
    if chosen is not None:
      spec[:len(chosen)] = [tuple(e) if isinstance(e, list) else e for e in chosen]
    else:
      for axis in others:
        if len(shape) >= 2 and spec[-1] is None and shape[-1] % sizes[axis] == 0:
          spec[-1] = axis
    used = {a for e in spec for a in ((e,) if isinstance(e, str) else (e or ()))}
    if shards_axis(data) in used:  # a planned ZeRO split over groups, kept as given
      used.add(data)
    role = _role_of(path, getattr(leaf, "dtype", "float32"))
    if sizes[data] > 1 and data not in used and _zero_role(zero_stage, role):
      free = [dim for dim, entry in enumerate(spec) if entry is None]
      whole = [dim for dim in free if shape[dim] % sizes[data] == 0]
      grouped = [dim for dim in free if zero_shards and shape[dim] % zero_shards == 0]
      if whole:
        spec[whole[0]] = data
      elif grouped:
        spec[grouped[0]] = shards_axis(data)
    while spec and spec[-1] is None:
      spec.pop()
    out.append((path, tuple(spec)))
  return tuple(out)


def plan_for(cluster: Cluster, state: Any, *, global_batch: int, layout: HetMesh | tuple[int, ...] | None = None,
             microbatch: int | None = None, counts: Sequence[int] | None = None, zero_stage: int = 0,
             remat: str = "none", dtype: str = "float32", grad_reduce_dtype: str = "float32",
             overlap_reduction: bool = False, specs: Mapping[str, Sequence[SpecEntry]] | None = None,
             stages: Sequence[int] = (), overlap_microbatches: int = 1) -> Plan:
  """A plan over ``cluster`` with microbatch counts proportional to device speed.

  Args:
    cluster: devices bound to JAX (``Cluster.from_devices`` / ``emulate``).
    state: the train state (arrays or ``ShapeDtypeStruct``s) whose leaves
      get PartitionSpecs.
    global_batch: examples per step.
    layout: a ``HetMesh`` or a ``(data, model)`` shape; default all data.
    microbatch: examples per microbatch; default :func:`default_microbatch`.
    counts: microbatches per data position; default proportional to each
      position's peak FLOP/s in ``dtype``.
    grad_reduce_dtype: the dtype gradients cross ``data`` in
      (:data:`GRAD_REDUCE_DTYPES`); accumulation stays float32.
    overlap_reduction: run each position's last microbatch outside its loop,
      so that gradient reductions can overlap its backward pass.
    overlap_microbatches: with ``overlap_reduction``, how many of each
      position's microbatches that last pass runs, as one batch (every
      position runs at least this many): a longer backward pass to hide the
      reductions under, beside small microbatches that weight the devices.
    specs: ``{path suffix: spec}`` kept as given for the leaves they match
      (e.g. ``hetspmd.annotated_specs(params, rules)``: the model's own
      ``nnx.with_partitioning`` / ``nn.with_logical_partitioning``
      annotations); other leaves get hetspmd's choice.
    stages: layers per pipeline stage, in order (e.g. ``(8, 4)``), for a
      step whose model runs its layers as one scan over stacked parameters
      (``nn.scan``, ``nnx.scan``): the devices form ``len(stages)``
      consecutive groups (whole hosts first), and a faster group takes
      more layers; each group splits every microbatch's examples evenly
      (see :mod:`hetspmd.lowering.staged`). ``counts`` default to the global batch's
      microbatches spread as evenly as they go (the ticks are lockstep,
      so weighting the data positions would not pay; a position past its
      count skips the ticks' work). State leaves of ``sum(stages)`` rows
      (the stacked layers and their optimizer moments) are split over the
      stages in equal blocks when the stage count divides the layers; the
      rest of the state is replicated.
  """
  if cluster.jax_device_ids is None:
    raise HetSpmdError("the cluster is not bound to JAX devices; use Cluster.from_devices(jax.devices()) or "
                       "Cluster.emulate(jax.devices(), kinds=[...]) to run on this machine")
  if not isinstance(global_batch, int) or global_batch < 1:
    raise InvalidValueError(f"global_batch must be a positive integer, got {global_batch!r}")
  if stages:
    given = {"layout": layout is not None, "zero_stage": zero_stage != 0,
             "overlap_reduction": overlap_reduction, "specs": specs is not None, "dtype": dtype != "float32",
             "overlap_microbatches": overlap_microbatches != 1}
    if any(given.values()):
      raise InvalidValueError(f"pipeline stages choose their own mesh and state layout and run with ZeRO-0 "
                              f"and no overlap; drop {[k for k, v in given.items() if v]} or drop stages")
    return _staged_plan(cluster, state, tuple(stages), global_batch, microbatch, counts, remat, grad_reduce_dtype)
  mesh = _layout(cluster, layout)
  microbatch = _microbatch_for(global_batch, mesh.shape[0], microbatch, counts)
  if counts is None:
    counts = proportional_counts(mesh.speed_weights(dtype), global_batch // microbatch)
  devices = cluster.devices
  shards = zero_shards_for(state, mesh.axis_names, mesh.shape, zero_stage, specs)
  return Plan(
      axis_names=mesh.axis_names,
      mesh_shape=mesh.shape,
      device_ids=tuple(cluster.jax_device_ids[i] for i in mesh.device_ids),
      global_batch=global_batch,
      microbatch=microbatch,
      microbatch_counts=tuple(int(c) for c in counts),
      state_specs=auto_state_specs(state, mesh.axis_names, mesh.shape, zero_stage, specs, zero_shards=shards),
      zero_stage=zero_stage,
      zero_shards=shards,
      remat=remat,
      grad_reduce_dtype=grad_reduce_dtype,
      overlap_reduction=overlap_reduction,
      overlap_microbatches=overlap_microbatches,
      device_kinds=tuple(devices[i].spec.name for i in mesh.device_ids),
  )


def stage_layers(cluster: Cluster, stages: int, layers: int, dtype: str = "float32") -> tuple[int, ...]:
  """Layers per stage for ``stages`` equal groups of consecutive devices (as ``plan_for(stages=...)`` forms them).

  A stage's tick lasts its layer count over its speed, the peak FLOP/s in ``dtype`` of its slowest device
  (every device of a stage runs an equal share of each microbatch); the split minimises the slowest
  stage: one layer each, then every further layer to the stage that would finish it first.
  """
  n = cluster.num_devices
  if stages < 1 or n % stages:
    raise InvalidValueError(f"{n} devices do not form {stages} stages of equal size; valid stage counts: "
                            f"{[k for k in range(1, n + 1) if n % k == 0]}")
  if layers < stages:
    raise InvalidValueError(f"{layers} layers cannot fill {stages} stages; every stage needs at least one")
  width = n // stages
  devices = cluster.devices
  speed = [min(devices[i].spec.peak_flops(dtype) for i in range(s * width, (s + 1) * width)) for s in range(stages)]
  from hetspmd.planner.stages import split_layers

  return split_layers([1.0 / v for v in speed], [0.0] * stages, layers)


def _stacked_leaf(leaf: Any, stages: tuple[int, ...]) -> bool:
  """A state leaf of the layer stack (parameters, their optimizer moments): split over ``stage`` in even blocks,
  which the staged program moves to the stages' uneven layers and back (``hetspmd.lowering.staged``)."""
  layers = sum(stages)
  return np.ndim(leaf) >= 1 and np.shape(leaf)[0] == layers and layers % len(stages) == 0


def even_counts(n: int, total: int) -> tuple[int, ...]:
  """``total`` microbatches spread over ``n`` positions as evenly as they go, the first positions taking one more."""
  return tuple(total // n + (1 if i < total % n else 0) for i in range(n))


def _microbatch_for(global_batch: int, positions: int, microbatch: int | None, counts: Sequence[int] | None) -> int:
  """The plan's microbatch: as given, else what ``counts`` imply, else :func:`default_microbatch`; it must divide
  the global batch (a clear error before the Plan's own checks)."""
  if microbatch is None:
    if counts is None:
      return default_microbatch(global_batch, positions)
    if sum(counts) > global_batch:
      raise InvalidValueError(f"microbatch counts {list(counts)} hold {sum(counts)} microbatches, more than the "
                              f"global batch of {global_batch} examples; give counts whose sum times the microbatch "
                              f"is {global_batch}")
    microbatch = global_batch // max(1, sum(counts))
  if microbatch < 1 or global_batch % microbatch:
    raise InvalidValueError(f"global batch {global_batch} is not divisible by the microbatch {microbatch}; "
                            f"valid microbatches: {[d for d in range(1, global_batch + 1) if global_batch % d == 0]}")
  return microbatch


def _staged_plan(cluster: Cluster, state: Any, stages: tuple[int, ...], global_batch: int, microbatch: int | None,
                 counts: Sequence[int] | None, remat: str, grad_reduce_dtype: str) -> Plan:
  n, S = cluster.num_devices, len(stages)
  if n % S:
    raise InvalidValueError(f"{n} devices do not form {S} stages of equal size; valid stage counts: "
                            f"{[k for k in range(1, n + 1) if n % k == 0]}")
  positions = n // S
  microbatch = _microbatch_for(global_batch, positions, microbatch, counts)
  if counts is None and global_batch < positions * microbatch:
    raise InvalidValueError(f"global batch {global_batch} does not split into microbatches of {microbatch} with at "
                            f"least one for each of the {positions} data positions; valid microbatches: "
                            f"{[d for d in range(1, global_batch // positions + 1) if global_batch % d == 0]}")
  # every tick is lockstep across the data positions, so the fastest split is the most even one (the
  # stages' layers carry the weighting); a position past its count skips the ticks' work
  counts = even_counts(positions, global_batch // microbatch) if counts is None else tuple(counts)
  grid = np.arange(n).reshape(S, positions).T  # stage s holds devices s * positions ... (consecutive hosts)
  mesh = HetMesh(cluster, ("data", STAGE_AXIS), (positions, S), tuple(int(i) for i in grid.ravel()))
  devices = cluster.devices
  return Plan(
      axis_names=mesh.axis_names, mesh_shape=mesh.shape,
      device_ids=tuple(cluster.jax_device_ids[i] for i in mesh.device_ids), global_batch=global_batch,
      microbatch=microbatch, microbatch_counts=tuple(int(c) for c in counts),
      state_specs=tuple((p, (STAGE_AXIS,) if _stacked_leaf(leaf, stages) else ()) for p, leaf in leaves_with_paths(state)),
      remat=remat,
      grad_reduce_dtype=grad_reduce_dtype, stages=stages,
      device_kinds=tuple(devices[i].spec.name for i in mesh.device_ids))


def _layout(cluster: Cluster, layout: HetMesh | tuple[int, ...] | None) -> HetMesh:
  if isinstance(layout, HetMesh):
    return layout
  layouts = list(enumerate_layouts(cluster))
  if layout is None:
    return layouts[0]
  for mesh in layouts:
    if mesh.shape == tuple(layout):
      return mesh
  raise InvalidValueError(f"layout {tuple(layout)} is not valid for {cluster}; valid (data, model) shapes: "
                          f"{[m.shape for m in layouts]}")
