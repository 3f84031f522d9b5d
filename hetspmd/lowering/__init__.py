"""Lowering: a Plan's layout and a step's microbatch analysis → one SPMD program under ``jax.jit``.

``program`` holds what the lowering reads of the analysis (:class:`Layout`,
``Program``); ``loop`` the microbatch loop's shared pieces; ``weighted`` the
device-weighted data-parallel program (per-device trip counts, one reduction
over ``data`` after the loop); ``staged`` with ``ticks`` and ``exchange`` the
lockstep pipeline stages over a layer scan; ``collectives`` the reductions;
``operands`` the example-free operands rebuilt at a microbatch's size;
``pipeline`` the tick schedule and its estimate.
"""

from hetspmd.lowering.program import Layout as Layout
from hetspmd.lowering.program import recompute_factor as recompute_factor
from hetspmd.lowering.weighted import build as build

__all__ = ["Layout", "build", "recompute_factor"]
