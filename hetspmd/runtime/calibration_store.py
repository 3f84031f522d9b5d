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
import warnings
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


def covers(calibration: Calibration, kinds: Sequence[str], sizes: Sequence[int], remats: Sequence[str],
           asked: dict | None = None) -> bool:
  """Whether ``calibration`` timed the step's microbatches on every kind of ``kinds`` under every policy of
  ``remats`` at every size of ``sizes``, or was asked to (``asked``: ``{policy: sizes}`` a store recorded; a
  size that ran out of memory on some kind is left out of its timing, and timing it again would not fit)."""
  asked = asked or {}
  for remat in remats:
    if set(sizes) <= set(asked.get(remat, ())) and all(calibration.of(k, remat) is not None for k in kinds):
      continue
    for kind in kinds:
      timing = calibration.of(kind, remat)
      if timing is None or timing.part != "step" or not set(sizes) <= {m for m, _ in timing.points}:
        return False
  return True


def load(directory: pathlib.Path, fingerprint: str, cluster: Any, sizes: Sequence[int],
         remats: Sequence[str]) -> tuple[Calibration | None, tuple[Calibration, dict] | None]:
  """``(usable, kept)``: the calibration kept in ``directory`` for this step and pool, ``usable`` where it covers
  ``sizes`` and ``remats`` and every process found the same one (else None); ``kept``, what this process read
  and the sizes each policy was asked for (merged into a new timing before it is written again), or None."""
  kept, asked = None, {}
  try:
    data = json.loads(path(directory, fingerprint, cluster).read_text())
    found = Calibration.from_json(data)
    kept = found if found.fingerprint == fingerprint else None
    asked = {str(r): [int(m) for m in ms] for r, ms in dict(data.get("asked", {})).items()}
  except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none yet, or not one: timed anew, written over
    pass
  usable = kept is not None and covers(kept, cluster.kinds, sizes, remats, asked)
  if jax.process_count() > 1:  # 4 words of 28 bits: gathered as int32 where JAX runs without 64-bit types
    text = hashlib.sha256(json.dumps(kept.to_json()).encode()).hexdigest() if usable else "f" * 28
    digest = np.array([int(text[i:i + 7], 16) for i in range(0, 28, 7)] + [int(usable)], np.int32)
    every = np.asarray(multihost_utils.process_allgather(digest)).reshape(-1, digest.size)
    usable = bool((every == digest).all() and every[:, -1].all())
  return (kept if usable else None), ((kept, asked) if kept is not None else None)


def save(directory: pathlib.Path, calibration: Calibration, kept: tuple[Calibration, dict] | None, cluster: Any,
         sizes: Sequence[int]) -> None:
  """Writes ``calibration`` (with the policies ``kept`` timed that it did not), and the ``sizes`` it was asked
  to time under each of its policies, for its step and ``cluster``, atomically (a temporary file renamed), so a
  process reading it never sees half of it. A directory that cannot be written is warned about, not raised:
  the other processes go on, and so does this one."""
  before, asked = kept if kept is not None else (None, {})
  merged = calibration if before is None else calibration.merged(before)
  asked = {**{r: m for r, m in asked.items() if r in {t.remat for t in merged.kinds}},
           **{t.remat: sorted(set(sizes)) for t in calibration.kinds}}
  data = {**merged.to_json(), "asked": asked, "pool": pool(cluster)}
  try:
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".json")
    with os.fdopen(handle, "w") as f:
      f.write(json.dumps(data, indent=1) + "\n")
    os.replace(temporary, path(directory, calibration.fingerprint, cluster))
  except OSError as e:
    warnings.warn(f"the calibration could not be kept in {directory}: {e}", stacklevel=2)
