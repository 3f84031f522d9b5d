"""Pricing a group plan's state held in memory shares (ZeRO-1 and ZeRO-3 by free memory): how the values the
owners hold travel (copies, or two hops where some devices hold much more than the rest), and the parameters'
bytes as ZeRO-3 group programs take them. The group search (:mod:`hetspmd.planner.grouping`) reads these."""

from __future__ import annotations

import functools
from typing import Sequence

from hetspmd.passes.costing.step_cost import StepProfile
from hetspmd.plan.groups import copy_factor, padded_length, relay_axis, relay_factor, relays
from hetspmd.planner.data_axis import whole_gather_seconds
from hetspmd.planner.group_execution import one_process
from hetspmd.planner.pricing import Costing, DeviceGroups


def gather_seconds(costing: Costing, layout: DeviceGroups, shares: Sequence[float], zero: int) -> float:
  """Sending the parameters the update programs made to every device (under ZeRO-3 their casts, as the programs
  take them, in place of whole ones), every leaf whole whether or not the devices divide it, as the runtime
  does: in one process as copies from each one's device
  (:func:`hetspmd.plan.groups.copy_factor` of a ring all-gather) or, where one device holds much more than the
  rest, in two hops (:func:`hetspmd.plan.groups.relay_factor`); across processes one uniform program adds every
  device's row (the value on its owner, zeros elsewhere), an all-reduce: twice an all-gather's bytes."""
  gather = whole_gather_seconds(costing.cluster, layout.hosts, costing.profile)
  if zero == 3:
    gather *= loop_param_bytes(costing.profile) / max(costing.profile.param_bytes, 1)
  if not one_process(costing, layout):
    return 2.0 * gather
  return gather * share_factor(shares, split_fraction(costing.profile, shares))


def share_factor(shares: Sequence[float], split: tuple[float, float, float]) -> float:
  """Values each device holds in ``shares``, sent to or gathered from every device against a ring: ``split``
  (:func:`split_fraction`) gives the fraction of their bytes in two hops (padding included:
  :func:`hetspmd.plan.groups.relay_factor`) and the fraction copied."""
  return split[0] * relay_factor(shares) + split[1] * copy_factor(shares)


COPIED = (0.0, 1.0, 0.0)  # every value copied: none in two hops, none padded


def split_fraction(profile: StepProfile, shares: Sequence[float]) -> tuple[float, float, float]:
  """How the values held in ``shares`` travel (one per device): where they take two hops
  (:func:`hetspmd.plan.groups.relays`), the parameters' elements that do over that many devices
  (:func:`hetspmd.plan.groups.relay_axis`: all but scalars, empty leaves and those padding would grow too much),
  padding included; those copied; and those of the leaves that are padded, padding included (each device holds a
  padded copy of them while it sends them): fractions of all of them (all in two hops, none padded, where the
  profile has no leaf shapes). :data:`COPIED` otherwise."""
  if not relays(shares):
    return COPIED
  return _split_of(profile.param_leaf_shapes, profile.param_leaf_sizes, len(shares))


@functools.lru_cache(maxsize=None)
def _split_of(shapes: tuple, sizes: tuple, n: int) -> tuple[float, float, float]:
  total = sum(sizes)
  if not shapes or not total:
    return 1.0, 0.0, 0.0
  moved = copied = padded = 0
  for shape, size in zip(shapes, sizes):
    axis = relay_axis(shape, n)
    if axis is None:
      copied += size
    else:
      sent = size // shape[axis] * padded_length(shape[axis], n)
      moved += sent
      padded += sent if shape[axis] % n else 0
  return moved / total, copied / total, padded / total


def loop_param_bytes(profile: StepProfile) -> int:
  """The parameters' bytes as ZeRO-3 group programs receive them: the casts of those the step reads only
  through casts to a narrower dtype, the others whole."""
  return profile.param_bytes - profile.castable_param_bytes + profile.cast_param_bytes
