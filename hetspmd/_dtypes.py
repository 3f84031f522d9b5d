"""Accumulation dtypes: low-precision floats are summed in float32."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def wide(x: Any) -> Any:
  """``x`` as float32 when it is a float narrower than 32 bits (float16, bfloat16), else as it is."""
  x = jnp.asarray(x)
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x
