"""accum_jax.value_and_grad and accum_jax.grad on one device.

Every result is compared with a reference computed without accum_jax: either
jax.value_and_grad on the whole batch, or an explicit Python loop of
jax.value_and_grad over the microbatches.
"""

import functools
import inspect
import re

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp, mse_loss, normal, tree_allclose

import accum_jax

BATCH_SIZE = 8
IN_FEATURES = 4
WIDTH = 16


# Models and losses. Module level, so that the caches below see the same
# function objects on every call. Data are made with numpy: every eager jax
# operation on a new shape is one more compilation.


def with_value(array, index, value):
  """A copy of ``array`` with ``array[index] = value``."""
  array = np.array(array)
  array[index] = value
  return array


def make_mlp_params(dtype=np.float32, seed=0):
  return {
      "w1": normal(seed, (IN_FEATURES, WIDTH), 0.5).astype(dtype),
      "b1": normal(seed + 1, (WIDTH,), 0.1).astype(dtype),
      "w2": normal(seed + 2, (WIDTH, 1), 0.25).astype(dtype),
      "b2": np.full((1,), 0.1, dtype),
  }


def make_batch(batch_size=BATCH_SIZE, seed=10):
  return {"x": normal(seed, (batch_size, IN_FEATURES)), "y": normal(seed + 1, (batch_size,))}


def scaled_loss_with_aux(params, scale, batch):
  pred = mlp(params, batch["x"])
  return scale * jnp.mean((pred - batch["y"]) ** 2), {"pred_mean": jnp.mean(pred)}


def batch_first_loss(batch, params):
  return mse_loss(params, batch)


def inputs_targets_loss(params, inputs, targets):
  return jnp.mean((mlp(params, inputs) - targets) ** 2)


def nested_batch_loss(params, batch):
  (x_left, right), y = batch["inputs"], batch["y"]
  x = jnp.concatenate([x_left, right["x_right"].reshape(x_left.shape[0], -1)], axis=-1)
  return jnp.mean((mlp(params, x) - y) ** 2)


def sequence_loss(params, batch):
  """The token mean of one (micro)batch of masked, variable-length sequences."""
  errors = (mlp(params, batch["x"]) - batch["y"]) ** 2
  return jnp.sum(batch["mask"] * errors) / jnp.sum(batch["mask"])


def num_tokens(batch):
  return jnp.sum(batch["mask"])


def dropout_loss(params, batch, key):
  h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
  keep = jax.random.bernoulli(key, 0.5, h.shape)
  pred = (jnp.where(keep, h / 0.5, 0.0) @ params["w2"] + params["b2"])[:, 0]
  return jnp.mean((pred - batch["y"]) ** 2), keep


def running_mean_loss(params, state, batch):
  """A BatchNorm-like layer by hand: the loss depends on the threaded state."""
  mean = 0.9 * state["mean"] + 0.1 * jnp.mean(batch["x"], axis=0)
  new_state = {"mean": mean, "num_updates": state["num_updates"] + 1}
  pred = mlp(params, batch["x"] - mean)
  return jnp.mean((pred - batch["y"]) ** 2), (new_state, {"pred_mean": jnp.mean(pred)})


class BatchNormMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.8)(x)
    return nn.Dense(1)(jnp.tanh(x))[..., 0]


BATCH_NORM_MLP = BatchNormMLP()


def flax_batch_norm_loss(params, batch_stats, batch):
  pred, updates = BATCH_NORM_MLP.apply(
      {"params": params, "batch_stats": batch_stats}, batch["x"], mutable=["batch_stats"]
  )
  return jnp.mean((pred - batch["y"]) ** 2), (updates["batch_stats"], None)


def weighted_loss_with_metrics(params, batch):
  errors = (mlp(params, batch["x"]) - batch["y"]) ** 2
  loss = jnp.sum(batch["w"] * errors) / jnp.sum(batch["w"])
  return loss, {"loss": loss, "max_error": jnp.max(errors)}


def row_weight(batch):
  return jnp.sum(batch["w"])


def linear_loss(w, x):
  return jnp.mean(x @ w)


# Compiled functions, shared between tests that use the same options.


def microbatched(fun, num_microbatches, **options):
  """``jax.jit(accum_jax.value_and_grad(...))``, compiled once per set of options."""
  return _microbatched(fun, num_microbatches, tuple(sorted(options.items())))


@functools.cache
def _microbatched(fun, num_microbatches, options):
  return jax.jit(accum_jax.value_and_grad(fun, num_microbatches, **dict(options)))


@functools.cache
def reference(fun, argnums=0, has_aux=False):
  return jax.jit(jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux))


# Helpers for the references and for reading jaxprs.


def split(tree, num_microbatches):
  """The microbatches, as a Python list of pytrees."""
  size = jax.tree.leaves(tree)[0].shape[0] // num_microbatches
  return [
      jax.tree.map(lambda x, i=i: x[i * size : (i + 1) * size], tree)
      for i in range(num_microbatches)
  ]


def tree_mean(trees, weights=None):
  """The (weighted) mean of pytrees, in numpy."""
  weights = [1.0] * len(trees) if weights is None else [float(w) for w in weights]
  return jax.tree.map(
      lambda *xs: sum(w * np.asarray(x) for w, x in zip(weights, xs)) / sum(weights), *trees
  )


