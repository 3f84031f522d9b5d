"""Tensor-parallel strategies per operation on the ``model`` axis, chosen by an ILP.

What it computes. For a step profiled at two batch sizes
(:class:`~hetspmd.passes.costing.step_cost.StepProfile`, which keeps both traces) and a
model-axis size ``m``, :func:`strategy_space` finds the **sites**: the
per-microbatch ``dot_general`` and ``gather`` nodes that read a parameter
(directly or through a transpose or dtype conversion). Each parameter read
at a site is one **decision**: which of its dimensions, if any, is split
over ``model``. :data:`SITE_RULES`, keyed by primitive, lists the options
and what each does at a site:

* ``replicated`` (every primitive; the **default** for a parameter read by
  anything else, which is then not a decision at all);
* ``dot_general``: ``column``, a non-contracting (output feature)
  dimension: the output is feature-sharded and the input must be whole;
  ``row``, a contracting dimension: the input must be sharded the same way,
  the output is a partial sum that is all-reduced over ``model``;
  ``expert``, a batch dimension (a stack of expert weights applied
  batch-wise, ``einsum("ebcd,edf->ebcf")``): the other operand's matching
  dimension must be sharded the same way (its slots are sliced, for free,
  from a whole dispatch) and the output comes out sharded along it; the
  combine that contracts the expert dimension is then all-reduced over
  ``model``. The tokens of a group's microbatch are on every device of the
  group, so no all-to-all moves them;
* ``gather``: ``vocab``, the indexed table dimension: every device looks up
  the rows it holds and an all-reduce adds the masked results; ``column``, a
  sliced dimension kept whole by the lookup: the output is feature-sharded.

Attention-head splitting is ``column`` on the q/k/v projections and ``row``
on the output projection. A tied embedding is one decision with several
sites (the lookup, the logits matmul and its backward), named by its first.

Each option is costed per microbatch from the same per-node fits as the
data-parallel cost model:

* a split parameter's sites do ``1/m`` of their work;
* a site whose output is sharded owns a **region**: the nodes reached from
  it before the next sites (a node reached from several sites belongs to the
  latest). :data:`~hetspmd.passes.sharding.propagation.PROPAGATION_RULES`, keyed by primitive, carries the
  sharded dimension through it: elementwise ops keep it, transposes,
  broadcasts and reshapes move it, reductions and ``dot_general`` over it
  all-reduce their result, lookups along it are masked and all-reduced; the
  **default** for any other primitive all-gathers the operand and goes on
  replicated. Sharded region nodes take ``1/m`` of their time. Splitting,
  slicing, padding or concatenating along the sharded dimension marks the
  option as needing a ``collective-permute``. A parameter of the site's own
  module applied elementwise along the sharded dimension (a bias) is split
  with it;
* collectives are α–β on the model group's link (one host): all-reduce
  ``2(m-1)/m · B/bw + 2(m-1)α``, all-gather ``(m-1)/m · B/bw + (m-1)α``;
* **resharding** between decisions: a region that brings a sharded value to
  a site that needs it whole (or sharded along another dimension) pays an
  all-gather of it; a whole value needed sharded is sliced for free;
* **conflicts** between decisions: an option whose sharded value is added
  into another region's stream (a residual) lets XLA shard that stream in
  both passes; a lookup on the stream then has its table gradient scattered
  feature-sharded, which meets a vocabulary split of the table only through
  an all-to-all. Such pairs are excluded like permutes (seen on GPT-2 with
  a tied embedding split by vocabulary). So are an ``expert`` split and a
  split that shards the stream before the experts' last site (a
  feature-split embedding, a ``row`` split of the final projection, whose
  input gradient shards the cotangent stream from the top of the backward
  pass): the experts would meet feature-sharded tokens through an
  all-to-all (seen on BERT-MoE).

The backward pass needs no rules of its own: a weight's input-gradient
matmul reads the weight, so it is a site (``column`` gives a partial input
gradient, all-reduced; ``row`` a sharded one), and the weight-gradient matmul
lies in the region of the cotangent it reads.

The ILP that picks one option per decision is in
:mod:`hetspmd.passes.sharding.ilp` (``choose``, ``frontier``,
``param_dims``).

Assumptions: a weight whose gradient is computed sharded while the weight is
whole (or the reverse) costs nothing extra; activation memory shrinks by the
sharded share of intermediate bytes; options that need a collective-permute
are left out unless asked for, because inside the weighted microbatch loop a
permute forces lockstep execution (:mod:`hetspmd.runtime.step`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from hetspmd.errors import InvalidValueError
from hetspmd.passes.costing.step_cost import LinearCost, StepProfile, fit_linear
from hetspmd.passes.ir import Graph, Node, Role, Source, ValueRef

from hetspmd.passes.sharding.propagation import (ELEMENTWISE, PROPAGATION_RULES, _REARRANGED_AXES, _VIEWS, Dim, SiteEffect,
                                        _dot_parts, _gather_effect, _replicate, _upstream_dims)


@dataclasses.dataclass(frozen=True, slots=True)
class Strategy:
  """Split parameter dimension ``dim`` over ``model`` (``None``: replicated)."""

  name: str
  dim: int | None = None


REPLICATED = Strategy("replicated")


# --- traffic -----------------------------------------------------------------------


class LinkLike(Protocol):
  """What traffic pricing reads of a link (:class:`hetspmd.hardware.devices.Link` is one): bytes/s and seconds
  per message."""

  @property
  def bandwidth(self) -> float: ...

  @property
  def latency(self) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Traffic:
  """Collectives over ``model`` in one microbatch: counts and total bytes (fixed + per example)."""

  all_reduces: float = 0.0
  all_reduce_bytes: LinearCost = LinearCost(0.0, 0.0)
  all_gathers: float = 0.0
  all_gather_bytes: LinearCost = LinearCost(0.0, 0.0)

  def __add__(self, other: "Traffic") -> "Traffic":
    add = lambda a, b: LinearCost(a.fixed + b.fixed, a.per_example + b.per_example)
    return Traffic(self.all_reduces + other.all_reduces, add(self.all_reduce_bytes, other.all_reduce_bytes),
                   self.all_gathers + other.all_gathers, add(self.all_gather_bytes, other.all_gather_bytes))

  def seconds(self, link: LinkLike, m: int, batch: float) -> float:
    if m < 2:
      return 0.0
    share = (m - 1) / m
    reduce = (2 * share * self.all_reduce_bytes.at(batch) / link.bandwidth
              + 2 * (m - 1) * link.latency * self.all_reduces)
    gather = share * self.all_gather_bytes.at(batch) / link.bandwidth + (m - 1) * link.latency * self.all_gathers
    return reduce + gather


NO_TRAFFIC = Traffic()


def _traffic(op: str, nbytes: LinearCost, count: float) -> Traffic:
  scaled = LinearCost(nbytes.fixed * count, nbytes.per_example * count)
  return Traffic(all_reduces=count, all_reduce_bytes=scaled) if op == "all-reduce" else Traffic(
      all_gathers=count, all_gather_bytes=scaled)


# --- the strategy space ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Option:
  """One strategy of one decision, costed over all its sites (repeats included)."""

  strategy: Strategy
  scaled: np.ndarray                      # node ids whose time divides by m
  traffic: Traffic
  splits: tuple[tuple[int, int], ...]     # (graph input index, dim) split over model
  split_elements: int                     # parameter elements those splits cover
  activation_share: float                 # share of intermediate bytes made sharded
  permute: bool                           # needs a collective-permute
  spreads_at: int | None = None           # first node where its sharded value joins another region's stream

  @property
  def spreads(self) -> bool:
    return self.spreads_at is not None


@dataclasses.dataclass(frozen=True)
class SplitChoice:
  """One choice the ILP makes: how a parameter (and every repeat of it) splits over ``model``, among its options."""

  name: str                    # path of the representative parameter
  options: tuple[Option, ...]  # options[0] is replicated
  sites: tuple[int, ...]       # site node ids, repeats included
  params: tuple[int, ...]      # graph inputs it decides for (one per repeat)


class Pair(NamedTuple):
  """A pair of options of two decisions that costs ``traffic`` (or is excluded: ``permute``)."""

  src: int           # option of the source decision
  dst: int           # option of the destination decision
  traffic: Traffic
  permute: bool = False


@dataclasses.dataclass(frozen=True)
class Resharding:
  """Costs between two decisions' options."""

  src: int
  dst: int
  pairs: tuple[Pair, ...]


