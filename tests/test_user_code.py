"""accum_jax.value_and_grad on code shaped as users write it.

Per-example outputs (logits) as aux, the common ``loss(params, x, y)``
signature, integer counts as aux, what ``fun`` returns checked against what was
promised, non-array arguments, raw keys, and meshes with a model axis. Every
result is compared with jax.value_and_grad on the whole batch.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal, tree_allclose
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax

BATCH, FEATURES, CLASSES = 16, 3, 4


def make_params():
  return {"w": normal(0, (FEATURES, CLASSES), 0.5), "b": normal(1, (CLASSES,), 0.1)}


def make_data(batch=BATCH):
  x = normal(2, (batch, FEATURES))
  y = np.arange(batch) % CLASSES
  mask = (np.arange(batch) % 5 != 0).astype(np.float32)
  return x, y, mask


def logits_loss(params, x, y):
  """The loss of a linear classifier, with its logits as aux (as the Flax examples do)."""
  logits = x @ params["w"] + params["b"]
  loss = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1))
  return loss, logits


def masked_logits_loss(params, x, y, mask):
  logits = x @ params["w"] + params["b"]
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[:, 0]
  loss = jnp.sum(mask * nll) / jnp.sum(mask)
  return loss, {"logits": logits, "loss": loss}


def weight_of(x, y, mask):
  return jnp.sum(mask)


def full_batch(fun, *args):
  return jax.value_and_grad(fun, has_aux=True)(*args)


# Per-example aux: "concat", asked for (the default refuses a leaf sized by the rows).


@pytest.mark.parametrize("split", ["contiguous", "strided"])
def test_per_example_aux_comes_back_in_batch_order(split):
  params, (x, y, _) = make_params(), make_data()
  vg = accum_jax.value_and_grad(logits_loss, 4, has_aux=True, batch_argnums=(1, 2),
      data_parallel=accum_jax.DataParallel(split=split), aux_reduction="concat")
  (loss, logits), grads = jax.jit(vg)(params, x, y)
  (expected_loss, expected_logits), expected_grads = full_batch(logits_loss, params, x, y)
  assert logits.shape == (BATCH, CLASSES)
  tree_allclose((loss, logits, grads), (expected_loss, expected_logits, expected_grads))


def _padded(rows, *arrays):
  return [np.pad(a, [(0, rows)] + [(0, 0)] * (a.ndim - 1)) for a in arrays]


def test_per_example_aux_of_a_padded_batch_comes_back_in_batch_order():
  params, (x, y, mask) = make_params(), make_data(batch=14)  # 14 = 3 x 4 + 2
  vg = accum_jax.value_and_grad(masked_logits_loss, 4, has_aux=True, weight_fn=weight_of,
                                batch_argnums=(1, 2, 3), aux_reduction={"logits": "concat"},
                                data_parallel=accum_jax.DataParallel(split="strided"))
  (loss, aux), grads = jax.jit(vg)(params, *_padded(2, x, y, mask))
  expected = full_batch(masked_logits_loss, params, x, y, mask)
  assert aux["logits"].shape == (16, CLASSES)
  aux = {**aux, "logits": aux["logits"][:14]}
  tree_allclose(((loss, aux), grads), expected)


def test_per_example_aux_under_a_mesh_comes_back_in_batch_order():
  mesh = jax.make_mesh((4,), ("data",))
  params, (x, y, mask) = make_params(), make_data(batch=30)  # padded to 32
  vg = accum_jax.value_and_grad(masked_logits_loss, 2, has_aux=True, weight_fn=weight_of,
                                batch_argnums=(1, 2, 3), aux_reduction={"logits": "concat"},
                                data_parallel=accum_jax.DataParallel(mesh=mesh, param_sharding=P()))
  (loss, aux), grads = jax.jit(vg)(params, *_padded(2, x, y, mask))
  expected = full_batch(masked_logits_loss, params, x, y, mask)
  assert aux["logits"].shape == (32, CLASSES)
  aux = {**aux, "logits": np.asarray(aux["logits"])[:30]}
  tree_allclose(((loss, aux), grads), expected)


def test_concat_of_an_aux_leaf_without_a_row_axis_is_refused():
  vg = accum_jax.value_and_grad(lambda p, x, y: (logits_loss(p, x, y)[0], jnp.ones(3)), 4,
                                has_aux=True, batch_argnums=(1, 2), aux_reduction="concat")
  with pytest.raises(ValueError, match=re.escape("has shape (3,), with no leading axis of the"
                                                 " microbatch's 4 rows")):
    vg(make_params(), *make_data()[:2])


def test_numpy_float64_and_int64_data_give_float32_results_without_a_warning():
  # Data from numpy: float64 features, int64 labels, float64 parameters. JAX
  # computes in float32, and asking it for float64 would warn on every call
  # (pytest turns warnings into errors here).
  params = jax.tree.map(lambda p: p.astype(np.float64), make_params())
  x, y, _ = make_data()
  x = x.astype(np.float64)
  assert y.dtype == np.int64
  expected = full_batch(logits_loss, params, x, y)
  out = jax.jit(accum_jax.value_and_grad(logits_loss, 4, has_aux=True, batch_argnums=(1, 2),
                                         aux_reduction="concat"))(params, x, y)
  assert jax.tree.map(lambda a: a.dtype, out[1]) == {"w": jnp.float32, "b": jnp.float32}
  tree_allclose(out, expected)
  grads = jax.tree.map(lambda g: np.asarray(g, np.float64), expected[1])
  opt = accum_jax.accumulate(optax.sgd(1.0), every_k=2)
  state = opt.init(params)
  for _ in range(2):  # eager calls, as a loop that never compiles makes them
    updates, state = opt.update(grads, state, params)
  tree_allclose(updates, jax.tree.map(lambda g: -g, expected[1]))


# Integer aux.


def counting_loss(params, x, counts):
  loss = jnp.mean(x @ params["w"])
  return loss, {"tokens": jnp.sum(counts), "mean_count": jnp.sum(counts) // x.shape[0]}


def test_integer_aux_is_summed_exactly_in_integers():
  params, (x, _, _) = make_params(), make_data()
  # 20000001 in all: float32 has no such number (its spacing there is 2).
  counts = np.full((BATCH,), 1_250_000, np.int32)
  counts[0] += 1
  vg = accum_jax.value_and_grad(counting_loss, 4, has_aux=True, batch_argnums=(1, 2),
                                aux_reduction="sum")
  (_, aux), _ = jax.jit(vg)(params, x, counts)
  assert aux["tokens"].dtype == jnp.int32
  assert int(aux["tokens"]) == int(counts.sum()) == 20_000_001


def test_the_mean_of_integer_aux_is_a_float_not_truncated():
  params, (x, _, _) = make_params(), make_data()
  counts = np.repeat(np.array([1, 2, 2, 2], np.int32), BATCH // 4)
  (_, aux), _ = jax.jit(accum_jax.value_and_grad(counting_loss, 4, has_aux=True,
                                                 batch_argnums=(1, 2)))(params, x, counts)
  assert jnp.issubdtype(aux["mean_count"].dtype, jnp.floating)
  np.testing.assert_allclose(aux["mean_count"], 1.75)


# The batch arguments.


def test_loss_of_params_x_y_splits_both_once_named_and_argument_1_alone_by_default():
  params, (x, y, _) = make_params(), make_data()
  out = jax.jit(accum_jax.value_and_grad(logits_loss, 4, has_aux=True, batch_argnums=(1, 2),
                                         aux_reduction="concat"))(params, x, y)
  tree_allclose(out, full_batch(logits_loss, params, x, y))
  # The default is optax.microbatching's, batch_argnums=1: y is not split, so the
  # microbatch's 4 rows of logits meet all 16 labels, which JAX refuses when it traces them.
  default = accum_jax.value_and_grad(logits_loss, 4, has_aux=True, aux_reduction="concat")
  with pytest.raises(ValueError, match="Incompatible shapes for broadcasting"):
    jax.jit(default)(params, x, y)


def test_batch_argnums_none_is_refused_with_the_fix():
  with pytest.raises(ValueError, match="^" + re.escape(
      "batch_argnums=None does not say which arguments are the batch, and they are not"
      " guessed from shapes: name them, e.g. batch_argnums=1 (the default) for"
      " loss(params, batch), or batch_argnums=(1, 2) for loss(params, x, y).")):
    accum_jax.value_and_grad(logits_loss, 4, has_aux=True, batch_argnums=None)


def test_an_argument_left_out_of_batch_argnums_is_passed_whole_to_every_microbatch():
  # A table with a leading axis of its own (5 rows, not the batch's 16) is not split
  # by the default, batch_argnums=1; named as a batch, its size is refused.
  params, (x, _, _) = make_params(), make_data()
  table = np.arange(10, dtype=np.float32).reshape(5, 2)

  def loss(p, x, table):
    return jnp.mean(x @ p["w"]) + jnp.sum(table[:, 0] * jnp.mean(x))

  out = jax.jit(accum_jax.value_and_grad(loss, 4))(params, x, table)
  tree_allclose(out, jax.value_and_grad(loss)(params, x, table))
  vg = accum_jax.value_and_grad(loss, 4, batch_argnums=(1, 2))
  with pytest.raises(ValueError, match=re.escape(
      "The batch arguments have different leading (batch) sizes (argument 1: 16, argument 2:"
      " 5)")):
    vg(params, x, table)


def test_no_batch_among_the_arguments_is_refused_with_the_fix():
  # The default names argument 1, here a scalar: it cannot be split.
  vg = accum_jax.value_and_grad(lambda p, scale: scale * jnp.sum(p["w"]), 4)
  with pytest.raises(ValueError, match=re.escape(
      "Argument 1 is a scalar, but batch_argnums names it: every leaf of a batch argument"
      " needs a leading batch axis. Pass it as another argument, or give it a batch axis.")):
    vg(make_params(), 2.0)


def test_batch_argnums_that_is_not_an_int_is_named():
  with pytest.raises(ValueError, match=re.escape("batch_argnums=1.0 must be a non-negative int")):
    accum_jax.value_and_grad(logits_loss, 4, batch_argnums=1.0)


# What fun returns.


def state_loss(params, state, x):
  return jnp.mean(x @ params["w"]), (state + jnp.mean(x), {"n": jnp.ones(())})


@pytest.mark.parametrize(
    "fun, options, message",
    [
        pytest.param(lambda p, x: jnp.mean(x @ p["w"]), dict(has_aux=True),
                     "has_aux=True, so fun must return a pair (value, aux), but it returned an"
                     " array of shape ()", id="has_aux but a loss alone"),
        pytest.param(lambda p, x: (jnp.mean(x @ p["w"]), 1.0, 2.0), dict(has_aux=True),
                     "but it returned a tuple of 3", id="three outputs"),
        pytest.param(lambda p, x: (jnp.mean(x @ p["w"]), x), dict(),
                     "fun returned a tuple of 2, not a scalar loss. If it returns (loss, aux),"
                     " pass has_aux=True", id="aux without has_aux"),
    ],
)
def test_what_fun_returns_is_checked_against_has_aux(fun, options, message):
  params, (x, _, _) = make_params(), make_data()
  with pytest.raises(ValueError, match=re.escape(message)):
    accum_jax.value_and_grad(fun, 4, batch_argnums=1, **options)(params, x)


@pytest.mark.parametrize(
    "returned, message",
    [
        pytest.param(lambda loss, state: (loss, state),
                     "fun must return (value, (new_state, aux)), but its aux is an array of"
                     " shape (2,)", id="no aux element"),
        pytest.param(lambda loss, state: (loss, (state[:1], ())),
                     "The new state's leaf  has shape (1,) and dtype float32, but the state"
                     " passed in has shape (2,)", id="broadcastable shape"),
        pytest.param(lambda loss, state: (loss, (state.astype(jnp.float16), ())),
                     "dtype float16, but the state passed in has shape (2,) and dtype float32",
                     id="other dtype"),
        pytest.param(lambda loss, state: (loss, {"batch_stats": state}),
                     "but its aux is a dict", id="Linen's updates dict"),
        pytest.param(lambda loss, state: (loss, ({"batch_stats": state}, ())),
                     "The new state has structure", id="another tree"),
    ],
)
def test_a_new_state_that_does_not_match_the_state_is_refused(returned, message):
  def loss(params, state, x):
    return returned(jnp.mean(x @ params["w"]), state + jnp.mean(x))

  params, (x, _, _) = make_params(), make_data()
  vg = accum_jax.value_and_grad(loss, 4, has_aux=True, state_argnums=1, batch_argnums=2)
  with pytest.raises(ValueError, match=re.escape(message)):
    vg(params, np.zeros((2,), np.float32), x)


def test_differentiating_an_argument_that_holds_a_function_names_the_fix():
  def loss(model, x):
    return jnp.mean(model["act"](x @ model["w"]))

  vg = accum_jax.value_and_grad(loss, 4)
  with pytest.raises(ValueError, match=re.escape("accum_jax.equinox.filter_value_and_grad")):
    vg({"w": make_params()["w"], "act": jax.nn.relu}, make_data()[0])


# Non-array arguments and a model axis under a mesh.


def activation_loss(params, x, y, activation):
  logits = activation(x @ params["w"] + params["b"])
  return jnp.mean((logits - jax.nn.one_hot(y, CLASSES)) ** 2)


def test_a_non_array_argument_is_passed_through_a_mesh():
  mesh = jax.make_mesh((4,), ("data",))
  params, (x, y, _) = make_params(), make_data()
  vg = accum_jax.value_and_grad(activation_loss, 2, batch_argnums=(1, 2),
      data_parallel=accum_jax.DataParallel(mesh=mesh, param_sharding=P()))
  out = jax.jit(vg, static_argnums=3)(params, x, y, jnp.tanh)
  tree_allclose(out, jax.value_and_grad(activation_loss)(params, x, y, jnp.tanh))


def test_parameters_sharded_over_a_model_axis_keep_their_sharding_in_the_gradients():
  # As in the JAX AI Stack's miniGPT: parameters annotated P(None, "model").
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  params, (x, y, _) = make_params(), make_data()
  sharding = {"w": NamedSharding(mesh, P(None, "model")), "b": NamedSharding(mesh, P("model"))}
  params = jax.device_put(params, sharding)
  vg = accum_jax.value_and_grad(activation_loss, 2, batch_argnums=(1, 2),
      data_parallel=accum_jax.DataParallel(mesh=mesh, data_axis="data", param_sharding=sharding))
  loss, grads = jax.jit(vg, static_argnums=3)(params, x, y, jnp.tanh)
  tree_allclose((loss, grads), jax.value_and_grad(activation_loss)(params, x, y, jnp.tanh))
  for name in params:
    assert grads[name].sharding.is_equivalent_to(sharding[name], grads[name].ndim), (
        name, grads[name].sharding)


# Keys.


def dropout_loss(params, x, key):
  keep = jax.random.bernoulli(key, 0.5, x.shape)
  return jnp.mean(jnp.where(keep, x, 0.0) @ params["w"])


def test_a_raw_rbg_key_is_a_key():
  key = jax.random.key_data(jax.random.key(0, impl="rbg"))
  assert key.shape == (4,)
  params, (x, _, _) = make_params(), make_data()

  def loss(params, x, key):
    return dropout_loss(params, x, jax.random.wrap_key_data(key, impl="rbg"))

  vg = accum_jax.value_and_grad(loss, 4, rng_argnums=2)
  value, _ = jax.jit(vg)(params, x, key)
  assert np.isfinite(value)


# A gradient that is not finite where its loss is.


def masked_linear_loss(w, x):
  # Rows with x = inf are masked out of the loss, but not out of its gradient:
  # d/dw of where(mask, w * x, 0) is where(mask, x, 0) * ..., and 0 * inf is NaN.
  return jnp.mean(jnp.where(jnp.isfinite(x), w * x, 0.0))


def test_with_microbatch_skips_a_nan_gradient_under_a_finite_loss_is_left_out():
  x = normal(3, (BATCH, 2))
  x[5, 1] = np.inf  # microbatch 1 of 4
  w = np.ones((2,), np.float32)
  vg = jax.jit(accum_jax.value_and_grad(masked_linear_loss, 4, return_info=True,
                                        on_nonfinite="skip_microbatch"))
  value, grads, info = vg(w, x)
  assert np.isfinite(masked_linear_loss(w, x)) and not np.isfinite(
      jax.grad(masked_linear_loss)(w, x[4:8])).all()
  kept = np.concatenate([x[:4], x[8:]])
  expected_value, expected_grads = jax.value_and_grad(masked_linear_loss)(w, kept)
  assert int(info.num_skipped) == 1 and float(info.total_weight) == 3
  tree_allclose((value, grads), (expected_value, expected_grads))


def masked_padded_loss(w, batch):
  rows = jnp.where(jnp.isfinite(batch["x"]), w * batch["x"], 0.0).sum(-1) + batch["poison"]
  return jnp.sum(rows * batch["mask"]) / jnp.maximum(batch["mask"].sum(), 1.0)


def test_padding_whose_loss_is_nan_never_skips_the_default_step():
  x = normal(3, (BATCH, 2))
  mask, poison = np.ones(BATCH, np.float32), np.zeros(BATCH, np.float32)
  mask[12:], poison[12:] = 0, np.nan  # microbatch 3: padding, its loss NaN
  batch = {"x": x, "poison": poison, "mask": mask}
  w = np.ones((2,), np.float32)
  vg = jax.jit(accum_jax.value_and_grad(
      masked_padded_loss, 4, weight_fn=lambda b: b["mask"].sum(), return_info=True))
  value, grads, info = vg(w, batch)
  assert not bool(info.step_not_finite) and int(info.num_skipped) == 0
  assert float(info.total_weight) == 12 and bool(np.all(info.loss_finite))
  kept = jax.tree.map(lambda a: a[:12], batch)
  tree_allclose((value, grads), jax.value_and_grad(masked_padded_loss)(w, kept))


@pytest.mark.parametrize("loss_nan", [False, True], ids=["rechecked", "by loss"])
def test_padding_whose_loss_is_nan_is_never_counted_even_in_a_rechecked_step(
    loss_nan,
):
  # 4 microbatches of 4 rows: microbatch 1 has a NaN gradient under a finite loss
  # (or, "by loss", a NaN loss), which makes the step recheck its gradients;
  # microbatch 3 is padding (weight 0) whose loss is NaN: it counts for nothing.
  x = normal(3, (BATCH, 2))
  poison = np.zeros(BATCH, np.float32)
  if loss_nan:
    poison[5] = np.nan
  else:
    x[5, 1] = np.inf
  mask = np.ones(BATCH, np.float32)
  mask[12:] = 0
  poison[12:] = np.nan
  batch = {"x": x, "poison": poison, "mask": mask}
  w = np.ones((2,), np.float32)
  vg = jax.jit(accum_jax.value_and_grad(
      masked_padded_loss, 4, weight_fn=lambda b: b["mask"].sum(), return_info=True,
      on_nonfinite="skip_microbatch"))
  value, grads, info = vg(w, batch)
  assert int(info.num_skipped) == 1 and float(info.total_weight) == 8
  kept = jax.tree.map(lambda a: np.concatenate([a[:4], a[8:12]]), batch)
  tree_allclose((value, grads), jax.value_and_grad(masked_padded_loss)(w, kept))


def test_a_float16_accumulator_under_a_mesh_equals_the_float32_one():
  # Gradients of ~2000 in float16: eight devices' sums of them would overflow
  # float16, and their running means must be weighed, not added.
  mesh = jax.make_mesh((8,), ("data",))
  w = np.ones((3,), np.float16)
  x = (normal(4, (64, 3)) * 30).astype(np.float16)

  def loss(w, x):
    return jnp.mean((x @ w) ** 2)

  # float16 arithmetic without a loss scale: on_nonfinite is stated, not left at its default.
  narrow = jax.jit(accum_jax.grad(loss, 2,
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, param_sharding=P()), accumulator_dtype=None, on_nonfinite="propagate"))(w, x)
  wide = jax.jit(accum_jax.grad(loss, 2,
      data_parallel=accum_jax.DataParallel(
          mesh=mesh, param_sharding=P()), on_nonfinite="propagate"))(w, x)
  assert narrow.dtype == jnp.float16 and np.isfinite(narrow).all()
  np.testing.assert_allclose(narrow.astype(np.float32), wide.astype(np.float32), rtol=2e-3)