def take_rows(tree, rows):
  return jax.tree.map(lambda x: x[np.asarray(rows)], tree)


def subjaxprs(eqn):
  for value in eqn.params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, jax.extend.core.ClosedJaxpr):
        yield v.jaxpr
      elif isinstance(v, jax.extend.core.Jaxpr):
        yield v


def all_eqns(jaxpr):
  """Every equation of ``jaxpr``, nested jaxprs (pjit, scan, custom_jvp...) included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in subjaxprs(eqn):
      yield from all_eqns(sub)


def count_primitive(jaxpr, name):
  return sum(eqn.primitive.name == name for eqn in all_eqns(jaxpr))


def the_scan(closed_jaxpr):
  """The microbatch loop: the one top-level loop.

  With ``skip_nonfinite`` the recheck's loop sits in a conditional beside it.
  """
  loops = [eqn for eqn in closed_jaxpr.jaxpr.eqns if eqn.primitive.name in ("scan", "while")]
  assert len(loops) == 1, f"expected one loop, found {len(loops)}"
  return loops[0]


def count_outside_loops(jaxpr, name):
  """Equations named ``name`` in ``jaxpr`` outside every loop's body."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == name
    if eqn.primitive.name not in ("scan", "while"):
      count += sum(count_outside_loops(sub, name) for sub in subjaxprs(eqn))
  return count


# 1. Same call and return structure as jax.value_and_grad, same values.


