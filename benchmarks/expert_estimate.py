"""What experts split across hosts would predict on a slow network, next to today's best plan.

    python benchmarks/expert_estimate.py [--case hap-v100-p100:bert-moe-base:2048:128 ...]

hetspmd splits experts over the ``model`` axis, inside one host (the ``expert`` split of
:mod:`hetspmd.passes.sharding.strategies`): the group's tokens are on all its devices, so no all-to-all is
needed, but every host still holds every expert, and each expert's gradient still crosses the
network once per step. Splitting the experts over ``k`` groups of hosts instead (each host holding
``E / k`` of them, data parallel inside the host) takes ``E (k - 1) / k`` experts' gradients off each
host's network link, and puts the dispatched tokens on it: GShard's all-to-all. This script prices
that trade with the search's own pieces, to say whether building it would pay, and where:

* the bytes the forward dispatch einsums make per example (all MoE blocks, fitted over the two traces
  of the step): each MoE block moves them four times across its all-to-all group (dispatch and combine
  in the forward pass, their transposes in the backward pass), ``(k - 1) / k`` of them off the host,
  through the host's one network link, in the model's compute dtype; all-to-alls sit on the critical
  path (the next matmul waits for its tokens), so none of it is hidden;
* the gradient reduction the same way the search prices it (:func:`hetspmd.planner.data_axis.allreduce_seconds`:
  a ring in each host, then across hosts, one ring's bytes through each host's link), in the reduce
  dtype of today's best plan: the dense parameters over every host, each group's experts over the
  ``H / k`` hosts that hold them;
* the hosts: those today's best plan runs on, with its devices;
* the step: today's best plan with its exposed reduction replaced by the new one (the same seconds
  hidden behind the last microbatch's backward pass as today), plus the all-to-alls. Compute, memory
  and balance are left as today's best plan has them.

Prints, per case and per ``k``, the reduction today and with experts across ``k`` host groups, the
all-to-all seconds, and today's step over the estimate (> 1: experts across hosts would be faster),
and the largest batch at which they would still break even.
"""

from __future__ import annotations

import argparse

CASES = [  # (cluster, model, global batch, sequence)
    ("hap-v100-p100", "bert-moe-base", 2048, 128),
    ("hap-v100-p100", "bert-moe-base", 256, 128),
    ("hap-v100-p100", "bert-moe-base-top2", 2048, 128),
    ("hap-v100-p100", "bert-moe-base", 2048, 512),
]


def dispatch_bytes_per_example(profile) -> float:
  """Bytes of the forward dispatch einsums' outputs per example, over all MoE blocks."""
  from hetspmd.passes.costing.step_cost import fit_linear

  small, large = profile.traces

  def total(graph) -> float:
    return float(sum(n.outputs[0].nbytes * n.count for n in graph.nodes
                     if n.primitive == "dot_general" and n.module_path.endswith("dispatch")
                     and n.phase != "backward"))

  return fit_linear(total(small), total(large), *profile.trace_batches).per_example


def expert_elements(state) -> tuple[int, int]:
  """(experts' parameter elements, the rest's): a leaf is an expert's if it lives in an MoE block's MLP."""
  from hetspmd._pytree import leaves_with_paths

  experts = rest = 0
  for path, leaf in leaves_with_paths(state):
    if not path.startswith("params/"):
      continue
    if any(path.endswith(f"/mlp/{w}") for w in ("wi", "bi", "wo", "bo")):
      experts += leaf.size
    else:
      rest += leaf.size
  return experts, rest


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--case", action="append", default=[], help="cluster:model:batch:sequence; repeatable")
  args = parser.parse_args()
  cases = [(c, m, int(b), int(s)) for c, m, b, s in (x.split(":") for x in args.case)] or CASES

  from hetspmd import Cluster, models
  from hetspmd.planner.data_axis import REDUCE_BYTES, allreduce_seconds
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.ranking import search

  print(f"{'cluster':<14} {'model':<19} {'batch':>5} {'seq':>4} {'hosts':>5} {'best s':>7} {'reduce s':>8} {'k':>2} "
        f"{'reduce s':>8} {'a2a s':>7} {'step s':>7} {'ratio':>6} {'even at batch':>13}")
  for preset, name, batch, seq in cases:
    w = models.get(name)
    profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2, seq))
    cluster = Cluster.preset(preset)
    best = search(cluster, profile, batch, overlap=True, grad_reduce_dtypes=("float32", "bfloat16")).plans[0]
    experts, rest = expert_elements(w.abstract_state())
    num_experts = w.abstract_state()["params"]["layers"][1]["mlp"]["wi"].shape[0]
    grad_bytes = REDUCE_BYTES[best.grad_reduce_dtype]
    everyone = list(best.device_positions)  # the hosts today's best plan uses, split as it splits them
    by_host: dict[int, list[int]] = {}
    for i in everyone:
      by_host.setdefault(cluster.devices[i].host, []).append(i)
    hosts = len(by_host)
    today = allreduce_seconds(cluster, everyone, (experts + rest) * grad_bytes)
    exposed_today = best.comm_seconds - best.hidden_seconds
    slots = dispatch_bytes_per_example(profile)
    for k in (k for k in range(2, hosts + 1) if hosts % k == 0 and num_experts % k == 0):
      holders = [i for h in list(by_host)[:hosts // k] for i in by_host[h]]  # the hosts holding one group's experts
      reduce = (allreduce_seconds(cluster, everyone, rest * grad_bytes)
                + allreduce_seconds(cluster, holders, experts / k * grad_bytes))
      a2a_per_example = 4 * slots * (k - 1) / k / cluster.inter.bandwidth
      a2a = a2a_per_example * batch / hosts
      step = best.step_seconds - exposed_today + max(0.0, exposed_today + reduce - today) + a2a
      # the batch at which the all-to-alls cost what the reduction saves (the reduction does not grow with it)
      even = (today - reduce) / a2a_per_example * hosts if today > reduce else 0.0
      print(f"{preset:<14} {name:<19} {batch:>5} {seq:>4} {hosts:>5} {best.step_seconds:7.3f} {today:8.3f} {k:>2} "
            f"{reduce:8.3f} {a2a:7.3f} {step:7.3f} {best.step_seconds / step:6.2f} {even:13.0f}", flush=True)
  print("hosts: the hosts today's best plan runs on (the estimate splits experts over them); best s: its step; reduce s: its gradient reduction (its reduce dtype, nothing hidden); k: "
        "host groups the experts are split over; ratio: best / estimate (> 1: experts across hosts would be "
        "faster); even at batch: the global batch at which the all-to-alls cost what the reduction saves")


if __name__ == "__main__":
  main()
