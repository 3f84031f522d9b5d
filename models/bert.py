"""BERT (Devlin et al., 2019) and BERT-MoE in Flax NNX, trained on masked LM.

BERT: the post-LayerNorm encoder of the paper and its released checkpoints
(``bert-base-uncased``, ``bert-large-uncased``): word + position +
token-type embeddings followed by LayerNorm (epsilon 1e-12), blocks
``x = LN(x + attn(x)); x = LN(x + mlp(x))`` with exact (erf) GELU, weights
drawn from a normal of std 0.02 truncated at two std, zero biases. The
masked-LM head is BERT's: a dense transform, GELU, LayerNorm, then a decoder
tied to the word embeddings plus an output bias of vocabulary size.

The pooler and the next-sentence head are left out: the loss is masked LM
only, so they would be weights that no gradient reaches. What is counted
here is embeddings + encoder + masked-LM head (transform, LayerNorm, output
bias). The paper rounds to 110M (base) and 340M (large); the released
checkpoints (Hugging Face ``BertModel``: embeddings + encoder + pooler, no
heads) hold 109,482,240 and 335,141,888 parameters. This module counts
109,514,298 for ``bert-base`` (the checkpoint less the pooler's 590,592 plus
the head's 622,650) and 335,174,458 for ``bert-large``. No choice of heads
brings the large model within 1% of the paper's 340M (every head included
gives 336,226,108, 1.1% short), so ``published_params`` is the released
checkpoints' count for both sizes, as for GPT-2.

BERT-MoE: BERT-base in which every other block's MLP (blocks 1, 3, ..., 11,
the GShard and Switch convention of replacing every other feed-forward layer)
is a mixture of experts. A router (dense ``d -> E``, no bias, float32
softmax) sends each token to its top-1 expert (Switch; combine weight = the
router probability) or its top-2 experts (GShard; the two probabilities
renormalised to sum to one, second expert always taken, no random routing so
the step stays deterministic). Routing groups are sequences, as GShard's
groups: every sequence of ``s`` tokens gives each expert
``capacity = ceil(capacity_factor * s * k / E)`` slots, filled in token order
(all first choices before any second choice); a token over capacity gets no
expert output and passes through on the residual only. Expert weights carry
a leading expert dimension (kernels ``[E, d, 4d]`` and ``[E, 4d, d]``) and
run through GShard's one-hot dispatch tensor ``[b, s, E, capacity]`` and its
dispatch/combine einsums, so a plan can shard the expert axis. The
load-balancing loss of Switch, ``E * sum_e f_e * P_e`` (``f_e`` the share of
a sequence's tokens whose first choice is ``e``, ``P_e`` their mean router
probability for ``e``), is averaged over the MoE blocks, added to the loss
times ``aux_loss_coef`` (0.01, as in Switch) and reported as the
``moe_aux_loss`` metric. There is no published parameter count;
``bert-moe-base`` (8 experts, 6 MoE blocks, top-1, capacity factor 1.25) and
``bert-moe-base-top2`` (the same with top-2 routing) hold 307,893,306
parameters; ``bert-moe-tiny`` (4 experts) is the test size.

The loss. ``hetspmd.weighted(total, weight)`` (total = cross entropy summed
over masked tokens, weight = number of masked tokens) is what makes a
microbatched step equal the single-device one, but plain
``jax.value_and_grad`` only takes a scalar (``Weighted`` is a two-leaf pytree:
"Gradient only defined for scalar-output functions"), and
``Workload.make_train_step`` uses ``jax.value_and_grad`` by default. So the
loss is the scalar ``total / max(weight, 1)`` unless the config sets
``weighted_loss=True``, which returns the weighted form for steps built with
``value_and_grad=hetspmd.value_and_grad``. On one device the two agree; in
a microbatched step only the weighted form is exact (a scalar is reduced as
a mean over examples, which weights microbatches by examples, not by masked
tokens). In both forms each sequence's load-balancing loss is weighted by
its masked-token count, so that it, too, is a ratio of sums.

Every block runs under ``jax.named_scope`` (``layer_3/attn``,
``layer_3/moe/dispatch``, ...), so the traced graph carries module paths. The
training step is deterministic (no dropout).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetspmd.autodiff import weighted
from hetspmd.errors import InvalidValueError
from hetspmd.models.workload import Workload

_INIT = nnx.initializers.truncated_normal(stddev=0.02)


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """The mixture-of-experts MLP used in every ``every``-th block.

  Attributes:
    num_experts: experts per MoE block (``E``).
    top_k: 1 (Switch routing) or 2 (GShard routing).
    capacity_factor: slots per expert are
      ``ceil(capacity_factor * tokens_per_sequence * top_k / num_experts)``.
    aux_loss_coef: weight of the load-balancing loss in the training loss.
    every: blocks ``every - 1, 2 * every - 1, ...`` are MoE blocks.
  """

  num_experts: int
  top_k: int = 1
  capacity_factor: float = 1.25
  aux_loss_coef: float = 0.01
  every: int = 2

  def __post_init__(self):
    if self.num_experts < 2:
      raise InvalidValueError(f"MoEConfig.num_experts must be at least 2, got {self.num_experts!r}")
    if self.top_k not in (1, 2):
      raise InvalidValueError(f"MoEConfig.top_k must be 1 (Switch) or 2 (GShard), got {self.top_k!r}")
    if self.top_k > self.num_experts:
      raise InvalidValueError(f"MoEConfig.top_k must be at most num_experts={self.num_experts}, got top_k={self.top_k}")
    if not self.capacity_factor > 0:
      raise InvalidValueError(f"MoEConfig.capacity_factor must be positive, got {self.capacity_factor!r}")
    if self.aux_loss_coef < 0:
      raise InvalidValueError(f"MoEConfig.aux_loss_coef must be non-negative, got {self.aux_loss_coef!r}")
    if self.every < 1:
      raise InvalidValueError(f"MoEConfig.every must be a positive integer, got {self.every!r}")

  def capacity(self, tokens: int) -> int:
    """Slots per expert for a routing group of ``tokens`` tokens."""
    return math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts)


@dataclasses.dataclass(frozen=True)
class BertConfig:
  n_layer: int
  n_head: int
  d_model: int
  vocab_size: int = 30522
  max_position: int = 512
  type_vocab_size: int = 2
  mask_token_id: int = 103  # [MASK] in the uncased vocabulary; used by synthetic batches
  moe: MoEConfig | None = None
  weighted_loss: bool = False  # return hetspmd.weighted(total, weight), for hetspmd.value_and_grad
  dtype: str = "float32"

  def __post_init__(self):
    if self.d_model % self.n_head:
      raise InvalidValueError(f"BertConfig.d_model must be divisible by n_head={self.n_head}, got d_model={self.d_model}")
    if not 0 <= self.mask_token_id < self.vocab_size:
      raise InvalidValueError(f"BertConfig.mask_token_id must lie in [0, vocab_size={self.vocab_size}), "
                              f"got mask_token_id={self.mask_token_id}")

  @property
  def d_ff(self) -> int:
    return 4 * self.d_model

  def is_moe_block(self, i: int) -> bool:
    return self.moe is not None and i % self.moe.every == self.moe.every - 1


def gelu(x: jax.Array) -> jax.Array:
  """Exact GELU in BERT's own form, ``x / 2 * (1 + erf(x / sqrt 2))``.

  ``jax.nn.gelu(approximate=False)`` computes the same through ``erfc``,
  which XLA's CPU cost analysis counts as a ~60-FLOP polynomial per element
  while hetspmd's FLOP rules count one transcendental; ``erf`` is costed
  alike by both.
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1 / math.sqrt(2))))