@pytest.mark.parametrize("num_microbatches", [1, 2, 4, BATCH_SIZE])
def test_value_and_grad_equals_the_full_batch_for_every_num_microbatches(num_microbatches):
  params, batch = make_mlp_params(), make_batch()
  value, grads = microbatched(mse_loss, num_microbatches)(params, batch)
  expected_value, expected_grads = reference(mse_loss)(params, batch)
  assert value.shape == () and value.dtype == expected_value.dtype
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_a_strided_split_gives_microbatch_i_the_rows_i_plus_multiples_of_n():
  def first_row_index(params, batch):
    return mse_loss(params, batch), batch["row"][0]

  params, batch = make_mlp_params(), make_batch()
  batch["row"] = np.arange(BATCH_SIZE)
  vg = microbatched(first_row_index, 4, has_aux=True, aux_reduction="stack",
      data_parallel=accum_jax.DataParallel(split="strided"))
  (value, rows), grads = vg(params, batch)
  np.testing.assert_array_equal(rows, np.arange(4))  # microbatch i starts at row i
  expected_value, expected_grads = reference(mse_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_a_batch_padded_with_rows_of_zero_weight_gives_the_unpadded_batch():
  # 7 rows into 4 microbatches: the user appends one row of zeros, whose weight is 0.
  params = make_mlp_params()
  batch = {key: value[:7] for key, value in make_weighted_batch().items()}
  padded = jax.tree.map(lambda x: np.pad(x, [(0, 1)] + [(0, 0)] * (x.ndim - 1)), batch)
  vg = microbatched(
      weighted_loss_with_metrics, 4, has_aux=True, weight_fn=row_weight, return_info=True,
  )
  (value, _), grads, info = vg(params, padded)
  (expected_value, _), expected_grads = reference(weighted_loss_with_metrics, has_aux=True)(
      params, batch
  )
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  assert float(info.total_weight) == float(batch["w"].sum())


def test_keyword_arguments_reach_fun_unsplit_and_undifferentiated():
  def scaled_loss(params, batch, *, scale):
    return scale * mse_loss(params, batch)

  params, batch = make_mlp_params(), make_batch()
  vg = jax.jit(accum_jax.value_and_grad(scaled_loss, 4))
  value, grads = vg(params, batch, scale=jnp.float32(3.0))
  expected_value, expected_grads = jax.value_and_grad(scaled_loss)(params, batch, scale=3.0)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_num_microbatches_may_be_a_numpy_or_concrete_jax_integer():
  params, batch = make_mlp_params(), make_batch()
  for n in (np.int64(4), jnp.int32(4)):
    value, _ = accum_jax.value_and_grad(mse_loss, n)(params, batch)
    tree_allclose(value, reference(mse_loss)(params, batch)[0])


def test_tuple_argnums_with_aux_return_the_structure_of_jax_value_and_grad():
  params, scale, batch = make_mlp_params(), jnp.float32(1.5), make_batch()
  options = dict(argnums=(0, 1), batch_argnums=2, has_aux=True)
  out = microbatched(scaled_loss_with_aux, 4, **options)(params, scale, batch)
  expected = reference(scaled_loss_with_aux, argnums=(0, 1), has_aux=True)(params, scale, batch)
  # ((value, aux), (grad_params, grad_scale)), as jax.value_and_grad returns.
  tree_allclose(out, expected)


def test_an_int_argnums_after_the_batch_returns_the_gradient_of_that_argument():
  params, batch = make_mlp_params(), make_batch()
  out = microbatched(batch_first_loss, 2, argnums=1, batch_argnums=0)(batch, params)
  tree_allclose(out, reference(batch_first_loss, argnums=1)(batch, params))


def test_two_batch_arguments_are_split_together():
  params, batch = make_mlp_params(), make_batch()
  out = microbatched(inputs_targets_loss, 4, batch_argnums=(1, 2))(params, batch["x"], batch["y"])
  tree_allclose(out, reference(inputs_targets_loss)(params, batch["x"], batch["y"]))


def class_weighted_loss(w, x, class_weight):
  labels = x[:, 0].astype(jnp.int32)  # each row's class, in its first column
  return jnp.mean(class_weight[labels] * (x[:, 1:] @ w - 1.0) ** 2)


def test_an_argument_of_the_batchs_length_is_not_split_unless_named_as_the_batch():
  # Per-class weights, as many classes as rows, beside bare inputs: batch_argnums=1
  # by default, as optax.microbatching's, so the vector reaches every microbatch whole.
  x = np.concatenate([np.arange(8.0)[:, None], np.arange(16.0).reshape(8, 2) / 16], 1)
  w, class_weight = np.ones(2, np.float32), np.arange(1.0, 9.0, dtype=np.float32)
  out = microbatched(class_weighted_loss, 2)(w, x.astype(np.float32), class_weight)
  tree_allclose(out, reference(class_weighted_loss)(w, x.astype(np.float32), class_weight))


def test_the_batch_argument_is_one_by_default_as_in_optax_microbatching():
  default = inspect.signature(accum_jax.value_and_grad).parameters["batch_argnums"].default
  assert default == 1


def test_batch_argnums_none_is_refused_naming_the_arguments_to_split():
  with pytest.raises(ValueError, match=re.escape(
      "batch_argnums=None does not say which arguments are the batch, and they are not"
      " guessed from shapes: name them, e.g. batch_argnums=1 (the default)")):
    accum_jax.value_and_grad(inputs_targets_loss, 2, batch_argnums=None)


def test_nested_pytree_batches_are_split_leaf_by_leaf():
  params, flat = make_mlp_params(), make_batch()
  batch = {
      "inputs": (flat["x"][:, :2], {"x_right": flat["x"][:, 2:].reshape(BATCH_SIZE, 1, 2)}),
      "y": flat["y"],
  }
  out = microbatched(nested_batch_loss, 4)(params, batch)
  tree_allclose(out, reference(nested_batch_loss)(params, batch))


def test_grad_returns_what_jax_grad_returns_with_aux_and_info():
  params, scale, batch = make_mlp_params(), jnp.float32(1.5), make_batch()
  grad = accum_jax.grad(scaled_loss_with_aux, 2, batch_argnums=2, has_aux=True, return_info=True)
  (grads, aux), info = jax.jit(grad)(params, scale, batch)
  (_, expected_aux), expected_grads = reference(scaled_loss_with_aux, has_aux=True)(
      params, scale, batch
  )
  tree_allclose((grads, aux), (expected_grads, expected_aux))
  assert isinstance(info, accum_jax.MicrobatchInfo)
  assert int(info.num_skipped) == 0 and float(info.total_weight) == 2.0


def test_grad_without_aux_returns_only_the_gradient():
  params, batch = make_mlp_params(), make_batch()
  # Not jitted: the eager path gives the same answer.
  grads = accum_jax.grad(mse_loss, 4)(params, batch)
  tree_allclose(grads, reference(mse_loss)(params, batch)[1])


def loss_with_a_frozen_infinite_entry(w, x):
  # w[1] = -inf is a masked entry that the loss never sees through a product.
  return jnp.mean(x * w[0]) + jnp.max(w[1:])


def test_a_parameter_holding_minus_inf_gets_the_gradient_jax_gives():
  w = np.asarray([1.0, -np.inf, 2.0], np.float32)
  x = np.arange(4.0, dtype=np.float32)
  out = microbatched(loss_with_a_frozen_infinite_entry, 2)(w, x)
  tree_allclose(out, jax.value_and_grad(loss_with_a_frozen_infinite_entry)(w, x))


# 2. Memory: the gradient is taken inside each scan iteration.


def test_the_backward_pass_runs_inside_the_one_scan():
  params, batch = make_mlp_params(), make_batch()
  jaxpr = jax.make_jaxpr(accum_jax.value_and_grad(mse_loss, 4))(params, batch)
  scan = the_scan(jaxpr)  # the gradient of a scan would show a second, transposed scan
  forward_dots = count_primitive(jax.make_jaxpr(mse_loss)(params, batch).jaxpr, "dot_general")
  assert forward_dots == 2
  body_dots = count_primitive(scan.params["jaxpr"].jaxpr, "dot_general")
  # Forward (2) and backward (dW2, dh, dW1) matrix products, all in the body;
  # none outside a loop, where a whole-batch forward or backward would sit.
  assert body_dots >= forward_dots + 3
  assert count_outside_loops(jaxpr.jaxpr, "dot_general") == 0


def activation_heavy_loss(params, batch):
  h = jnp.tanh(batch["x"] @ params["w1"])
  h = jnp.tanh(h @ params["w2"])
  return jnp.mean((jnp.sum(h, axis=-1) - batch["y"]) ** 2)


def test_more_microbatches_need_much_less_temporary_memory():
  # Activations (512 rows x 256 wide, twice) dominate the parameters.
  width, batch_size = 256, 512
  params = {"w1": np.full((IN_FEATURES, width), 0.01), "w2": np.full((width, 64), 0.01)}
  batch = {"x": np.ones((batch_size, IN_FEATURES)), "y": np.ones((batch_size,))}

  def temp_bytes(num_microbatches):
    vg = accum_jax.value_and_grad(activation_heavy_loss, num_microbatches)
    return jax.jit(vg).lower(params, batch).compile().memory_analysis().temp_size_in_bytes

  assert temp_bytes(8) < 0.5 * temp_bytes(1)


# 3. Token weights.


SEQUENCE_LENGTHS = (8, 8, 7, 8, 1, 2, 1, 1)


def make_sequences(lengths=SEQUENCE_LENGTHS, max_len=8, seed=20):
  lengths = np.asarray(lengths)
  mask = (np.arange(max_len)[None, :] < lengths[:, None]).astype(np.float32)
  # Short sequences have larger targets: their microbatches have larger losses.
  y = normal(seed, (len(lengths), max_len)) + 3.0 * (lengths < 4)[:, None]
  x = normal(seed + 1, (len(lengths), max_len, IN_FEATURES))
  return {"x": x, "y": y.astype(np.float32), "mask": mask}


def test_token_weights_give_the_full_batch_token_mean():
  params, batch = make_mlp_params(), make_sequences()
  value, grads = microbatched(sequence_loss, 4, weight_fn=num_tokens)(params, batch)
  expected_value, expected_grads = reference(sequence_loss)(params, batch)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_without_weights_the_mean_of_microbatch_means_is_materially_different():
  params, batch = make_mlp_params(), make_sequences()
  value, grads = microbatched(sequence_loss, 4)(params, batch)
  expected_value, expected_grads = reference(sequence_loss)(params, batch)
  assert abs(float(value) / float(expected_value) - 1) > 0.2
  assert float(jnp.max(jnp.abs(grads["b2"] - expected_grads["b2"]))) > 0.2 * float(
      jnp.max(jnp.abs(expected_grads["b2"]))
  )


def test_a_zero_weight_microbatch_with_a_nan_loss_contributes_nothing():
  params, batch = make_mlp_params(), make_sequences()
  # The last microbatch (rows 6 and 7) is padding: no valid token, NaN inputs.
  padded = dict(
      batch,
      mask=with_value(batch["mask"], slice(6, None), 0.0),
      x=with_value(batch["x"], slice(6, None), np.nan),
  )
  vg = microbatched(sequence_loss, 4, weight_fn=num_tokens, return_info=True)
  value, grads, info = vg(params, padded)
  expected_value, expected_grads = reference(sequence_loss)(params, take_rows(batch, range(6)))
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  assert int(info.num_skipped) == 0
  assert float(info.total_weight) == float(batch["mask"][:6].sum())


# 4. Per-microbatch PRNG keys.


def dropout_reference(params, batch, key, num_microbatches):
  one_microbatch = reference(dropout_loss, has_aux=True)
  outs = [
      one_microbatch(params, mb, jax.random.fold_in(key, i))
      for i, mb in enumerate(split(batch, num_microbatches))
  ]
  values = [value for (value, _), _ in outs]
  masks = [mask for (_, mask), _ in outs]
  grads = [g for _, g in outs]
  return tree_mean(values), np.stack(masks), tree_mean(grads)


@pytest.mark.parametrize("key_kind", ["typed key", "raw uint32 key"])
def test_microbatch_i_uses_fold_in_of_the_key_with_i(key_kind):
  params, batch = make_mlp_params(), make_batch()
  key = jax.random.key(3) if key_kind == "typed key" else jax.random.PRNGKey(3)
  vg = microbatched(
      dropout_loss, 4, batch_argnums=1, rng_argnums=2, has_aux=True, aux_reduction="stack"
  )
  (value, masks), grads = vg(params, batch, key)
  expected_value, expected_masks, expected_grads = dropout_reference(params, batch, key, 4)
  assert masks.shape == (4, BATCH_SIZE // 4, WIDTH)
  np.testing.assert_array_equal(masks, expected_masks)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_a_pytree_of_keys_gets_each_key_folded_with_the_microbatch_index():
  # Linen's rngs={"dropout": key, ...}: every key of the dict is folded in.
  def two_key_loss(params, batch, rngs):
    return dropout_loss(params, batch, rngs["dropout"])[0], (
        jax.random.uniform(rngs["noise"], ()),
    )

  params, batch = make_mlp_params(), make_batch()
  rngs = {"dropout": jax.random.key(3), "noise": jax.random.key(4)}
  vg = microbatched(
      two_key_loss, 4, batch_argnums=1, rng_argnums=2, has_aux=True, aux_reduction="stack"
  )
  (value, (noise,)), grads = vg(params, batch, rngs)
  expected_value, _, expected_grads = dropout_reference(params, batch, rngs["dropout"], 4)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)
  expected_noise = [jax.random.uniform(jax.random.fold_in(rngs["noise"], i), ()) for i in range(4)]
  tree_allclose(noise, np.stack(expected_noise))


def test_dropout_masks_differ_between_microbatches_and_repeat_across_calls():
  params, batch = make_mlp_params(), make_batch()
  vg = microbatched(
      dropout_loss, 4, batch_argnums=1, rng_argnums=2, has_aux=True, aux_reduction="stack"
  )
  (_, masks), grads = vg(params, batch, jax.random.key(3))
  for i in range(1, 4):
    assert not np.array_equal(masks[0], masks[i])
  (_, masks_again), grads_again = vg(params, batch, jax.random.key(3))
  np.testing.assert_array_equal(masks, masks_again)
  tree_allclose(grads, grads_again, rtol=0, atol=0)
  (_, other_masks), _ = vg(params, batch, jax.random.key(4))
  assert not np.array_equal(masks, other_masks)


# 5. Threaded state.


def sequential_reference(fun, params, state, batch, num_microbatches):
  """N forward and backward passes by hand, each starting from the last one's state.

  Each pass is jitted like the scan body under test: eager and compiled
  BatchNorm variances of two rows differ by more than the tolerance.
  """
  one_microbatch = reference(fun, has_aux=True)
  values, grads, auxes = [], [], []
  for mb in split(batch, num_microbatches):
    (value, (state, aux)), g = one_microbatch(params, state, mb)
    values.append(value)
    grads.append(g)
    auxes.append(aux)
  return (tree_mean(values), (state, tree_mean(auxes))), tree_mean(grads)


def test_a_running_mean_threads_through_microbatches_like_sequential_passes():
  params, batch = make_mlp_params(), make_batch()
  state = {"mean": np.full((IN_FEATURES,), 0.5, np.float32), "num_updates": np.int32(0)}
  vg = microbatched(running_mean_loss, 4, batch_argnums=2, state_argnums=1, has_aux=True)
  (value, (final_state, aux)), grads = vg(params, state, batch)
  (expected_value, (expected_state, expected_aux)), expected_grads = sequential_reference(
      running_mean_loss, params, state, batch, 4
  )
  assert int(final_state["num_updates"]) == 4
  assert final_state["num_updates"].dtype == jnp.int32
  tree_allclose(final_state, expected_state)
  tree_allclose(value, expected_value)
  tree_allclose(aux, expected_aux)
  tree_allclose(grads, expected_grads)


def test_flax_batch_norm_statistics_thread_through_microbatches():
  batch = make_batch()
  variables = jax.jit(BATCH_NORM_MLP.init)(jax.random.key(0), batch["x"])
  params, batch_stats = variables["params"], variables["batch_stats"]
  vg = microbatched(flax_batch_norm_loss, 4, batch_argnums=2, state_argnums=1, has_aux=True)
  (value, (final_stats, aux)), grads = vg(params, batch_stats, batch)
  (expected_value, (expected_stats, _)), expected_grads = sequential_reference(
      flax_batch_norm_loss, params, batch_stats, batch, 4
  )
  assert aux is None
  # The statistics moved away from their initial values, once per microbatch.
  assert not np.allclose(final_stats["BatchNorm_0"]["mean"], batch_stats["BatchNorm_0"]["mean"])
  tree_allclose(final_stats, expected_stats)
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


# 6. Aux reductions.


def make_weighted_batch():
  batch = make_batch()
  batch["w"] = np.asarray([1.0, 3.0, 0.5, 0.5, 2.0, 2.0, 4.0, 1.0], np.float32)
  return batch


@pytest.mark.parametrize(
    "aux_reduction, with_weight_fn",
    [
        pytest.param("mean", True, id="weighted mean"),
        pytest.param("mean", False, id="mean"),
        # sum and stack ignore the weights.
        pytest.param("sum", True, id="sum"),
        pytest.param("stack", True, id="stack"),
    ],
)
def test_aux_is_reduced_across_microbatches_as_asked(aux_reduction, with_weight_fn):
  params, batch = make_mlp_params(), make_weighted_batch()
  options = dict(has_aux=True, aux_reduction=aux_reduction)
  if with_weight_fn:
    options["weight_fn"] = row_weight
  (_, aux), _ = microbatched(weighted_loss_with_metrics, 4, **options)(params, batch)
  mbs = split(batch, 4)
  one_microbatch = reference(weighted_loss_with_metrics, has_aux=True)
  per_mb = [one_microbatch(params, mb)[0][1] for mb in mbs]
  if aux_reduction == "mean":
    weights = [np.sum(mb["w"]) for mb in mbs] if with_weight_fn else None
    expected = tree_mean(per_mb, weights)
  elif aux_reduction == "sum":
    expected = jax.tree.map(lambda *xs: sum(np.asarray(x) for x in xs), *per_mb)
  else:
    expected = jax.tree.map(lambda *xs: np.stack(xs), *per_mb)
    assert aux["loss"].shape == (4,)
  tree_allclose(aux, expected)


def test_weighted_mean_of_a_loss_aux_equals_the_full_batch_loss():
  params, batch = make_mlp_params(), make_weighted_batch()
  vg = microbatched(
      weighted_loss_with_metrics, 4, has_aux=True, aux_reduction="mean", weight_fn=row_weight
  )
  (value, aux), grads = vg(params, batch)
  (expected_value, _), expected_grads = reference(weighted_loss_with_metrics, has_aux=True)(
      params, batch
  )
  tree_allclose(value, expected_value)
  tree_allclose(aux["loss"], expected_value)
  tree_allclose(grads, expected_grads)


# 7. Low-precision gradients.


def bf16_problem():
  # Microbatch 0 has gradient 1, the 63 others 2**-9 each: added one by one to
  # a bfloat16 sum near 1 (spacing 2**-7), every 2**-9 is rounded away.
  w = np.zeros((3,), jnp.bfloat16)
  x = with_value(np.full((64, 3), 2.0**-9, jnp.bfloat16), 0, 1.0)
  return w, x


def test_bf16_gradients_accumulate_in_float32_and_come_back_as_bf16():
  w, x = bf16_problem()
  value, grads = microbatched(linear_loss, 64)(w, x)
  assert grads.dtype == jnp.bfloat16 and value.dtype == jnp.bfloat16
  # float32 sums are exact here: the mean is rounded to bfloat16 once, at the
  # end. A bfloat16 running mean, rounded per microbatch, ends one unit away.
  exact = (1.0 + 63 * 2.0**-9) / 64
  np.testing.assert_array_equal(np.asarray(grads, np.float32), float(jnp.bfloat16(exact)))


def test_accumulator_dtype_none_accumulates_in_the_gradient_dtype():
  w, x = bf16_problem()
  value, grads = microbatched(linear_loss, 64, accumulator_dtype=None)(w, x)
  assert grads.dtype == jnp.bfloat16
  # A bfloat16 accumulator holds the running mean, updated in float32 and rounded
  # once per microbatch: within bfloat16's precision (2**-8) of the exact mean,
  # where a bfloat16 running sum would stay at 1 (1 / 64, 11% low).
  exact = (1.0 + 63 * 2.0**-9) / 64
  np.testing.assert_allclose(np.asarray(grads, np.float32), exact, rtol=2**-6)


def test_a_bfloat16_accumulator_saves_two_bytes_per_parameter_over_a_float32_one():
  # What the accumulator dtype costs, from the compiled program: the float32
  # running sums take 4 bytes per parameter, accumulator_dtype=None's 2 (times
  # the copies of the loop carry XLA keeps).
  size = 2**16
  w, x = jax.ShapeDtypeStruct((size,), jnp.bfloat16), jax.ShapeDtypeStruct((16, size), jnp.bfloat16)

  def temp_bytes(accumulator_dtype):
    vg = accum_jax.value_and_grad(linear_loss, 4, accumulator_dtype=accumulator_dtype)
    return jax.jit(vg).lower(w, x).compile().memory_analysis().temp_size_in_bytes

  saved = temp_bytes(jnp.float32) - temp_bytes(None)
  assert saved >= 2 * size


def test_bf16_mlp_gradients_match_float32_reference_to_bf16_precision():
  params = make_mlp_params(jnp.bfloat16)
  batch = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_batch())
  value, grads = microbatched(mse_loss, 4)(params, batch)
  assert all(g.dtype == jnp.bfloat16 for g in jax.tree.leaves(grads))
  params_f32, batch_f32 = jax.tree.map(lambda x: x.astype(np.float32), (params, batch))
  expected_value, expected_grads = reference(mse_loss)(params_f32, batch_f32)
  tree_allclose(value, expected_value, rtol=5e-2, atol=2e-2)
  tree_allclose(grads, expected_grads, rtol=5e-2, atol=2e-2)


