"""Accumulation dtypes: low-precision floats are summed in float32."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np


def wide(x: Any) -> Any:
  """``x`` as float32 when it is a float narrower than 32 bits (float16, bfloat16), else as it is."""
  x = jnp.asarray(x)
  return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32 else x


def traced_dtype(x: Any) -> Any:
  """The dtype JAX traces ``x`` with: its own, or for a Python scalar JAX's default for it (float32 for a float
  unless 64-bit mode is on), as ``jnp.asarray`` gives."""
  dtype = getattr(x, "dtype", None)
  return dtype if dtype is not None else jnp.asarray(x).dtype


def nbytes(x: Any) -> int:
  """The bytes ``x`` takes as JAX traces it."""
  return int(np.size(x)) * np.dtype(traced_dtype(x)).itemsize