@dataclasses.dataclass(frozen=True)
class StrategySpace:
  m: int
  decisions: tuple[SplitChoice, ...]
  reshardings: tuple[Resharding, ...]
  param_paths: dict[int, str]      # graph input index -> path inside the step's first argument
  param_elements: int              # all parameter elements


# --- site rules ------------------------------------------------------------------------


class SiteRule(NamedTuple):
  options: Callable[[Node, int, int], Strategy | None]      # (node, operand, operand dim) -> named option
  effect: Callable[[Node, int, int], SiteEffect | None]     # None: this split is not possible here


def _dot_option(node: Node, operand: int, dim: int) -> Strategy | None:
  contracting, batch, _, _ = _dot_parts(node, operand)
  name = "expert" if dim in batch else "row" if dim in contracting else "column"
  return Strategy(name, dim)


def _dot_effect(node: Node, operand: int, dim: int) -> SiteEffect | None:
  contracting, batch, free, offset = _dot_parts(node, operand)
  if dim in batch:  # a stack of weights applied batch-wise (experts): the other operand's matching rows
    other = 1 - operand
    k = batch.index(dim)
    return SiteEffect(k, False, (other, _dot_parts(node, other)[1][k]))
  if dim in contracting:
    other = 1 - operand
    other_contracting = _dot_parts(node, other)[0]
    return SiteEffect(None, True, (other, other_contracting[contracting.index(dim)]))
  return SiteEffect(offset + free.index(dim), False, None)


