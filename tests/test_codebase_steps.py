"""value_and_grad on what large-model codebases hand it, against their own loops.

MaxText returns a ten-key aux with Python numbers (``moe_lb_loss=0.0``), weighs
tokens and drops out with a key per microbatch; T5X sums its loss, reports
Python-int metrics (``steps=1``) and gives its optimizer float32 gradients of
bfloat16 parameters. Each step below is checked against that codebase's own
accumulation, written plainly (a hand-written scan), and against the full batch.
Beside them, one test per failure they showed: Python numbers in aux, the value
of a summed loss, a partial ``aux_reduction`` mapping, ``gradient_dtype``, an
argument of the batch's length beside a batch pytree, and padding in a rechecked
step.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal, tolerance_for, tree_allclose

import accum_jax

N, B, D, V, T = 4, 8, 4, 5, 3  # microbatches, batch, width, vocabulary, tokens per row
BF16 = tolerance_for(jnp.bfloat16)


def _tokens(seed: int = 0) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  weights = (rng.random((B, T)) > 0.3).astype(np.float32)
  weights[:, 0] = 1.0  # every row has a token
  return {"inputs": rng.integers(0, V, (B, T)), "targets": rng.integers(0, V, (B, T)),
          "weights": weights}


def _params(dtype) -> dict[str, jax.Array]:
  return {"embed": jnp.asarray(normal(0, (V, D), 0.5), dtype),
          "out": jnp.asarray(normal(1, (D, V), 0.5), dtype)}


def _token_xent(params, batch, key, rate):
  """Per-token cross-entropy of a one-layer decoder, in float32, with dropout."""
  h = params["embed"][batch["inputs"]]
  if rate:
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    h = jnp.where(keep, h / (1.0 - rate), 0).astype(h.dtype)
  logits = (h @ params["out"]).astype(jnp.float32)
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["targets"][..., None], -1)[..., 0]


# MaxText (train.py loss_fn): the token-weighted mean, and an aux of ten keys,
# several of them Python numbers.
def maxtext_loss(params, batch, key, *, rate=0.25):
  xent = _token_xent(params, batch, key, rate)
  total_loss = jnp.sum(xent * batch["weights"])
  total_weights = jnp.sum(batch["weights"])
  loss = total_loss / total_weights
  aux = {
      "total_loss": total_loss, "total_weights": total_weights, "moe_lb_loss": 0.0,
      "moe_bias_updates": 0.0, "mtp_loss": 0.0, "z_loss": 0.0, "indexer_loss": 0.0,
      "num_sequences": 2, "max_token_loss": jnp.max(xent), "xent_per_row": jnp.sum(xent, -1),
  }
  return loss, aux


MAXTEXT_REDUCTIONS = {"total_loss": "sum", "total_weights": "sum", "max_token_loss": "max",
                      "xent_per_row": "concat"}


def maxtext_scan(params, batch, key, rate=0.25):
  """MaxText's gradient accumulation, as it writes it: a scan summing each
  microbatch's gradient times its weight, divided by the total weight after."""
  micro = jax.tree.map(lambda x: x.reshape(N, B // N, *x.shape[1:]), batch)
  grad_fn = jax.value_and_grad(maxtext_loss, has_aux=True)

  def body(carry, x):
    index, mb = x
    (_, aux), grads = grad_fn(params, mb, jax.random.fold_in(key, index), rate=rate)
    acc_grads, total_loss, total_weights = carry
    w = aux["total_weights"]
    acc_grads = jax.tree.map(lambda a, g: a + w * g.astype(jnp.float32), acc_grads, grads)
    return (acc_grads, total_loss + aux["total_loss"], total_weights + w), aux["xent_per_row"]

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (grads, total_loss, total_weights), rows = jax.lax.scan(
      body, (zeros, 0.0, 0.0), (jnp.arange(N), micro))
  grads = jax.tree.map(lambda g, p: (g / total_weights).astype(p.dtype), grads, params)
  return total_loss / total_weights, total_loss, total_weights, rows.reshape(B), grads


def _maxtext_step(**options):
  return jax.jit(accum_jax.value_and_grad(
      maxtext_loss, N, has_aux=True, rng_argnums=2, aux_reduction=MAXTEXT_REDUCTIONS,
      weight_fn=lambda batch: batch["weights"].sum(), **options))


def test_a_maxtext_step_matches_its_own_scan_and_the_full_batch():
  params, batch, key = _params(jnp.bfloat16), _tokens(), jax.random.key(0)
  (loss, aux), grads = _maxtext_step()(params, batch, key)
  value, total_loss, total_weights, rows, expected_grads = jax.jit(maxtext_scan)(
      params, batch, key)
  tree_allclose((loss, aux["total_loss"], aux["total_weights"], aux["xent_per_row"], grads),
                (value, total_loss, total_weights, rows, expected_grads), **BF16)
  for name in ("moe_lb_loss", "moe_bias_updates", "mtp_loss", "z_loss", "indexer_loss"):
    assert aux[name] == 0.0 and isinstance(aux[name], jax.Array), name
  assert aux["num_sequences"] == 2
  assert grads["embed"].dtype == jnp.bfloat16
  # Without dropout, the full batch's token mean.
  (loss, aux), grads = jax.jit(accum_jax.value_and_grad(
      lambda p, b: maxtext_loss(p, b, None, rate=0.0), N, has_aux=True,
      aux_reduction=MAXTEXT_REDUCTIONS, weight_fn=lambda batch: batch["weights"].sum()),
  )(params, batch)
  (full_loss, full_aux), full_grads = jax.jit(jax.value_and_grad(
      lambda p, b: maxtext_loss(p, b, None, rate=0.0), has_aux=True))(params, batch)
  tree_allclose((loss, aux["total_loss"], aux["max_token_loss"], grads),
                (full_loss, full_aux["total_loss"], full_aux["max_token_loss"], full_grads),
                **BF16)


# T5X (EncoderDecoderModel.loss_fn with loss_normalizing_factor=None): the summed
# token loss, and metrics holding Python ints.
def t5x_loss(params, batch):
  xent = _token_xent(params, batch, None, 0.0)
  loss = jnp.sum(xent * batch["weights"])
  return loss, {"steps": 1, "num_tokens": jnp.sum(batch["weights"]), "loss": loss}


def t5x_scan(params, batch):
  """T5X's accumulate_grads_microbatched: the microbatches' gradients and
  metrics summed (in float32 here, as its optimizer then sees them)."""
  micro = jax.tree.map(lambda x: x.reshape(N, B // N, *x.shape[1:]), batch)

  def body(carry, mb):
    (loss, aux), grads = jax.value_and_grad(t5x_loss, has_aux=True)(params, mb)
    acc, tokens = carry
    acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
    return (acc, tokens + aux["num_tokens"]), loss

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  (grads, tokens), losses = jax.lax.scan(body, (zeros, 0.0), micro)
  return jnp.sum(losses), tokens, grads


def test_a_t5x_step_sums_its_loss_and_gives_float32_gradients_of_bfloat16_parameters():
  params, batch = _params(jnp.bfloat16), _tokens(1)
  (loss, aux), grads = jax.jit(accum_jax.value_and_grad(
      t5x_loss, N, has_aux=True, reduction="sum", gradient_dtype=jnp.float32,
      aux_reduction={"num_tokens": "sum", "loss": "sum"}))(params, batch)
  # The reference jitted, as the door is: its bfloat16 gradients rounded by the
  # same compiler, not op by op.
  value, tokens, expected = jax.jit(t5x_scan)(params, batch)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  tree_allclose((loss, aux["loss"], aux["num_tokens"], aux["steps"], grads),
                (value, value, tokens, jnp.float32(1.0), expected))
  (full_loss, _), full_grads = jax.value_and_grad(t5x_loss, has_aux=True)(params, batch)
  tree_allclose((loss, grads), (full_loss.astype(loss.dtype),
                                jax.tree.map(lambda g: g.astype(jnp.float32), full_grads)),
                **BF16)


# One test per failure.

@pytest.mark.parametrize("reduction", ["mean", "sum", "max", "last", "stack"])
def test_python_numbers_in_aux_come_back_as_arrays_under_every_reduction(reduction):
  def loss(w, x):
    return jnp.mean((x @ w) ** 2), {"extra": 0.5, "steps": 1, "flag": True}

  w, x = jnp.ones(3), jnp.asarray(normal(0, (B, 3)))
  (_, aux), _ = jax.jit(accum_jax.value_and_grad(
      loss, N, has_aux=True, aux_reduction=reduction))(w, x)
  per_microbatch = {"extra": 0.5, "steps": 1, "flag": True}
  expected = {
      "mean": {"extra": 0.5, "steps": 1.0, "flag": 1.0},
      "sum": {"extra": 0.5 * N, "steps": N, "flag": N},
      "stack": {k: np.full(N, v) for k, v in per_microbatch.items()},
  }.get(reduction, per_microbatch)
  for name, value in expected.items():
    assert isinstance(aux[name], jax.Array), name
    np.testing.assert_allclose(np.asarray(aux[name], np.float32), np.float32(value))


def test_a_summed_loss_with_grad_reduction_sum_gives_the_batch_s_sum_as_its_value():
  def loss(w, x):
    return jnp.sum((x @ w) ** 2)

  w, x = jnp.ones(3), jnp.asarray(normal(0, (B, 3)))
  out = jax.jit(accum_jax.value_and_grad(loss, N, reduction="sum"))(w, x)
  tree_allclose(out, jax.value_and_grad(loss)(w, x))
  # With weights, the weighted sum, as the gradient is.
  weights = jnp.arange(1.0, N + 1.0)
  weighted = accum_jax.value_and_grad(
      lambda w, x, i: loss(w, x), N, batch_argnums=(1, 2), reduction="sum",
      weight_fn=lambda x, i: weights[i[0]])
  value, grads = jax.jit(weighted)(w, x, jnp.arange(B) // (B // N))
  parts = [jax.value_and_grad(loss)(w, x[k * 2:(k + 1) * 2]) for k in range(N)]
  tree_allclose((value, grads), jax.tree.map(
      lambda *xs: sum(wk * xk for wk, xk in zip(weights, xs)), *parts))


def test_an_aux_reduction_mapping_naming_some_keys_leaves_the_others_at_the_default():
  def loss(w, x):
    per_row = (x @ w) ** 2
    return jnp.mean(per_row), {"total": jnp.sum(per_row), "mean": jnp.mean(per_row),
                               "rows": per_row}

  w, x = jnp.ones(3), jnp.asarray(normal(0, (B, 3)))
  (_, aux), _ = jax.jit(accum_jax.value_and_grad(
      loss, N, has_aux=True, aux_reduction={"total": "sum", "rows": "concat"}))(w, x)
  _, full = loss(w, x)
  tree_allclose(aux, full)  # "sum" and "concat" as named, then the default: the mean
  with pytest.raises(ValueError, match=re.escape("aux_reduction names 'totl', which the aux")):
    accum_jax.value_and_grad(loss, N, has_aux=True, aux_reduction={"totl": "sum"})(w, x)


def test_gradient_dtype_returns_the_accumulator_s_unrounded_mean():
  def loss(p, x):
    return jnp.mean(jnp.tanh(x @ p["w"]) ** 2)

  params = {"w": jnp.asarray(normal(0, (3, 2)), jnp.bfloat16)}
  x = jnp.asarray(normal(1, (B, 3)), jnp.bfloat16)
  _, grads = jax.jit(accum_jax.value_and_grad(loss, N, gradient_dtype=jnp.float32))(params, x)
  # Each microbatch's gradient is rounded to bfloat16, which XLA:CPU computes
  # differently on different machines and in different programs: the reference is
  # jitted, as the door's microbatch is, and bounded by one bfloat16 rounding of
  # each microbatch's gradient, not held to float32's.
  part = jax.jit(jax.grad(loss))
  parts = [part(params, x[k * (B // N):(k + 1) * (B // N)])["w"] for k in range(N)]
  mean = sum(g.astype(jnp.float32) for g in parts) / N
  rounding = sum(jnp.abs(g.astype(jnp.float32)) for g in parts) / N * 2.0**-8
  assert grads["w"].dtype == jnp.float32
  np.testing.assert_array_less(jnp.abs(grads["w"] - mean), rounding + 1e-7)
  # The mean of the microbatches' bfloat16 gradients, unrounded: not a bfloat16
  # number, as the mean cast back (without the option) would be.
  w = grads["w"]
  assert not np.array_equal(w.astype(jnp.bfloat16).astype(jnp.float32), w)
  with pytest.raises(ValueError, match=re.escape("gradient_dtype=<class 'jax.numpy.int32'>")):
    accum_jax.value_and_grad(loss, N, gradient_dtype=jnp.int32)


def test_gradient_dtype_passes_through_the_nnx_and_equinox_doors():
  import equinox as eqx
  from flax import nnx

  import accum_jax.equinox
  import accum_jax.flax

  x = jnp.asarray(normal(1, (B, 3)))
  model = nnx.Linear(3, 2, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  _, grads = accum_jax.flax.nnx_value_and_grad(
      lambda m, x: jnp.mean(m(x) ** 2), N, gradient_dtype=jnp.float32)(model, x)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  linear = eqx.nn.Linear(3, 2, dtype=jnp.bfloat16, key=jax.random.key(0))
  _, grads = accum_jax.equinox.filter_value_and_grad(
      lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), N, gradient_dtype=jnp.float32)(linear, x)
  assert {leaf.dtype for leaf in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}


def _class_weighted(params, batch, class_weights):
  return jnp.mean((batch["x"] @ params) ** 2) * jnp.sum(class_weights)


def test_an_argument_of_the_batch_s_length_beside_a_batch_pytree_is_passed_whole_by_default():
  params, batch = jnp.ones(3), {"x": jnp.asarray(normal(0, (B, 3)))}
  class_weights = jnp.arange(B, dtype=jnp.float32)  # B classes, by coincidence
  # batch_argnums=1 is the default: the class weights are passed whole, never split.
  expected = jax.value_and_grad(_class_weighted)(params, batch, class_weights)
  tree_allclose(accum_jax.value_and_grad(_class_weighted, N)(params, batch, class_weights),
                expected)
  out = accum_jax.value_and_grad(_class_weighted, N, batch_argnums=1)(params, batch, class_weights)
  tree_allclose(out, expected)
  # Bare arrays with a leading axis are batch data where they are named.
  out = accum_jax.value_and_grad(lambda w, x, y: jnp.mean((x @ w - y) ** 2), N,
                                 batch_argnums=(1, 2))(params, batch["x"], class_weights)
  tree_allclose(out, jax.value_and_grad(lambda w, x, y: jnp.mean((x @ w - y) ** 2))(
      params, batch["x"], class_weights))


def test_the_equinox_door_refuses_the_same_ambiguous_call():
  import equinox as eqx

  import accum_jax.equinox

  linear = eqx.nn.Linear(3, 1, key=jax.random.key(0))
  batch, class_weights = {"x": jnp.asarray(normal(0, (B, 3)))}, jnp.ones(B)

  def loss(model, batch, class_weights):
    return jnp.mean(jax.vmap(model)(batch["x"]) ** 2) * jnp.sum(class_weights)

  with pytest.raises(ValueError, match=re.escape("batch_argnums=(1, 2) to split them all")):
    accum_jax.equinox.filter_value_and_grad(loss, N)(linear, batch, class_weights)


def test_padding_with_a_nan_loss_is_not_counted_in_a_rechecked_step():
  def loss(w, b):
    r = (b["x"] @ w) ** 2
    # Rows of kind 1 hide their NaN from the loss but not from the gradient.
    r = jnp.where(jnp.isnan(r) & (b["kind"] == 1), 0.0, r)
    return jnp.sum(jnp.where(b["mask"] > 0, r, 0.0) + 0.0 * r) / jnp.maximum(b["mask"].sum(), 1)

  x, mask, kind = np.ones((B, 3), np.float32), np.ones(B, np.float32), np.zeros(B, np.int32)
  x[6:], mask[6:] = np.nan, 0  # microbatch 3: padding, its loss NaN
  x[0, 0] = np.nan  # microbatch 0: a NaN loss
  x[2, 0], kind[2:4] = np.nan, 1  # microbatch 1: a finite loss, a NaN gradient
  vg = jax.jit(accum_jax.value_and_grad(
      loss, N, weight_fn=lambda b: b["mask"].sum(), return_info=True,
      on_nonfinite="skip_microbatch"))
  value, grads, info = vg(jnp.ones(3), {"x": x, "mask": mask, "kind": kind})
  assert int(info.num_skipped) == 2
  kept = {"x": x[4:6], "mask": mask[4:6], "kind": kind[4:6]}
  tree_allclose((value, grads, info.total_weight),
                (*jax.value_and_grad(loss)(jnp.ones(3), kept), jnp.float32(2.0)))
