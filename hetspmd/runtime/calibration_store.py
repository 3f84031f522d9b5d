"""Calibrations kept on disk and reused: ``parallelize(..., calibrate=directory)``.

A calibration is the step's own times on each kind of a pool (:mod:`hetspmd.runtime.calibrating`). It holds for
the same step (its jaxpr fingerprint) on the same devices: the same kinds, each backed by the same JAX device kind
(an emulated ``V100-32GB`` on CPU devices is not a V100) in the same number, timed by as many processes. One file
per step and pool, named by both, holds it. A later search of that step on that pool reads the file instead of
timing, where it timed every kind at the sizes and remat policies asked for; else the step is timed and the file
written again (policies timed before and not asked for now are kept). Across processes every process reads its own
copy, and the file is used only where every process found the same one: else every process times, as without a
store, and each writes its copy.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from hetspmd.hardware.calibration import Calibration


def directory_of(option: Any) -> pathlib.Path | None:
  """The directory ``parallelize``'s ``calibrate`` names (an existing directory), else None."""
  if isinstance(option, (str, os.PathLike)) and pathlib.Path(option).expanduser().is_dir():
    return pathlib.Path(option).expanduser()
  return None


def pool(cluster: Any) -> list[list]:
  """What a calibration on ``cluster`` (bound to JAX devices) was timed on: per kind, its name, the JAX device
  kinds behind it and how many devices; and the number of processes."""
  found = {d.id: d for d in jax.devices()}
  kinds: dict[str, list] = {}
  for i, device in zip(cluster.jax_device_ids, cluster.devices):
    kinds.setdefault(device.spec.name, []).append(found[i].device_kind if i in found else "?")
  return [[kind, sorted(set(backed)), len(backed)] for kind, backed in sorted(kinds.items())] + [
      ["processes", jax.process_count()]]


def path(directory: pathlib.Path, fingerprint: str, cluster: Any) -> pathlib.Path:
  key = hashlib.sha256(json.dumps(pool(cluster)).encode()).hexdigest()[:16]
  return directory / f"calibration-{fingerprint[:16]}-{key}.json"


def covers(calibration: Calibration, kinds: Sequence[str], sizes: Sequence[int], remats: Sequence[str]) -> bool:
  """Whether ``calibration`` timed the step's microbatches on every kind of ``kinds`` under every policy of
  ``remats`` at every size of ``sizes``."""
  for kind in kinds:
    for remat in remats:
      timing = calibration.of(kind, remat)
      if timing is None or timing.part != "step" or not set(sizes) <= {m for m, _ in timing.points}:
        return False
  return True


def load(directory: pathlib.Path, fingerprint: str, cluster: Any, sizes: Sequence[int],
         remats: Sequence[str]) -> tuple[Calibration | None, Calibration | None]:
  """``(usable, kept)``: the calibration kept in ``directory`` for this step and pool, ``usable`` where it covers
  ``sizes`` and ``remats`` and every process found the same one (else None); ``kept``, what this process read
  (merged into a new timing before it is written again)."""
  kept = None
  try:
    found = Calibration.load(path(directory, fingerprint, cluster))
    kept = found if found.fingerprint == fingerprint else None
  except (OSError, ValueError, KeyError, TypeError):  # none yet, or not one: timed anew and written over
    pass
  usable = kept is not None and covers(kept, cluster.kinds, sizes, remats)
  if jax.process_count() > 1:  # 4 words of 28 bits: gathered as int32 where JAX runs without 64-bit types
    text = hashlib.sha256(json.dumps(kept.to_json()).encode()).hexdigest() if usable else "f" * 28
    digest = np.array([int(text[i:i + 7], 16) for i in range(0, 28, 7)] + [int(usable)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    usable = bool((every == digest).all() and every[:, -1].all())
  return (kept if usable else None), kept


def save(directory: pathlib.Path, calibration: Calibration, kept: Calibration | None, cluster: Any) -> None:
  """Writes ``calibration`` (with the policies ``kept`` timed that it did not) for its step and ``cluster``,
  atomically (a temporary file renamed), so a process reading it never sees half of it."""
  merged = calibration if kept is None else calibration.merged(kept)
  target = path(directory, calibration.fingerprint, cluster)
  data = {**merged.to_json(), "pool": pool(cluster)}
  handle, temporary = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".json")
  with os.fdopen(handle, "w") as f:
    f.write(json.dumps(data, indent=1) + "\n")
  os.replace(temporary, target)