def _gather_option(node: Node, operand: int, dim: int) -> Strategy | None:
  effect = _gather_effect(node, operand, dim)
  if effect is None:
    return None
  return Strategy("vocab" if effect.partial else "column", dim)


# Primitives at which a parameter read is a decision. Default: not a site.
SITE_RULES: dict[str, SiteRule] = {
    "dot_general": SiteRule(_dot_option, _dot_effect),
    "gather": SiteRule(_gather_option, _gather_effect),
}


# --- building the space ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Region:
  """What a site's sharded output does downstream (one site, one output dimension)."""

  scaled: tuple[int, ...]
  traffic: Traffic
  arrivals: dict[tuple[int, int], int]     # (site, operand) -> sharded dim it arrives with
  followers: tuple[tuple[int, int], ...]   # (graph input, dim)
  permute: bool
  sharded_bytes: int
  spreads_at: int | None


class _Analysis:
  """Graph facts shared by every region walk (built once per space)."""

  def __init__(self, profile: StepProfile, m: int):
    small, large = profile.traces
    self.graph, self.large, self.m = small, large, m
    self.batches, self.per_step = profile.trace_batches, profile.per_step
    self.params = {i.index for i in small.inputs if i.role is Role.PARAM}
    self.param_views = _param_views(small, self.params)
    self.sites = {n.id: hit for n in small.nodes if not self.per_step[n.id]
                  for hit in [_site_param(n, self.param_views, self.params)] if hit is not None}
    self.owner = _owners(small, self.sites, self.per_step)
    self.owned: dict[int, list[int]] = {}
    for node in small.nodes:
      if self.owner[node.id] >= 0 and node.id not in self.sites:
        self.owned.setdefault(int(self.owner[node.id]), []).append(node.id)
    self.fed: dict[int, list[tuple[int, int, ValueRef]]] = {}
    for site in self.sites:
      for j, ref in enumerate(small.nodes[site].operands):
        if ref.source is Source.NODE and self.owner[ref.index] >= 0:
          self.fed.setdefault(int(self.owner[ref.index]), []).append((site, j, ref))
    self.intermediate_bytes = sum(n.outputs[0].nbytes * n.count for n in small.nodes
                                  if n.outputs and not self.per_step[n.id]) or 1

  def param_view(self, ref: ValueRef, rank: int) -> tuple[int, tuple[Dim, ...]] | None:
    if ref.source is Source.INPUT and ref.index in self.params:
      return ref.index, tuple(range(rank))
    return self.param_views.get((ref.index, ref.output)) if ref.source is Source.NODE else None

  def tensor_bytes(self, node: int, output: int = 0) -> LinearCost:
    small, large = self.graph.nodes[node].outputs[output].nbytes, self.large.nodes[node].outputs[output].nbytes
    return fit_linear(small, large, *self.batches)

  def region(self, site: int, dim: int) -> _Region:
    nodes = self.graph.nodes
    layout: dict[tuple[int, int], int] = {(site, 0): dim}
    scaled, followers = [], []
    traffic, permute, spreads_at, sharded_bytes = NO_TRAFFIC, False, None, 0
    for n in self.owned.get(site, ()):
      node = nodes[n]
      in_dims = [layout.get((r.index, r.output)) if r.source is Source.NODE else None for r in node.operands]
      if all(d is None for d in in_dims):
        continue
      flow = PROPAGATION_RULES.get(node.primitive, _replicate)(node, in_dims, self.m)
      for j in flow.gather:
        ref = node.operands[j]
        traffic += _traffic("all-gather", self.tensor_bytes(ref.index, ref.output), node.count)
      if flow.reduce:
        traffic += _traffic("all-reduce", self.tensor_bytes(n), node.count)
      permute |= flow.permute
      if any(d is not None for d in flow.out) or (flow.reduce and not flow.gather):
        scaled.append(n)
        sharded_bytes += node.outputs[0].nbytes * node.count
      for k, d in enumerate(flow.out):
        if d is not None:
          layout[(n, k)] = d
      if node.primitive in ELEMENTWISE and flow.out and flow.out[0] is not None:
        if node.module_path == nodes[site].module_path:
          followers += self._followers(node, in_dims, flow.out[0])
        if spreads_at is None and self._joins_stream(node, in_dims, flow.out[0], site):
          spreads_at = n
    arrivals = {(s, j): layout[(r.index, r.output)] for s, j, r in self.fed.get(site, ())
                if (r.index, r.output) in layout}
    return _Region(tuple(scaled), traffic, arrivals, tuple(followers), permute, sharded_bytes, spreads_at)

  def upstream_permutes(self, site: int, operand: int, dim: int) -> bool:
    """Whether sharding ``site``'s ``operand`` along ``dim`` reaches, upstream, a split along it.

    XLA propagates a sharding backwards too: an operand that must arrive
    sharded (a ``row`` split's activation) makes its producers sharded,
    through elementwise ops, views and activation ``dot_general`` s, up to
    the previous sites. A split, slice or concatenate along the sharded
    dimension on the way (GPT-2's fused query/key/value projection, split
    into heads) then needs a collective-permute.
    """
    nodes = self.graph.nodes
    todo = [(nodes[site].operands[operand], dim)]
    seen: set[tuple[int, int, int]] = set()
    while todo:
      ref, d = todo.pop()
      if ref.source is not Source.NODE or d is None or (ref.index, ref.output, d) in seen:
        continue
      seen.add((ref.index, ref.output, d))
      node = nodes[ref.index]
      if node.id in self.sites or self.per_step[node.id]:
        continue
      axes = _REARRANGED_AXES.get(node.primitive)
      if axes is not None:
        if d in axes(node):
          return True
        todo += [(r, d) for r, t in zip(node.operands, node.inputs) if len(t.shape) == len(node.outputs[0].shape)]
      else:
        todo += [(node.operands[j], dj) for j, dj in _upstream_dims(node, d, self.m)]
    return False

  def _joins_stream(self, node: Node, in_dims: Sequence[Dim], dim: int, site: int) -> bool:
    """Whether a sharded value is added to a whole one of the same shape from another region."""
    for j, ref in enumerate(node.operands):
      if (in_dims[j] is None and ref.source is Source.NODE and self.owner[ref.index] not in (-1, site)
          and node.inputs[j].shape == node.outputs[0].shape):
        return True
    return False

  def _followers(self, node: Node, in_dims: Sequence[Dim], dim: int) -> list[tuple[int, int]]:
    """Parameters added elementwise along the sharded dimension (biases) split with it."""
    out = []
    shape_out = node.outputs[0].shape
    for j, ref in enumerate(node.operands):
      shape = node.inputs[j].shape
      view = self.param_view(ref, len(shape))
      if in_dims[j] is None and view is not None and len(shape) == len(shape_out) and shape[dim] == shape_out[dim]:
        param, dims = view
        if dims[dim] is not None:
          out.append((param, dims[dim]))
    return out


