"""Training across processes, as a multi-host job runs: the same three lines as in one process, plus a loader
that reads only this process's examples.

    python examples/multihost.py --processes 2    # starts 2 local processes (CPU devices, gloo), as a launcher would
    python examples/multihost.py --distributed    # one process of a job whose launcher set jax.distributed's
                                                  # environment (SLURM, Open MPI, Cloud TPU)
    python examples/multihost.py                  # one process alone

Each process holds some devices of the pool; here the first process's stand in for V100s and the others' for
P100s (``--kinds``). Every process builds the same cluster from all processes' devices and searches the same
plan (``plan="search"``: a single program or a group plan, whichever is priced ahead). Then each process feeds
the step only ``batch[step.process_examples()]``. Process 0 prints one JSON line: the plan's form and the losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

RANK = "HETSPMD_EXAMPLE_RANK"  # set for the processes --processes starts


def parse(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=int, default=0, help="start this many local processes (default: none)")
  parser.add_argument("--distributed", action="store_true",
                      help="join the job a launcher started: jax.distributed.initialize() reads its environment")
  parser.add_argument("--devices", type=int, default=2, help="CPU devices per local process (default: 2)")
  parser.add_argument("--kinds", default="V100-32GB,P100-16GB",
                      help="device kinds the processes' devices stand for: the first process's, then the others' "
                      "(default: V100-32GB,P100-16GB)")
  parser.add_argument("--plan", default="search",
                      help="'search' (default: the search's choice), 'groups' (the best group plan the search "
                      "priced, chosen or not), or a plan file every process loads")
  parser.add_argument("--global-batch", type=int, default=128, help="examples per step (default: 128)")
  parser.add_argument("--steps", type=int, default=3, help="steps to train (default: 3)")
  parser.add_argument("--port", type=int, default=0, help="the coordinator's port for --processes (default: free)")
  return parser.parse_args(argv)


def launch(args: argparse.Namespace, argv: list[str]) -> int:
  """Starts ``args.processes`` copies of this script, each one process of the job; returns the worst exit code."""
  import socket

  port = args.port
  if not port:
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      port = s.getsockname()[1]
  children = []
  for rank in range(args.processes):
    env = {**os.environ, RANK: str(rank), "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
    children.append(subprocess.Popen([sys.executable, __file__, *argv, "--port", str(port)], env=env))
  return max(child.wait() for child in children)


def make_state(seed: int = 0, hidden: int = 1024):
  """An MLP classifier's Linen ``TrainState`` (as Flax's MNIST example makes one)."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import optax
  from flax.training import train_state

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(10)(nn.relu(nn.Dense(hidden)(x)))

  model = MLP()
  params = model.init(jax.random.key(seed), jnp.zeros((1, 64)))["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def train_step(state, batch):
  """One single-device step: cross-entropy, Adam."""
  import jax
  import optax

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


def global_batches(size: int, steps: int, seed: int = 0) -> list[dict]:
  """The dataset's global batches (a real loader reads only the rows it is asked for)."""
  rs = np.random.RandomState(seed)
  return [{"x": rs.standard_normal((size, 64)).astype(np.float32), "y": rs.randint(0, 10, size).astype(np.int32)}
          for _ in range(steps)]


def train(args: argparse.Namespace) -> dict:
  import jax

  if RANK in os.environ:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args.port}", num_processes=args.processes,
                               process_id=int(os.environ[RANK]), initialization_timeout=60)
  elif args.distributed:
    jax.distributed.initialize()
  import hetspmd as hs

  first, others = args.kinds.split(",")
  kinds = [first if d.process_index == 0 else others for d in jax.devices()]
  cluster = hs.Cluster.emulate(jax.devices(), kinds=kinds)
  batches = global_batches(args.global_batch, args.steps)
  plan = args.plan
  if plan == "groups":  # every process searches the same pool the same way: the same group plan
    plan = hs.search(train_step, make_state(), batches[0], cluster=cluster).best_group_plan
  step = hs.parallelize(train_step, cluster=cluster, plan=plan, global_batch=args.global_batch,
                        example_batch=batches[0])
  state = step.shard_state(make_state())
  mine = step.process_examples()  # the loader's indices: this process's examples, in this order
  losses = []
  for batch in batches:
    state, metrics = step(state, {k: v[mine] for k, v in batch.items()})
    losses.append(float(np.asarray(metrics["loss"].addressable_shards[0].data)))
  return {"processes": jax.process_count(), "form": "group plan" if step.grouped else "single program",
          "examples": len(mine), "losses": losses}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parse(argv)
  if args.processes and RANK not in os.environ:
    return launch(args, [a for a in argv])
  result = train(args)
  if int(os.environ.get(RANK, 0)) == 0:
    print(json.dumps(result), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
