"""Per-layer rematerialization of a traced, already differentiated step.

A step differentiated by ``jax.value_and_grad`` (or ``jax.grad``,
``nnx.value_and_grad``, a ``custom_vjp``) traces to one straight-line
jaxpr: the forward pass, then its transpose. The backward equations read
*residuals*: values the forward pass made and that stay live until the
backward pass of their layer. This pass changes which values stay live,
without the user's code: for each layer it recomputes the residuals from the
layer's own inputs, in one checkpointed call (``remat2`` with
``differentiated=True``, whose inputs XLA sees through an optimization
barrier, as ``jax.checkpoint`` lowers) placed just before the first backward
equation that reads one. Only the values that cross layer boundaries (and
what no recomputation may remake) stay live across the step.

What a layer is: the equations under one numbered module scope of a repeated
block, ``h_0`` / ``h_1``, ``layers_3``, ``blocks/7`` (:func:`layer_scopes`):
MaxText's ``remat_policy: full`` on each decoder layer, or ``nn.remat``
around a block. Embeddings, the final norm, the head and the loss stay as
they are. Linen names its modules' scopes; NNX modules push none, so there a
layer is read from the parameters: the forward equations from the first read
of one numbered block's parameters to the first read of the next
(:func:`parameter_scopes`).

What is recomputed (:func:`segments`): a layer's forward values that carry
the example axis and that its backward pass reads, and the per-example
forward work they depend on inside the layer. Example-free values (a cast
weight, a BatchNorm's batch statistics under ``batch_stats="exact"``) are
read saved, never made again, so a recomputed BatchNorm normalises with the
saved global statistics. Side effects and collectives are never recomputed;
their outputs are read saved. A dropout mask is remade from the same key by
the same draw, so it has the same bits. Metrics are not counted twice: only
backward equations read the recomputed values.

Both the rewrite (:func:`rematerialize`, over the flat jaxpr the batch-axis
pass analyses) and the cost model (:mod:`hetspmd.passes.costing.step_cost`,
over a traced :class:`~hetspmd.passes.ir.Graph`) describe their equations as
:class:`Site` values and ask :func:`segments`, so the pricing and the lowering
recompute the same values.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Hashable, Iterable, Sequence

from hetspmd.passes import _jax_adapter as jx

# Collectives: never run again in a recomputation (their outputs are read saved).
COLLECTIVES = frozenset({"psum", "pmax", "pmin", "pmean", "all_gather", "all_to_all", "ppermute", "psum_scatter",
                         "reduce_scatter", "axis_index", "pbroadcast", "psum_invariant", "all_gather_invariant"})

_NUMBERED = re.compile(r"^(?P<stem>.*?)(?:_(?P<n>\d+)|(?P<digits>\d+))$")


@dataclasses.dataclass(frozen=True, slots=True)
class Site:
  """One equation as the segment finder reads it: its module path, its phase (``"forward"``, ``"backward"`` or
  ``""``), the values it reads and writes (any hashable names, literals left out), and whether running it
  again is allowed (no side effect, no collective)."""

  path: str
  phase: str
  reads: tuple[Hashable, ...]
  writes: tuple[Hashable, ...]
  recomputable: bool = True


@dataclasses.dataclass(frozen=True, slots=True)
class Segment:
  """One layer's recomputation.

  ``members``: the forward sites run again, in program order; ``inputs``: the values they read that they do
  not make (the layer's saved inputs); ``residuals``: the values they remake for the backward pass; ``at``: the
  first backward site that reads one (the recomputation runs just before it)."""

  layer: str
  members: tuple[int, ...]
  inputs: tuple[Hashable, ...]
  residuals: tuple[Hashable, ...]
  at: int


def _numbered(component: str) -> str | None:
  """The stem of a numbered scope component (``h_3`` -> ``h``, ``layers_12`` -> ``layers``, ``7`` -> ``""``)."""
  match = _NUMBERED.match(component)
  if match is None or (match.group("n") is None and match.group("digits") != component):
    return None
  return match.group("stem")


def layer_scopes(paths: Iterable[str]) -> dict[str, str]:
  """``{path: layer}`` for the paths inside a layer: the shortest prefix that ends in a numbered component
  (``h_3``, ``layers/7``) whose stem, under the same parent, numbers at least two scopes. (A leading component of
  digits alone is an argument's position in a parameter path, not a layer.)"""
  paths = set(paths)
  members: dict[tuple[str, str], set[str]] = {}
  candidates: dict[str, list[str]] = {}
  for path in paths:
    parts = path.split("/") if path else []
    for depth, part in enumerate(parts):
      stem = _numbered(part)
      if stem is None or (depth == 0 and part.isdigit()):
        continue
      parent, prefix = "/".join(parts[:depth]), "/".join(parts[:depth + 1])
      members.setdefault((parent, stem), set()).add(prefix)
      candidates.setdefault(path, []).append(prefix)
  repeated = {p for group in members.values() if len(group) >= 2 for p in group}
  found = {}
  for path, prefixes in candidates.items():
    layer = next((p for p in prefixes if p in repeated), None)
    if layer is not None:
      found[path] = layer
  return found


def parameter_scopes(sites: Sequence[Site], params: dict[Hashable, str]) -> list[str]:
  """Per site, a module path read from the parameters, for steps whose equations carry none (NNX modules push
  no name scope): ``params`` maps the values holding parameters to their paths (``blocks/3/mlp/kernel``). A
  forward site takes the layer (:func:`layer_scopes` of the parameter paths) of the parameter scope read most
  recently for the first time in program order; values made from one scope's parameters alone (a cast, a
  transpose) belong to it. Other sites keep their path (a jitted step's name, which names no layer)."""
  layer_of = layer_scopes(params.values())
  owner = {v: layer_of.get(p, "~" + p) for v, p in params.items()}  # "~": a parameter outside every layer
  bounds: list[tuple[int, str]] = []
  seen: set[str] = set()
  for i, site in enumerate(sites):
    keys = {owner[v] for v in site.reads if v in owner}
    if site.reads and len(keys) == 1 and all(v in owner for v in site.reads):
      owner.update((w, next(iter(keys))) for w in site.writes)
      continue
    if site.phase == "forward":
      for key in sorted(keys - seen, key=str):
        bounds.append((i, key))
        seen.add(key)
  paths, current, k = [], None, 0
  for i, site in enumerate(sites):
    while k < len(bounds) and bounds[k][0] <= i:
      current, k = bounds[k][1], k + 1
    inside = site.phase == "forward" and current is not None and not current.startswith("~")
    paths.append(current if inside else site.path)
  return paths


def segments(sites: Sequence[Site], per_example: Callable[[Hashable], bool],
             params: dict[Hashable, str] | None = None) -> tuple[Segment, ...]:
  """Each layer's recomputation, in layer order: what it runs again and what it remakes.

  ``per_example(value)``: whether a value carries the example axis (only those are recomputed; the rest are
  read saved). ``params``: the values holding parameters and their paths, for steps whose module paths name no
  layer (:func:`parameter_scopes`). A layer whose backward pass reads no per-example value of its own, or whose recomputation would
  run after a reader, gets none.
  """
  if params and not layer_scopes(s.path for s in sites if s.phase == "forward"):
    sites = [dataclasses.replace(s, path=p) for s, p in zip(sites, parameter_scopes(sites, params))]
  layer_of = layer_scopes(s.path for s in sites if s.phase == "forward")
  forward: dict[str, list[int]] = {}
  for i, site in enumerate(sites):
    layer = layer_of.get(site.path) if site.phase == "forward" else None
    if layer is not None:
      forward.setdefault(layer, []).append(i)
  readers: dict[Hashable, list[int]] = {}
  for i, site in enumerate(sites):
    for v in site.reads:
      readers.setdefault(v, []).append(i)
  found = []
  for layer, indices in forward.items():
    segment = _segment(layer, indices, sites, readers, per_example)
    if segment is not None:
      found.append(segment)
  return tuple(found)


def _segment(layer: str, indices: list[int], sites: Sequence[Site], readers: dict, per_example) -> Segment | None:
  inside = set(indices)
  made_by = {v: i for i in indices for v in sites[i].writes}
  remade = [v for v, i in made_by.items() if per_example(v) and _only_backward_outside(v, inside, sites, readers)
            and any(sites[r].phase == "backward" for r in readers.get(v, ()))]
  if not remade:
    return None
  members, stack, seen = set(), list(remade), set()
  while stack:
    v = stack.pop()
    if v in seen:
      continue
    seen.add(v)
    i = made_by.get(v)
    if i is None or not per_example(v) or not sites[i].recomputable:
      continue
    if i not in members:
      members.add(i)
      stack.extend(sites[i].reads)
  remade = [v for v in remade if made_by[v] in members]
  if not remade:
    return None
  order = sorted(members)
  made = {v for i in order for v in sites[i].writes}
  inputs = tuple(dict.fromkeys(v for i in order for v in sites[i].reads if v not in made))
  at = min(r for v in remade for r in readers[v] if sites[r].phase == "backward")
  if at <= order[-1]:
    return None
  return Segment(layer, tuple(order), inputs, tuple(remade), at)


def timed_segment(found: Sequence[Segment]) -> Segment:
  """The layer a calibration times of a step that unrolls its layers, and whose forward the cost model's
  prediction is compared with: the middle one (of an even count, the later of the two middle ones; the first
  and the last may read what others do not, an embedding's output or the final norm's input, so of two layers
  the second is taken)."""
  return found[len(found) // 2]


def renamed(segment: Segment, names: dict) -> Segment:
  """``segment`` with its values renamed by ``names`` (the same step traced again at another batch size)."""
  return dataclasses.replace(segment, inputs=tuple(names[v] for v in segment.inputs),
                             residuals=tuple(names[v] for v in segment.residuals))


def _only_backward_outside(v: Hashable, inside: set[int], sites: Sequence[Site], readers: dict) -> bool:
  """Whether every reader of ``v`` outside its layer's forward pass is a backward site (a value another layer,
  the head or the step's outputs read is a layer boundary: saved, not remade)."""
  return all(r in inside or sites[r].phase == "backward" for r in readers.get(v, ()))


# --- the rewrite of a flat jaxpr ---------------------------------------------------


def sites_of(eqns: Sequence[Any], outputs: Sequence[Any] = ()) -> list[Site]:
  """The :class:`Site` of each equation of a flat jaxpr. ``outputs``: the jaxpr's outputs (read by a pseudo-site
  at the end, so a value the step returns is never taken for a residual)."""
  sites = [Site(jx.module_path(e), jx.phase(e), tuple(v for v in e.invars if not jx.is_literal(v)),
                tuple(v for v in e.outvars if not jx.is_dropped(v)),
                recomputable=not jx.is_effectful(e) and jx.primitive_name(e) not in COLLECTIVES) for e in eqns]
  sites.append(Site("", "", tuple(v for v in outputs if not jx.is_literal(v)), ()))
  return sites


def rematerialize(flat: jx.ClosedJaxpr, per_example: Callable[[Any], bool], param_paths: dict[int, str] | None = None
                  ) -> tuple[jx.ClosedJaxpr, tuple[Segment, ...]]:
  """``flat`` (a flat closed jaxpr) with each layer's residuals recomputed before the backward pass reads
  them, and the segments it recomputes (none: ``flat`` as it is). ``param_paths``: ``{input position: path}`` of
  the parameter inputs (layers found from them where the equations' module paths name none)."""
  eqns = jx.equations(flat)
  invars = jx.invars(flat)
  params = {invars[i]: p for i, p in (param_paths or {}).items() if i < len(invars)}
  found = segments(sites_of(eqns, jx.outvars(flat)), per_example, params)
  if not found:
    return flat, ()
  at: dict[int, list[Segment]] = {}
  for segment in found:
    at.setdefault(segment.at, []).append(segment)
  backward = {i for i, e in enumerate(eqns) if jx.phase(e) == "backward"}

  def run(*args):
    env = dict(zip(jx.constvars(flat), jx.consts(flat)))
    env.update(zip(jx.invars(flat), args))
    remade: dict = {}
    for i, eqn in enumerate(eqns):
      for segment in at.get(i, ()):
        values = jx.recomputed_call(segment_body(segment, eqns), [env[v] for v in segment.inputs], like=eqn)
        remade.update(zip(segment.residuals, values))
      source = remade if i in backward else {}
      invals = [jx.read(env, v) if jx.is_literal(v) or v not in source else source[v] for v in eqn.invars]
      env.update(zip(eqn.outvars, jx.bind(eqn, invals)))
    return [jx.read(env, v) for v in jx.outvars(flat)]

  return jx.make_closed_jaxpr(run, *jx.input_avals(flat)), found


def segment_body(segment: Segment, eqns: Sequence[Any]) -> Callable[..., list[Any]]:
  """``segment`` of the flat ``eqns`` as a function: its inputs to the residuals it remakes."""
  def body(*inputs):
    env = dict(zip(segment.inputs, inputs))
    jx.eval_equations([eqns[i] for i in segment.members], env)
    return [env[v] for v in segment.residuals]

  return body