def _param_views(graph: Graph, params: set[int]) -> dict[tuple[int, int], tuple[int, tuple[Dim, ...]]]:
  """(node, output) -> (parameter input, parameter dim of each view dim) for views of parameters."""
  views: dict[tuple[int, int], tuple[int, tuple[Dim, ...]]] = {}
  for node in graph.nodes:
    if node.primitive not in _VIEWS or len(node.operands) != 1:
      continue
    ref = node.operands[0]
    if ref.source is Source.INPUT and ref.index in params:
      source = (ref.index, tuple(range(len(node.inputs[0].shape))))
    elif ref.source is Source.NODE and (ref.index, ref.output) in views:
      source = views[(ref.index, ref.output)]
    else:
      continue
    mapped = _view_dims(node, source[1])
    if mapped is not None:
      views[(node.id, 0)] = (source[0], mapped)
  return views


def _view_dims(node: Node, dims: tuple[Dim, ...]) -> tuple[Dim, ...] | None:
  """Parameter dims of a view's output dims, given those of its input."""
  if node.primitive == "transpose":
    return tuple(dims[p] for p in node.param("permutation"))
  if node.primitive == "broadcast_in_dim":
    out: list[Dim] = [None] * len(node.outputs[0].shape)
    for k, d in enumerate(node.param("broadcast_dimensions")):
      out[d] = dims[k] if node.inputs[0].shape[k] == node.outputs[0].shape[d] else None
    return tuple(out)
  if node.primitive == "reshape":  # only size-1 dims added or removed
    in_shape, out_shape = node.inputs[0].shape, node.outputs[0].shape
    if [s for s in in_shape if s != 1] != [s for s in out_shape if s != 1]:
      return None
    real = iter(d for s, d in zip(in_shape, dims) if s != 1)
    return tuple(next(real) if s != 1 else None for s in out_shape)
  return dims


