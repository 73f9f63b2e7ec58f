"""accum_jax.value_and_grad data-parallel over 8 CPU devices.

The references are computed on one device without accum_jax: the full-batch
jax.value_and_grad, or explicit Python loops over devices and microbatches.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mlp, mse_loss, normal, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax.testing import collective_counts

NUM_DEVICES = 8
NUM_MICROBATCHES = 2
BATCH_SIZE = 32  # 8 devices x 2 microbatches x 2 rows
IN_FEATURES = 4
WIDTH = 16


def data_mesh():
  return jax.make_mesh((NUM_DEVICES,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


# Data are made with numpy: every eager jax operation on a new shape is one
# more compilation.


def make_params():
  return {
      "w1": normal(0, (IN_FEATURES, WIDTH), 0.5),
      "b1": np.full((WIDTH,), 0.1, np.float32),
      "w2": normal(1, (WIDTH, 1), 0.25),
      "b2": np.full((1,), -0.1, np.float32),
  }


def make_batch(batch_size=BATCH_SIZE, seed=10):
  return {"x": normal(seed, (batch_size, IN_FEATURES)), "y": normal(seed + 1, (batch_size,))}


def sequence_loss(params, batch):
  """The token mean of one (micro)batch of masked, variable-length sequences."""
  errors = (mlp(params, batch["x"]) - batch["y"]) ** 2
  return jnp.sum(batch["mask"] * errors) / jnp.sum(batch["mask"])


def num_tokens(batch):
  return jnp.sum(batch["mask"])


def make_sequences(max_len=4, seed=20):
  # Devices see very different numbers of tokens (the first half of the batch
  # has one token per sequence, with larger targets): only one normalisation
  # by the global number of tokens gives the token mean.
  lengths = np.random.default_rng(seed).integers(1, max_len + 1, BATCH_SIZE)
  lengths[: BATCH_SIZE // 2] = 1
  mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.float32)
  y = normal(seed + 1, (BATCH_SIZE, max_len)) + 2.0 * (lengths == 1)[:, None]
  x = normal(seed + 2, (BATCH_SIZE, max_len, IN_FEATURES))
  return {"x": x, "y": y.astype(np.float32), "mask": mask}


def running_mean_loss(params, state, batch):
  """A BatchNorm-like layer by hand: the loss depends on the threaded state."""
  mean = 0.9 * state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
  new_state = {"mean": mean, "num_updates": state["num_updates"] + 1}
  return mse_loss(params, dict(batch, x=batch["x"] - mean)), (new_state, None)


def tree_mean(trees):
  """The mean of pytrees, in numpy."""
  return jax.tree.map(lambda *xs: sum(map(np.asarray, xs)) / len(xs), *trees)


@functools.cache
def reference(fun, has_aux=False):
  return jax.jit(jax.value_and_grad(fun, has_aux=has_aux))


@functools.cache
def data_parallel(fun, **options):
  # param_sharding=P(): under jax.jit with automatic axes the replicated
  # parameters must say so (or an UnknownShardingWarning says it cannot tell).
  vg = accum_jax.value_and_grad(
      fun, NUM_MICROBATCHES,
          data_parallel=accum_jax.DataParallel(
              mesh=data_mesh(), data_axis="data", param_sharding=P()), **options
  )
  return jax.jit(vg)


def test_data_parallel_equals_the_single_device_full_batch():
  params, batch = make_params(), make_batch()
  value, grads = data_parallel(mse_loss)(params, batch)
  expected_value, expected_grads = reference(mse_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_a_batch_padded_to_a_multiple_of_the_devices_times_microbatches():
  # 8 devices x 2 microbatches need a multiple of 16 rows: 30 get 2 rows of no tokens.
  params = make_params()
  batch = {key: value[:30] for key, value in make_sequences().items()}
  padded = jax.tree.map(lambda x: np.pad(x, [(0, 2)] + [(0, 0)] * (x.ndim - 1)), batch)
  value, grads = data_parallel(sequence_loss, weight_fn=num_tokens)(params, padded)
  expected_value, expected_grads = reference(sequence_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_the_ambient_mesh_is_used_when_only_data_axis_is_given():
  params, batch = make_params(), make_batch()
  vg = jax.jit(accum_jax.value_and_grad(mse_loss, NUM_MICROBATCHES,
      data_parallel=accum_jax.DataParallel(data_axis="data", param_sharding=P())))
  with jax.set_mesh(data_mesh()):
    value, grads = vg(params, batch)
  expected_value, expected_grads = reference(mse_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_token_weights_across_devices_give_the_full_batch_token_mean():
  params, batch = make_params(), make_sequences()
  vg = data_parallel(sequence_loss, weight_fn=num_tokens, return_info=True)
  value, grads, info = vg(params, batch)
  expected_value, expected_grads = reference(sequence_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  # The weights of all devices were summed.
  assert float(info.total_weight) == float(batch["mask"].sum())
  assert int(info.num_skipped) == 0


def per_device_state_reference(params, state, batch, num_microbatches):
  """Each device threads the state through its own microbatches, in order;
  the gradients are averaged over all microbatches and the devices' final
  states are averaged (integer counters agree across devices)."""
  one_microbatch = reference(running_mean_loss, has_aux=True)
  rows = BATCH_SIZE // NUM_DEVICES // num_microbatches
  values, grads, final_states = [], [], []
  for device in range(NUM_DEVICES):
    device_state = state
    for i in range(num_microbatches):
      start = (device * num_microbatches + i) * rows
      mb = jax.tree.map(lambda x, start=start: x[start : start + rows], batch)
      (value, (device_state, _)), g = one_microbatch(params, device_state, mb)
      values.append(value)
      grads.append(g)
    final_states.append(device_state)
  final_state = {
      "mean": tree_mean([s["mean"] for s in final_states]),
      "num_updates": final_states[0]["num_updates"],
  }
  return (tree_mean(values), (final_state, None)), tree_mean(grads)


def test_threaded_state_is_threaded_per_device_then_averaged():
  params, batch = make_params(), make_batch()
  state = {"mean": np.full((IN_FEATURES,), 0.5, np.float32), "num_updates": np.int32(0)}
  vg = data_parallel(running_mean_loss, batch_argnums=2, state_argnums=1, has_aux=True)
  (value, (final_state, _)), grads = vg(params, state, batch)
  (expected_value, (expected_state, _)), expected_grads = per_device_state_reference(
      params, state, batch, NUM_MICROBATCHES
  )
  assert int(final_state["num_updates"]) == NUM_MICROBATCHES
  assert final_state["num_updates"].dtype == jnp.int32
  tree_allclose(final_state, expected_state)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def dropout_loss(params, batch, key):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), h / 0.5, 0.0)
  return jnp.mean(((h @ params["w2"] + params["b2"])[:, 0] - batch["y"]) ** 2)


def test_each_device_and_microbatch_gets_its_own_dropout_key():
  params, batch, key = make_params(), make_batch(), jax.random.key(5)
  vg = data_parallel(dropout_loss, rng_argnums=2)
  value, grads = vg(params, batch, key)
  # Microbatch i on device d sees fold_in(fold_in(key, i), d).
  one_microbatch = reference(dropout_loss)
  rows = BATCH_SIZE // NUM_DEVICES // NUM_MICROBATCHES
  outs = []
  for device in range(NUM_DEVICES):
    for i in range(NUM_MICROBATCHES):
      start = (device * NUM_MICROBATCHES + i) * rows
      mb = jax.tree.map(lambda x, start=start: x[start : start + rows], batch)
      device_key = jax.random.fold_in(jax.random.fold_in(key, i), device)
      outs.append(one_microbatch(params, mb, device_key))
  expected_value, expected_grads = tree_mean(outs)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


# Where the cross-device reductions are.


@functools.cache
def data_parallel_step_hlo() -> str:
  """The compiled text of a data-parallel step of 4 microbatches (test_xla_facts.py
  reads it too)."""
  vg = accum_jax.value_and_grad(mse_loss, 4,
      data_parallel=accum_jax.DataParallel(mesh=data_mesh(), data_axis="data", param_sharding=P()))
  return jax.jit(vg).lower(make_params(), make_batch()).compile().as_text()


def test_gradients_are_reduced_once_after_the_loop_not_per_microbatch():
  counts = collective_counts(data_parallel_step_hlo())
  # Into how many all-reduces XLA makes the one reduction of the sums, weights and
  # counts is its choice: test_xla_facts.py.
  assert counts.in_loop == 0 and counts.outside_loop >= 1, counts


def plain_scan_value_and_grad(params, batch, num_microbatches=4):
  """The obvious way: lax.scan over microbatches of a sharded batch."""
  microbatches = jax.tree.map(lambda x: x.reshape(num_microbatches, -1, *x.shape[1:]), batch)

  def body(total, microbatch):
    out = jax.value_and_grad(mse_loss)(params, microbatch)
    return jax.tree.map(jnp.add, total, out), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
  total, _ = jax.lax.scan(body, zeros, microbatches)
  return jax.tree.map(lambda x: x / num_microbatches, total)


def test_a_plain_scan_over_a_sharded_batch_reduces_inside_the_loop():
  # The problem the data-parallel path solves: one all-reduce per microbatch.
  mesh = data_mesh()
  params = jax.device_put(make_params(), NamedSharding(mesh, P()))
  batch = jax.device_put(make_batch(), NamedSharding(mesh, P("data")))
  hlo = jax.jit(plain_scan_value_and_grad).lower(params, batch).compile().as_text()
  assert collective_counts(hlo).in_loop > 0


# Errors.


def test_a_data_axis_that_is_not_in_the_mesh_is_refused():
  vg = accum_jax.value_and_grad(mse_loss, 2,
      data_parallel=accum_jax.DataParallel(mesh=data_mesh(), data_axis="batch"))
  with pytest.raises(ValueError, match=re.escape("data_axis='batch' is not an axis of the mesh")):
    vg(make_params(), make_batch())


def test_a_multi_axis_mesh_needs_a_data_axis():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  vg = accum_jax.value_and_grad(mse_loss, 2, data_parallel=accum_jax.DataParallel(mesh=mesh))
  with pytest.raises(ValueError, match=re.escape("data_axis= to name the one")):
    vg(make_params(), make_batch())


def test_a_batch_that_does_not_split_over_devices_and_microbatches_is_refused():
  vg = accum_jax.value_and_grad(mse_loss, 2,
      data_parallel=accum_jax.DataParallel(mesh=data_mesh(), data_axis="data"))
  # 24 rows split over 8 devices, but not into 2 microbatches on each.
  with pytest.raises(
      ValueError,
      match=re.escape("A batch of 24 does not split into num_microbatches=2 on each of 8 devices"),
  ):
    vg(make_params(), make_batch(24))


def test_stacked_aux_is_refused_with_a_mesh_when_the_function_is_made():
  with pytest.raises(ValueError, match=re.escape("aux_reduction='stack' is not available")):
    accum_jax.value_and_grad(
        lambda p, b: (mse_loss(p, b), None),
        2,
        has_aux=True,
        aux_reduction="stack",
        data_parallel=accum_jax.DataParallel(mesh=data_mesh(), data_axis="data"))


# Before JAX 0.10 the same bug fails otherwise: a ValueError under jax.jit on 0.7.1, the
# oldest JAX that pyproject.toml accepts ("Collective psum_invariant must be applied to
# a device-varying type").
@pytest.mark.xfail(
    strict=True,
    raises=AssertionError if jax.__version_info__ >= (0, 10) else (AssertionError, ValueError),
    reason=("A JAX bug (docs/development.md): with the varying-axis checks on, a collective"
            " over a vmap axis name inside shard_map (the pmean of eqx.nn.BatchNorm) fails"
            " with a bare AssertionError in pvary, so accum_jax's shard_map keeps"
            " check_vma=False; when this passes, turn the checks on in"
            " _across_devices.map_devices"))
def test_jax_checks_a_vmap_named_collective_inside_shard_map():
  def per_device(x):
    return jax.vmap(lambda y: jax.lax.pmean(jnp.mean(y), "batch"), axis_name="batch")(x)

  step = jax.shard_map(per_device, mesh=data_mesh(), in_specs=P("data"), out_specs=P("data"))
  jax.jit(step)(jnp.arange(64.0).reshape(16, 4))