# 8. Non-finite microbatches.


@pytest.mark.parametrize("bad_value", [np.nan, np.inf], ids=["nan", "inf"])
def test_with_microbatch_skips_nonfinite_ones_are_counted_and_left_out_of_the_mean(bad_value):
  params, batch = make_mlp_params(), make_batch()
  bad = dict(batch, x=with_value(batch["x"], 3, bad_value))  # row 3: microbatch 1 of 4
  value, grads, info = microbatched(mse_loss, 4, return_info=True,
                                    on_nonfinite="skip_microbatch")(params, bad)
  assert int(info.num_skipped) == 1
  assert float(info.total_weight) == 3.0
  kept = [0, 1, 4, 5, 6, 7]
  expected_value, expected_grads = reference(mse_loss)(params, take_rows(batch, kept))
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_weighted_nonfinite_microbatches_are_left_out_of_the_weighted_mean():
  params, batch = make_mlp_params(), make_sequences()
  bad = dict(batch, y=with_value(batch["y"], (2, 0), np.nan))  # a valid token of microbatch 1
  vg = microbatched(sequence_loss, 4, weight_fn=num_tokens, return_info=True,
                    on_nonfinite="skip_microbatch")
  value, grads, info = vg(params, bad)
  kept = [0, 1, 4, 5, 6, 7]
  expected_value, expected_grads = reference(sequence_loss)(params, take_rows(batch, kept))
  assert int(info.num_skipped) == 1
  assert float(info.total_weight) == float(batch["mask"][np.asarray(kept)].sum())
  tree_allclose(value, expected_value)
  tree_allclose(grads, expected_grads)