def _site_param(node: Node, views: dict, params: set[int]) -> tuple[int, int, tuple[Dim, ...]] | None:
  """(operand, parameter input, parameter dim of each operand dim) when ``node`` is a site."""
  if node.primitive not in SITE_RULES:
    return None
  for j, ref in enumerate(node.operands):
    if ref.source is Source.INPUT and ref.index in params:
      return j, ref.index, tuple(range(len(node.inputs[j].shape)))
    if ref.source is Source.NODE and (ref.index, ref.output) in views:
      param, dims = views[(ref.index, ref.output)]
      if sorted(d for d in dims if d is not None) == list(range(len(dims))):
        return j, param, dims
  return None


def _owners(graph: Graph, sites: dict, per_step: np.ndarray) -> np.ndarray:
  """The site whose region each node is in (-1: none); the latest site wins."""
  owner = np.full(len(graph.nodes), -1, dtype=np.int64)
  for node in graph.nodes:
    if node.id in sites:
      owner[node.id] = node.id
    elif not per_step[node.id]:
      best = -1
      for ref in node.operands:
        if ref.source is Source.NODE and owner[ref.index] > best:
          best = owner[ref.index]
      owner[node.id] = best
  return owner


def strategy_space(profile: StepProfile, m: int) -> StrategySpace:
  """Every decision, its options and the resharding costs between them, for ``m`` devices per group."""
  if not profile.traces:
    raise InvalidValueError("the profile keeps no traces; build it with hetspmd.passes.costing.step_cost.step_profile")
  analysis = _Analysis(profile, m)
  graph = analysis.graph
  keys = _decision_keys(analysis)
  order = sorted(set(keys.values()), key=lambda p: min(s for s, k in keys.items() if k == p))
  decision_of = {p: i for i, p in enumerate(order)}
  sizes = {i.index: i.type for i in graph.inputs}
  regions: dict[tuple[int, int], _Region] = {}

  def region(site: int, dim: int) -> _Region:
    if (site, dim) not in regions:
      regions[(site, dim)] = analysis.region(site, dim)
    return regions[(site, dim)]

  decisions, strategies_of = [], []
  for key in order:
    sites = sorted(s for s, k in keys.items() if k == key)
    strategies = _strategies(analysis, sites, sizes, m)
    strategies_of.append(strategies)
    options = tuple(_option(analysis, sites, t, region, sizes) for t in strategies)
    params = tuple(sorted({analysis.sites[s][1] for s in sites}))
    decisions.append(SplitChoice(graph.inputs[key].path, options, tuple(sites), params))
  reshardings = _reshardings(analysis, keys, decision_of, strategies_of, region)
  decisions = [_fold_self_pairs(d, i, reshardings) for i, d in enumerate(decisions)]
  reshardings += _stream_conflicts(analysis, decisions)
  paths = {i.index: i.path.split("/", 1)[-1] for i in graph.inputs if i.role is Role.PARAM}
  return StrategySpace(m, tuple(decisions), tuple(r for r in reshardings if r.src != r.dst), paths,
                       graph.elements_with_role(Role.PARAM))