def _linear(cfg: BertConfig, d_in: int, d_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  return nnx.Linear(d_in, d_out, kernel_init=_INIT, dtype=cfg.dtype, rngs=rngs)


def _layer_norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.d_model, epsilon=1e-12, dtype=cfg.dtype, rngs=rngs)


class Embeddings(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    embed = lambda n: nnx.Embed(n, cfg.d_model, embedding_init=_INIT, dtype=cfg.dtype, rngs=rngs)
    self.word = embed(cfg.vocab_size)
    self.position = embed(cfg.max_position)
    self.token_type = embed(cfg.type_vocab_size)
    self.ln = _layer_norm(cfg, rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    positions = jnp.arange(tokens.shape[1])[None, :]
    x = self.word(tokens) + self.position(positions) + self.token_type(jnp.zeros_like(tokens))
    return self.ln(x)


class Attention(nnx.Module):
  """Bidirectional multi-head self attention (every position is a real token)."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.n_head = cfg.n_head
    self.query = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
    self.key = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
    self.value = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
    self.output = _linear(cfg, cfg.d_model, cfg.d_model, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, s, d = x.shape
    heads = lambda t: t.reshape(b, s, self.n_head, d // self.n_head)
    q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d // self.n_head).astype(x.dtype)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    return self.output(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, d))


class MLP(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.intermediate = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    self.output = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.output(gelu(self.intermediate(x)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
  """One MoE block's routing of ``b`` sequences of ``s`` tokens.

  ``dispatch`` and ``combine`` are ``[b, s, E, capacity]``: ``dispatch`` is
  1 where a token holds a slot, ``combine`` that slot's gate weight.
  ``aux_loss`` is the per-sequence load-balancing loss ``[b]``.
  """

  dispatch: jax.Array
  combine: jax.Array
  aux_loss: jax.Array


def route(probs: jax.Array, moe: MoEConfig) -> Routing:
  """Top-1 (Switch) or top-2 (GShard) routing with per-expert capacity.

  ``probs`` are the router probabilities ``[b, s, E]`` (float32).
  """
  experts = probs.shape[-1]
  capacity = moe.capacity(probs.shape[1])
  first = jax.nn.one_hot(jnp.argmax(probs, axis=-1), experts, dtype=probs.dtype)
  choices = [first]
  if moe.top_k == 2:
    choices.append(jax.nn.one_hot(jnp.argmax(jnp.where(first > 0, -1.0, probs), axis=-1), experts, dtype=probs.dtype))
  gates = [jnp.sum(probs * c, axis=-1) for c in choices]  # [b, s] each
  if moe.top_k == 2:
    norm = gates[0] + gates[1]
    gates = [g / norm for g in gates]
  dispatch = combine = jnp.zeros(probs.shape + (capacity,), probs.dtype)
  filled = jnp.zeros(probs.shape[:1] + probs.shape[2:], probs.dtype)  # [b, E] slots taken so far
  for choice, gate in zip(choices, gates):
    slot = jnp.cumsum(choice, axis=1) - 1.0 + filled[:, None, :]  # [b, s, E]
    kept = choice * (slot < capacity)
    filled = filled + jnp.sum(kept, axis=1)
    position = jnp.sum(slot * choice, axis=-1).astype(jnp.int32)  # slot at the chosen expert, [b, s]
    slots = kept[..., None] * jax.nn.one_hot(position, capacity, dtype=probs.dtype)[:, :, None, :]
    dispatch = dispatch + slots
    combine = combine + gate[:, :, None, None] * slots
  share = jnp.mean(first, axis=1)  # f_e per sequence, [b, E]
  mean_prob = jnp.mean(probs, axis=1)  # P_e per sequence, [b, E]
  aux_loss = experts * jnp.sum(share * mean_prob, axis=-1)
  return Routing(dispatch=dispatch, combine=combine, aux_loss=aux_loss)


class MoEMLP(nnx.Module):
  """``E`` BERT MLPs behind a router; expert weights have a leading expert axis."""

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    if cfg.moe is None:
      raise InvalidValueError("MoEMLP needs a BertConfig whose moe is a MoEConfig, got moe=None")
    self.moe = cfg.moe
    self.dtype = cfg.dtype
    e, d, f = cfg.moe.num_experts, cfg.d_model, cfg.d_ff
    self.router = nnx.Param(_INIT(rngs.params(), (d, e), jnp.float32))
    self.wi = nnx.Param(_INIT(rngs.params(), (e, d, f), jnp.float32))
    self.bi = nnx.Param(jnp.zeros((e, f), jnp.float32))
    self.wo = nnx.Param(_INIT(rngs.params(), (e, f, d), jnp.float32))
    self.bo = nnx.Param(jnp.zeros((e, d), jnp.float32))

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [b, s, d] -> (y [b, s, d], aux_loss [b])``; dropped tokens get ``y = 0``."""
    with jax.named_scope("router"):
      logits = jnp.einsum("bsd,de->bse", x.astype(jnp.float32), self.router[...])
      routing = route(jax.nn.softmax(logits, axis=-1), self.moe)
    dtype = jnp.dtype(self.dtype)
    with jax.named_scope("dispatch"):
      expert_in = jnp.einsum("bsec,bsd->ebcd", routing.dispatch.astype(dtype), x)
    with jax.named_scope("experts"):
      wi, bi, wo, bo = (p[...].astype(dtype) for p in (self.wi, self.bi, self.wo, self.bo))
      h = gelu(jnp.einsum("ebcd,edf->ebcf", expert_in, wi) + bi[:, None, None])
      expert_out = jnp.einsum("ebcf,efd->ebcd", h, wo) + bo[:, None, None]
    with jax.named_scope("combine"):
      y = jnp.einsum("bsec,ebcd->bsd", routing.combine.astype(dtype), expert_out)
    return y, routing.aux_loss


class Block(nnx.Module):
  """Post-LN encoder block; returns the block output and per-sequence aux loss (or None)."""

  def __init__(self, cfg: BertConfig, moe: bool, rngs: nnx.Rngs):
    self.attn = Attention(cfg, rngs)
    self.attn_ln = _layer_norm(cfg, rngs)
    self.mlp = MoEMLP(cfg, rngs) if moe else MLP(cfg, rngs)
    self.mlp_ln = _layer_norm(cfg, rngs)

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    with jax.named_scope("attn"):
      x = x + self.attn(x)
    with jax.named_scope("attn_ln"):
      x = self.attn_ln(x)
    aux = None
    if isinstance(self.mlp, MoEMLP):
      with jax.named_scope("moe"):
        y, aux = self.mlp(x)
    else:
      with jax.named_scope("mlp"):
        y = self.mlp(x)
    with jax.named_scope("mlp_ln"):
      return self.mlp_ln(x + y), aux


class MLMHead(nnx.Module):
  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.transform = _linear(cfg, cfg.d_model, cfg.d_model, rngs)
    self.ln = _layer_norm(cfg, rngs)
    self.bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32))

  def __call__(self, x: jax.Array, word: nnx.Embed) -> jax.Array:
    h = self.ln(gelu(self.transform(x)))
    return word.attend(h) + self.bias[...].astype(h.dtype)


