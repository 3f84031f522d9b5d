"""The hetspmd exception family.

Every error hetspmd raises on purpose is a :class:`HetSpmdError`, so callers
can catch one type. Messages say what was given, what was expected, and where
(argument path or Flax module path) the problem sits.
"""

from __future__ import annotations

import difflib
from typing import Iterable


class HetSpmdError(Exception):
  """Base class of every error raised by hetspmd on purpose."""


class TraceError(HetSpmdError, TypeError):
  """The function or its arguments cannot be traced to a jaxpr."""


class UnsupportedPrimitiveError(TraceError):
  """The step uses a primitive hetspmd cannot read (one carrying a nested jaxpr it does not know): names the
  primitive and the Flax module and source line it came from."""


class UnpartitionableError(HetSpmdError):
  """The step has an effect (host callback, debug print) that cannot be split."""


class UnknownNameError(HetSpmdError, KeyError):
  """A model, preset or device name that hetspmd does not know."""

  def __str__(self) -> str:  # KeyError would quote the message.
    return str(self.args[0]) if self.args else ""


class InvalidValueError(HetSpmdError, ValueError):
  """A number or spec outside its valid range."""


class PlanDoesNotFitError(HetSpmdError):
  """No plan fits the devices' memory: names the device that overflows, by how much, and what would fit."""


class CannotTimeError(HetSpmdError):
  """The step cannot be timed whole on a device of some kind (it does not fit there, or its state or batch is
  split across processes): one layer (of its layer scan, or a numbered block) can be timed instead."""


class NoLayerStackError(HetSpmdError):
  """The step has no layer stack that pipeline stages can cut: says what differs from one scan over stacked
  parameters and its transpose."""


def closest(name: object, names: Iterable[str]) -> str | None:
  """The one of ``names`` closest to ``name`` (a likely typo's intent, for "did you mean"), or None."""
  close = difflib.get_close_matches(str(name), list(names), n=1)
  return close[0] if close else None