def _decision_keys(analysis: _Analysis) -> dict[int, int]:
  """Site -> its decision: the parameter read at the same place of the layer it repeats.

  Sites that read one parameter (a tied embedding) share a decision too.
  """
  representative = _representatives(analysis.graph)
  keys: dict[int, int] = {}
  for site, (_, param, _) in analysis.sites.items():
    rep = representative.get(site, site)
    keys[site] = analysis.sites[rep][1] if rep in analysis.sites else param
  merged: dict[int, int] = {}   # parameter -> smallest key of any site reading it
  for site, key in keys.items():
    param = analysis.sites[site][1]
    merged[param] = min(merged.get(param, key), key, merged.get(key, key))
  return {site: merged.get(key, key) for site, key in keys.items()}


def _representatives(graph: Graph) -> dict[int, int]:
  """Node -> the node at the same place in the layer it repeats."""
  by_name = {layer.name: layer for layer in graph.layers}
  out = {}
  for layer in graph.layers:
    if layer.repeat_of is not None:
      out.update(zip(layer.node_ids, by_name[layer.repeat_of].node_ids))
  return out


def _effect(analysis: _Analysis, site: int, param_dim: int) -> SiteEffect | None:
  operand, _, dims = analysis.sites[site]
  node = analysis.graph.nodes[site]
  return SITE_RULES[node.primitive].effect(node, operand, dims.index(param_dim))


def _strategies(analysis: _Analysis, sites: Sequence[int], sizes: dict, m: int) -> tuple[Strategy, ...]:
  """Replicated, and every split of the parameter that each of its sites can take, named by the first site."""
  operand, param, dims = analysis.sites[sites[0]]
  node = analysis.graph.nodes[sites[0]]
  out = [REPLICATED]
  for param_dim, size in enumerate(sizes[param].shape):
    if param_dim not in dims:  # a stacked parameter's layer dimension: the site reads one layer of it
      continue
    named = None if size % m else SITE_RULES[node.primitive].options(node, operand, dims.index(param_dim))
    if named is not None and all(_splits_evenly(analysis, s, param_dim, m) for s in sites):
      out.append(named)
  return tuple(out)


def _splits_evenly(analysis: _Analysis, site: int, param_dim: int, m: int) -> bool:
  if param_dim not in analysis.sites[site][2]:
    return False
  effect = _effect(analysis, site, param_dim)
  return effect is not None and (effect.out is None or analysis.graph.nodes[site].outputs[0].shape[effect.out] % m == 0)


def _option(analysis: _Analysis, sites: Sequence[int], strategy: Strategy, region, sizes: dict) -> Option:
  if strategy.dim is None:
    return Option(strategy, np.zeros(0, np.int64), NO_TRAFFIC, (), 0, 0.0, False)
  scaled, splits = [], {}
  traffic, permute, spreads_at, sharded = NO_TRAFFIC, False, None, 0
  for site in sites:
    node = analysis.graph.nodes[site]
    param = analysis.sites[site][1]
    splits.setdefault(param, strategy.dim)
    effect = _effect(analysis, site, strategy.dim)
    scaled.append(site)
    if effect.need is not None:
      permute |= analysis.upstream_permutes(site, *effect.need)
    if effect.partial:
      traffic += _traffic("all-reduce", analysis.tensor_bytes(site), node.count)
    if effect.out is not None:
      r = region(site, effect.out)
      scaled += r.scaled
      traffic += r.traffic
      permute |= r.permute
      if r.spreads_at is not None:
        spreads_at = r.spreads_at if spreads_at is None else min(spreads_at, r.spreads_at)
      sharded += r.sharded_bytes + node.outputs[0].nbytes * node.count
      for p, d in r.followers:
        splits.setdefault(p, d)
  elements = sum(sizes[p].size for p in splits)
  return Option(strategy, np.array(sorted(set(scaled)), np.int64), traffic, tuple(sorted(splits.items())), elements,
                sharded / analysis.intermediate_bytes, permute, spreads_at)


