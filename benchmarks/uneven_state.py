"""What memory-weighted (uneven, padded) ZeRO shards cost per device, next to uniform ones, in one SPMD program.

    python benchmarks/uneven_state.py [--rows 41600] [--width 256] [--memory 80,80,80,80,24,24,24,24]

Holds an Adam state (parameters, gradient, two moments, float32) of ``rows x width`` over 8 emulated CPU
devices two ways, and runs one Adam update on it under ``jax.jit``:

* uniform: every leaf split evenly over ``data`` (ZeRO-1/3 as hetspmd plans it);
* weighted: each position's share of the rows proportional to its device's memory (``--memory``, GB),
  every shard padded to the largest, as one uniform SPMD program must hold them (DESIGN.md, mechanism 3).

Prints, per layout, each position's valid rows, the bytes its shard of the state takes (from the arrays'
addressable shards), and the compiled program's per-device argument, output and temporary bytes
(``Compiled.memory_analysis``), then the ratio weighted / uniform on the smallest device. One SPMD
program allocates the same buffers on every device, so a padded shard costs its padded size everywhere:
weighting by memory can only raise the bytes on the smallest device, which sets what fits.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rows", type=int, default=41600)
  parser.add_argument("--width", type=int, default=256)
  parser.add_argument("--memory", default="80,80,80,80,24,24,24,24", help="GB per position, comma-separated")
  args = parser.parse_args()

  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import AxisType, NamedSharding
  from jax.sharding import PartitionSpec as P

  memory = [float(x) for x in args.memory.split(",")]
  n = len(memory)
  if len(jax.devices()) < n:
    raise SystemExit(f"needs {n} devices, found {len(jax.devices())}")
  mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])
  split = NamedSharding(mesh, P("data"))

  weights = np.array(memory) / sum(memory)
  valid = np.floor(weights * args.rows).astype(int)
  valid[np.argmax(weights)] += args.rows - valid.sum()
  layouts = {"uniform": np.full(n, -(-args.rows // n)), "weighted": valid}

  def adam(p, g, mu, nu):
    mu = 0.9 * mu + 0.1 * g
    nu = 0.999 * nu + 0.001 * g * g
    return p - 1e-3 * mu / (jnp.sqrt(nu) + 1e-8), mu, nu

  print(f"Adam state of {args.rows} x {args.width} float32 over {n} positions with memory {memory} GB")
  print(f"{'layout':<10} {'valid rows per position':<48} {'state bytes/device':>19} {'program bytes/device':>21}")
  per_device = {}
  for name, rows in layouts.items():
    padded = int(rows.max())
    host = np.zeros((n * padded, args.width), np.float32)
    for i, r in enumerate(rows):  # zero padding past each position's valid rows
      host[i * padded:i * padded + min(r, args.rows)] = 1.0
    leaves = [jax.device_put(host, split) for _ in range(4)]
    shard_bytes = {s.data.nbytes for leaf in leaves for s in leaf.addressable_shards}
    sizes = sorted({sum(s.data.nbytes for leaf in leaves for s in leaf.addressable_shards if s.device == d)
                    for d in mesh.devices.ravel()})
    compiled = jax.jit(adam, donate_argnums=(0, 2, 3)).lower(*leaves).compile()
    analysis = compiled.memory_analysis()
    program = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes
               + analysis.temp_size_in_bytes) if analysis is not None else float("nan")
    per_device[name] = (sizes, program)
    print(f"{name:<10} {str(list(map(int, rows))):<48} {' / '.join(map(str, sizes)):>19} {program:>21,}")
    assert len(shard_bytes) == 1, shard_bytes
  smallest = int(np.argmin(memory))
  ratio = per_device["weighted"][0][0] / per_device["uniform"][0][0]
  print(f"weighted / uniform state bytes on the smallest device (position {smallest}, {memory[smallest]:g} GB): "
        f"{ratio:.2f}x; program bytes {per_device['weighted'][1] / per_device['uniform'][1]:.2f}x")


if __name__ == "__main__":
  main()
