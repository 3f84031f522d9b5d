"""Group plans: the devices partitioned into groups, each running its own program with its own microbatch.

One SPMD program gives every device the same buffers, so the pool's weakest
device sets the microbatch size for all. A :class:`GroupPlan` gives each
:class:`Group` of devices its own microbatch size and per-device counts: a
step then runs as a short schedule of programs (:mod:`hetspmd.runtime.grouped`),
one per group over a mesh of its devices (its microbatch loop, giving each
device's partial sums), then one uniform program over every device that
adds those sums and runs the rest of the step once.

The examples are laid out group by group, device by device: device ``i`` of
group ``g`` takes ``counts[i] * microbatch`` consecutive examples of the
global batch, after those of the groups and devices before it. A group with
a model axis (``Group.model``) lays them out by data position instead, its
devices ``model`` at a time running each position's microbatches together.

With ``state_shares`` (ZeRO-1 by memory), the optimizer state is not
replicated: each device holds whole, unpadded optimizer-state leaves adding
up to about its share of the bytes (:func:`assign_owners`), updates them in
its own program, and sends the parameters it updated to every device. With
``zero_stage=3`` the parameters stay with their optimizer state between
steps too (each device holds its share of both), and are sent to every
device at the start of the next step instead.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from hetspmd._format import quantity
from hetspmd.errors import InvalidValueError
from hetspmd.plan.options import GRAD_REDUCE_DTYPES, REMAT_POLICIES, ZERO_STAGES

GROUP_PLAN_VERSION = 7
# the JSON versions from_json reads (version 1: no state shares; version 2: no zero_stage, ZeRO-1 under shares;
# version 3: no reduce_dtype, float32; version 4: no model axis; version 5: no shard_params; version 6: the
# reduction dtype under "reduce_dtype", now "grad_reduce_dtype" as in a single program's plan)
_READS = (1, 2, 3, 4, 5, 6, 7)
# the ZeRO stages a group plan runs: 0 replicated, 1 optimizer state in shares, 3 parameters in shares too
# relative slack on state shares that must add up to 1
_SHARE_SLACK = 1e-6


@dataclasses.dataclass(frozen=True)
class Group:
  """Devices (JAX device ids, in position order) that run one program: microbatches of ``microbatch``
  examples, ``counts[i]`` of them on device ``i``, each microbatch's forward pass saved or recomputed as
  ``remat`` says (:data:`hetspmd.plan.options.REMAT_POLICIES`; applied by ``hetspmd.value_and_grad``).

  ``model`` > 1 gives the group a model axis: its devices, taken ``model`` at a time, are data positions whose
  devices split each microbatch's work, each parameter of ``model_dims`` (``(path, dimension)`` pairs, paths as
  the state's leaves are named: ``params/h/0/mlp/c_fc/kernel``) split along that dimension over them, so each
  holds that part of the parameter's gradient and activations. A position's devices share one count (each
  device has its entry in ``counts``, equal within a position) and hold the whole parameters between steps.

  ``shard_params`` runs the group's loop FSDP-style: each floating parameter its loop reads is split evenly over
  the group's devices (zero-padded along one axis where the group's size does not divide it), gathered for each
  equation that reads it inside each microbatch (a layer scan's a slice per iteration), and each microbatch's
  gradient sums are reduce-scattered into an accumulator of parts. Its devices then run the group's longest count in lockstep, masking the microbatches they do not
  have. Needs ``model`` == 1.

  ``slots`` > 0 gives each device microbatch buffers of that many slots (at least its count), and the group's
  programs read its counts when they run: new counts that fit the slots run the same programs (rebalancing,
  :class:`hetspmd.Rebalance`). 0: buffers of the longest count, which the programs may take as a constant."""

  devices: tuple[int, ...]
  microbatch: int
  counts: tuple[int, ...]
  remat: str = "none"
  model: int = 1
  model_dims: tuple[tuple[str, int], ...] = ()
  shard_params: bool = False
  slots: int = 0

  def __post_init__(self):
    object.__setattr__(self, "devices", tuple(int(d) for d in self.devices))
    object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))
    if not self.devices:
      raise InvalidValueError("a group needs at least one device")
    if len(set(self.devices)) != len(self.devices):
      raise InvalidValueError(f"a group names a device twice: devices {self.devices}")
    if not isinstance(self.microbatch, int) or self.microbatch < 1:
      raise InvalidValueError(f"a group's microbatch must be a positive integer, got {self.microbatch!r}")
    if self.remat not in REMAT_POLICIES:
      raise InvalidValueError(f"a group's remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}")
    if len(self.counts) != len(self.devices) or any(c < 0 for c in self.counts):
      raise InvalidValueError(f"a group needs one count of at least 0 per device: {len(self.devices)} devices "
                              f"{self.devices}, counts {self.counts}")
    pairs = list(self.model_dims.items() if isinstance(self.model_dims, Mapping) else self.model_dims)
    if any(not isinstance(pair, (tuple, list)) or len(pair) != 2 for pair in pairs):
      raise InvalidValueError(f"model_dims must map parameter paths to dimensions (a dict, or (path, dimension) "
                              f"pairs), got {self.model_dims!r}")
    twice = sorted({str(p) for p, _ in pairs if sum(str(q) == str(p) for q, _ in pairs) > 1})
    if twice:
      raise InvalidValueError(f"model_dims names {twice} more than once: give each parameter one dimension")
    object.__setattr__(self, "model_dims", tuple(sorted((str(p), int(d)) for p, d in pairs)))
    if not isinstance(self.slots, int) or isinstance(self.slots, bool) or self.slots < 0:
      raise InvalidValueError(f"a group's slots must be a non-negative integer (0: none beyond its longest count), "
                              f"got {self.slots!r}")
    self._check_model()

  def _check_model(self) -> None:
    m = self.model
    if not isinstance(m, int) or m < 1 or len(self.devices) % m:
      raise InvalidValueError(f"a group's model axis must be a positive integer dividing its {len(self.devices)} "
                              f"devices, got model={m!r}")
    if m == 1 and self.model_dims:
      raise InvalidValueError("a group's model_dims need a model axis: give the group model > 1, or no model_dims")
    if not isinstance(self.shard_params, bool):
      raise InvalidValueError(f"a group's shard_params must be True or False, got {self.shard_params!r}")
    if self.shard_params and m > 1:
      raise InvalidValueError(f"a group with shard_params runs data-only for now: it cannot also have a model "
                              f"axis (model={m}); give it model=1, or shard_params=False")
    if m > 1 and not self.model_dims:
      raise InvalidValueError(f"a group with a model axis of {m} needs model_dims: which dimension of which "
                              "parameters splits over it, as (path, dimension) pairs")
    if any(d < 0 for _, d in self.model_dims):
      raise InvalidValueError(f"model_dims dimensions must be at least 0, got {dict(self.model_dims)}")
    uneven = [p for p in range(len(self.positions)) if len(set(self.counts[p * m:(p + 1) * m])) > 1]
    if uneven:
      raise InvalidValueError(f"the devices of a data position share its count (model axis of {m}): counts "
                              f"{list(self.counts)} differ within position(s) {uneven}")

  @property
  def positions(self) -> tuple[int, ...]:
    """Each data position's count (its devices', ``model`` of them in a row)."""
    return self.counts[::self.model]

  @property
  def examples(self) -> int:
    return sum(self.positions) * self.microbatch

  @property
  def max_count(self) -> int:
    """Each device's microbatch buffer slots: its longest count, or :attr:`slots` where more."""
    return max(max(self.counts), self.slots, 1)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
  """Groups that together cover the global batch, no device in two of them.

  ``tail_count`` microbatches of ``tail_microbatch`` examples per device (every device of every group, in
  group order) run last, inside the uniform program that reduces the groups' sums: the reduction then
  overlaps their backward pass, as a single program's does its last microbatch's. They take the last
  examples of the batch.

  ``state_shares``: each device's fraction of the state it holds between steps (devices in group order), or
  none to replicate it; ``zero_stage``: what the shares hold, 1 the optimizer state, 3 the parameters as well
  (default: 1 with shares, 0 without).

  ``grad_reduce_dtype``: the dtype the gradients' partial sums cross devices in (as :attr:`Plan.grad_reduce_dtype`) (float32, or bfloat16 to halve the
  bytes; every other sum, the metrics' and the loss's, crosses in float32 either way).

  ``predicted`` (the search's figures: step seconds, throughput, ...) and ``predicted_per_device`` (per device
  in group order: its peak bytes, its compute seconds) describe the plan; they do not take part in equality."""

  groups: tuple[Group, ...]
  global_batch: int
  tail_microbatch: int = 0
  tail_count: int = 0
  state_shares: tuple[float, ...] = ()
  zero_stage: int | None = None
  grad_reduce_dtype: str = "float32"
  predicted: tuple[tuple[str, float], ...] = dataclasses.field(default=(), compare=False)
  predicted_per_device: tuple[tuple[str, tuple[float, ...]], ...] = dataclasses.field(default=(), compare=False)

  def __post_init__(self):
    object.__setattr__(self, "groups", tuple(self.groups))
    object.__setattr__(self, "state_shares", tuple(float(s) for s in self.state_shares))
    if self.zero_stage is None:
      object.__setattr__(self, "zero_stage", 1 if self.state_shares else 0)
    if self.zero_stage not in ZERO_STAGES:
      raise InvalidValueError(f"a group plan's zero_stage must be one of {list(ZERO_STAGES)}, got "
                              f"{self.zero_stage!r}")
    object.__setattr__(self, "predicted", tuple((str(k), float(v)) for k, v in self.predicted))
    object.__setattr__(self, "predicted_per_device", tuple((str(k), tuple(map(float, v)))
                                                           for k, v in self.predicted_per_device))
    if bool(self.zero_stage) != bool(self.state_shares):
      raise InvalidValueError(f"zero_stage {self.zero_stage} needs " + (
          "state_shares (each device's fraction of the state): use shares_for(...)" if self.zero_stage else
          "zero_stage 1 or 3 beside state_shares (0 replicates the state)"))
    if not self.groups:
      raise InvalidValueError("a group plan needs at least one group")
    if self.grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
      raise InvalidValueError(f"a group plan's grad_reduce_dtype must be one of {list(GRAD_REDUCE_DTYPES)}, got "
                              f"{self.grad_reduce_dtype!r}")
    if (self.tail_microbatch > 0) != (self.tail_count > 0) or self.tail_microbatch < 0 or self.tail_count < 0:
      raise InvalidValueError(f"a tail needs a positive microbatch and count together, got tail_microbatch="
                              f"{self.tail_microbatch}, tail_count={self.tail_count}")
    owner: dict[int, int] = {}
    for g, group in enumerate(self.groups):
      for d in group.devices:
        if d in owner:
          raise InvalidValueError(f"device {d} is in group {owner[d]} and in group {g}: each device belongs to "
                                  "one group")
        owner[d] = g
    covered = sum(group.examples for group in self.groups) + self.tail_examples
    if covered != self.global_batch:
      detail = " + ".join([f"{sum(g.positions)} x {g.microbatch}" for g in self.groups] + (
          [f"{len(self.devices) * self.tail_count} x {self.tail_microbatch} in the tail"] if self.tail_count else []))
      raise InvalidValueError(f"the groups cover {covered} examples ({detail}), not the global batch of "
                              f"{self.global_batch}: change the counts or the microbatch sizes")
    for key, values in self.predicted_per_device:
      if len(values) != len(owner):
        raise InvalidValueError(f"predicted {key!r} has {len(values)} values for the plan's {len(owner)} devices")
    self._check_shares()

  def _check_shares(self) -> None:
    shares, n = self.state_shares, len(self.devices)
    if not shares:
      return
    if len(shares) != n:
      raise InvalidValueError(f"state_shares needs one share per device of the plan ({n}: devices "
                              f"{list(self.devices)}), got {len(shares)}")
    if any(not s >= 0 for s in shares) or abs(sum(shares) - 1) > _SHARE_SLACK:
      raise InvalidValueError(f"state_shares must be fractions of at least 0 adding up to 1, got {list(shares)} "
                              f"(sum {sum(shares):.6g}): use shares_for(...) to make them from free memory")

  @property
  def devices(self) -> tuple[int, ...]:
    return tuple(d for g in self.groups for d in g.devices)

  @property
  def hybrid(self) -> bool:
    """Whether every group holds its parameters and optimizer state split over its own devices between steps
    (FSDP's state, each group its own copy: hybrid sharding, as PyTorch's HSDP): every group shards its parameters
    (:attr:`Group.shard_params`), all groups have as many devices, and the state is in no shares and the plan
    has no tail. A one-group plan of this kind is plain FSDP."""
    return is_hybrid([g.shard_params for g in self.groups], [len(g.devices) for g in self.groups],
                     shares=bool(self.state_shares), tail=bool(self.tail_count))

  @property
  def tail_remat(self) -> str:
    """The remat policy of the tail and of the exchange program's trace: the groups' that recomputes most."""
    return max((g.remat for g in self.groups), key=REMAT_POLICIES.index)

  @property
  def tail_examples(self) -> int:
    return len(self.devices) * self.tail_count * self.tail_microbatch

  def tail_starts(self) -> tuple[int, ...]:
    """Each device's first tail example (devices in group order)."""
    first = self.global_batch - self.tail_examples
    return tuple(first + i * self.tail_count * self.tail_microbatch for i in range(len(self.devices)))

  def examples_of(self, devices: Any) -> np.ndarray:
    """The global batch's examples that ``devices`` (device ids: one process's) run, ascending: each data
    position's, where one of its devices is among them, and each of those devices' tail examples. A process
    feeds these, in this order (:meth:`hetspmd.runtime.grouped.GroupedStep.shard_batch`)."""
    mine = set(devices)
    ranges = []
    for group, starts in zip(self.groups, self.starts()):
      for p, (count, start) in enumerate(zip(group.positions, starts)):
        if mine.intersection(group.devices[p * group.model:(p + 1) * group.model]):
          ranges.append(np.arange(start, start + count * group.microbatch))
    size = self.tail_count * self.tail_microbatch
    ranges += [np.arange(s, s + size) for d, s in zip(self.devices, self.tail_starts()) if d in mine]
    return np.unique(np.concatenate(ranges)) if ranges else np.zeros((0,), np.int64)

  def starts(self) -> tuple[tuple[int, ...], ...]:
    """Per group, each data position's first example of the global batch (one per device where the group has
    no model axis)."""
    out, at = [], 0
    for group in self.groups:
      firsts = []
      for c in group.positions:
        firsts.append(at)
        at += c * group.microbatch
      out.append(tuple(firsts))
    return tuple(out)

  @property
  def example_width(self) -> int:
    """The most examples one device runs in its group's loop: each device's rows of a per-example output are
    padded to it, so that they have one shape across groups."""
    return max(1, max(g.max_count * g.microbatch for g in self.groups))

  def example_slots(self) -> tuple[int, ...]:
    """For each example of the global batch, its slot among the rows of a per-example output: each device's
    :attr:`example_width` loop rows (a data position's on its first device), then each device's tail examples."""
    width, n = self.example_width, len(self.devices)
    slots, at = [], 0
    for group in self.groups:  # the groups' examples come in order, each position's a run of them
      for i, c in enumerate(group.positions):
        first = at + i * group.model  # the position's first device, by index in the plan
        slots.extend(range(first * width, first * width + c * group.microbatch))
      at += len(group.devices)
    tail = self.tail_count * self.tail_microbatch
    slots.extend(range(n * width, n * width + n * tail))
    return tuple(slots)

  def summary(self) -> str:
    lines = [f"{len(self.groups)} group program(s), global batch {self.global_batch}"]
    for g, group in enumerate(self.groups):
      lines.append(f"  group {g}: devices {list(group.devices)}, microbatch {group.microbatch}, counts "
                   f"{list(group.counts)} ({group.examples} examples), remat {group.remat}" + (
                       f", model axis {group.model} ({len(group.model_dims)} parameters split over it)"
                       if group.model > 1 else "") + (
                       ", parameters sharded over its devices (FSDP, in lockstep)" if group.shard_params else ""))
    if self.hybrid:
      lines.append("  hybrid: each group holds its parameters and optimizer state split over its devices between "
                   "steps, its own copy" + (" (FSDP)" if len(self.groups) == 1 else " (HSDP)"))
    if self.state_shares:
      shares = ", ".join(f"{d}: {s:.1%}" for d, s in zip(self.devices, self.state_shares))
      what = "optimizer state" if self.zero_stage == 1 else "parameters and optimizer state"
      lines.append(f"  {what} (ZeRO-{self.zero_stage}) in unpadded shares of whole leaves by device: {shares}")
    if self.grad_reduce_dtype != "float32":
      lines.append(f"  gradients' partial sums cross devices in {self.grad_reduce_dtype}")
    if self.tail_count:
      lines.append(f"  tail (in the uniform program, overlapping the reduction): {self.tail_count} microbatch(es) "
                   f"of {self.tail_microbatch} on every device ({self.tail_examples} examples)")
    lines += [f"  predicted {key}: {quantity(key, value)}" for key, value in self.predicted]
    for key, values in self.predicted_per_device:
      lines.append(f"  predicted {key} by device: " +
                   ", ".join(f"{d}: {quantity(key, v)}" for d, v in zip(self.devices, values)))
    return "\n".join(lines)

  def to_json(self) -> dict[str, Any]:
    return {"version": GROUP_PLAN_VERSION, "global_batch": self.global_batch,
            "tail_microbatch": self.tail_microbatch, "tail_count": self.tail_count,
            "state_shares": list(self.state_shares), "zero_stage": self.zero_stage,
            "grad_reduce_dtype": self.grad_reduce_dtype,
            "groups": [{"devices": list(g.devices), "microbatch": g.microbatch, "counts": list(g.counts),
                        "remat": g.remat, "model": g.model, "model_dims": dict(g.model_dims),
                        "shard_params": g.shard_params, **({"slots": g.slots} if g.slots else {})}
                       for g in self.groups],
            "predicted": dict(self.predicted),
            "predicted_per_device": {k: list(v) for k, v in self.predicted_per_device}}

  @classmethod
  def from_json(cls, data: dict[str, Any]) -> "GroupPlan":
    if data.get("version") not in _READS:
      raise InvalidValueError(f"group plan version {data.get('version')!r} is not one of {list(_READS)}")
    return cls(tuple(Group(tuple(g["devices"]), int(g["microbatch"]), tuple(g["counts"]), g.get("remat", "none"),
                           int(g.get("model", 1)), g.get("model_dims", ()), g.get("shard_params", False),
                           int(g.get("slots", 0)))
                     for g in data["groups"]),
               int(data["global_batch"]), int(data.get("tail_microbatch", 0)), int(data.get("tail_count", 0)),
               tuple(data.get("state_shares", ())), data.get("zero_stage"),
               data.get("grad_reduce_dtype", data.get("reduce_dtype", "float32")),
               tuple(data.get("predicted", {}).items()), tuple(data.get("predicted_per_device", {}).items()))

  def dumps(self) -> str:
    return json.dumps(self.to_json(), indent=2)

  def save(self, path: str | Path) -> None:
    Path(path).write_text(self.dumps())

  @classmethod
  def load(cls, path: str | Path) -> "GroupPlan":
    """Reads a group plan JSON file written by :meth:`save` (``hetspmd search --group-plan-out``)."""
    try:
      data = json.loads(Path(path).read_text())
    except FileNotFoundError:
      raise InvalidValueError(f"group plan file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as e:
      raise InvalidValueError(f"group plan file {str(path)!r} is not valid JSON: {e}") from None
    except OSError as e:  # a directory, no permission
      raise InvalidValueError(f"cannot read group plan file {str(path)!r}: {e.strerror or e}") from None
    if not isinstance(data, dict) or "groups" not in data:
      raise InvalidValueError(f"group plan file {str(path)!r} holds no groups: write one with "
                              "hetspmd search --group-plan-out")
    return cls.from_json(data)


def group_plan(groups: Sequence[tuple], global_batch: int, *, tail: tuple[int, int] = (0, 0),
               state_shares: Sequence[float] = (), zero_stage: int | None = None,
               grad_reduce_dtype: str = "float32") -> GroupPlan:
  """``GroupPlan`` from ``(devices, microbatch, counts)``, ``(devices, microbatch, counts, remat)``, ``(devices,
  microbatch, counts, remat, model, model_dims)`` or ``(..., model, model_dims, shard_params)`` tuples
  (:class:`Group`), or :class:`Group` values;
  ``tail``: ``(microbatch, count)`` per device; ``state_shares``: each device's fraction of the state it holds
  (devices in group order), or none to replicate it; ``zero_stage``: 1 (the default with shares) holds the
  optimizer state in the shares, 3 the parameters too; ``grad_reduce_dtype``: the dtype the gradients'
  partial sums cross devices in."""
  return GroupPlan(tuple(g if isinstance(g, Group) else Group(tuple(g[0]), g[1], tuple(g[2]), *g[3:]) for g in groups),
                   global_batch, *tail,
                   state_shares=tuple(state_shares), zero_stage=zero_stage,
                   grad_reduce_dtype=grad_reduce_dtype)


def shares_for(free_bytes: Sequence[float]) -> tuple[float, ...]:
  """State shares in proportion to each device's free bytes (what the rest of the step leaves it)."""
  free = [max(float(f), 0.0) for f in free_bytes]
  if not free or sum(free) <= 0:
    raise InvalidValueError(f"state shares need some free memory, got free bytes {list(free_bytes)}")
  return tuple(f / sum(free) for f in free)


def copy_factor(shares: Sequence[float]) -> float:
  """Devices sending values they hold (``shares`` of the bytes) to every other device as copies, or receiving
  every device's rows of theirs, against a ring all-gather (or reduce-scatter): the busiest device sends
  ``(n - 1) * share`` or receives ``1 - share``, where a ring moves ``(n - 1) / n`` through each."""
  n = len(shares)
  return max((n - 1) * max(shares), 1 - min(shares)) / ((n - 1) / n) if n > 1 else 0.0


def relay_factor(shares: Sequence[float]) -> float:
  """The same values sent in two hops (:func:`relays`), against a ring all-gather: each device's holder splits
  it evenly over the devices (the busiest sends ``(n - 1) / n`` of its ``share``), then an all-gather; or, the
  other way, every device's rows reduce-scattered evenly, then each part sent to the value's holder."""
  return 1.0 + max(shares) if len(shares) > 1 else 0.0


def split_axis(shape: Sequence[int], n: int) -> int | None:
  """The first axis of ``shape`` that ``n`` devices split evenly into parts that are not empty, if any."""
  return next((a for a, size in enumerate(shape) if size > 0 and size % n == 0), None)


def relay_axis(shape: Sequence[int], n: int) -> int | None:
  """The axis a value of ``shape`` is split along over ``n`` devices for two hops (:func:`relays`): the first
  that ``n`` splits evenly (:func:`split_axis`), else the one that zero-padding to a multiple of ``n`` grows
  least, if by at most :data:`MAX_PADDING` (the padded copy is transient); none for a scalar, an empty value or
  one that padding would grow more (it is copied whole)."""
  axis = shard_axis(shape, n)
  return axis if axis is None or padded_length(shape[axis], n) <= (1 + MAX_PADDING) * shape[axis] else None


MAX_PADDING = 1 / 8  # the most a value may grow by zero-padding to take two hops


def shard_axis(shape: Sequence[int], n: int) -> int | None:
  """The axis a parameter (or a gradient's sum) of ``shape`` is split along over a sharded group's ``n`` devices
  (:attr:`Group.shard_params`): the first that ``n`` splits evenly (:func:`split_axis`), else the one that
  zero-padding to a multiple of ``n`` grows least (the padding lives only in the parts and in the buffers that
  gather them); none for a scalar or an empty value (kept whole)."""
  if not shape or 0 in shape:
    return None
  axis = split_axis(shape, n)
  return axis if axis is not None else min(range(len(shape)), key=lambda a: padded_length(shape[a], n) / shape[a])


def padded_length(size: int, n: int) -> int:
  """``size`` rounded up to a multiple of ``n``."""
  return -(-size // n) * n


def relays(shares: Sequence[float]) -> bool:
  """Whether the values each device holds (the parameters its updates made, under ZeRO-3 their casts) reach
  every device, and the sums its updates read reach it, faster in two hops than as copies: where some devices
  hold much more than the rest (in one process; across processes uniform programs move them). Scalars, empty
  values, PRNG keys and values padding would grow by more than :data:`MAX_PADDING` are copied
  (:func:`relay_axis`)."""
  return len(shares) > 1 and relay_factor(shares) < copy_factor(shares)


def assign_owners(sizes: Sequence[int], shares: Sequence[float]) -> tuple[int, ...]:
  """The device (index into ``shares``) holding each unit of ``sizes`` bytes, whole: the largest units first,
  each to the device furthest below its share of the total. Devices with no share hold nothing."""
  total = float(sum(sizes))
  target = [s * total for s in shares]
  held = [0.0] * len(shares)
  owners = [0] * len(sizes)
  able = [d for d, s in enumerate(shares) if s > 0]
  if not able:
    raise InvalidValueError(f"no device has a state share: {list(shares)}")
  for u in sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)):
    d = max(able, key=lambda d: (target[d] - held[d], -d))
    owners[u] = d
    held[d] += sizes[u]
  return tuple(owners)