def test_with_microbatch_skips_when_every_one_is_skipped_the_loss_and_gradients_are_nan():
  params, batch = make_mlp_params(), make_batch()
  batch["x"] = np.full_like(batch["x"], np.nan)
  value, grads, info = microbatched(mse_loss, 4, return_info=True,
                                    on_nonfinite="skip_microbatch")(params, batch)
  assert np.isnan(value) and all(np.isnan(g).all() for g in jax.tree.leaves(grads))
  assert int(info.num_skipped) == 4 and float(info.total_weight) == 0.0
  # So accumulate skips the window that holds it, whole, and counts its calls.
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=2)
  state = opt.init(params)
  finite = jax.tree.map(np.ones_like, params)
  for call in (grads, finite):
    updates, state = jax.jit(opt.update)(call, state, params)
    tree_allclose(updates, jax.tree.map(np.zeros_like, params))
  assert int(state.num_skipped) == 2 and int(accum_jax.optimizer_step(state)) == 0


@pytest.mark.parametrize("bad_value", [np.nan, np.inf], ids=["nan", "inf"])
def test_by_default_a_nonfinite_step_is_skipped_whole_its_loss_reported_as_it_was(bad_value):
  params, batch = make_mlp_params(), make_batch()
  bad = dict(batch, x=with_value(batch["x"], 3, bad_value))  # row 3: microbatch 1 of 4
  (value, aux), grads, info = microbatched(
      lambda p, b: (mse_loss(p, b), {"loss": mse_loss(p, b)}), 4, has_aux=True,
      return_info=True)(params, bad)
  assert not np.isfinite(value) and not np.isfinite(aux["loss"])
  # NaN in every leaf, never a zero gradient an optimizer would step on.
  assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))
  assert bool(info.step_not_finite) and int(info.num_skipped) == 4
  assert float(info.total_weight) == 0.0
  np.testing.assert_array_equal(info.loss_finite, [True, False, True, True])
  # A finite step is not skipped: the full batch's mean, every loss finite.
  value, grads, info = microbatched(mse_loss, 4, return_info=True)(params, batch)
  tree_allclose((value, grads), reference(mse_loss)(params, batch))
  assert not bool(info.step_not_finite) and int(info.num_skipped) == 0
  np.testing.assert_array_equal(info.loss_finite, [True] * 4)


