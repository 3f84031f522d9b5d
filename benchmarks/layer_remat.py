"""What remat ``"layers"`` takes off a step's temporaries, and what its extra forward pass costs, measured.

    python benchmarks/layer_remat.py [--layers 24] [--width 128] [--seq 64] [--microbatch 4]

A ``--layers``-deep pre-norm residual block stack (LayerNorm, Dense to 4x, gelu, Dense back, over ``--seq``
positions of ``--width``), Adam, float32, on 8 emulated CPU devices, every device a microbatch of
``--microbatch`` per loop trip. The step is written as Flax users write it, with ``jax.value_and_grad``
(nothing of hetspmd in it), once unrolled (``Block_0`` .. ``Block_23``) and once as a layer scan
(``nn.scan``). Each row is one plan's program: its ``Compiled.memory_analysis()`` temporaries per device,
against one layer's input (``microbatch x seq x width`` floats, what ``"layers"`` keeps per layer) and against
one layer's activations (``none``'s temporaries over the layer count), and the step's time (the median of 5
calls after one warm-up) against ``none``'s in the same run.

Policies: ``none``; ``layers`` (each block recomputed from its input before its backward pass, on the traced
step); ``full`` and ``dots`` where the step differentiates with ``hs.value_and_grad`` instead (the whole loss
checkpointed). For the layer scan, ``layers`` finds no numbered block (the scan is one equation each way) and
changes nothing; ``nn.remat`` around the scanned block is shown as what the user's own checkpoint gives.
XLA on CPU schedules an unrolled program's buffers by its own heuristics: where the temporaries do not drop,
the pass's saving is not visible in this backend's buffer assignment, and the cost model's liveness
(``predicted``) is shown beside it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=24)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--microbatch", type=int, default=4)
  args = parser.parse_args()

  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  import hetspmd as hs
  from hetspmd.passes.profile import profile_step
  from hetspmd.planner.data_axis import microbatch_bytes

  width, seq, m = args.width, args.seq, args.microbatch

  class Block(nn.Module):
    scanned: bool = False

    @nn.compact
    def __call__(self, x, _=None):
      h = nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))
      return (x + h, None) if self.scanned else x + h

  class Stack(nn.Module):
    form: str  # "unrolled", "scan" or "scan+nn.remat"

    @nn.compact
    def __call__(self, x):
      if self.form == "unrolled":
        for _ in range(args.layers):
          x = Block()(x)
      else:
        block = nn.remat(Block) if self.form == "scan+nn.remat" else Block
        x, _ = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True}, length=args.layers)(
            True)(x, None)
      return nn.Dense(10)(nn.LayerNorm()(x).mean(axis=1))

  def step_with(value_and_grad):
    def step(state, batch):
      def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
      loss, grads = value_and_grad(loss_fn)(state.params)
      return state.apply_gradients(grads=grads), {"loss": loss}
    return step

  devices = jax.devices()[:8]
  if len(devices) < 8:
    raise SystemExit(f"needs 8 devices, found {len(devices)}")
  cluster = hs.Cluster.emulate(devices, kinds=["V100-32GB"] * 8)
  batch_size = 8 * m
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(batch_size, seq, width).astype(np.float32),
           "y": rs.randint(0, 10, batch_size).astype(np.int32)}
  layer_input = m * seq * width * 4
  print(f"{args.layers} blocks of width {width} over {seq} positions, microbatch {m} per device; one layer's "
        f"input {layer_input / 1e6:.3f} MB")
  print(f"{'model':>14} {'step':>16} {'remat':>7} {'temp MB':>9} {'/input':>7} {'/layer act':>10} "
        f"{'predicted MB':>12} {'step ms':>8} {'/none':>6}")
  for form in ("unrolled", "scan", "scan+nn.remat"):
    model = Stack(form)
    params = jax.device_get(model.init(jax.random.key(0), jnp.zeros((1, seq, width)))["params"])
    fresh = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    profile = profile_step(step_with(jax.value_and_grad), fresh(), batch)
    rows = [("jax.value_and_grad", jax.value_and_grad, "none"), ("jax.value_and_grad", jax.value_and_grad, "layers")]
    if form == "unrolled":
      rows += [("hs.value_and_grad", hs.value_and_grad, r) for r in ("dots", "full")]
    base_temp = base_ms = None
    for name, vg, remat in rows:
      plan = hs.plan_for(cluster, fresh(), global_batch=batch_size, layout=(8, 1), microbatch=m,
                         counts=(1,) * 8, remat=remat)
      step = hs.parallelize(step_with(vg), cluster=cluster, plan=plan, global_batch=batch_size)
      state = step.shard_state(fresh())
      temp = step.lower(state, batch).compile().memory_analysis().temp_size_in_bytes
      state, metrics = step(state, batch)
      jax.block_until_ready(metrics)
      times = []
      for _ in range(5):
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
      ms = 1e3 * statistics.median(times)
      if base_temp is None:
        base_temp, base_ms = temp, ms
      predicted = microbatch_bytes(profile, m, remat) if name == "jax.value_and_grad" else float("nan")
      print(f"{form:>14} {name:>16} {remat:>7} {temp / 1e6:9.2f} {temp / layer_input:7.1f} "
            f"{temp / (base_temp / args.layers):10.2f} {predicted / 1e6:12.2f} {ms:8.1f} {ms / base_ms:6.2f}")


if __name__ == "__main__":
  main()
