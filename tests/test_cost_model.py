"""Cost-model pieces: memory traffic after fusion, gradient accumulation, devices that share compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import hetspmd as hs
from hetspmd import Cluster, models
from hetspmd.hardware.devices import DeviceSpec
from hetspmd.passes.costing.fusion import fused_bytes, fused_traffic, kernels
from hetspmd.passes.costing.step_cost import step_profile
from hetspmd.planner.pricing import evaluate, shared_finish_times
from hetspmd.passes.profile import profile_step

N = 1024  # float32 elements: 4 KiB per vector
KIB4 = 4 * N


def _unfused(graph):
  return np.array([n.bytes_read + n.bytes_written for n in graph.nodes])


def test_an_elementwise_chain_reads_its_inputs_once_and_writes_its_result():
  graph = hs.trace(lambda p, g: p - 0.1 * (g * g + jnp.sqrt(g * g + 1.0)), *[jax.ShapeDtypeStruct((N,), jnp.float32)] * 2)
  assert len(set(kernels(graph))) == 1
  assert fused_bytes(graph).sum() == 3 * KIB4  # read p and g, write the result
  assert _unfused(graph).sum() > 3 * fused_bytes(graph).sum()


def test_fused_traffic_splits_reads_from_writes():
  graph = hs.trace(lambda p, g: p - 0.1 * (g * g + jnp.sqrt(g * g + 1.0)), *[jax.ShapeDtypeStruct((N,), jnp.float32)] * 2)
  reads, writes = fused_traffic(graph)
  assert (reads.sum(), writes.sum()) == (2 * KIB4, KIB4)
  np.testing.assert_array_equal(reads + writes, fused_bytes(graph))


@pytest.mark.parametrize("read_ratio", [1.0, 1.5, 3.0, 10.0])
def test_reads_and_writes_are_timed_at_their_own_rates(read_ratio):
  copy = 1e9
  spec = DeviceSpec("x", 1e15, 1e15, 2**34, copy, measured=True,
                    read_bandwidth=None if read_ratio == 1.0 else read_ratio * copy)
  # a copy of n bytes (n read, n written) takes 2n / copy, whatever the split
  assert 1 / spec.read_rate + 1 / spec.write_rate == pytest.approx(2 / copy)
  assert spec.write_rate <= copy <= spec.read_rate
  # a sum over a batch of vectors reads the batch and writes one float
  small, large = (hs.trace(jnp.sum, jax.ShapeDtypeStruct((b, N), jnp.float32)) for b in (2, 4))
  profile = step_profile(small, large, 2, 4)
  assert profile.node_seconds(spec, 8).sum() == pytest.approx(8 * KIB4 / spec.read_rate + 4 / spec.write_rate)


def test_a_read_bandwidth_below_half_the_copy_rate_is_refused():
  with pytest.raises(hs.InvalidValueError, match="read_bandwidth must be a number above half the copy bandwidth"):
    DeviceSpec("x", 1e12, 1e12, 2**34, 1e9, read_bandwidth=4e8)


@pytest.mark.parametrize("fields,match", [
    ({"cache_bytes": 2**20}, "give cache_bytes and cache_write_bandwidth together"),
    ({"cache_write_bandwidth": 1e9}, "give cache_bytes and cache_write_bandwidth together"),
    ({"cache_bytes": 0, "cache_write_bandwidth": 1e9}, "cache_bytes must be a positive number"),
    ({"cache_bytes": 2**20, "cache_write_bandwidth": float("nan")}, "cache_write_bandwidth must be a positive number"),
])
def test_a_cache_needs_both_a_size_and_a_positive_rate(fields, match):
  with pytest.raises(hs.InvalidValueError, match=match):
    DeviceSpec("x", 1e12, 1e12, 2**34, 1e9, **fields)


def _two_layer_profile(width: int):
  """A dense layer pair traced at batches 2 and 4: its weight gradients are ``width × width`` float32 values."""
  def step(w1, w2, x):
    loss = lambda w1, w2: jnp.sum(jnp.tanh(jnp.tanh(x @ w1) @ w2))
    return jax.grad(loss, argnums=(0, 1))(w1, w2)

  w = jax.ShapeDtypeStruct((width, width), jnp.float32)
  small, large = (hs.trace(step, w, w, jax.ShapeDtypeStruct((b, width), jnp.float32)) for b in (2, 4))
  return step_profile(small, large, 2, 4)


@pytest.mark.parametrize("cache_bytes,width,cached", [
    (None, 64, False),        # no cache modelled
    (2**20, 64, True),        # 16 KiB weight gradients fit a 1 MiB cache
    (2**20, 1024, False),     # 4 MiB ones do not
    (2**24, 1024, True),      # ...but fit 16 MiB
])
def test_later_microbatches_write_cache_sized_values_at_the_cache_rate(cache_bytes, width, cached):
  profile = _two_layer_profile(width)
  memory_only = dict(fp32_flops=1e18, bf16_flops=1e18, memory_bytes=2**34, memory_bandwidth=1e9, measured=True)
  cache = {} if cache_bytes is None else {"cache_bytes": cache_bytes, "cache_write_bandwidth": 1e11}
  spec = DeviceSpec("x", **memory_only, **cache)
  plain = DeviceSpec("x", **memory_only)
  micro = ~profile.per_step
  first = float(np.sum(profile.node_seconds(spec, 8, first=True) * micro))
  # the first microbatch writes everything to memory, as without a cache
  assert first == pytest.approx(float(np.sum(profile.node_seconds(plain, 8) * micro)))
  later = profile.microbatch_seconds(spec, 8)
  # the extra is that of the values written to buffers: the fused elementwise ones (tanh here) write none
  written = micro & ~profile.elementwise
  extra = float(np.sum((profile.node_seconds(spec, 8, first=True) - profile.node_seconds(spec, 8)) * written))
  assert profile.first_microbatch_extra_seconds(spec, 8) == pytest.approx(extra)
  assert profile.elementwise[micro].any() and extra <= first - later
  if cache_bytes is None:
    assert later == pytest.approx(first) and profile.first_microbatch_extra_seconds(spec, 8) == 0.0
    return
  # the weight gradients (two width² float32 values) are written at the cache rate after the first
  # microbatch when they fit; the activations (8 × width floats) fit in every case here
  gradient_saving = 2 * width * width * 4 * (1 / spec.write_rate - 1 / 1e11)
  assert (first - later >= gradient_saving * (1 - 1e-9)) == cached
  assert first > later


def test_the_first_microbatch_extra_is_paid_once_per_step():
  profile = _two_layer_profile(64)
  spec = DeviceSpec("cpu", 1e18, 1e18, 2**34, 1e9, measured=True, cache_bytes=2**20, cache_write_bandwidth=1e11)
  cluster = Cluster.parse("1x2xcpu", devices={"cpu": spec})
  step = lambda counts: evaluate(cluster, profile, (0, 1), 2, 0, "none", global_batch=2 * sum(counts), counts_rule=counts, name="x").compute_seconds
  micro = profile.microbatch_seconds(spec, 2) + profile.accumulate_seconds(spec)
  first = profile.first_microbatch_extra_seconds(spec, 2)
  fixed = profile.step_fixed_seconds(spec) + profile.zeroing_seconds(spec)  # a loop zeros its accumulator
  assert first > 0 and micro > 0
  assert step((2, 2)) == pytest.approx(fixed + first + 2 * micro)
  assert step((4, 4)) - step((2, 2)) == pytest.approx(2 * micro)
  # a position without microbatches pays neither
  assert step((2, 0)) == pytest.approx(fixed + first + 2 * micro)


def test_a_layer_scan_pays_the_first_microbatch_extra_once_not_per_layer():
  """A scan's body writes into the buffers its first iteration touched: the first microbatch's extra of a scan of
  4 layers is that of 2 (each layer's per-microbatch work is twice as long), and equals one unrolled layer's."""
  def step(ws, x, scanned):
    def layer(h, w):
      return jnp.tanh(h @ w), None
    def loss(ws):
      if scanned:
        return jnp.sum(jax.lax.scan(layer, x, ws)[0])
      h = x
      for i in range(ws.shape[0]):
        h = layer(h, ws[i])[0]
      return jnp.sum(h)
    return jax.grad(loss)(ws)

  def profile(layers, scanned):
    ws = jax.ShapeDtypeStruct((layers, 64, 64), jnp.float32)
    small, large = (hs.trace(lambda ws, x: step(ws, x, scanned), ws, jax.ShapeDtypeStruct((b, 64), jnp.float32))
                    for b in (2, 4))
    return step_profile(small, large, 2, 4)

  spec = DeviceSpec("cpu", 1e18, 1e18, 2**34, 1e9, measured=True, cache_bytes=2**20, cache_write_bandwidth=1e11)
  extra = {(n, s): profile(n, s).first_microbatch_extra_seconds(spec, 8) for n in (2, 4) for s in (True, False)}
  micro = {n: profile(n, True).microbatch_seconds(spec, 8) for n in (2, 4)}
  assert extra[(2, True)] > 0 and micro[4] > 1.5 * micro[2]
  assert extra[(4, True)] == pytest.approx(extra[(2, True)], rel=0.05)
  assert extra[(4, False)] > 1.5 * extra[(2, False)]  # unrolled, every layer's values are their own buffers


@pytest.mark.parametrize("kind,faster", [("A100-40GB", True), ("H100-80GB", True), ("TPU-v4", True), ("V100-32GB", False)])
def test_float32_matmuls_run_on_tf32_tensor_cores_unless_full_precision_is_asked_for(kind, faster):
  # JAX's default precision lets XLA compute float32 matmuls with TF32 on Ampere and later GPUs
  from hetspmd.hardware.devices import DEVICE_PRESETS

  profile = _two_layer_profile(1024)
  spec = DEVICE_PRESETS[kind]
  default = profile.microbatch_seconds(spec, 4096)
  with jax.default_matmul_precision("float32"):
    full = profile.microbatch_seconds(spec, 4096)
    assert spec.f32_matmul_flops(False) == spec.fp32_flops
  assert (full > 2 * default) == faster and (full == default) == (not faster)
  assert spec.f32_matmul_flops() == (spec.reduced_f32_flops if faster else spec.fp32_flops)
  for bad in (0.0, True):
    with pytest.raises(hs.InvalidValueError, match="reduced_f32_flops must be a positive number"):
      spec.replace(reduced_f32_flops=bad)
  with pytest.raises(hs.InvalidValueError, match="is below fp32_flops"):
    spec.replace(reduced_f32_flops=spec.fp32_flops / 2)


def test_a_matmul_that_sets_its_own_precision_is_priced_by_it():
  # precision="highest" on the dot (or the config at trace time, which JAX writes into the dot) means full
  # float32 whatever the config when costing; precision left unset follows the config when costing
  from hetspmd.hardware.devices import DEVICE_PRESETS
  from hetspmd.passes import _jax_adapter as jx

  a100 = DEVICE_PRESETS["A100-40GB"]
  w, x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32), lambda b: jax.ShapeDtypeStruct((b, 1024), jnp.float32)

  def profile(fn):
    return step_profile(hs.trace(fn, w, x(64)), hs.trace(fn, w, x(128)), 64, 128)

  plain = profile(lambda w, x: jnp.sum(x @ w))
  highest = profile(lambda w, x: jnp.sum(jnp.dot(x, w, precision="highest")))
  with jax.default_matmul_precision("float32"):
    traced_full = profile(lambda w, x: jnp.sum(x @ w))
    plain_full = plain.microbatch_seconds(a100, 4096)
  assert list(highest.f32_precision[highest.matmul]) == [2] and list(plain.f32_precision[plain.matmul]) == [0]
  fast, full = plain.microbatch_seconds(a100, 4096), highest.microbatch_seconds(a100, 4096)
  assert full > 3 * fast
  assert traced_full.microbatch_seconds(a100, 4096) == pytest.approx(full) == pytest.approx(plain_full)
  for setting, expected in [(None, None), (("DEFAULT", "DEFAULT"), "reduced"), (("HIGH", "HIGH"), "reduced"),
                            (("HIGHEST", "HIGHEST"), "full"), ("TF32_TF32_F32", "reduced"), ("TF32_TF32_F32_X3", "full"),
                            ("BF16_BF16_F32_X6", "full"), ("F32_F32_F32", "full"), ("tensorfloat32", "reduced"),
                            ("float32", "full"), ("bfloat16", "reduced")]:
    assert jx.f32_matmul_precision(setting) == expected, setting


def test_float16_and_bfloat16_matmuls_are_priced_apart_before_ampere():
  # a V100 runs float16 dots on its tensor cores (125 TF/s) and bfloat16 ones at its float32 rate (15.7 TF/s);
  # an A100 runs both at 312 TF/s
  from hetspmd.hardware.devices import DEVICE_PRESETS

  v100, a100 = DEVICE_PRESETS["V100-32GB"], DEVICE_PRESETS["A100-40GB"]

  def profile(dtype):
    w, x = jax.ShapeDtypeStruct((4096, 4096), dtype), lambda b: jax.ShapeDtypeStruct((b, 4096), dtype)
    fn = lambda w, x: jnp.sum((x @ w).astype(jnp.float32))
    return step_profile(hs.trace(fn, w, x(64)), hs.trace(fn, w, x(128)), 64, 128)

  half, brain = profile(jnp.float16), profile(jnp.bfloat16)
  assert list(half.float16[half.matmul]) == [True] and list(brain.float16[brain.matmul]) == [False]
  batch = 8192  # compute-bound: 2 * 8192 * 4096^2 FLOPs against 64 MiB of operands
  dot = lambda p, spec: float(np.sum(p.node_seconds(spec, batch) * p.matmul))
  # the float16 dot runs on matrix units, the bfloat16 one on the vector units: each at its chip's efficiency
  e = v100.efficiency
  assert dot(brain, v100) / dot(half, v100) == pytest.approx(125 * e.matrix / (15.7 * e.vector), rel=1e-6)
  assert dot(half, a100) == pytest.approx(dot(brain, a100))
  # the datasheet efficiencies price both at their peaks' ratio
  plain = v100.replace(chip=None)
  assert dot(brain, plain) / dot(half, plain) == pytest.approx(125 / 15.7, rel=1e-6)


def test_a_value_that_cannot_fuse_into_its_consumer_is_written_and_read_back():
  # the dot cannot fuse: its input x * 2 is written, read by the dot, and the dot's output read by the tanh kernel
  graph = hs.trace(lambda x, w: jnp.tanh((x * 2.0) @ w), jax.ShapeDtypeStruct((8, 128), jnp.float32),
                   jax.ShapeDtypeStruct((128, 128), jnp.float32))
  by_primitive = dict(zip((n.primitive for n in graph.nodes), fused_bytes(graph)))
  x, w, y = 8 * 128 * 4, 128 * 128 * 4, 8 * 128 * 4
  assert by_primitive["mul"] == x + x          # read x, write x * 2
  assert by_primitive["dot_general"] == x + w + y
  assert by_primitive["tanh"] == y + y         # read the dot's output, write the result


def test_a_reduction_ends_its_kernel():
  graph = hs.trace(lambda x: jnp.exp(x) / jnp.sum(jnp.exp(x)), jax.ShapeDtypeStruct((N,), jnp.float32))
  groups = kernels(graph)
  reduce = next(n.id for n in graph.nodes if n.primitive == "reduce_sum")
  div = next(n.id for n in graph.nodes if n.primitive == "div")
  assert groups[reduce] != groups[div]
  # the sum's kernel reads x; the division's kernel reads x and the sum and writes the result
  assert fused_bytes(graph).sum() == KIB4 + 4 + KIB4 + 4 + KIB4


def test_adam_update_is_one_pass_over_its_state():
  params = {"w": jnp.zeros((N,), jnp.float32)}
  opt = optax.adam(1e-3)

  def update(params, state, grads):
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  graph = hs.trace(update, params, opt.init(params), params)
  # reads: params, grads, mu, nu (and the step count); writes: params, mu, nu (and the count)
  assert 7 * KIB4 <= fused_bytes(graph).sum() <= 7 * KIB4 + 64
  assert _unfused(graph).sum() > 2 * fused_bytes(graph).sum()


def test_accumulating_gradients_costs_one_read_of_the_accumulator_per_microbatch():
  w = models.get("mlp-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  spec = DeviceSpec("x", 1e12, 1e12, 2**34, 1e9, measured=True)
  assert profile.accumulate_seconds(spec) == pytest.approx(4 * profile.param_count / 1e9)


@pytest.mark.parametrize("calibrated", [False, True], ids=["datasheet", "calibrated"])
def test_a_program_of_one_microbatch_everywhere_neither_zeros_nor_adds_into_an_accumulator(calibrated):
  """With a loop, every step writes the float32 accumulator's zeros and each microbatch adds into it; with one
  microbatch on every device there is no loop and XLA folds both away (an MLP of 40 MB on 8 CPU devices:
  measured 109 ms under the line through counts 2 to 4, its zeros priced at 108). A step timing's fixed
  seconds hold the zeros its loops wrote: priced apart, not twice."""
  from hetspmd.hardware.calibration import Calibration, KindTiming

  w = models.get("mlp-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  cluster = Cluster.parse("1x4xV100-32GB")
  if calibrated:
    cluster = cluster.calibrated(Calibration("step", (KindTiming("V100-32GB", ((8, 0.01),), 0.004),)))
  spec = cluster.spec_of("V100-32GB")
  accumulate, zeros = profile.accumulate_seconds(spec), profile.zeroing_seconds(spec)
  assert zeros == pytest.approx(4 * profile.param_count / spec.write_rate) and zeros > 0 and accumulate > 0
  one, two = (evaluate(cluster, profile, tuple(range(4)), 8, 0, "none", global_batch=8 * 4 * c,
                       counts_rule=(c,) * 4, name="x") for c in (1, 2))
  micro = 0.01 if calibrated else profile.microbatch_seconds(spec, 8) + accumulate
  assert two.compute_seconds - one.compute_seconds == pytest.approx(micro + accumulate + zeros, rel=1e-9)
  if calibrated:  # the measured 4 ms hold the zeros once, and the reduction the timing program ran
    from hetspmd.planner.pricing import Costing

    assert Costing(cluster, profile, 8).fixed["V100-32GB"] < 0.004 - zeros + 1e-12


@pytest.mark.parametrize("seconds,capacity,speedup,expected", [
    ((1.0, 1.0, 1.0, 1.0), 4, 4.0, (1.0, 1.0, 1.0, 1.0)),            # all busy: the measured rate
    ((2.0, 2.0, 1.0, 1.0), 4, 4.0, (1.5, 1.5, 1.0, 1.0)),            # the light ones leave their share
    ((4.0, 0.0, 0.0, 0.0), 4, 4.0, (1.0, 0.0, 0.0, 0.0)),            # one device alone: 4x faster
    ((4.0, 0.0, 0.0, 0.0), 4, 2.0, (2.0, 0.0, 0.0, 0.0)),            # ...up to its alone speedup
    ((3.0, 2.0, 1.0), 3, 1.0, (3.0, 2.0, 1.0)),                      # independent devices
])
def test_shared_finish_times(seconds, capacity, speedup, expected):
  assert shared_finish_times(seconds, 1, capacity, speedup) == pytest.approx(expected)


def test_shared_finish_times_keep_the_total_work():
  rng = np.random.default_rng(0)
  for _ in range(20):
    seconds = rng.uniform(0, 1, size=int(rng.integers(1, 8)))
    finish = shared_finish_times(seconds, 1, 8, 8.0)
    # with the host's whole capacity available to any one device, it never idles until the last finishes
    assert max(finish) == pytest.approx(seconds.sum() / 8 if len(seconds) > 1 else seconds[0] / 8)
    assert all(f <= s + 1e-12 for f, s in zip(finish, seconds))


def test_uneven_counts_on_a_shared_host_cost_the_same_total_work():
  w = models.get("mlp-tiny")
  profile = profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))
  spec = DeviceSpec("cpu", 1e10, 1e10, 2**34, 1e9, measured=True)
  plain = Cluster.parse("1x8xcpu", devices={"cpu": spec})
  shared = plain.replace(hosts=(dataclasses.replace(plain.hosts[0], alone_speedup=8.0),))
  positions = tuple(range(8))
  uneven = (8, 8, 4, 4, 2, 2, 2, 2)
  compute = lambda c, counts: evaluate(c, profile, positions, 2, 0, "none", global_batch=64, counts_rule=counts, name="x").compute_seconds
  assert compute(shared, uneven) == pytest.approx(compute(shared, (4,) * 8))
  # independent devices: the two devices with 8 microbatches set the pace
  assert compute(plain, uneven) > 1.5 * compute(plain, (4,) * 8)


@pytest.mark.timeout(300)
def test_a_profiled_cpu_host_records_how_much_faster_a_device_runs_alone():
  from conftest import require_devices

  require_devices(2)
  profile = hs.profile(jax.devices()[:2], message_bytes=(1024,), progress=False)
  host = Cluster.from_profile(profile).hosts[0]
  ratio = min(d.peak("float32", busy=False) / d.peak("float32") for d in profile.devices)
  assert 1.0 <= host.alone_speedup <= host.count
  assert host.alone_speedup == (1.0 if ratio < 1.5 else pytest.approx(min(ratio, 2.0)))
  for device in profile.devices:
    assert 0 < device.busy_copy_bandwidth and device.bandwidth == device.busy_copy_bandwidth
    assert device.busy_read_bandwidth > 0
  spec = profile.device_spec(profile.devices[0].kind)
  # a read-only pass faster than a copy's rate is kept; otherwise reads and writes share the copy's rate
  fastest_read = min(d.busy_read_bandwidth for d in profile.devices)
  assert spec.read_bandwidth == (fastest_read if fastest_read > spec.memory_bandwidth else None)
  # a CPU's private cache, and the rate at which a loop rewrites a value that fits it
  from hetspmd.hardware.profiler import private_cache_bytes

  assert all(d.cache_bytes == private_cache_bytes() for d in profile.devices)
  if private_cache_bytes():
    assert all(d.busy_cache_write_bandwidth > 0 for d in profile.devices)
    assert spec.cache_bytes == private_cache_bytes()
    assert spec.cache_write_bandwidth == min(d.busy_cache_write_bandwidth for d in profile.devices)
  else:
    assert spec.cache_bytes is None and spec.cache_write_bandwidth is None


def _sysfs_cpu(root, siblings, caches):
  (root / "topology").mkdir(parents=True)
  (root / "topology" / "thread_siblings_list").write_text(siblings + "\n")
  for i, (kind, size, shared) in enumerate(caches):
    entry = root / "cache" / f"index{i}"
    entry.mkdir(parents=True)
    for name, value in (("type", kind), ("size", size), ("shared_cpu_list", shared)):
      (entry / name).write_text(value + "\n")
  return str(root)


@pytest.mark.parametrize("siblings,caches,expected", [
    ("0", [("Data", "48K", "0"), ("Instruction", "64K", "0"), ("Unified", "2048K", "0"), ("Unified", "491520K", "0-1")],
     2 * 2**20),                                                          # L2 per core, L3 shared by two cores
    ("0,4", [("Data", "32K", "0,4"), ("Unified", "1024K", "0,4"), ("Unified", "32M", "0-7")], 2**20),  # hyperthreads
    ("0", [("Data", "32K", "0"), ("Instruction", "32K", "0")], 32 * 2**10),   # only L1
    ("0", [("Unified", "8M", "0-3")], 0),                                  # nothing private
])
def test_private_cache_bytes_reads_the_largest_cache_a_core_has_to_itself(tmp_path, siblings, caches, expected):
  from hetspmd.hardware.profiler import private_cache_bytes

  assert private_cache_bytes(_sysfs_cpu(tmp_path / "cpu0", siblings, caches)) == expected


def test_private_cache_bytes_is_zero_without_sysfs(tmp_path):
  from hetspmd.hardware.profiler import private_cache_bytes

  assert private_cache_bytes(str(tmp_path / "missing")) == 0


@pytest.fixture(scope="module")
def gpt_profile():
  w = models.get("gpt2-tiny")
  return profile_step(w.make_train_step(), w.abstract_state(), w.example_batch(2))


def test_trace_tells_forward_from_backward(gpt_profile):
  graph = gpt_profile.traces[0]
  dots = [n for n in graph.nodes if n.primitive == "dot_general"]
  forward = [n for n in dots if n.phase == "forward"]
  backward = [n for n in dots if n.phase == "backward"]
  # every forward matmul has two in the backward pass (input and weight gradients)
  assert len(forward) == 13 and len(backward) == 2 * len(forward)
  # the optimizer update is outside the differentiated function: Adam's sqrt(nu), one per parameter
  params = [i for i in graph.inputs if i.role is hs.Role.PARAM]
  assert sum(n.primitive == "sqrt" and n.phase == "" for n in graph.nodes) == len(params)


def test_remat_policies_trade_compute_for_activations(gpt_profile):
  from hetspmd.planner.data_axis import microbatch_bytes

  spec = DeviceSpec("x", 1e13, 1e13, 2**34, 1e11, measured=True)
  mb = 8
  whole = gpt_profile.microbatch_seconds(spec, mb)
  all_dots, dots, full = (gpt_profile.recompute_seconds(spec, mb, p) for p in ("all_dots", "dots", "full"))
  assert gpt_profile.recompute_seconds(spec, mb, "none") == 0.0
  assert 0 < all_dots < dots < full < whole / 2  # the forward pass is about a third of forward + backward
  peaks = [microbatch_bytes(gpt_profile, mb, p) for p in ("dots", "all_dots", "none")]
  assert 0 < peaks[0] < peaks[1] < peaks[2] == gpt_profile.activation.at(mb)
  # the whole loss checkpointed without a policy: the backward pass stores every residual again
  assert microbatch_bytes(gpt_profile, mb, "full") == peaks[2]
  with pytest.raises(ValueError, match="remat policy"):
    microbatch_bytes(gpt_profile, mb, "some")
  # the saved weight-matmul outputs: (query/key/value, projection, two MLP) per layer and the logits;
  # all_dots adds attention's scores and weighted values
  assert gpt_profile.saved.at(mb) > 0 and gpt_profile.saved_batched.at(mb) > 0
  assert gpt_profile.saved_bytes("all_dots", mb) == gpt_profile.saved.at(mb) + gpt_profile.saved_batched.at(mb)
  assert gpt_profile.saved_bytes("full", mb) == gpt_profile.saved_bytes("none", mb) == 0.0


def test_remat_counts_recomputed_matmuls_and_reductions_not_fused_elementwise_work(gpt_profile):
  nodes = gpt_profile.traces[0].nodes
  full, dots = gpt_profile.recomputed("full"), gpt_profile.recomputed("dots")
  all_dots = gpt_profile.recomputed("all_dots")
  forward_dots = [n.id for n in nodes if n.primitive == "dot_general" and n.phase == "forward"]
  batched = [i for i in forward_dots if nodes[i].param("dimension_numbers")[1][0]]  # attention's two per layer
  assert len(batched) == 4 and all(full[i] for i in forward_dots) and [i for i in forward_dots if dots[i]] == batched
  assert not any(all_dots[i] for i in forward_dots)
  assert all(all_dots[i] == dots[i] for i in range(len(nodes)) if i not in forward_dots)  # reductions and gathers
  assert any(full[n.id] for n in nodes if n.primitive == "reduce_max")  # softmax and loss maxima: own kernels
  elementwise = [n.id for n in nodes if n.phase == "forward" and n.primitive in ("add", "mul", "tanh", "exp")]
  assert elementwise and not any(full[i] or dots[i] for i in elementwise)


def test_gradient_all_reduces_are_counted_as_the_runtime_issues_them(gpt_profile):
  from hetspmd.planner.data_axis import allreduce_seconds, gradient_reductions

  leaves = len(gpt_profile.param_leaf_sizes)
  assert leaves == 28 and max(gpt_profile.param_leaf_sizes) * 4 <= 2**20
  assert gradient_reductions(gpt_profile, 1) == 1            # every leaf is small: one bucket
  assert gradient_reductions(gpt_profile, 2) == leaves + 2   # with a model axis: one per leaf, loss and weight
  cluster = Cluster.parse("8xV100-32GB")
  one, many = (allreduce_seconds(cluster, range(8), 1e6, reductions=r) for r in (1, 30))
  assert many - one == pytest.approx(29 * 2 * 7 * cluster.hosts[0].intra.latency)


def test_device_spec_and_link_have_what_passes_read():
  """passes prices devices and links through protocols of its own; the hardware values must provide them."""
  import inspect

  from hetspmd.hardware.profiler import device_spec
  from hetspmd.hardware.devices import link
  from hetspmd.passes.costing.step_cost import Device
  from hetspmd.passes.sharding.strategies import LinkLike

  for protocol, value in ((Device, device_spec("V100-16GB")), (LinkLike, link("nvlink"))):
    members = [n for n, _ in inspect.getmembers(protocol) if not n.startswith("_")]
    assert members and all(hasattr(value, n) for n in members), (protocol.__name__, members)
