"""Uneven pipeline stages on a real heterogeneous pair: layers split evenly vs by measured speed.

    python benchmarks/pipeline_hetero.py [--layers 12] [--microbatches 8] [--steps 7] [--slowdown-seconds 240]

Two processes with one CPU device each, pinned to separate cores with ``taskset`` and joined by
``jax.distributed`` (gloo on 127.0.0.1); each process is one stage of :func:`hetspmd.lowering.pipeline.pipelined_grad`
(a stack of residual MLP layers, a squared-error head on the last stage). A busy loop pinned to the
second core (it stops by itself after ``--slowdown-seconds``) makes that device slower. Each process
times one layer's forward and backward and the head on its own device; the weighted split is the one
:func:`hetspmd.lowering.pipeline.schedule_seconds` predicts fastest on those times. Printed side by side, from
one run:

* even: half the layers on each stage;
* weighted: the predicted-fastest split;
* each with its predicted seconds (schedule_seconds on the measured layer times, no transfer term) and
  its measured median step;
* ideal: both devices' throughputs on the whole stack added (no bubble, no transfers, no imbalance).

Needs Linux with ``taskset`` and 2+ cores.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

WORKER = textwrap.dedent("""
    import os, sys, json, time, statistics
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    rank, port, layers, microbatches, steps = map(int, sys.argv[1:6])
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=rank, initialization_timeout=120)
    import numpy as np, jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from hetspmd.lowering import pipeline

    WIDTH, EXAMPLES = 512, 256

    def block(p, h):
      return h + jnp.tanh(h @ p["w1"]) @ p["w2"] * 0.1

    def head(p, h, t):
      return jnp.sum((h @ p["w"] - t) ** 2)

    def median_seconds(fn, *args):
      jax.block_until_ready(fn(*args))
      times = []
      start = time.perf_counter()
      while len(times) < 20 or time.perf_counter() - start < 1.0:
        t = time.perf_counter(); jax.block_until_ready(fn(*args)); times.append(time.perf_counter() - t)
      return statistics.median(times)

    rng = np.random.default_rng(0)
    layer = {"w1": rng.standard_normal((WIDTH, WIDTH), np.float32) / WIDTH ** 0.5,
             "w2": rng.standard_normal((WIDTH, WIDTH), np.float32) / WIDTH ** 0.5}
    head_params = {"w": rng.standard_normal((WIDTH, 16), np.float32) / WIDTH ** 0.5}
    h = rng.standard_normal((EXAMPLES, WIDTH), np.float32)
    target = rng.standard_normal((EXAMPLES, 16), np.float32)
    f = median_seconds(jax.jit(block), layer, h)
    fb = median_seconds(jax.jit(lambda p, h: jax.vjp(block, p, h)[1](h)), layer, h)
    hd = median_seconds(jax.jit(lambda p, h, t: jax.vjp(lambda p, h: head(p, h, t), p, h)[1](jnp.float32(1))),
                        head_params, h, target)
    timed = multihost_utils.process_allgather(np.array([f, max(fb - f, 0.0), hd]))
    forward, backward, heads = [float(x) for x in timed[:, 0]], [float(x) for x in timed[:, 1]], float(timed[1, 2])

    splits = {"even": (layers // 2, layers - layers // 2)}
    best = min(((n, layers - n) for n in range(1, layers)), key=lambda split: pipeline.schedule_seconds(
        pipeline.Stages(split, microbatches), forward, backward, heads))
    splits["weighted"] = best
    mesh = Mesh(np.array(jax.devices()).reshape(2, 1), ("stage", "data"))
    put = lambda a, spec: jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])
    xs = rng.standard_normal((microbatches, EXAMPLES, WIDTH), np.float32)
    ts = rng.standard_normal((microbatches, EXAMPLES, 16), np.float32)
    stack = {k: np.stack([v] * layers) for k, v in layer.items()}
    result = {"forward": forward, "backward": backward, "head": heads}
    for name, split in splits.items():
      stages = pipeline.Stages(split, microbatches)
      padded = jax.tree.map(np.asarray, pipeline.pack(stack, stages))
      args = (jax.tree.map(lambda a: put(a, P("stage")), padded), jax.tree.map(lambda a: put(a, P()), head_params),
              put(xs, P(None, "data")), put(ts, P(None, "data")))
      run = jax.jit(pipeline.pipelined_grad(block, head, stages, mesh))
      jax.block_until_ready(run(*args))
      times = []
      for _ in range(steps):
        t = time.perf_counter(); jax.block_until_ready(run(*args)); times.append(time.perf_counter() - t)
      result[name] = {"layers": list(split), "median_s": statistics.median(times),
                      "predicted_s": pipeline.schedule_seconds(stages, forward, backward, heads)}
    print(json.dumps(result))
""")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--microbatches", type=int, default=8)
  parser.add_argument("--steps", type=int, default=7)
  parser.add_argument("--slowdown-seconds", type=int, default=240)
  args = parser.parse_args()
  if args.layers < 2:
    sys.exit("--layers must be at least 2 (one per stage)")
  from _steps import run_slowed_pair

  r = run_slowed_pair(WORKER, (args.layers, args.microbatches, args.steps), args.slowdown_seconds)

  f, b, head = r["forward"], r["backward"], r["head"]
  per_device = [args.microbatches * (args.layers * (2 * f[i] + b[i]) + head) for i in range(2)]
  ideal = 1.0 / sum(1.0 / t for t in per_device)
  print(f"2 processes x 1 CPU device (cores 0 and 1; core 1 shared with a busy loop), {args.layers} layers, "
        f"{args.microbatches} microbatches")
  print(f"one layer on a microbatch: forward {f[0] * 1e3:.2f} and {f[1] * 1e3:.2f} ms, backward {b[0] * 1e3:.2f} and "
        f"{b[1] * 1e3:.2f} ms (device 1 at {(f[0] + b[0]) / (f[1] + b[1]):.2f}x device 0); head {head * 1e3:.2f} ms")
  print(f"{'split':10} {'layers':>8} {'predicted s':>12} {'measured s':>11} {'measured/predicted':>19} "
        f"{'of ideal':>9} {'speedup vs even':>16}")
  for name in ("even", "weighted"):
    x = r[name]
    print(f"{name:10} {str(x['layers']):>8} {x['predicted_s']:12.3f} {x['median_s']:11.3f} "
          f"{x['median_s'] / x['predicted_s']:19.2f} {ideal / x['median_s']:9.1%} "
          f"{r['even']['median_s'] / x['median_s']:16.2f}")
  print(f"{'ideal':10} {'':>8} {ideal:12.3f}   (both devices' throughput on the whole stack, no bubble)")


if __name__ == "__main__":
  main()
