"""Train GPT-2 with ``@hetspmd.parallelize`` on a (possibly emulated) mixed cluster.

    python examples/train_gpt2.py                        # gpt2-tiny, 8 CPU devices as 4 V100 + 4 P100
    python examples/train_gpt2.py --steps 40 --ckpt /tmp/gpt2-ckpt
    python examples/train_gpt2.py --steps 80 --ckpt /tmp/gpt2-ckpt --resume \\
        --cluster 2xA100-40GB+6xT4                       # continue under another plan

What it does:

1. builds the cluster: ``--cluster`` is a preset, a TOML file or a compact
   spec with one device per local JAX device; each local device stands in
   for one device of the spec (``Cluster.emulate``). On a CPU-only machine
   the script asks XLA for as many host devices as the spec has;
2. searches a plan for the model on that cluster (``hetspmd.search``) and
   binds the best one to the step (``hetspmd.parallelize``); the step
   (``make_train_step``) is a plain single-device step with
   ``jax.value_and_grad`` over a closure of the batch, wrapped in ``jax.jit``;
3. trains on a locally generated corpus (arithmetic token sequences, so the
   loss has something to learn), printing per-step loss and the achieved
   step time beside the planner's prediction. Predictions are for the
   devices named in the spec, so on emulated devices they are expected to
   differ from the achieved times; pass ``--profile`` to cost the plan with
   the measured speed of the local devices instead;
4. with ``--ckpt DIR`` saves the train state with orbax at the end and every
   ``--save-every`` steps. ``--resume`` restores the latest checkpoint into
   the current plan's shardings, whatever plan wrote it, and continues: the
   data of step *k* depends only on *k*, so the loss curve continues where it
   stopped. Each save and restore prints a line (step, path, plan).

The defaults (128 sequences of 64 tokens) are sized so that the plan puts
every device to work, the V100s on more microbatches than the P100s: at a
few dozen sequences the gradients' reduction costs more than the P100s'
work saves, and the search leaves them idle.

Results (the plan, each save and restore, the median step) go to stdout; on
a terminal a progress bar is drawn on stderr, elsewhere (a log file) each
step is one line on stdout.

``main(argv)`` returns the per-step records, so tests can run it in-process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

DEFAULT_CLUSTER = "4xV100-32GB+4xP100-16GB"


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="gpt2-tiny", help="a GPT-2 size from the zoo (default: gpt2-tiny)")
  p.add_argument("--cluster", default=DEFAULT_CLUSTER,
                 help=f"preset, TOML file or compact spec, one device per local device (default: {DEFAULT_CLUSTER})")
  p.add_argument("--steps", type=int, default=30, help="train until this step (default: 30)")
  p.add_argument("--global-batch", type=int, default=128, help="examples per step (default: 128)")
  p.add_argument("--seq", type=int, default=64, help="tokens per example (default: 64)")
  p.add_argument("--lr", type=float, default=3e-3, help="adam learning rate (default: 3e-3)")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--ckpt", default=None, help="checkpoint directory (orbax)")
  p.add_argument("--save-every", type=int, default=0, help="also save every N steps (default: only at the end)")
  p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt")
  p.add_argument("--profile", action="store_true", help="cost the plan with measured local device speeds")
  p.add_argument("--log", default=None, help="write one JSON line per step to this file")
  p.add_argument("--quiet", action="store_true", help="no per-step progress (bar or lines)")
  args = p.parse_args(argv)
  for name in ("steps", "global_batch", "seq"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
  if args.resume and not args.ckpt:
    p.error("--resume needs --ckpt DIR")
  return args


def _ensure_host_devices(count: int) -> None:
  """On a CPU-only machine, ask XLA for ``count`` host devices.

  Takes effect if no JAX backend has started yet (importing jax starts none).
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def corpus_batch(step: int, batch: int, seq: int, vocab: int, seed: int = 0):
  """Step ``step``'s batch: sequences ``t_{i+1} = (t_i + stride) mod vocab``.

  A start token and a stride in 1..7 per example, drawn from ``(seed, step)``
  only, so any run sees the same data at the same step.
  """
  import numpy as np

  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, size=(batch, 1))
  stride = rng.integers(1, 8, size=(batch, 1))
  tokens = (start + stride * np.arange(seq + 1)[None, :]) % vocab
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


