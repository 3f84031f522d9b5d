"""The :class:`Workload` interface shared by every model in the zoo.

A workload bundles what hetspmd needs to plan and run a model: how to build
it (Flax NNX), its loss, its batch layout, its optimizer, and a ready
single-device ``train_step(state, batch) -> (state, metrics)``.

The train state is a plain dict, the layout ``hetspmd.trace`` infers roles
for without help::

    {"params": nnx.State,      # the model's nnx.Param variables
     "opt_state": optax state, # over the same tree
     "step": int32 scalar}

``abstract_state()`` builds it with ``nnx.eval_shape`` (``ShapeDtypeStruct``
leaves, no memory), so even the largest configs can be traced on a laptop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetspmd.errors import InvalidValueError

Batch = Mapping[str, Any]
LossFn = Callable[[nnx.Module, Batch], tuple[jax.Array, Mapping[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class Workload:
  """A model, its loss, its batch layout and its optimizer.

  Attributes:
    name: registry name, e.g. ``gpt2-small``.
    family: model family, e.g. ``gpt2``.
    config: the model's frozen config dataclass.
    build: ``build(config, rngs) -> nnx.Module``.
    loss: ``loss(model, batch) -> (scalar loss, aux metrics)``.
    batch_spec: ``batch_spec(config, batch, seq) -> {name: ShapeDtypeStruct}``.
    make_optimizer: ``() -> optax.GradientTransformation``.
    default_batch, default_seq: sizes used when none are given (``seq`` is
      ``None`` for models without a sequence axis).
    published_params: the parameter count published for this config, if any.
    source: where the config comes from (paper or model card).
    test_size: True for the small configs that tests compile and run.
    synthetic: optional ``synthetic(config, rng, specs) -> {name: ndarray}``
      for batches whose entries need more than the default rule (integers
      below ``vocab_size`` / ``num_classes``, floats from a normal), e.g. a
      0/1 token mask.
  """

  name: str
  family: str
  config: Any
  build: Callable[[Any, nnx.Rngs], nnx.Module]
  loss: LossFn
  batch_spec: Callable[[Any, int, int | None], dict[str, jax.ShapeDtypeStruct]]
  make_optimizer: Callable[[], optax.GradientTransformation] = lambda: optax.adam(1e-3)
  default_batch: int = 8
  default_seq: int | None = None
  max_seq: int | None = None
  published_params: int | None = None
  source: str = ""
  test_size: bool = False
  synthetic: Callable[[Any, np.random.Generator, dict[str, jax.ShapeDtypeStruct]], dict[str, np.ndarray]] | None = None

  # --- state -----------------------------------------------------------------

  def init_state(self, seed: int = 0) -> dict[str, Any]:
    """A concrete train state (allocates the weights)."""
    model = self.build(self.config, nnx.Rngs(seed))
    return self._state_from_params(nnx.state(model, nnx.Param))

  def _state_from_params(self, params: nnx.State) -> dict[str, Any]:
    return {"params": params, "opt_state": self.make_optimizer().init(params), "step": jnp.zeros((), jnp.int32)}

  def abstract_state(self) -> dict[str, Any]:
    """The train state as ``ShapeDtypeStruct``s; allocates nothing."""
    _, params = _abstract_model(self)
    return jax.eval_shape(self._state_from_params, params)

  def graphdef(self) -> nnx.GraphDef:
    return _abstract_model(self)[0]

  def param_count(self) -> int:
    _, params = _abstract_model(self)
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))

  def with_dtype(self, dtype: str) -> "Workload":
    """This workload computing in ``dtype`` (float32 parameters and optimizer state either way)."""
    if dtype == getattr(self.config, "dtype", "float32"):
      return self
    if dtype not in ("float32", "bfloat16", "float16"):
      raise InvalidValueError(f"{self.name}: dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not any(f.name == "dtype" for f in dataclasses.fields(self.config)):
      raise InvalidValueError(f"{self.name} computes in float32 only; the transformer families (gpt2, gpt3, bert, "
                              f"bert-moe, linen-lm) take a compute dtype")
    return dataclasses.replace(self, name=f"{self.name}-{dtype}", config=dataclasses.replace(self.config, dtype=dtype))

  # --- batches ---------------------------------------------------------------

  def example_batch(self, batch: int | None = None, seq: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    """The batch layout as ``ShapeDtypeStruct``s, sizes checked."""
    batch = self.default_batch if batch is None else batch
    seq = self.default_seq if seq is None else seq
    if not isinstance(batch, int) or batch < 1:
      raise InvalidValueError(f"{self.name}: batch must be a positive integer, got {batch!r}")
    if self.default_seq is None and seq is not None:
      raise InvalidValueError(f"{self.name} has no sequence axis; do not pass a sequence length (got {seq})")
    if self.default_seq is not None:
      if not isinstance(seq, int) or seq < 1:
        raise InvalidValueError(f"{self.name}: sequence length must be a positive integer, got {seq!r}")
      if self.max_seq is not None and seq > self.max_seq:
        raise InvalidValueError(f"{self.name}: sequence length {seq} exceeds the model's context of {self.max_seq}")
    return self.batch_spec(self.config, batch, seq)

  def synthetic_batch(self, seed: int = 0, batch: int | None = None, seq: int | None = None) -> dict[str, np.ndarray]:
    """Random host data with the layout of :meth:`example_batch`."""
    rng = np.random.default_rng(seed)
    specs = self.example_batch(batch, seq)
    if self.synthetic is not None:
      return self.synthetic(self.config, rng, specs)
    out = {}
    for key, spec in specs.items():
      if np.issubdtype(spec.dtype, np.integer):
        high = _integer_high(self.config, key)
        out[key] = rng.integers(0, high, size=spec.shape, dtype=spec.dtype)
      else:
        out[key] = rng.standard_normal(spec.shape).astype(spec.dtype)
    return out

  # --- the step --------------------------------------------------------------

  def binder(self) -> Callable[[Any], Any]:
    """``bind(params) -> model``: what ``loss`` receives for a given parameter tree."""
    graphdef = self.graphdef()
    return lambda params: nnx.merge(graphdef, params)

  def make_train_step(self, value_and_grad: Callable[..., Any] = jax.value_and_grad
                      ) -> Callable[[dict[str, Any], Batch], tuple[dict[str, Any], dict[str, jax.Array]]]:
    """The single-device ``train_step(state, batch) -> (state, metrics)``.

    ``hetspmd.parallelize`` runs it as it is; ``value_and_grad=hetspmd.value_and_grad``
    gives the same step (the same values) with the loss checkpointed under a
    plan's remat policy.
    """
    bind = self.binder()
    tx = self.make_optimizer()
    loss = self.loss

    def train_step(state, batch):
      def loss_fn(params, batch):
        return loss(bind(params), batch)

      (value, aux), grads = value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      new_state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
      return new_state, {"loss": value, **aux}

    train_step.__name__ = f"{self.name.replace('-', '_')}_train_step"
    return train_step


def abstract_rngs(seed: int = 0) -> nnx.Rngs:
  """``nnx.Rngs(seed)`` whose stream counters are NumPy, for building under ``eval_shape``.

  Each draw from an ``nnx.Rngs`` increments a counter variable. Under
  ``eval_shape`` the new count is a tracer, and Flax compares its
  ``.sharding`` with the old one; a tracer's ``.sharding`` raises an error
  whose message JAX builds from every equation traced so far, so building a
  model costs time quadratic in its size (GPT-2 large: 8 s). With NumPy
  counters the count stays concrete and the build is linear (1 s); the keys
  drawn, and so the initial values, are the same.
  """
  rngs = nnx.Rngs(seed)
  for stream in vars(rngs).values():
    if isinstance(stream, nnx.RngStream):
      stream.count.set_raw_value(np.zeros(stream.count.shape, np.uint32).view(_CopiedOnRead))
  return rngs


class _CopiedOnRead(np.ndarray):
  """A NumPy counter whose reads are copies.

  An ``RngStream`` draw reads its counter, hands the value to ``fold_in``,
  then increments the counter in place. JAX may read a NumPy argument
  without copying it, after the call has returned (dispatch is
  asynchronous), so with a plain array an eager draw could fold in the
  incremented count.
  """

  def __getitem__(self, index):
    return np.array(np.asarray(self)[index])


@functools.cache
def _abstract_model(workload: Workload) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and abstract parameters, built once per workload."""
  model = nnx.eval_shape(lambda: workload.build(workload.config, abstract_rngs(0)))
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, params


def _integer_high(config: Any, key: str) -> int:
  """Exclusive upper bound for synthetic integer inputs named ``key``."""
  for attr in ("vocab_size", "num_classes"):
    if hasattr(config, attr) and key in ("inputs", "targets", "tokens", "labels"):
      return int(getattr(config, attr))
  return 2