def _reshardings(analysis: _Analysis, keys: dict, decision_of: dict, strategies_of: list, region
                 ) -> list[Resharding]:
  pairs: dict[tuple[int, int], dict[tuple[int, int], Traffic]] = {}
  for site, key in keys.items():
    src = decision_of[key]
    for s, strategy in enumerate(strategies_of[src]):
      if strategy.dim is None:
        continue
      effect = _effect(analysis, site, strategy.dim)
      if effect.out is None:
        continue
      for (dst_site, operand), arrived in region(site, effect.out).arrivals.items():
        dst = decision_of[keys[dst_site]]
        node = analysis.graph.nodes[dst_site]
        ref = node.operands[operand]
        moved = _traffic("all-gather", analysis.tensor_bytes(ref.index, ref.output), node.count)
        for t, wanted in enumerate(strategies_of[dst]):
          need = None if wanted.dim is None else _effect(analysis, dst_site, wanted.dim).need
          if need != (operand, arrived):
            table = pairs.setdefault((src, dst), {})
            table[(s, t)] = table.get((s, t), NO_TRAFFIC) + moved
  return [Resharding(src, dst, tuple(Pair(s, t, tr) for (s, t), tr in sorted(table.items())))
          for (src, dst), table in sorted(pairs.items())]


def _stream_conflicts(analysis: _Analysis, decisions: Sequence[SplitChoice]) -> list[Resharding]:
  """Options that spread a feature sharding along a stream, against splits that meet it by an all-to-all.

  A sharded value added into another region's stream (a residual) lets
  XLA's propagation shard that stream by features, in both passes. Two
  kinds of split then meet it only through an all-to-all, a
  collective-permute-like exchange that forces lockstep:

  * a lookup feeding the stream gets its table gradient scattered
    feature-sharded, against a table split along its indexed (vocabulary)
    dimension;
  * the tokens an MoE block dispatches from the stream (or, in the backward
    pass, the cotangents its combine reads) reach its experts
    feature-sharded, against an ``expert`` split, which needs them sharded
    by expert (seen on BERT-MoE). Only a stream sharded before the experts'
    last site in program order reaches them: a split that first joins the
    stream in the backward pass of an earlier layer (an MLP's ``row``, a
    query's ``row``) comes after every expert site and is free to pair with
    them, as are other expert splits (the combine contracts the expert
    dimension).
  """
  victims: dict[int, list[int]] = {}
  for d, decision in enumerate(decisions):
    for o, option in enumerate(decision.options):
      if option.strategy.dim is not None and (option.strategy.name == "expert" or any(
          analysis.graph.nodes[s].primitive == "gather" and _effect(analysis, s, option.strategy.dim).partial
          for s in decision.sites)):
        victims.setdefault(d, []).append(o)
  out = []
  for u, decision in enumerate(decisions):
    for v, options in victims.items():
      if v == u:
        continue
      last_expert_site = max(decisions[v].sites)
      pairs = tuple(Pair(s, t, NO_TRAFFIC, True) for s, spreader in enumerate(decision.options) if spreader.spreads
                    for t in options if decisions[v].options[t].strategy.name != "expert" or (
                        spreader.strategy.name != "expert" and spreader.spreads_at < last_expert_site))
      if pairs:
        out.append(Resharding(u, v, pairs))
  return out


def _fold_self_pairs(decision: SplitChoice, index: int, reshardings: Sequence[Resharding]) -> SplitChoice:
  """A decision resharding into itself pays only when an option meets itself."""
  extra: dict[int, Traffic] = {}
  for r in reshardings:
    if r.src == index and r.dst == index:
      for pair in r.pairs:
        if pair.src == pair.dst:
          extra[pair.src] = extra.get(pair.src, NO_TRAFFIC) + pair.traffic
  if not extra:
    return decision
  options = tuple(dataclasses.replace(o, traffic=o.traffic + extra[i]) if i in extra else o
                  for i, o in enumerate(decision.options))
  return dataclasses.replace(decision, options=options)
