"""Static arguments: a step ``jax.jit``-ed (or ``nnx.jit``-ed) with ``static_argnums`` / ``static_argnames``, or
given Python settings, runs unchanged under ``parallelize``. Static values are bound into the programs as
hashable Python values (a new one builds programs of its own, as ``jax.jit`` recompiles); a Python float that
changes every step stays traced (no new program, no compile); an unjitted step's int that sets a layer's width is
bound static on its own. Each runs under ``plan="auto"`` (an uneven data split on a mixed pool), ``plan="search"``
and a group plan, and is checked against one device."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import hetspmd as hs
from hetspmd.plan.groups import group_plan
from hetspmd.runtime.binding import Static, StaticArgs

from conftest import require_devices
from exactness import NnxReference, Reference, assert_exact

GLOBAL_BATCH = 22
STEPS = 2
PLANS = ["auto", "search", "groups"]
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class Net(nn.Module):
  width: int = 8

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Dropout(0.25, deterministic=not train)(nn.gelu(nn.Dense(self.width)(x)))
    return nn.Dense(4)(x)


def _state(width=8):
  model = Net(width)
  params = model.init(jax.random.key(0), jnp.zeros((1, 6)), train=False)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=1e-4))
  return state.replace(step=jnp.zeros((), jnp.int32))  # one type at every step: one trace per static value


def _copy(state):
  """``state`` with fresh buffers (the step donates the ones it is given)."""
  return jax.tree.map(jnp.copy, state)


def _batches(seed=0, steps=STEPS):
  rs = np.random.RandomState(seed)
  return [{"x": rs.randn(GLOBAL_BATCH, 6).astype(np.float32),
           "y": rs.randint(0, 4, GLOBAL_BATCH).astype(np.int32)} for _ in range(steps)]


def _parallel(step_fn, plan, **options):
  """``step_fn`` under ``plan``: ``"auto"`` and ``"search"`` on a mixed emulated pool, ``"groups"`` a given group
  plan of two groups with their own microbatch sizes."""
  require_devices(8)
  if plan == "groups":
    plan = group_plan([((0, 1, 2, 3), 4, (1, 1, 1, 1)), ((4, 5, 6, 7), 2, (1, 1, 1, 0))], GLOBAL_BATCH)
    return hs.parallelize(step_fn, plan=plan, global_batch=GLOBAL_BATCH, **options)
  pool = hs.Cluster.emulate(jax.devices()[:8], kinds=["V100-32GB"] * 3 + ["P100-16GB"] * 5)
  return hs.parallelize(step_fn, cluster=pool, plan=plan, global_batch=GLOBAL_BATCH, **options)


def _check_plan(step, plan):
  """The step ran under the plan asked for: a group plan's groups, or (``"auto"``) a data split of unequal
  shares."""
  if plan == "groups":
    assert step.grouped
  if plan == "auto":
    assert not step.grouped and len(set(step.plan.examples_per_position())) > 1


def _programs(step) -> int:
  """How many argument structures the step has built programs for."""
  return step._runner.program_count


def classify_step(state, batch, train, num_classes):
  """A Linen step with a ``train`` flag (dropout on or off) and a class count (a one-hot's width): both must be
  Python values."""
  key = jax.random.fold_in(jax.random.key(7), state.step)

  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=train, rngs={"dropout": key})
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(batch["y"], num_classes)).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


JITTED = {"static_argnums": jax.jit(classify_step, static_argnums=(2, 3)),
          "static_argnames": functools.partial(jax.jit, static_argnames=("train", "num_classes"))(classify_step)}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("given", list(JITTED))
def test_a_jitted_step_takes_its_static_arguments_as_python_values(given, plan):
  """``jax.jit(step, static_argnums=...)`` or ``static_argnames=...``, called with a Python bool and int: exact
  against one device; a new ``train`` value builds programs of its own and stays exact, and the first value
  runs its programs again without building more."""
  batches, built, initial = _batches(), [], _state()
  step = _parallel(JITTED[given], plan)
  for train in (True, False, True):
    ref = Reference(functools.partial(classify_step, train=train, num_classes=4), _copy(initial)).run(batches)
    state = _copy(initial)  # the same optimizer functions: only the static value tells the calls apart
    for i, batch in enumerate(batches):
      state, metrics = (step(state, batch, train, 4) if given == "static_argnums" else
                        step(state, batch, train=train, num_classes=4))
      ref.check_metrics(metrics, i)
    ref.check(state.params, lambda s: s.params)
    built.append(_programs(step))
  _check_plan(step, plan)
  assert built == [1, 2, 2]  # one per train value
  if not step.grouped:  # a call's program, lowered: the one its static values built
    args, kwargs = ((False, 4), {}) if given == "static_argnums" else ((), {"train": False, "num_classes": 4})
    assert step.lower(_copy(initial), batches[0], *args, **kwargs).as_text() and _programs(step) == 2
  assert "bound static" not in step.explain()  # declared, not found


def width_step(state, batch, width):
  """An unjitted step whose int argument sets a layer's width, as ``nn.Dense(self.latents)``."""
  def loss_fn(params):
    logits = Net(width).apply({"params": params}, batch["x"], train=False)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


@pytest.mark.parametrize("plan", PLANS)
def test_an_unjitted_steps_int_that_sets_a_width_is_bound_static(plan):
  """The int reaches ``nn.Dense`` as a Python value: bound static on the first call's failed trace, exact
  against one device, and ``explain()`` says so."""
  batches = _batches(1)
  ref = Reference(functools.partial(width_step, width=8), _state()).run(batches)
  step = _parallel(width_step, plan)
  state = _state()
  for i, batch in enumerate(batches):
    state, metrics = step(state, batch, 8)
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  _check_plan(step, plan)
  assert step.static.inferred == (2,) and _programs(step) == 1
  assert "argument 2 ('width'), a Python value the step uses as a shape or a branch, is bound static" in (
      step.explain())


def scaled_step(state, batch, scale):
  """A step given a Python float every step (a loss scale, a learning rate from the host)."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"], train=False)
    return scale * optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss}


@pytest.mark.parametrize("plan", PLANS)
def test_a_python_float_with_a_new_value_every_step_is_traced(plan):
  """A float given anew each step runs the programs built for the first: one argument structure, and no XLA
  compilation after the first step; each step exact against one device."""
  batches, scales = _batches(2, steps=3), (0.5, 0.75, 1.25)
  ref = Reference(scaled_step, _state())
  step = _parallel(scaled_step, plan)
  state = step.shard_state(_state()) if plan != "search" else _state()  # the search traces the first call
  compiles, built = [], []
  for i, (batch, scale) in enumerate(zip(batches, scales)):
    ref.step(batch, scale)
    seen = []

    def count(event, duration, **kwargs):
      seen.append(event == _COMPILE_EVENT)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
      state, metrics = step(state, batch, scale)
    finally:
      jax.monitoring.unregister_event_duration_listener(count)
    compiles.append(sum(seen))
    built.append(_programs(step))
    ref.check_metrics(metrics, i)
  ref.check(state.params, lambda s: s.params)
  _check_plan(step, plan)
  # compiled on the first step (which the count sees), and, where that step's state was not placed yet (the
  # search's), once more for the placed state; never for a new float
  placed = 1 if plan != "search" else 2
  assert compiles[0] > 0 and compiles[placed:] == [0] * (len(scales) - placed), compiles
  assert built == [1, 1, 1] and not step.static.inferred


class NnxNet:
  """Built lazily: ``flax.nnx`` is imported inside the tests."""

  @staticmethod
  def objects():
    from flax import nnx

    class Model(nnx.Module):
      def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.25)
        self.out = nnx.Linear(16, 4, rngs=rngs)

      def __call__(self, x, train, key):
        return self.out(self.drop(nnx.gelu(self.hidden(x)), deterministic=not train, rngs=key))

    model = Model(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-4), wrt=nnx.Param)


def nnx_step(model, optimizer, batch, train):
  """An NNX step in place whose ``train`` flag switches dropout."""
  from flax import nnx

  key = jax.random.fold_in(jax.random.key(7), optimizer.step[...])

  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"], train, key), batch["y"]).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return {"loss": loss}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("jitted", [True, False], ids=["nnx.jit", "unjitted"])
def test_an_nnx_step_with_a_bool_flag_that_switches_dropout(jitted, plan):
  """``nnx.jit(step, static_argnames="train")``, or the step unjitted (its flag found to be needed as a Python
  value): dropout on, then off, each exact against one device in place, each value its own programs."""
  from flax import nnx

  batches = _batches(3)
  step = _parallel(nnx.jit(nnx_step, static_argnames="train") if jitted else nnx_step, plan)
  for train in (True, False):
    ref = NnxReference(functools.partial(nnx_step, train=train), NnxNet.objects()).run(batches)
    model, optimizer = NnxNet.objects()
    for batch in batches:
      step(model, optimizer, batch, train=train)
    assert_exact(nnx.state(model, nnx.Param), nnx.state(ref.single[0], nnx.Param),
                 nnx.state(ref.ref64[0], nnx.Param), what=f"params (train={train})")
  _check_plan(step, plan)
  assert _programs(step) == 2
  assert step.static.inferred == (() if jitted else ("train",))


@pytest.mark.parametrize("plan", PLANS)
def test_an_unhashable_static_argument_is_refused_by_name(plan):
  """A list given as a static argument: a HetSpmdError naming it and the fix, before anything is traced."""
  step = _parallel(jax.jit(classify_step, static_argnames=("train", "num_classes")), plan)
  with pytest.raises(hs.HetSpmdError, match=r"static argument 3 \('num_classes'\) is a list, which is not "
                                            r"hashable.*a tuple for a list"):
    step(_state(), _batches()[0], True, [4])


@pytest.mark.parametrize("plan", PLANS)
def test_a_jitted_steps_traced_int_that_needs_a_value_is_named(plan):
  """A jitted step whose int is not among its static arguments fails under ``jax.jit`` alone; here it is a
  TraceError (a HetSpmdError) naming the argument and where to declare it, under every plan, never a raw
  JAX error."""
  step = _parallel(jax.jit(classify_step, static_argnames="train"), plan)
  with pytest.raises(hs.TraceError, match=r"argument 3 \('num_classes'\) = 4\. To bind an argument as a hashable "
                                          r"Python value, name the argument it comes from in the step's jax.jit"):
    step(_state(), _batches()[0], True, 4)
  assert step.static.inferred == ()


def test_static_arguments_resolve_by_position_and_name():
  """Positions and names resolve against the signature, as ``jax.jit`` resolves them; a jitted step's own are
  read from it; positions given to ``parallelize`` count after ``nnx.cached_partial``'s objects; static values
  are keys by type and value."""
  own = StaticArgs.of(JITTED["static_argnames"], None, None, 0)
  assert own.jitted and own.argnums == {2, 3} and own.argnames == {"train", "num_classes"}
  given = StaticArgs.of(classify_step, 1, "num_classes", 1)
  assert not given.jitted and given.argnums == {2, 3} and given.argnames == {"train", "num_classes"}
  args, kwargs = given.mark(("s", "b", True), {"num_classes": 4})
  assert args[2] == Static(True, "") and kwargs["num_classes"] == Static(4, "") != Static(4.0, "")
  assert args[:2] == ("s", "b") and given.scalars(("s", 3, True), {"k": 1}) == [1, "k"]
  with pytest.raises(hs.InvalidValueError, match="static_argnums"):
    StaticArgs.of(classify_step, "train", None, 0)