def build_cluster(spec: str, profile: bool):
  import jax

  import hetspmd as hs

  virtual = hs.Cluster.resolve(spec)
  devices = jax.devices()
  if virtual.num_devices != len(devices):
    raise SystemExit(f"--cluster {spec!r} has {virtual.num_devices} devices but JAX sees {len(devices)}; "
                     f"give a spec with {len(devices)} devices")
  if profile:
    return hs.Cluster.from_profile(hs.profile(devices))
  kinds = [d.spec.name for d in virtual.devices]
  return hs.Cluster.emulate(devices, kinds, custom={k: virtual.spec_of(k) for k in virtual.kinds})


class Progress:
  """A one-line progress bar on stderr where stderr is a terminal; elsewhere one line per step on stdout."""

  def __init__(self, total: int, start: int, quiet: bool):
    self.total, self.start, self.quiet = total, start, quiet
    self.bar = sys.stderr.isatty()

  def update(self, step: int, text: str) -> None:
    if self.quiet:
      return
    if not self.bar:
      print(f"step {step}/{self.total} {text}", flush=True)
      return
    done = (step - self.start) / max(1, self.total - self.start)
    bar = "#" * int(24 * done) + "." * (24 - int(24 * done))
    sys.stderr.write(f"\r[{bar}] {step}/{self.total} {text}")
    if step == self.total:
      sys.stderr.write("\n")
    sys.stderr.flush()