def test_by_default_a_nan_gradient_under_a_finite_loss_skips_the_step_and_its_state():
  params, batch = make_mlp_params(), make_batch()
  state = {"mean": np.zeros(IN_FEATURES, np.float32)}

  def loss(p, s, b):
    # Rows with a NaN x are masked out of the loss, not out of its gradient.
    ok = jnp.isfinite(b["x"])
    x = jnp.where(ok, b["x"], 0.0)
    value = mse_loss(p, dict(b, x=x)) + jnp.mean(jnp.where(ok, b["x"] * p["w1"][0, 0], 0.0))
    return value, ({"mean": 0.5 * s["mean"] + 0.5 * jnp.mean(x, axis=0)}, ())

  bad = dict(batch, x=with_value(batch["x"], 3, np.nan))
  (value, (new_state, _)), grads, info = microbatched(
      loss, 4, has_aux=True, batch_argnums=2, state_argnums=1, return_info=True
  )(params, state, bad)
  assert np.isfinite(value) and bool(info.step_not_finite)
  assert bool(np.all(info.loss_finite))  # the losses said nothing; the sums did
  assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))
  tree_allclose(new_state, state)  # the state passed in, not the skipped step's


def _masked_loss(p, b):
  # Rows with a NaN x are masked out of the loss, not out of its gradient.
  ok = jnp.isfinite(b["x"])
  x = jnp.where(ok, b["x"], 0.0)
  return mse_loss(p, dict(b, x=x)) + jnp.mean(jnp.where(ok, b["x"] * p["w1"][0, 0], 0.0))


