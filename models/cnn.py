"""VGG19 and ResNet-50 in Flax NNX, with batch norm carried in the train state.

Sources and published sizes (torchvision's ``vgg19`` and ``resnet50`` with a
1000-class head, which the counts here match exactly):

* VGG19 (Simonyan & Zisserman, 2015, configuration E): sixteen 3x3
  convolutions in five stages of 64, 128, 256, 512, 512 channels, each stage
  ending in a 2x2 max pool, then fully connected layers 4096, 4096, 1000;
  no batch norm; 143,667,240 parameters. torchvision's
  ``AdaptiveAvgPool2d((7, 7))`` is the identity for 224x224 inputs and is
  left out: the classifier sees ``(image / 32)**2 * 512`` features (NHWC
  flattening order, same count). Dropout in the classifier is left out so the
  step needs no RNG.
* ResNet-50 (He et al., 2016): a 7x7 stride-2 stem and 3x3 stride-2 max
  pool, bottleneck blocks [3, 4, 6, 3] of widths 64, 128, 256, 512 (output
  4x wider), the stride on the 3x3 convolution as in torchvision ("v1.5"),
  1x1 projection shortcuts with batch norm, global average pool, a 1000-way
  linear head; 25,557,032 parameters counting batch-norm scale and bias (the
  running mean and variance are statistics, not parameters).

Images are NHWC float32, labels int32 below ``num_classes``. Every stage runs
under ``jax.named_scope`` (``features_2/conv_1``, ``layer3_4/conv2``, ...).
Convolutions start from torchvision's kaiming-normal (fan out) weights.
Optimizers: ResNet uses He et al.'s SGD (momentum 0.9, learning rate 0.1,
weight decay 1e-4); VGG uses Adam (1e-3) like the rest of the zoo, because
the paper's SGD at 1e-2 barely moves the batch-norm-free ``vgg-tiny`` in the
20 steps the zoo tests train for.

Batch norm. ResNet workloads are :class:`BatchNormWorkload`\\ s, whose train
state is ``{"params", "batch_stats", "opt_state", "step"}``: ``batch_stats``
holds the ``nnx.BatchStat`` running means and variances. The train step runs
batch norm in training mode: each call of the loss normalises activations
with the mean and (biased) variance of the examples that call sees, and
returns the running statistics updated as ``r <- 0.9 r + 0.1 s`` (momentum
0.9 in Flax's convention, torchvision's 0.1; Flax keeps the biased batch
variance where torchvision keeps the unbiased one).

What microbatching does to it: under ``hetspmd.parallelize`` with
``hetspmd.value_and_grad``, the loss runs once per microbatch, so each
microbatch is normalised with its own statistics, as in ghost batch norm
(Hoffer et al., 2017). The gradients therefore depend on the microbatch size
(a step with microbatch 8 is not the step with the whole batch in one
microbatch) but not on which device ran a microbatch or how many microbatches
each device ran: the same microbatches give the same step on any plan. The
updated running statistics travel out of the loss as auxiliary values, which
``hetspmd.value_and_grad`` averages over the microbatches weighted by their
examples; since the update is affine, the new running statistics are
``r <- 0.9 r + 0.1 mean_k(s_k)``, one update per step with the mean of the
microbatches' statistics (the running variance is the mean of the
per-microbatch variances, which leaves out the spread of the microbatch means).
With plain ``jax.value_and_grad`` the whole batch is one microbatch and this
is the usual update. Microbatches of one example are degenerate: at a 1x1
spatial stage their batch variance is zero. ``hetspmd.trace`` gives the
``batch_stats`` leaves the role ``other`` (they are ``nnx.BatchStat``
variables), so they are neither counted nor sharded as parameters.
``nnx.view(model, use_running_average=True)`` gives the evaluation-mode model.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hetspmd.errors import InvalidValueError
from hetspmd.models.mlp import classification_loss
from hetspmd.models.vit import image_batch_spec
from hetspmd.models.workload import Workload, abstract_rngs

# torchvision's initialisers: kaiming normal (fan out, ReLU gain) for convolutions.
_conv_init = jax.nn.initializers.variance_scaling(2.0, "fan_out", "normal")


# --- VGG ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VGGConfig:
  stages: tuple[tuple[int, ...], ...]  # output channels of each 3x3 convolution, per pooling stage
  hidden: tuple[int, ...] = (4096, 4096)  # fully connected widths before the head
  num_classes: int = 1000
  image_size: int = 224
  channels: int = 3

  def __post_init__(self):
    if not self.stages or any(not stage for stage in self.stages):
      raise InvalidValueError(f"VGGConfig.stages needs at least one stage and no empty one, got {self.stages!r}")
    if self.image_size % 2 ** len(self.stages):
      raise InvalidValueError(f"VGGConfig.image_size must be divisible by 2**{len(self.stages)} (one 2x2 pool per "
                              f"stage), got image_size={self.image_size}")

  @property
  def flat_features(self) -> int:
    side = self.image_size // 2 ** len(self.stages)
    return side * side * self.stages[-1][-1]


class VGGStage(nnx.Module):
  def __init__(self, in_channels: int, widths: tuple[int, ...], rngs: nnx.Rngs):
    ins = (in_channels,) + widths[:-1]
    self.convs = nnx.List([nnx.Conv(a, b, kernel_size=(3, 3), padding=((1, 1), (1, 1)), kernel_init=_conv_init,
                                    rngs=rngs) for a, b in zip(ins, widths)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for i, conv in enumerate(self.convs):
      with jax.named_scope(f"conv_{i}"):
        x = jax.nn.relu(conv(x))
    with jax.named_scope("pool"):
      return nnx.max_pool(x, (2, 2), strides=(2, 2))


class VGG(nnx.Module):
  def __init__(self, cfg: VGGConfig, rngs: nnx.Rngs):
    ins = (cfg.channels,) + tuple(stage[-1] for stage in cfg.stages[:-1])
    self.features = nnx.List([VGGStage(c, stage, rngs) for c, stage in zip(ins, cfg.stages)])
    widths = (cfg.flat_features,) + cfg.hidden + (cfg.num_classes,)
    linear_init = jax.nn.initializers.normal(0.01)
    self.classifier = nnx.List([nnx.Linear(a, b, kernel_init=linear_init, rngs=rngs)
                                for a, b in zip(widths[:-1], widths[1:])])

  def __call__(self, images: jax.Array) -> jax.Array:
    x = images
    for i, stage in enumerate(self.features):
      with jax.named_scope(f"features_{i}"):
        x = stage(x)
    x = x.reshape(x.shape[0], -1)
    for i, layer in enumerate(self.classifier):
      with jax.named_scope(f"classifier_{i}"):
        x = layer(x)
        if i + 1 < len(self.classifier):
          x = jax.nn.relu(x)
    return x


# --- ResNet ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
  blocks: tuple[int, ...]  # bottleneck blocks per stage
  widths: tuple[int, ...] = (64, 128, 256, 512)  # bottleneck widths; blocks output 4x as many channels
  stem_width: int = 64
  num_classes: int = 1000
  image_size: int = 224
  channels: int = 3
  expansion: int = 4
  bn_momentum: float = 0.9  # Flax convention: r <- momentum r + (1 - momentum) batch
  bn_epsilon: float = 1e-5

  def __post_init__(self):
    if len(self.blocks) != len(self.widths) or any(b < 1 for b in self.blocks):
      raise InvalidValueError(f"ResNetConfig needs one positive block count per width, got blocks={self.blocks} "
                              f"widths={self.widths}")
    if self.image_size % (4 * 2 ** (len(self.blocks) - 1)):
      raise InvalidValueError(f"ResNetConfig.image_size must be divisible by {4 * 2 ** (len(self.blocks) - 1)} "
                              f"(the stem and each later stage halve it), got image_size={self.image_size}")


def _batch_norm(cfg: ResNetConfig, features: int, rngs: nnx.Rngs) -> nnx.BatchNorm:
  return nnx.BatchNorm(features, momentum=cfg.bn_momentum, epsilon=cfg.bn_epsilon, rngs=rngs)


def _conv(in_features: int, out_features: int, kernel: int, stride: int, rngs: nnx.Rngs) -> nnx.Conv:
  pad = kernel // 2  # torchvision's symmetric padding (SAME would pad stride-2 convolutions unevenly)
  return nnx.Conv(in_features, out_features, kernel_size=(kernel, kernel), strides=(stride, stride),
                  padding=((pad, pad), (pad, pad)), use_bias=False, kernel_init=_conv_init, rngs=rngs)


class Bottleneck(nnx.Module):
  def __init__(self, cfg: ResNetConfig, in_features: int, width: int, stride: int, rngs: nnx.Rngs):
    out_features = width * cfg.expansion
    self.conv1, self.bn1 = _conv(in_features, width, 1, 1, rngs), _batch_norm(cfg, width, rngs)
    self.conv2, self.bn2 = _conv(width, width, 3, stride, rngs), _batch_norm(cfg, width, rngs)
    self.conv3, self.bn3 = _conv(width, out_features, 1, 1, rngs), _batch_norm(cfg, out_features, rngs)
    if stride != 1 or in_features != out_features:
      self.downsample = nnx.Sequential(_conv(in_features, out_features, 1, stride, rngs),
                                       _batch_norm(cfg, out_features, rngs))
    else:
      self.downsample = None

  def __call__(self, x: jax.Array) -> jax.Array:
    with jax.named_scope("conv1"):
      h = jax.nn.relu(self.bn1(self.conv1(x)))
    with jax.named_scope("conv2"):
      h = jax.nn.relu(self.bn2(self.conv2(h)))
    with jax.named_scope("conv3"):
      h = self.bn3(self.conv3(h))
    if self.downsample is not None:
      with jax.named_scope("downsample"):
        x = self.downsample(x)
    return jax.nn.relu(h + x)


class ResNet(nnx.Module):
  def __init__(self, cfg: ResNetConfig, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(cfg.channels, cfg.stem_width, kernel_size=(7, 7), strides=(2, 2),
                          padding=((3, 3), (3, 3)), use_bias=False, kernel_init=_conv_init, rngs=rngs)
    self.bn1 = _batch_norm(cfg, cfg.stem_width, rngs)
    layers, features = [], cfg.stem_width
    for stage, (count, width) in enumerate(zip(cfg.blocks, cfg.widths)):
      blocks = []
      for i in range(count):
        blocks.append(Bottleneck(cfg, features, width, 2 if stage > 0 and i == 0 else 1, rngs))
        features = width * cfg.expansion
      layers.append(nnx.List(blocks))
    self.layers = nnx.List(layers)
    self.fc = nnx.Linear(features, cfg.num_classes, rngs=rngs)

  def __call__(self, images: jax.Array) -> jax.Array:
    with jax.named_scope("stem"):
      x = jax.nn.relu(self.bn1(self.conv1(images)))
      x = nnx.max_pool(x, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)))
    for s, layer in enumerate(self.layers):
      for i, block in enumerate(layer):
        with jax.named_scope(f"layer{s + 1}_{i}"):
          x = block(x)
    with jax.named_scope("head"):
      return self.fc(jnp.mean(x, axis=(1, 2)))


# --- workloads ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchNormWorkload(Workload):
  """A :class:`Workload` whose model also holds ``nnx.BatchStat`` running statistics.

  The train state is ``{"params", "batch_stats", "opt_state", "step"}``; the
  step runs the model in training mode and returns the updated statistics
  (see the module docstring for what microbatching does to them).
  """

  def init_state(self, seed: int = 0) -> dict[str, Any]:
    _, params, batch_stats = nnx.split(self.build(self.config, nnx.Rngs(seed)), nnx.Param, nnx.BatchStat)
    return self._state_from(params, batch_stats)

  def _state_from(self, params: nnx.State, batch_stats: nnx.State) -> dict[str, Any]:
    return {"params": params, "batch_stats": batch_stats, "opt_state": self.make_optimizer().init(params),
            "step": jnp.zeros((), jnp.int32)}

  def abstract_state(self) -> dict[str, Any]:
    _, params, batch_stats = _abstract_split(self)
    return jax.eval_shape(self._state_from, params, batch_stats)

  def graphdef(self) -> nnx.GraphDef:
    return _abstract_split(self)[0]

  def param_count(self) -> int:
    _, params, _ = _abstract_split(self)
    return int(sum(np.prod(x.shape, dtype=np.int64) for x in jax.tree.leaves(params)))

  def make_train_step(self, value_and_grad: Callable[..., Any] = jax.value_and_grad
                      ) -> Callable[[dict[str, Any], Any], tuple[dict[str, Any], dict[str, jax.Array]]]:
    """Like :meth:`Workload.make_train_step`, also updating ``batch_stats``."""
    graphdef = self.graphdef()
    tx = self.make_optimizer()
    loss = self.loss

    def train_step(state, batch):
      def loss_fn(params, batch_stats, batch):
        # value_and_grad passes batch_stats through untouched, so its Variables belong to the
        # caller's trace and BatchNorm may not write to them; copy=True makes fresh ones here.
        model = nnx.merge(graphdef, params, batch_stats, copy=True)
        value, aux = loss(model, batch)
        return value, (aux, nnx.state(model, nnx.BatchStat))

      (value, (aux, batch_stats)), grads = value_and_grad(loss_fn, has_aux=True)(
          state["params"], state["batch_stats"], batch)
      updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
      params = optax.apply_updates(state["params"], updates)
      new_state = {"params": params, "batch_stats": batch_stats, "opt_state": opt_state, "step": state["step"] + 1}
      return new_state, {"loss": value, **aux}

    train_step.__name__ = f"{self.name.replace('-', '_')}_train_step"
    return train_step


@functools.cache
def _abstract_split(workload: BatchNormWorkload) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """Graph definition, abstract parameters and abstract batch statistics, built once."""
  model = nnx.eval_shape(lambda: workload.build(workload.config, abstract_rngs(0)))
  return nnx.split(model, nnx.Param, nnx.BatchStat)


_VGG19_STAGES = ((64, 64), (128, 128), (256,) * 4, (512,) * 4, (512,) * 4)

VGG_CONFIGS = {
    # name: (config, published parameter count or None)
    "vgg-tiny": (VGGConfig(stages=((8, 8), (16, 16), (32,) * 4, (32,) * 4, (32,) * 4), hidden=(64, 64),
                           num_classes=10, image_size=32), None),
    "vgg19": (VGGConfig(stages=_VGG19_STAGES), 143_667_240),
}

RESNET_CONFIGS = {
    "resnet-tiny": (ResNetConfig(blocks=(1, 1, 1, 1), widths=(8, 16, 32, 64), stem_width=8, num_classes=10,
                                 image_size=32), None),
    "resnet50": (ResNetConfig(blocks=(3, 4, 6, 3)), 25_557_032),
}

CONFIGS = {**VGG_CONFIGS, **RESNET_CONFIGS}


def _resnet_optimizer() -> optax.GradientTransformation:
  """He et al. (2016): SGD, momentum 0.9, learning rate 0.1, weight decay 1e-4."""
  return optax.chain(optax.add_decayed_weights(1e-4), optax.sgd(0.1, momentum=0.9))


def workloads() -> list[Workload]:
  vgg = [
      Workload(
          name=name, family="vgg", config=cfg, build=VGG, loss=classification_loss, batch_spec=image_batch_spec,
          make_optimizer=lambda: optax.adam(1e-3),
          default_batch=8 if published is None else 64, published_params=published,
          source="VGG19 (Simonyan & Zisserman, 2015); torchvision vgg19" if published else "test size",
          test_size=published is None)
      for name, (cfg, published) in VGG_CONFIGS.items()
  ]
  resnet = [
      BatchNormWorkload(
          name=name, family="resnet", config=cfg, build=ResNet, loss=classification_loss,
          batch_spec=image_batch_spec, make_optimizer=_resnet_optimizer,
          default_batch=8 if published is None else 64, published_params=published,
          source="ResNet-50 (He et al., 2016); torchvision resnet50" if published else "test size",
          test_size=published is None)
      for name, (cfg, published) in RESNET_CONFIGS.items()
  ]
  return vgg + resnet