def is_hybrid(shard_params: Sequence[bool], sizes: Sequence[int], *, shares: bool, tail: bool) -> bool:
  """Whether a group plan is hybrid (every group holds its parameters and optimizer state split over its own
  devices between steps; one group: plain FSDP): every group shards its parameters (``shard_params``), the
  groups, as they run, have as many devices each (``sizes``), and the state is in no shares and there is no
  tail. The one answer to the question, for the plan, the pricing and the lowering."""
  return bool(shard_params) and all(shard_params) and len(set(sizes)) == 1 and not shares and not tail


def split_by_process(plan: GroupPlan, process_of: Mapping[int, int]) -> GroupPlan:
  """``plan`` with each group that does not shard its parameters cut where its devices change process
  (``process_of``: device id → process index), so that its program, whose devices run their own trip counts,
  runs in one process. A group that shards its parameters stays whole: its devices run in lockstep, one program
  over them that every process holding some calls (plain FSDP over several hosts). The examples, counts and
  shares stay where they were: the pieces keep their devices' order, so the batch is laid out as before."""
  groups = []
  for g in plan.groups:
    if g.shard_params:  # one program over its devices, in lockstep: every process calls it
      groups.append(g)
      continue
    start = 0
    for i in range(1, len(g.devices) + 1):
      if i == len(g.devices) or process_of[g.devices[i]] != process_of[g.devices[start]]:
        if i % g.model:
          raise InvalidValueError(f"a data position of group devices {list(g.devices)} (model axis {g.model}) spans "
                                  "processes: a position's devices must be one process's")
        groups.append(dataclasses.replace(g, devices=g.devices[start:i], counts=g.counts[start:i]))
        start = i
  return dataclasses.replace(plan, groups=tuple(groups))


def is_group_plan_file(path: str | Path) -> bool:
  """Whether ``path`` holds a group plan (a JSON object with ``groups``) rather than a single-program plan; a
  file that cannot be read or parsed is not one (the single-program loader then says what is wrong)."""
  try:
    data = json.loads(Path(path).read_text())
  except (OSError, ValueError):
    return False
  return isinstance(data, dict) and "groups" in data