@pytest.mark.parametrize("bad_in", ["loss", "gradient"])
def test_a_call_of_no_option_skips_a_nonfinite_step_as_the_loop_does(bad_in):
  # A call that uses no option runs the plain scan; with return_info it runs the
  # loop. Both judge the step by its sums: NaN in every leaf, its loss as it was.
  params, batch = make_mlp_params(), make_batch()
  bad = dict(batch, x=with_value(batch["x"], 3, np.nan))
  loss = mse_loss if bad_in == "loss" else _masked_loss
  value, grads = microbatched(loss, 4)(params, bad)
  assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))
  assert np.isfinite(value) == (bad_in == "gradient")
  looped, looped_grads, info = microbatched(loss, 4, return_info=True)(params, bad)
  tree_allclose((value, grads), (looped, looped_grads))
  assert bool(info.step_not_finite)
  # A finite batch: the whole batch's value and gradient, as the loop gives them.
  plain = microbatched(loss, 4)(params, batch)
  tree_allclose(plain, reference(loss)(params, batch))
  tree_allclose(plain, microbatched(loss, 4, return_info=True)(params, batch)[:2], rtol=1e-6)


def test_a_call_of_no_option_returns_the_dtypes_jax_value_and_grad_does():
  # bfloat16 parameters, a bfloat16 loss: summed in float32, returned as given.
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), make_mlp_params())

  def loss(p, b):
    return mse_loss(p, b).astype(jnp.bfloat16)

  value, grads = microbatched(loss, 4)(params, make_batch())
  ref_value, ref_grads = reference(loss)(params, make_batch())
  assert value.dtype == ref_value.dtype == jnp.bfloat16
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda g: g.dtype, ref_grads)
  tree_allclose((value, grads), (ref_value, ref_grads), rtol=2e-2, atol=2e-2)


