"""A GPT-2-style decoder LM in Flax Linen, annotated with logical axis names.

Written the way MaxText and t5x users write Linen models: every parameter is
created through ``nn.with_logical_partitioning(init, names)`` and activations
pass through ``nn.with_logical_constraint(x, names)``. The logical names and
what they mean:

=========  ====================================  ==========================
name       axis                                  ``LOGICAL_AXIS_RULES``
=========  ====================================  ==========================
``batch``  examples                              ``data``
``length`` sequence positions                    unsharded
``embed``  model width ``d_model``               unsharded
``mlp``    MLP hidden width ``4 * d_model``      ``model``
``heads``  attention heads                       ``model``
``kv``     width of one head                     unsharded
``vocab``  vocabulary                            ``model``
=========  ====================================  ==========================

Constraints act only where both logical rules
(``nn.logical_axis_rules(...)``) and a mesh (``jax.set_mesh(...)``) are in
effect; outside them ``nn.with_logical_constraint`` returns its input, so the
step traces and runs under plain ``jax.jit`` (no ``sharding_constraint`` in
its jaxpr).

Architecture: GPT-2 (Radford et al., 2019), as ``hetspmd.models.gpt2`` but
with separate query / key / value projections to ``(heads, kv)``
(:class:`Einsum`, MaxText's ``DenseGeneral`` layout) in place of the fused
``c_attn``:
learned position embeddings, pre-LayerNorm blocks (epsilon 1e-5), GELU (tanh
form) 4x MLP, output projection tied to the token embedding. Weights are drawn
from a normal of std 0.02, biases are zero. The parameter count equals
GPT-2's: ``linen-lm-350m`` is GPT-2 medium's shape (24 layers, width 1024, 16
heads, context 1024, vocabulary 50257) and holds 354,823,168 parameters, the
released GPT-2 medium checkpoint's count.

The train state of :class:`LinenWorkload` holds unboxed arrays (what users
pass to ``jax.jit``); the logical names live beside it, in
:meth:`LinenWorkload.logical_specs` and :meth:`LinenWorkload.mesh_specs`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import PartitionSpec

from hetspmd.errors import InvalidValueError
from hetspmd.models.gpt2 import GPT2Config, lm_batch_spec, lm_loss
from hetspmd.models.workload import Workload

LogicalRules = tuple[tuple[str, str | None], ...]

LOGICAL_AXIS_RULES: LogicalRules = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("vocab", "model"),
)


def _weight(names: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.normal(0.02), names)


def _zeros(names: tuple[str | None, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _layer_norm(cfg: GPT2Config, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=1e-5, dtype=cfg.dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
                      bias_init=_zeros(("embed",)))


class Einsum(nn.Module):
  """``einsum(equation, x, kernel) + bias`` with logically named weights.

  MaxText's ``DenseGeneral``: the kernel is created at its full rank, so each
  of its axes carries a name. (``nn.DenseGeneral`` initialises a flattened 2-D
  kernel and reshapes it; under a mesh, unboxing the flat value applies the
  3-D names to a 2-D array and fails, even in ``apply``, where Flax re-runs
  the initialiser abstractly to check shapes.) The bias spans the kernel's
  trailing ``len(bias_axes)`` axes.
  """

  equation: str
  kernel_shape: tuple[int, ...]
  kernel_axes: tuple[str | None, ...]
  bias_axes: tuple[str | None, ...]
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    kernel = self.param("kernel", _weight(self.kernel_axes), self.kernel_shape, jnp.float32)
    bias_shape = self.kernel_shape[len(self.kernel_shape) - len(self.bias_axes):]
    bias = self.param("bias", _zeros(self.bias_axes), bias_shape, jnp.float32)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    return jnp.einsum(self.equation, x, kernel) + bias


class Attention(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    heads = ("batch", "length", "heads", "kv")

    def project(name):
      dense = Einsum("bld,dhk->blhk", (cfg.d_model, cfg.n_head, cfg.head_dim), ("embed", "heads", "kv"),
                     ("heads", "kv"), dtype=cfg.dtype, name=name)
      return nn.with_logical_constraint(dense(x), heads)

    q, k, v = project("query"), project("key"), project("value")
    s = x.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(cfg.head_dim).astype(x.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", probs, v), heads)
    out = Einsum("blhk,hkd->bld", (cfg.n_head, cfg.head_dim, cfg.d_model), ("heads", "kv", "embed"), ("embed",),
                 dtype=cfg.dtype, name="out")(out)
    return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class MLP(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.cfg
    h = nn.Dense(4 * cfg.d_model, dtype=cfg.dtype, name="c_fc",
                 kernel_init=_weight(("embed", "mlp")), bias_init=_zeros(("mlp",)))(x)
    h = nn.with_logical_constraint(jax.nn.gelu(h, approximate=True), ("batch", "length", "mlp"))
    out = nn.Dense(cfg.d_model, dtype=cfg.dtype, name="c_proj",
                   kernel_init=_weight(("mlp", "embed")), bias_init=_zeros(("embed",)))(h)
    return nn.with_logical_constraint(out, ("batch", "length", "embed"))


class Block(nn.Module):
  cfg: GPT2Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    with jax.named_scope("ln_1"):
      h = _layer_norm(self.cfg, "ln_1")(x)
    with jax.named_scope("attn"):
      x = x + Attention(self.cfg, name="attn")(h)
    with jax.named_scope("ln_2"):
      h = _layer_norm(self.cfg, "ln_2")(x)
    with jax.named_scope("mlp"):
      x = x + MLP(self.cfg, name="mlp")(h)
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class LinenLM(nn.Module):
  """Token ids ``(batch, length)`` to logits ``(batch, length, vocab)``."""

  cfg: GPT2Config

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    wte = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte", embedding_init=_weight(("vocab", "embed")))
    wpe = nn.Embed(cfg.n_ctx, cfg.d_model, dtype=cfg.dtype, name="wpe", embedding_init=_weight(("length", "embed")))
    with jax.named_scope("embed"):
      x = wte(tokens) + wpe(jnp.arange(tokens.shape[1])[None, :])
      x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    for i in range(cfg.n_layer):
      with jax.named_scope(f"h_{i}"):
        x = Block(cfg, name=f"h_{i}")(x)
    with jax.named_scope("ln_f"):
      x = _layer_norm(cfg, "ln_f")(x)
    with jax.named_scope("lm_head"):
      return nn.with_logical_constraint(wte.attend(x), ("batch", "length", "vocab"))


def _unbox(tree: Any) -> Any:
  """``tree`` with every ``nn.Partitioned`` box replaced by its value.

  Unlike ``nn.unbox`` this never applies a sharding constraint, so it works
  on ``ShapeDtypeStruct`` leaves whatever mesh is in effect.
  """
  return jax.tree.map(lambda x: x.value if isinstance(x, nn.Partitioned) else x, tree,
                      is_leaf=lambda x: isinstance(x, nn.Partitioned))


def _is_spec(x: Any) -> bool:
  return isinstance(x, PartitionSpec)


@dataclasses.dataclass(frozen=True)
class LinenWorkload(Workload):
  """A :class:`Workload` for a Flax Linen model with logical axis names.

  ``build(config)`` returns the Linen module (no ``rngs``), and ``loss`` is
  called with ``model = lambda tokens: module.apply({"params": params},
  tokens)``. The train state has the base layout with a Linen parameter
  tree, unboxed::

      {"params": {"wte": {"embedding": ...}, "h_0": {...}, ...},
       "opt_state": optax state, "step": int32 scalar}

  The logical names of the parameters come from :meth:`logical_specs`
  (a tree of ``PartitionSpec`` of logical names, the structure of
  ``state["params"]``); :meth:`mesh_specs` maps them to mesh axes under
  logical rules, and :meth:`state_mesh_specs` does so for the whole state
  (optimizer moments follow their parameter; counters are replicated).
  """

  def module(self) -> nn.Module:
    return self.build(self.config)

  # --- state -----------------------------------------------------------------

  def init_state(self, seed: int = 0) -> dict[str, Any]:
    params = jax.jit(lambda key: _unbox(self._boxed_params(key)))(jax.random.key(seed))
    return self._state_from_params(params)

  def abstract_state(self) -> dict[str, Any]:
    return jax.eval_shape(self._state_from_params, _unbox(_abstract_boxed_params(self)))

  def graphdef(self):
    raise InvalidValueError(f"{self.name} is a Flax Linen workload and has no NNX graph definition; "
                            f"use .module() and module.apply({{'params': params}}, tokens)")

  def param_count(self) -> int:
    leaves = jax.tree.leaves(_unbox(_abstract_boxed_params(self)))
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in leaves))

  def _boxed_params(self, key: jax.Array) -> dict[str, Any]:
    tokens = jnp.zeros((1, 1), jnp.int32)
    return self.module().init(key, tokens)["params"]

  # --- logical axis names ----------------------------------------------------

  def logical_specs(self) -> dict[str, Any]:
    """``PartitionSpec`` of logical names per parameter, shaped like ``state["params"]``."""
    return nn.get_partition_spec(_abstract_boxed_params(self))

  def mesh_specs(self, rules: LogicalRules = LOGICAL_AXIS_RULES) -> dict[str, Any]:
    """``PartitionSpec`` of mesh axes per parameter under ``rules``."""
    return _to_mesh(self.logical_specs(), rules)

  def state_mesh_specs(self, rules: LogicalRules = LOGICAL_AXIS_RULES) -> dict[str, Any]:
    """``PartitionSpec`` of mesh axes for every leaf of the train state."""
    boxed_state = jax.eval_shape(self._state_from_params, _abstract_boxed_params(self))
    return _to_mesh(nn.get_partition_spec(boxed_state), rules)

  # --- the step --------------------------------------------------------------

  def binder(self) -> Callable[[Any], Any]:
    """``bind(params)``: the module applied with ``params`` (what ``loss`` receives)."""
    module = self.module()
    return lambda params: functools.partial(module.apply, {"params": params})


@functools.cache
def _abstract_boxed_params(workload: LinenWorkload) -> dict[str, Any]:
  """Parameters as ``LogicallyPartitioned`` boxes of ``ShapeDtypeStruct``s."""
  return jax.eval_shape(workload._boxed_params, jax.random.key(0))


def _to_mesh(logical: Any, rules: LogicalRules) -> Any:
  return jax.tree.map(lambda spec: nn.logical_to_mesh_axes(spec, rules), logical, is_leaf=_is_spec)


CONFIGS = {
    # name: (config, published parameter count or None)
    "linen-lm-tiny": (GPT2Config(n_layer=2, n_head=4, d_model=64, vocab_size=512, n_ctx=128), None),
    "linen-lm-350m": (GPT2Config(n_layer=24, n_head=16, d_model=1024), 354_823_168),
}


def workloads() -> list[Workload]:
  out = []
  for name, (cfg, published) in CONFIGS.items():
    tiny = published is None
    out.append(LinenWorkload(
        name=name,
        family="linen-lm",
        config=cfg,
        build=LinenLM,
        loss=lm_loss,
        batch_spec=lm_batch_spec,
        make_optimizer=(lambda: optax.adam(1e-3)) if tiny else (lambda: optax.adam(3e-4)),
        default_batch=2 if tiny else 8,
        default_seq=32 if tiny else 1024,
        max_seq=cfg.n_ctx,
        published_params=published,
        source="test size" if tiny else "GPT-2 medium's shape (Radford et al., 2019); released checkpoint's count",
        test_size=tiny,
    ))
  return out
