"""Lowering: a plan and a step's microbatch analysis → the programs that run it under ``jax.jit``.

A single program (``Plan``) lowers to one SPMD program over every device; a
group plan (``GroupPlan``) to one program per group, joined by uniform
exchange programs. Both build their loops from the same pieces (``loop``,
``program``, ``weighted``'s ``before_loops``/``after_loops``).

``program`` holds what the lowering reads of the analysis (:class:`Layout`,
``Program``); ``loop`` the microbatch loop's shared pieces; ``weighted`` the
device-weighted data-parallel program (per-device trip counts, one reduction
over ``data`` after the loop); ``staged`` with ``ticks`` and ``exchange`` the
lockstep pipeline stages over a layer scan; ``collectives`` the reductions;
``operands`` the example-free operands rebuilt at a microbatch's size;
``pipeline`` the tick schedule and its estimate. For group plans:
``groups`` the group, combine, exchange and update programs;
``group_stages`` the named stages a group program is chained from;
``group_build`` every program of one argument structure, and where its
state lives; ``transfers`` moving values between devices (copies, two-hop
relays, reduce-scatters, rows).
"""

from hetspmd.lowering.program import Layout as Layout
from hetspmd.lowering.program import counts_fixed_when_traced as counts_fixed_when_traced
from hetspmd.lowering.program import recompute_factor as recompute_factor
from hetspmd.lowering.weighted import build as build

__all__ = ["Layout", "build", "counts_fixed_when_traced", "recompute_factor"]