def test_with_skip_nonfinite_false_a_nan_microbatch_poisons_the_result():
  params, batch = make_mlp_params(), make_batch()
  bad = dict(batch, x=with_value(batch["x"], 3, np.nan))
  value, grads, info = microbatched(mse_loss, 4, on_nonfinite="unchecked", return_info=True)(
      params, bad
  )
  assert int(info.num_skipped) == 0
  assert np.isnan(float(value))
  assert np.isnan(np.asarray(grads["w2"])).all()


# 10. and 12. What the lowered program looks like.


def lowered_text(num_microbatches, batch_size=64, debug_info=False):
  vg = accum_jax.value_and_grad(mse_loss, num_microbatches)
  lowered = jax.jit(vg).lower(make_mlp_params(), make_batch(batch_size))
  return lowered.as_text(debug_info=debug_info)


def test_the_program_does_not_grow_with_num_microbatches():
  small, large = len(lowered_text(2)), len(lowered_text(64))
  assert 0.9 < large / small < 1.1


def test_the_scan_body_is_named_for_profiles():
  # The name is in the ops' locations, which profiles and compiled HLO metadata show.
  assert "accum_jax_microbatch" in lowered_text(4, debug_info=True)


# 11. Errors.


def test_a_batch_that_does_not_split_names_both_numbers_and_suggests_padding():
  params, batch = make_mlp_params(), make_batch(10)
  with pytest.raises(
      ValueError, match=re.escape("A batch of 10 does not split into num_microbatches=4")
  ) as error:
    accum_jax.value_and_grad(mse_loss, 4)(params, batch)
  assert "zero weight" in str(error.value)
  assert "Pad it to a multiple of 4" in str(error.value)


def test_batch_arguments_of_different_leading_sizes_are_refused():
  params, batch = make_mlp_params(), make_batch()
  with pytest.raises(ValueError, match=re.escape("different leading (batch) sizes")):
    accum_jax.value_and_grad(inputs_targets_loss, 2, batch_argnums=(1, 2))(
        params, batch["x"], batch["y"][:6]
    )


@pytest.mark.parametrize("num_microbatches", [0, -2, 2.0, True, "4"])
def test_num_microbatches_must_be_a_positive_int(num_microbatches):
  with pytest.raises(ValueError, match=re.escape(f"num_microbatches={num_microbatches!r}")):
    accum_jax.value_and_grad(mse_loss, num_microbatches)


@pytest.mark.parametrize(
    "options, role",
    [
        (dict(batch_argnums=5), "batch_argnums=(5,)"),
        (dict(rng_argnums=2), "rng_argnums=(2,)"),
        (dict(argnums=3), "argnums=(3,)"),
    ],
)
def test_argnums_out_of_range_are_refused_when_called(options, role):
  vg = accum_jax.value_and_grad(mse_loss, 2, **options)
  with pytest.raises(ValueError, match=re.escape(f"{role} names argument")):
    vg(make_mlp_params(), make_batch())


@pytest.mark.parametrize(
    "options",
    [
        dict(argnums=1, batch_argnums=1),
        dict(batch_argnums=1, rng_argnums=(2, 1)),
        dict(batch_argnums=1, state_argnums=0, has_aux=True),
    ],
)
def test_an_argument_with_two_roles_is_refused(options):
  with pytest.raises(ValueError, match=re.escape("each argument has one role")):
    accum_jax.value_and_grad(mse_loss, 2, **options)


def test_a_non_scalar_weight_fn_is_refused():
  params, batch = make_mlp_params(), make_sequences()
  with pytest.raises(ValueError, match=re.escape("weight_fn must return a scalar weight")):
    accum_jax.value_and_grad(sequence_loss, 2, weight_fn=lambda b: b["mask"])(params, batch)


@pytest.mark.parametrize(
    "not_a_key", [np.ones((2,), np.float32), np.zeros((3,), np.uint32)], ids=["float", "uint32x3"]
)
def test_an_rng_argument_that_is_not_a_key_is_refused(not_a_key):
  vg = accum_jax.value_and_grad(dropout_loss, 2, has_aux=True, rng_argnums=2)
  with pytest.raises(ValueError, match=re.escape("which is not a PRNG key")):
    vg(make_mlp_params(), make_batch(), not_a_key)


def test_state_argnums_without_has_aux_is_refused():
  with pytest.raises(ValueError, match=re.escape("state_argnums needs has_aux=True")):
    accum_jax.value_and_grad(running_mean_loss, 2, batch_argnums=2, state_argnums=1)


def test_an_unknown_aux_reduction_is_refused():
  with pytest.raises(ValueError, match=re.escape("aux_reduction='median' is not one of")):
    accum_jax.value_and_grad(mse_loss, 2, has_aux=True, aux_reduction="median")
