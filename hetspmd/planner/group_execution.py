"""The groups a priced layout makes at run time, and how they run (:class:`~hetspmd.plan.execution.Execution`).

The group search prices a layout (every device a data position) before any
:class:`~hetspmd.plan.groups.GroupPlan` exists. It takes each device's process
as the runtime will (:func:`process_of`), cuts each kind's devices into the
groups the runtime runs (per process, or per host where the kind shards its
parameters: :func:`shard_groups`), and makes from them the same
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
  """Each device's process, by cluster position, as the pricing takes it: the cluster's own where it was made
  from JAX's devices (``device_processes``); one process where the cluster says so; one per host where it says
  nothing or names as many processes as hosts; else equal runs of consecutive devices (``processes=8`` on two
  hosts of four: one device each)."""
  devices, processes = cluster.devices, cluster.processes
  if cluster.device_processes is not None:
    return tuple(cluster.device_processes)
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


def shard_key(cluster: Cluster) -> tuple[tuple[str, int], ...]:
  """Per device (by cluster position), the sharded group it joins: its host's devices of its kind, every process
  on the host calling the group's one program (so one process per GPU still shards over the host's fast links);
  or, where one process drives several hosts (one process emulating a pool), that process's."""
  process = process_of(cluster)
  hosts: dict[tuple, set[int]] = {}  # per process and kind, its hosts
  for d, p in zip(cluster.devices, process):
    hosts.setdefault((p, d.spec.name), set()).add(d.host)
  return tuple(("process", p) if len(hosts[p, d.spec.name]) > 1 else ("host", d.host)
               for d, p in zip(cluster.devices, process))


def shard_groups(costing: Costing, layout: DeviceGroups) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Per kind, the groups its devices on ``layout`` make where it shards its parameters, smallest first: its
  devices on each host (:func:`shard_key`), one program each over every process of the host (the runtime keeps
  a sharded group whole: :func:`hetspmd.plan.groups.split_by_process`). A kind that shards is written as one
  group per host (HSDP, :func:`hetspmd.planner.grouping.to_group_plan`), each sharding over its own devices.
  Plain FSDP over every device, one group across hosts, is priced apart
  (:func:`hetspmd.planner.sharding.fsdp_baseline`)."""
  key = (tuple(layout.devices), tuple(layout.hosts.items()))
  if key not in costing.shard_groups:
    costing.shard_groups[key] = _kind_groups(costing.cluster, layout, shard_key(costing.cluster))
  return costing.shard_groups[key]


def _kind_groups(cluster: Cluster, layout: DeviceGroups, key: Sequence) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Per kind, its devices on ``layout`` cut by ``key`` (per device), smallest first."""
  found: dict[str, dict] = {}
  devices = cluster.devices
  for i in layout.devices:
    found.setdefault(devices[i].spec.name, {}).setdefault(key[i], []).append(i)
  return {k: tuple(sorted((tuple(g) for g in cut.values()), key=len)) for k, cut in found.items()}


def shard_size(costing: Costing, layout: DeviceGroups, kind: str) -> int:
  """The devices the smallest group of ``kind`` shards its parameters over (:func:`shard_groups`)."""
  return len(shard_groups(costing, layout)[kind][0])


def execution_of(costing: Costing, layout: DeviceGroups, sharded: frozenset[str], zero: int, tail: int, *,
                 data_only: bool = True) -> Execution:
  """How the group plan priced on ``layout`` runs (:class:`~hetspmd.plan.execution.Execution`): its groups as the
  runtime runs them (:func:`run_groups`), the state in shares under ``zero`` > 0, ``tail`` microbatches or none;
  ``data_only``: no model axis in any group."""
  key = ("execution", tuple(layout.devices), tuple(layout.hosts.items()), sharded, zero, bool(tail), data_only)
  if key not in costing.shard_groups:
    process = process_of(costing.cluster)
    groups = [({process[i] for i in g}, len(g), kind in sharded)
              for kind, kind_groups in run_groups(costing, layout, sharded).items() for g in kind_groups]
    costing.shard_groups[key] = Execution.made(groups, zero_stage=zero, shares=bool(zero), tail=bool(tail),
                                               data_only=data_only)
  return costing.shard_groups[key]


def run_groups(costing: Costing, layout: DeviceGroups, sharded: frozenset[str]
               ) -> dict[str, tuple[tuple[int, ...], ...]]:
  """Per kind, the groups of ``layout``'s devices as the runtime runs them: the kinds in ``sharded`` a group per
  host (:func:`shard_groups`), any other kind's devices cut per process."""
  return {**_kind_groups(costing.cluster, layout, process_of(costing.cluster)),
          **{k: g for k, g in shard_groups(costing, layout).items() if k in sharded}}


def one_process(costing: Costing, layout: DeviceGroups) -> bool:
  """Whether one process drives ``layout``'s devices."""
  return execution_of(costing, layout, frozenset(), 0, 0).one_process