class Bert(nnx.Module):
  """BERT encoder with the masked-LM head.

  ``model(tokens) -> (logits [b, s, vocab], aux_loss [b])``, where
  ``aux_loss`` is the load-balancing loss averaged over MoE blocks (zeros
  without any).
  """

  def __init__(self, cfg: BertConfig, rngs: nnx.Rngs):
    self.config = cfg
    self.embeddings = Embeddings(cfg, rngs)
    self.layers = nnx.List([Block(cfg, cfg.is_moe_block(i), rngs) for i in range(cfg.n_layer)])
    self.mlm = MLMHead(cfg, rngs)

  def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    with jax.named_scope("embed"):
      x = self.embeddings(tokens)
    aux_losses = []
    for i, block in enumerate(self.layers):
      with jax.named_scope(f"layer_{i}"):
        x, aux = block(x)
      if aux is not None:
        aux_losses.append(aux)
    with jax.named_scope("mlm_head"):
      logits = self.mlm(x, self.embeddings.word)
    aux = sum(aux_losses) / len(aux_losses) if aux_losses else jnp.zeros(tokens.shape[:1], jnp.float32)
    return logits, aux


def mlm_loss(model: Bert, batch):
  """Cross entropy over masked tokens, plus the MoE load-balancing loss.

  Scalar ``total / max(weight, 1)``, or ``hetspmd.weighted(total, weight)``
  when the config sets ``weighted_loss`` (see the module docstring).
  """
  cfg = model.config
  logits, aux = model(batch["inputs"])
  with jax.named_scope("loss"):
    mask = batch["mask"].astype(jnp.float32)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    count = jnp.sum(mask)
    totals = {"mlm_loss": jnp.sum(losses * mask)}
    total = totals["mlm_loss"]
    if cfg.moe is not None:  # each sequence's load-balancing loss weighted by its masked tokens
      totals["moe_aux_loss"] = jnp.sum(aux * jnp.sum(mask, axis=1))
      total = total + cfg.moe.aux_loss_coef * totals["moe_aux_loss"]
    if cfg.weighted_loss:
      return weighted(total, count), {k: weighted(v, count) for k, v in totals.items()}
    norm = jnp.maximum(count, 1.0)
    return total / norm, {k: v / norm for k, v in totals.items()}


