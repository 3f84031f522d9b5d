"""What each device holds under a group plan whose optimizer state follows memory, measured.

    python benchmarks/group_memory.py [--layers 48] [--width 128] [--memory 80,80,80,80,16,16,16,16]

Trains a deep Linen MLP (``--layers`` Dense + LayerNorm blocks of ``--width``, Adam, float32) for two steps on
8 emulated CPU devices posing as four large-memory and four small-memory devices (``--memory``, GB), under a
group plan (:mod:`hetspmd.runtime.grouped`): the large devices one group with microbatches of 4, the small
ones another with microbatches of 1, and the state in shares in proportion to memory (``state_shares``):
under ZeRO-1 each Adam moment lives whole and unpadded on one device, under ZeRO-3 each parameter too (both
stages are measured in one run). Then ZeRO-1 again with the small devices as two positions of a model axis
of 2 (each block's Dense split by its output columns), to measure what the axis takes off the small group's
program: its accumulator and activations, split.

The steps donate the state (``donate_state=True``): each device's update program writes its optimizer-state
leaves into their old buffers (``aliased`` below). Prints per stage and device: its share, the bytes of the sharded state it should hold (share x total), the bytes it does hold
(the state's arrays' shards on it), their ratio, and the bytes of every live array on it between steps
(``jax.live_arrays()``); then each program's ``Compiled.memory_analysis()`` (argument, output and temporary
bytes per device), and the ratio of what a small device holds to what one SPMD program would give it:
an even ZeRO shard padded to the largest memory-weighted share (``benchmarks/uneven_state.py``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=48)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--memory", default="80,80,80,80,16,16,16,16", help="GB per device, comma-separated")
  parser.add_argument("--sharded-layers", type=int, default=24, help="layers of the sharded-group model")
  parser.add_argument("--sharded-width", type=int, default=256, help="width of the sharded-group model")
  parser.add_argument("--sharded-only", action="store_true", help="measure only the sharded groups")
  args = parser.parse_args()
  if args.sharded_only:
    return _sharded_rows(args.sharded_layers, args.sharded_width)

  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  from hetspmd.plan.groups import group_plan, shares_for
  from hetspmd.runtime.grouped import run_groups

  memory = [float(x) for x in args.memory.split(",")]
  if len(memory) != 8 or len(jax.devices()) < 8:
    raise SystemExit(f"needs 8 devices and 8 memory sizes, found {len(jax.devices())} and {len(memory)}")

  class Deep(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(args.layers):
        x = x + nn.gelu(nn.Dense(args.width)(nn.LayerNorm()(x)))
      return nn.Dense(10)(x)

  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}

  model = Deep()
  params = jax.device_get(model.init(jax.random.key(0), jnp.zeros((1, args.width)))["params"])  # on the host
  shares = shares_for(memory)
  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(40, args.width).astype(np.float32), "y": rs.randint(0, 10, 40).astype(np.int32)}
  fresh = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
  small = {}
  for zero, axis in ((1, 1), (3, 1), (1, 2)):
    dims = {f"params/Dense_{i}/{leaf}": dim for i in range(args.layers) for leaf, dim in (("kernel", 1), ("bias", 0))}
    plan = group_plan([((0, 1, 2, 3), 4, (2, 2, 2, 2)),
                       ((4, 5, 6, 7), 1, (2, 2, 2, 2) if axis == 1 else (4, 4, 4, 4), "none", axis,
                        dims if axis > 1 else ())], 40, state_shares=shares, zero_stage=zero)
    small[(zero, axis)] = _report(run_groups(step, plan, donate_state=True), fresh, batch, memory)["group 1"]
  one, two = small[(1, 1)], small[(1, 2)]
  print(f"\nthe small group's program, ZeRO-1, data-only vs a model axis of 2 (bytes per device): arguments "
        f"{one.argument_size_in_bytes} vs {two.argument_size_in_bytes}, temporary {one.temp_size_in_bytes} vs "
        f"{two.temp_size_in_bytes} ({two.temp_size_in_bytes / one.temp_size_in_bytes:.2f}x)")
  _sharded_rows(args.sharded_layers, args.sharded_width)


def _sharded_rows(layers: int, width: int) -> None:
  """A group of 4 devices sharding its parameters (FSDP inside the group) beside 4 unsharded ones, against the
  same plan with neither sharded: a ``layers``-deep residual MLP of ``width``, once unrolled and once as a layer
  scan (``nn.scan``), each without remat and under the ``dots`` policy (the step's ``hs.value_and_grad``
  checkpoints the loss: the parts go into the checkpointed call, each reader inside gathers its copy), Adam,
  float32, microbatches of 2. Per program of group 0 (the one that shards): its
  arguments against the parameters' bytes, its temporaries less its accumulator (its part of the gradients: the
  loop's carry) against one layer's parameter bytes, its outputs (the gradient sums it hands over: whole-shaped
  rows to the uniform exchange program, or under shares its parts to their owners) against the parameters'
  bytes, and the most bytes live arrays hold on one of the group's devices between steps. Then the sharded group again under ZeRO-3 with the state in even shares over the 8
  devices (``Z3``): between steps each device holds its share of the parameters and Adam's moments, whole
  leaves each on one device (a layer scan's stacked leaves are few and large, so its shares are lumpy). And
  ``hybrid``: both groups sharding, each holding its own copy of the state split over its four devices between
  steps (a quarter of the parameters and moments per device, the layer scan's too).
  A layer scan's temporaries also hold its stacked part of the gradients (a quarter of the parameters) as
  the scan makes them, before they are added to the accumulator. Each row's step time is the median of 5 calls;
  the sharded group's over the unsharded one's, in one run, is what its gathers and reduce-scatters cost on CPU
  devices, where XLA runs collectives in line."""
  import flax.linen as nn
  import jax
  import jax.numpy as jnp
  import numpy as np
  import optax
  from flax.training import train_state

  import hetspmd as hs
  from hetspmd.plan.groups import Group, group_plan
  from hetspmd.runtime.grouped import run_groups

  class Block(nn.Module):
    scanned: bool = False

    @nn.compact
    def __call__(self, x, _=None):
      x = x + nn.gelu(nn.Dense(width)(nn.LayerNorm()(x)))
      return (x, None) if self.scanned else x

  class Layers(nn.Module):
    scanned: bool

    @nn.compact
    def __call__(self, x):
      if self.scanned:
        x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=layers)(True)(x, None)
      else:
        for _ in range(layers):
          x = Block()(x)
      return nn.Dense(10)(x)

  def step(state, batch):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["x"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    loss, grads = hs.value_and_grad(loss_fn)(state.params)  # the plan's remat policy checkpoints the loss
    return state.apply_gradients(grads=grads), {"loss": loss}

  rs = np.random.RandomState(0)
  batch = {"x": rs.randn(32, width).astype(np.float32), "y": rs.randint(0, 10, 32).astype(np.int32)}
  layer = (width * width + 4 * width) * 4  # one block's parameters: kernel, bias, LayerNorm scale and bias
  print(f"\n=== a sharded group of 4 beside an unsharded group of 4: {layers} layers of {width}, "
        f"one layer {layer / 1e3:.0f} KB ===")
  print(f"{'model':>14} {'group 0':>10} {'arguments':>10} {'/params':>8} {'temporary':>10} {'accum.':>9} "
        f"{'rest/layer':>10} {'outputs':>9} {'/params':>8} {'live max':>10} {'loss':>10} {'step ms':>8}")
  seconds = {}
  for scanned, remat in ((False, "none"), (True, "none"), (False, "dots"), (True, "dots")):
    model = Layers(scanned)
    params = jax.device_get(model.init(jax.random.key(0), jnp.zeros((1, width)))["params"])
    whole = sum(x.nbytes for x in jax.tree.leaves(params))
    for sharded, zero in ((False, None), (True, None)) + (((True, 3), ("hybrid", None)) if remat == "none" else ()):
      # "hybrid": the other group shards too, and each holds its state split over its devices between steps
      plan = group_plan([Group((0, 1, 2, 3), 2, (2, 2, 2, 2), remat, shard_params=bool(sharded)),
                         Group((4, 5, 6, 7), 2, (2, 2, 2, 2), remat, shard_params=sharded == "hybrid")], 32,
                        zero_stage=zero, state_shares=(1 / 8,) * 8 if zero else ())
      runner = run_groups(step, plan)
      state = runner.shard_state(train_state.TrainState.create(apply_fn=model.apply, params=params,
                                                               tx=optax.adam(1e-3)))
      for _ in range(3):  # the first call finds the state replicated (as shard_state places it), later ones held
        state, metrics = runner(state, batch)
      jax.block_until_ready((state, metrics))
      times = []
      for _ in range(5):
        start = time.perf_counter()
        state, metrics = runner(state, batch)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - start)
      seconds[(scanned, remat, sharded, zero)] = statistics.median(times)
      on_device = {d: 0 for d in range(8)}  # one snapshot (a shard's .data is an array of its own)
      for x in jax.live_arrays():
        for shard in x.addressable_shards:
          on_device[shard.device.id] += shard.data.nbytes
      live = max(on_device[d] for d in (0, 1, 2, 3))
      loop = runner.memory_analysis()["group 0"]
      accumulator = whole / 4 if sharded else 0  # the loop's carry: its part of every gradient (whole: an output)
      # a temporary beside the whole-shaped rows it makes; the output itself where it hands its owners its parts
      rest = loop.temp_size_in_bytes - (0 if runner._latest.part_sums else accumulator)
      print(f"{('scan' if scanned else 'unrolled') + ('' if remat == 'none' else ' ' + remat):>14} "
            f"{('hybrid' if sharded == 'hybrid' else 'sharded' if sharded else 'whole') + (' Z3' if zero else ''):>10} "
            f"{loop.argument_size_in_bytes / 1e6:>9.2f}M {loop.argument_size_in_bytes / whole:>8.2f} "
            f"{loop.temp_size_in_bytes / 1e6:>9.2f}M {accumulator / 1e6:>8.2f}M {rest / layer:>10.1f} "
            f"{loop.output_size_in_bytes / 1e6:>8.2f}M {loop.output_size_in_bytes / whole:>8.2f} "
            f"{live / 1e6:>9.2f}M {float(metrics['loss']):>10.6f} {seconds[(scanned, remat, sharded, zero)] * 1e3:>8.1f}")
      if zero:
        print(f"{'':>14} ZeRO-3: {len(runner._latest.parted)} of {len(jax.tree.leaves(params))} parameter leaves reach "
              f"the sharded group as its parts only; the exchange program takes "
              f"{runner.memory_analysis()['exchange'].argument_size_in_bytes} bytes of arguments")
      del state, metrics, runner
  ratios = [seconds[(sc, r, True, None)] / seconds[(sc, r, False, None)] for sc, r, sh, z in seconds
            if sh is True and z is None]
  print(f"sharded / whole step time (median of 5 each, one run; on CPU the collectives run in line, nothing hides "
        f"them): {', '.join(f'{x:.2f}' for x in ratios)}")
  print("goals: arguments about 1/4 of the parameters; temporaries beside the accumulator about 3 layers or fewer "
        "(a layer scan: beside its stacked part of the gradients too); outputs (the gradient sums it hands over) "
        "about 1/4 of the parameters where each owner reduces its own sums (ZeRO-3 shares here), in a hybrid plan, "
        "and beside the unsharded group of 4 (it hands over the same parts); between steps, under ZeRO-3 shares, each "
        "device its share, in a hybrid plan a quarter of the state")


def _report(runner, fresh, batch, memory) -> dict:
  """Two steps of ``runner`` from ``fresh()`` (the state; nothing else keeps it), then what each device holds
  against its share; each program's ``memory_analysis()``."""
  import jax
  import numpy as np

  plan, shares = runner.plan, runner.plan.state_shares
  state = runner.shard_state(fresh())
  for _ in range(2):
    state, metrics = runner(state, batch)
  jax.block_until_ready((state, metrics))
  del metrics

  def on_devices(tree):
    out = {d.id: 0 for d in runner.devices}
    for x in tree:
      for shard in x.addressable_shards:
        out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out

  sharded = (state.opt_state,) if plan.zero_stage == 1 else (state.params, state.opt_state)
  leaves = [x for x in jax.tree.leaves(sharded) if np.size(x) > 1]
  held = on_devices(leaves)
  total = sum(held.values())
  live = on_devices(jax.live_arrays())
  what = "optimizer state" if plan.zero_stage == 1 else "parameters and optimizer state"
  print(f"\n=== ZeRO-{plan.zero_stage} ===\n" + runner.explain())
  print(f"\n{what} (leaves of more than one element): {total / 1e6:.3f} MB over {len(leaves)} leaves")
  print(f"{'device':>6} {'memory':>7} {'share':>7} {'target MB':>10} {'holds MB':>9} {'ratio':>6} {'live MB':>8}")
  for d, mem, share in zip(plan.devices, memory, shares):
    target = share * total
    print(f"{d:>6} {mem:>6.0f}G {share:>7.2%} {target / 1e6:>10.3f} {held[d] / 1e6:>9.3f} "
          f"{held[d] / target:>6.3f} {live[d] / 1e6:>8.3f}")
  print("\nper-program memory_analysis (bytes per device):")
  print(f"{'program':>22} {'arguments':>10} {'outputs':>10} {'aliased':>10} {'temporary':>10}")
  analysis = runner.memory_analysis()
  for name, stats in analysis.items():
    print(f"{name:>22} {stats.argument_size_in_bytes:>10} {stats.output_size_in_bytes:>10} "
          f"{stats.alias_size_in_bytes:>10} {stats.temp_size_in_bytes:>10}")
  small = [d for d, mem in zip(plan.devices, memory) if mem == min(memory)]
  padded = max(shares) * total  # one SPMD program: every device's shard padded to the largest share
  worst = max(held[d] / (shares[plan.devices.index(d)] * total) for d in small)
  print(f"\nsmall devices hold at most {worst:.3f}x their share of the {what} (goal: within 1.10x); "
        f"{max(held[d] for d in small) / padded:.3f}x the padded shard one SPMD program would give them; "
        f"live bytes on a small device {live[small[0]] / 1e6:.3f} MB, on a large one "
        f"{live[plan.devices[0]] / 1e6:.3f} MB")
  return analysis

if __name__ == "__main__":
  main()
