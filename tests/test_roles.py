"""Roles of step inputs: explicit maps, inference for NNX and Linen states."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import linen, nnx
from flax.training import train_state

import hetspmd
from hetspmd import Role, models


def _roles(graph):
  return {i.path: i.role for i in graph.inputs}


@pytest.mark.parametrize("key", ["opt_state", "opt", "optimizer_state", "optim_state"])
def test_optimizer_state_under_its_common_names(key):
  from hetspmd.passes.frontend.roles import Leaf, infer_role

  assert infer_role(Leaf(("state", key, "0", "mu", "params", "w"), 0, "float32", None), 2) is Role.OPT_STATE
  assert infer_role(Leaf(("state", key, "0", "count"), 0, "int32", None), 2) is Role.OPT_STATE
  assert infer_role(Leaf(("state", "params", "w"), 0, "float32", None), 2) is Role.PARAM
  assert infer_role(Leaf(("state", "options", "w"), 0, "float32", None), 2) is Role.PARAM  # whole components only


def test_zoo_state_roles_are_inferred():
  workload = models.get("mlp-tiny")
  graph = hetspmd.trace(workload.make_train_step(), workload.abstract_state(), workload.example_batch())
  roles = _roles(graph)
  assert roles["state/params/layers/0/kernel"] is Role.PARAM
  assert roles["state/opt_state/0/mu/layers/0/kernel"] is Role.OPT_STATE
  assert roles["state/opt_state/0/count"] is Role.OPT_STATE
  assert roles["state/step"] is Role.OTHER
  assert roles["batch/inputs"] is Role.BATCH and roles["batch/labels"] is Role.BATCH
  assert graph.elements_with_role(Role.PARAM) == workload.param_count()
  assert graph.elements_with_role(Role.OPT_STATE) == 2 * workload.param_count() + 1


def test_linen_train_state_roles_are_inferred():
  model = linen.Dense(4)
  params = model.init(jax.random.key(0), jnp.ones((1, 3)))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1, momentum=0.9))

  def train_step(state, batch):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  graph = hetspmd.trace(train_step, state, {"x": jnp.ones((2, 3)), "y": jnp.ones((2, 4))})
  roles = _roles(graph)
  assert roles["state/params/kernel"] is Role.PARAM
  assert roles["state/opt_state/0/trace/kernel"] is Role.OPT_STATE
  assert roles["state/step"] is Role.OTHER
  assert roles["batch/x"] is Role.BATCH


def test_linen_batch_stats_as_plain_arrays_are_not_parameters():
  model = linen.BatchNorm(use_running_average=False)
  variables = model.init(jax.random.key(0), jnp.ones((4, 3)))
  state = {"params": variables["params"], "batch_stats": variables["batch_stats"]}

  def train_step(state, batch):
    out, updates = model.apply({"params": state["params"], "batch_stats": state["batch_stats"]}, batch,
                               mutable=["batch_stats"])
    return {"params": state["params"], "batch_stats": updates["batch_stats"]}, jnp.mean(out)

  roles = _roles(hetspmd.trace(train_step, state, jnp.ones((4, 3))))
  assert roles["state/params/scale"] is Role.PARAM
  assert roles["state/batch_stats/mean"] is Role.OTHER and roles["state/batch_stats/var"] is Role.OTHER


def test_nnx_optimizer_state_roles_are_inferred():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, x):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  roles = _roles(hetspmd.trace(train_step, state, jnp.ones((4, 3))))
  assert roles["state/0/kernel"] is Role.PARAM
  assert roles["state/1/opt_state/0/mu/kernel"] is Role.OPT_STATE
  assert roles["state/1/step"] is Role.OTHER
  assert roles["x"] is Role.BATCH


def test_rng_keys_are_recognised():
  fn = lambda params, batch, rng: params["w"] * jax.random.normal(rng, (3,)) + batch
  graph = hetspmd.trace(fn, {"w": jnp.ones(3)}, jnp.ones(3), jax.random.key(0))
  assert _roles(graph)["rng"] is Role.RNG


ROLE_CASES = [
    # (roles=, path, expected role)
    ({0: "batch"}, "a/w", Role.BATCH),
    ({"a": "opt_state"}, "a/w", Role.OPT_STATE),
    ({0: "batch", "a/w": "rng"}, "a/w", Role.RNG),  # a longer prefix beats an index
    ({0: "batch", "a/w": "rng"}, "a/v", Role.BATCH),
    ({1: Role.PARAM}, "b", Role.PARAM),
    ({"a.v": "other"}, "a/v", Role.OTHER),  # dots separate components too
]


@pytest.mark.parametrize("roles,path,expected", ROLE_CASES)
def test_explicit_roles(roles, path, expected):
  graph = hetspmd.trace(lambda a, b: a["w"] + a["v"] + b, {"w": jnp.ones(2), "v": jnp.ones(2)}, jnp.ones(2),
                        roles=roles)
  assert _roles(graph)[path] is expected


def test_bad_role_name_lists_valid_roles():
  with pytest.raises(hetspmd.InvalidValueError, match="valid roles are param, opt_state, batch, rng, other"):
    hetspmd.trace(lambda a: a * 2, jnp.ones(2), roles={0: "weights"})


def test_role_key_matching_nothing_is_refused():
  with pytest.raises(hetspmd.InvalidValueError, match="matches no input.*a/w"):
    hetspmd.trace(lambda a: a["w"] * 2, {"w": jnp.ones(2)}, roles={"state/params": "param"})