def mlm_batch_spec(cfg: BertConfig, batch: int, seq: int | None):
  shape = (batch, seq)
  return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
          "mask": jax.ShapeDtypeStruct(shape, jnp.float32)}


def mlm_synthetic(cfg: BertConfig, rng: np.random.Generator, specs) -> dict[str, np.ndarray]:
  """Random targets; ~15% of positions masked (at least one per row) and shown as [MASK] in the inputs."""
  shape = specs["targets"].shape
  targets = rng.integers(0, cfg.vocab_size, size=shape, dtype=np.int32)
  mask = rng.random(shape) < 0.15
  mask[np.arange(shape[0]), rng.integers(0, shape[1], size=shape[0])] = True
  inputs = np.where(mask, np.int32(cfg.mask_token_id), targets).astype(np.int32)
  return {"inputs": inputs, "targets": targets, "mask": mask.astype(np.float32)}


_TINY = dict(n_layer=2, n_head=4, d_model=64, vocab_size=512, max_position=128)
_BASE = dict(n_layer=12, n_head=12, d_model=768)

CONFIGS = {
    # name: (config, published parameter count or None)
    "bert-tiny": (BertConfig(**_TINY), None),
    "bert-base": (BertConfig(**_BASE), 109_482_240),
    "bert-large": (BertConfig(n_layer=24, n_head=16, d_model=1024), 335_141_888),
    "bert-moe-tiny": (BertConfig(**_TINY, moe=MoEConfig(num_experts=4)), None),
    "bert-moe-base": (BertConfig(**_BASE, moe=MoEConfig(num_experts=8)), None),
    "bert-moe-base-top2": (BertConfig(**_BASE, moe=MoEConfig(num_experts=8, top_k=2)), None),
}

