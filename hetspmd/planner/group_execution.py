"""The groups a priced layout makes at run time, and how they run (:class:`~hetspmd.plan.execution.Execution`).

The group search prices a layout (every device a data position) before any
:class:`~hetspmd.plan.groups.GroupPlan` exists. It takes each device's process
as the runtime will (:func:`process_of`), cuts each kind's devices into the
groups the runtime runs (:func:`shard_groups`), and makes from them the same
:class:`~hetspmd.plan.execution.Execution` the runtime makes from the plan
(:func:`execution_of`): one value, priced and built.
"""

from __future__ import annotations

from typing import Sequence

from hetspmd.hardware.cluster import Cluster
from hetspmd.plan.execution import Execution
from hetspmd.planner.pricing import Costing, DeviceGroups

# host-side cost of launching one program of the schedule (each group's, the exchange)
PROGRAM_DISPATCH_SECONDS = 50e-6


def process_of(cluster: Cluster) -> tuple[int, ...]:
  """Each device's process, by cluster position, as the pricing takes it: one process where the cluster says so;
  one per host where it says nothing or names as many processes as hosts; else equal runs of consecutive devices
  (``processes=8`` on two hosts of four: one device each)."""
  devices, processes = cluster.devices, cluster.processes
  if processes == 1:
    return (0,) * len(devices)
  if processes is None or processes == len(cluster.hosts):
    return tuple(d.host for d in devices)
  run = max(1, len(devices) // processes)
  return tuple(i // run for i in range(len(devices)))


def holds_every_process(positions: Sequence[int], processes: Sequence[int]) -> bool:
  """Whether the devices at ``positions`` include one of each process (``processes``: each device's, by cluster
  position): a plan on them leaves no running process without devices."""
  return {processes[i] for i in positions} == set(processes)


def shard_groups(costing: Costing, layout: DeviceGroups) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Per kind, the groups its devices on ``layout`` make, smallest first: its devices in each process
  (:func:`process_of`). The search chooses this cut: a group whose devices run their own trip counts must be one
  process's (the runtime cuts it: :func:`hetspmd.plan.groups.split_by_process`), and a kind that shards its
  parameters is written as one group per process too (HSDP, :func:`hetspmd.planner.grouping.to_group_plan`),
  each sharding over its own devices. Plain FSDP over every device, one group across processes, is priced apart
  (:func:`hetspmd.planner.sharding.fsdp_baseline`)."""
  key = (tuple(layout.devices), tuple(layout.hosts.items()))
  if key not in costing.shard_groups:
    every, process = costing.cluster.devices, process_of(costing.cluster)
    found: dict[str, dict[int, list[int]]] = {}
    for i in layout.devices:
      found.setdefault(every[i].spec.name, {}).setdefault(process[i], []).append(i)
    costing.shard_groups[key] = {k: tuple(sorted((tuple(g) for g in hosts.values()), key=len))
                                 for k, hosts in found.items()}
  return costing.shard_groups[key]


def shard_size(costing: Costing, layout: DeviceGroups, kind: str) -> int:
  """The devices the smallest group of ``kind`` shards its parameters over (:func:`shard_groups`)."""
  return len(shard_groups(costing, layout)[kind][0])


def execution_of(costing: Costing, layout: DeviceGroups, sharded: frozenset[str], zero: int, tail: int
                 ) -> Execution:
  """How the group plan priced on ``layout`` runs (:class:`~hetspmd.plan.execution.Execution`): its groups as the
  runtime runs them (:func:`shard_groups`: each kind's devices per process), the kinds in ``sharded`` sharding
  their parameters, the state in shares under ``zero`` > 0, ``tail`` microbatches or none."""
  key = ("execution", tuple(layout.devices), tuple(layout.hosts.items()), sharded, zero, bool(tail))
  if key not in costing.shard_groups:
    process = process_of(costing.cluster)
    groups = [({process[i] for i in g}, len(g), kind in sharded)
              for kind, kind_groups in shard_groups(costing, layout).items() for g in kind_groups]
    costing.shard_groups[key] = Execution.made(groups, zero_stage=zero, shares=bool(zero), tail=bool(tail))
  return costing.shard_groups[key]


def one_process(costing: Costing, layout: DeviceGroups) -> bool:
  """Whether one process drives ``layout``'s devices."""
  return execution_of(costing, layout, frozenset(), 0, 0).one_process