def make_train_step(workload):
  """A single-device train step, written as for one device: nothing in it is hetspmd's."""
  import jax
  import optax

  model_of, loss, tx = workload.binder(), workload.loss, workload.make_optimizer()

  @jax.jit
  def train_step(state, batch):
    def loss_fn(params):
      return loss(model_of(params), batch)   # the batch is closed over, as in Flax's examples

    (value, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, {"loss": value, **aux}

  return train_step


def main(argv=None) -> list[dict]:
  args = parse_args(argv)
  _ensure_host_devices(_device_count(args.cluster))
  ckpt_dir = os.path.abspath(args.ckpt) if args.ckpt else None
  resume_from = _latest(ckpt_dir) if args.resume else None

  import numpy as np
  import optax
  import orbax.checkpoint as ocp

  import hetspmd as hs
  from hetspmd import models
  workload = models.get(args.model)
  if workload.family != "gpt2":
    raise SystemExit(f"--model must be a GPT-2 size ({', '.join(n for n in models.names() if n.startswith('gpt2'))}), "
                     f"got {args.model!r}")
  workload = dataclasses.replace(workload, make_optimizer=lambda: optax.adam(args.lr))
  cluster = build_cluster(args.cluster, args.profile)
  vocab = workload.config.vocab_size
  workload.example_batch(args.global_batch, args.seq)  # checks the sizes

  step_fn = make_train_step(workload)
  plan = searched_plan(step_fn, workload, cluster, args)
  predicted = dict(plan.predicted)["step_seconds"]
  train_step = hs.parallelize(step_fn, cluster=cluster, plan=plan, global_batch=args.global_batch)

  state = workload.init_state(seed=args.seed)
  checkpointer = ocp.StandardCheckpointer() if args.ckpt else None
  if resume_from:
    state = _restore(checkpointer, resume_from, train_step, state)
    print(f"restored step {int(state['step'])} from {resume_from} into the plan {plan_line(plan)}", flush=True)
  else:
    state = train_step.shard_state(state)
  first = int(state["step"])
  if not args.quiet:
    print(train_step.explain())
    print(f"cluster {args.cluster} ({cluster.num_devices} devices); training steps {first}..{args.steps - 1}",
          flush=True)

  log = open(args.log, "a") if args.log else None
  progress = Progress(args.steps, first, args.quiet)
  records = []
  for step in range(first, args.steps):
    batch = corpus_batch(step, args.global_batch, args.seq, vocab, args.seed)
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    loss = float(metrics["loss"])  # waits for the step
    seconds = time.perf_counter() - start
    record = {"step": step, "loss": loss, "seconds": seconds, "predicted_seconds": predicted,
              "compiled": step == first}
    records.append(record)
    if log:
      log.write(json.dumps(record) + "\n")
    progress.update(step + 1, f"loss {loss:.4f}  {_ms(seconds)}/step (predicted {_ms(predicted)})")
    if checkpointer and args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
      _save(checkpointer, ckpt_dir, step + 1, state)
  if checkpointer and args.steps > first:
    _save(checkpointer, ckpt_dir, args.steps, state)
  if checkpointer:
    checkpointer.wait_until_finished()
  if log:
    log.close()
  timed = [r["seconds"] for r in records if not r["compiled"]]
  if timed and not args.quiet:
    where = "this machine's measured devices" if args.profile else f"the devices of {args.cluster}"
    print(f"median step {_ms(float(np.median(timed)))} achieved, {_ms(predicted)} predicted for {where}")
  return records


def searched_plan(step_fn, workload, cluster, args):
  """The search's best plan for ``step_fn`` on ``cluster`` at ``args``' batch and sequence length."""
  import hetspmd as hs
  from hetspmd.planner.building import plan_from

  found = hs.search(step_fn, workload.abstract_state(), workload.example_batch(2, args.seq), cluster=cluster,
                    global_batch=args.global_batch, top=1)
  return plan_from(found.plans[0], cluster, workload.abstract_state(), found.ideal_throughput)


def plan_line(plan) -> str:
  """``plan`` in one line: its mesh, microbatch and microbatch counts by device kind."""
  per = len(plan.device_ids) // plan.data_size
  counts: dict[str, list[int]] = {}
  for i, count in enumerate(plan.microbatch_counts):
    for kind in plan.device_kinds[i * per:(i + 1) * per]:
      counts.setdefault(kind, []).append(count)
  kinds = ", ".join(f"{len(c)}x{k} {'/'.join(map(str, sorted(set(c))))}" for k, c in counts.items())
  return (f"mesh {dict(zip(plan.axis_names, plan.mesh_shape))}, microbatches of {plan.microbatch} "
          f"({kinds} each)")


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.2f} ms"


def _device_count(spec: str) -> int:
  from hetspmd.hardware.cluster import Cluster

  return Cluster.resolve(spec).num_devices


def _latest(ckpt_dir: str) -> str:
  """The latest complete checkpoint in ``ckpt_dir``, as orbax finds it: a save that was killed leaves a
  ``step_N.orbax-checkpoint-tmp-*`` folder, which orbax does not count as a step."""
  from orbax.checkpoint.path import step as ocp_step

  latest = None
  if os.path.isdir(ckpt_dir):
    latest = ocp_step.latest_step_metadata(ckpt_dir, ocp_step.standard_name_format(step_prefix="step"))
  if latest is None:
    raise SystemExit(f"--resume: no checkpoint (a complete step_N folder) in {ckpt_dir}")
  return str(latest.path)


def _save(checkpointer, ckpt_dir: str, step: int, state) -> None:
  path = os.path.join(ckpt_dir, f"step_{step}")
  checkpointer.save(path, state, force=True)
  print(f"saving step {step} to {path}", flush=True)


def _restore(checkpointer, path: str, train_step, state):
  """The latest checkpoint, placed with the current plan's shardings."""
  import jax

  shardings = train_step.state_shardings(state)
  target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return checkpointer.restore(path, target)


if __name__ == "__main__":
  main()