_BERT_SOURCE = "BERT (Devlin et al., 2019); released checkpoints"
_MOE_SOURCE = ("GShard (Lepikhin et al., 2021) / Switch (Fedus et al., 2022) MoE in BERT-base, "
               "as in HAP's BERT-MoE")


def _bert_optimizer() -> optax.GradientTransformation:
  return optax.adam(1e-4)  # the paper's pre-training learning rate (without its warmup and decay)


def _tiny_optimizer() -> optax.GradientTransformation:
  return optax.adam(1e-3)


def workloads() -> list[Workload]:
  out = []
  for name, (cfg, published) in CONFIGS.items():
    tiny = name.endswith("-tiny")
    out.append(Workload(
        name=name,
        family="bert" if cfg.moe is None else "bert-moe",
        config=cfg,
        build=Bert,
        loss=mlm_loss,
        batch_spec=mlm_batch_spec,
        make_optimizer=_tiny_optimizer if tiny else _bert_optimizer,
        default_batch=4 if tiny else 8,
        default_seq=32 if tiny else 512,
        max_seq=cfg.max_position,
        published_params=published,
        source="test size" if tiny else _BERT_SOURCE if cfg.moe is None else _MOE_SOURCE,
        test_size=tiny,
        synthetic=mlm_synthetic,
    ))
  return out
