"""stats_value_and_grad: a loss with a term of whole-batch statistics, exact.

The model is a two-layer top-2 mixture of experts (tests/moe_model.py) with the
Switch/GShard load-balancing loss of the batch's routing statistics. The
reference is computed the plain way, without accum_jax: one ``jax.value_and_grad``
of the loss over the whole batch, its statistics the masked means over all the
batch's valid tokens (or, with dropout, over the same chunks and keys).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import moe_model as moe
import numpy as np
import pytest
from helpers import plain_grad, plain_value_and_grad, tree_allclose
from jax.sharding import PartitionSpec as P

import accum_jax

BATCH = 32


def full_batch_loss(params, batch):
  loss, stats = moe.loss_and_stats(params, batch)
  return loss + moe.balance_loss(stats)


def chunked_loss(params, batch, keys):
  """The whole batch's loss with each of ``len(keys)`` equal consecutive chunks'
  forward on its own key; loss and statistics are the token-weighted means."""
  parts = jax.tree.map(lambda x: x.reshape(len(keys), -1, *x.shape[1:]), batch)
  weights = jax.vmap(moe.tokens_of)(parts)
  losses, stats = jax.vmap(functools.partial(moe.loss_and_stats, params))(parts, keys)
  mean = lambda x: jnp.tensordot(weights, x, axes=1) / jnp.sum(weights)  # noqa: E731
  return mean(losses) + moe.balance_loss(jax.tree.map(mean, stats))


@functools.cache
def door(num_microbatches, **options):
  return jax.jit(accum_jax.stats_value_and_grad(
      moe.loss_and_stats, moe.balance_loss, num_microbatches, weight_fn=moe.tokens_of,
      **options))


@pytest.mark.parametrize("num_microbatches", [1, 2, 8, BATCH])
def test_equals_the_full_batch_for_every_num_microbatches(num_microbatches):
  params, batch = moe.init_params(), moe.make_batch(BATCH)
  value, grads = door(num_microbatches)(params, batch)
  tree_allclose((value, grads), plain_value_and_grad(full_batch_loss, params, batch))


def test_the_balance_gradient_of_plain_accumulation_is_wrong_and_this_one_is_not():
  # Averaging the balance loss over microbatches balances each microbatch: with
  # tokens sorted by source, its gradient is far from the batch's.
  def balance_only(params, batch):
    loss, stats = moe.loss_and_stats(params, batch)
    return 0.0 * loss, stats

  def per_microbatch(params, batch):
    return moe.balance_loss(balance_only(params, batch)[1])

  def full(params, batch):
    return moe.balance_loss(balance_only(params, batch)[1])

  params, batch = moe.init_params(), moe.make_batch(BATCH)
  plain = jax.jit(accum_jax.grad(per_microbatch, 8, weight_fn=moe.tokens_of))(params, batch)
  ours = jax.jit(accum_jax.stats_value_and_grad(
      balance_only, moe.balance_loss, 8, weight_fn=moe.tokens_of))(params, batch)[1]
  expected = plain_grad(full, params, batch)
  router = lambda g: g["layers"][0]["router"]  # noqa: E731
  deviation = float(jnp.max(jnp.abs(router(plain) - router(expected))) /
                    jnp.max(jnp.abs(router(expected))))
  assert deviation > 0.5
  tree_allclose(ours, expected)


def test_dropout_keys_are_the_same_in_both_passes():
  params, batch = moe.init_params(), moe.make_batch(BATCH)
  key = jax.random.key(3)
  value, grads = door(4, rng_argnums=2)(params, batch, key)
  keys = jnp.stack([jax.random.fold_in(key, j) for j in range(4)])
  expected = plain_value_and_grad(chunked_loss, params, batch, keys)
  tree_allclose((value, grads), expected)


def fsdp_specs():
  layer = {"router": P(), "w_in": P(None, None, "data"), "w_out": P(None, "data", None)}
  return {"embed": P(), "layers": [layer] * moe.LAYERS, "head": P()}


@pytest.mark.parametrize("sharding", ["data parallel", "fsdp"])
def test_a_mesh_of_8_balances_the_global_batch(sharding):
  # Each device's 4 rows in 2 microbatches of 2, dropout keys folded by microbatch
  # and device: the statistics are summed over every device before pass 2.
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  specs = fsdp_specs() if sharding == "fsdp" else P()
  params, batch = moe.init_params(), moe.make_batch(BATCH)
  key = jax.random.key(5)
  vg = jax.jit(accum_jax.stats_value_and_grad(
      moe.loss_and_stats, moe.balance_loss, 2, weight_fn=moe.tokens_of, rng_argnums=2,
      data_parallel=accum_jax.DataParallel(mesh, "data", param_sharding=specs), return_info=True))
  value, grads, info = vg(params, batch, key)
  # Device d's microbatch j: rows 4d + 2j and 4d + 2j + 1, the 2d + j-th chunk of 2.
  keys = jnp.stack([jax.random.fold_in(jax.random.fold_in(key, j), d)
                    for d in range(8) for j in range(2)])
  tree_allclose((value, grads), plain_value_and_grad(chunked_loss, params, batch, keys))
  assert int(info.num_skipped) == 0
  if sharding == "fsdp":
    assert grads["layers"][0]["w_in"].sharding.spec == P(None, None, "data")


def _poisoned():
  """Parameters and a batch whose microbatch 1 of 4 (rows 8..15) alone reads a NaN."""
  params, batch = moe.init_params(), moe.make_batch(BATCH)
  poisoned = {**params, "embed": params["embed"].copy()}
  batch["tokens"] = np.where(batch["tokens"] == moe.VOCAB - 1, 0, batch["tokens"])
  batch["tokens"][9, 3] = moe.VOCAB - 1
  poisoned["embed"][moe.VOCAB - 1] = np.nan
  return poisoned, batch


def test_by_default_a_non_finite_microbatch_skips_the_step_and_names_its_loss():
  poisoned, batch = _poisoned()
  _, grads, info = door(4, return_info=True)(poisoned, batch)
  assert bool(info.step_not_finite) and int(info.num_skipped) == 4
  np.testing.assert_array_equal(info.loss_finite, [True, False, True, True])
  assert all(np.isnan(g).all() for g in jax.tree.leaves(grads))


def test_a_non_finite_microbatch_is_left_out_of_both_passes_and_counted():
  poisoned, batch = _poisoned()
  value, grads, info = door(4, return_info=True, on_nonfinite="skip_microbatch")(poisoned, batch)
  assert int(info.num_skipped) == 1
  kept = jax.tree.map(lambda x: np.concatenate([x[:8], x[16:]]), batch)
  expected_value, expected_grads = plain_value_and_grad(full_batch_loss, poisoned, kept)
  tree_allclose(value, expected_value)
  tree_allclose(jax.tree.map(lambda g: jnp.nan_to_num(g), grads),
                jax.tree.map(lambda g: jnp.nan_to_num(g), expected_grads))


def test_aux_comes_back_as_value_and_grad_reduces_it():
  def with_aux(params, batch):
    loss, stats = moe.loss_and_stats(params, batch)
    return loss, (stats, {"loss": loss})

  params, batch = moe.init_params(), moe.make_batch(BATCH)
  vg = jax.jit(accum_jax.stats_value_and_grad(with_aux, moe.balance_loss, 4, has_aux=True,
                                              weight_fn=moe.tokens_of))
  (value, aux), grads = vg(params, batch)
  expected_value, expected_grads = plain_value_and_grad(full_batch_loss, params, batch)
  tree_allclose((value, grads), (expected_value, expected_grads))
  tree_allclose(aux["loss"], jax.jit(moe.loss_and_stats)(params, batch)[0])


def test_the_step_loops_with_a_known_trip_count_and_nothing_inside():
  from accum_jax.testing import assert_no_host_syncs_in_loops, host_syncs

  params, batch = moe.init_params(), moe.make_batch(BATCH)
  program = door(4).lower(params, batch).compile()
  assert_no_host_syncs_in_loops(program)
  syncs = host_syncs(program)
  assert [loop.trip_count for loop in syncs.loops].count(4) >= 2 and syncs.per_run <= 1


@pytest.mark.parametrize(("fun", "stats_loss", "options", "message"), [
    (lambda p, b: moe.loss_and_stats(p, b)[0], moe.balance_loss, {},
     "fun must return (loss, stats)"),
    (lambda p, b: (moe.loss_and_stats(p, b)[0], jnp.int32(3)), lambda s: s * 1.0, {},
     "has dtype int32: statistics are means over the microbatch's tokens"),
    (moe.loss_and_stats, lambda s: jnp.stack([s[0]["f"], s[0]["p"]]), {},
     "stats_loss must return a scalar loss of the whole batch's statistics"),
    (moe.loss_and_stats, moe.balance_loss, {"state_argnums": 1},
     "stats_value_and_grad does not take state_argnums="),
    (lambda p, b: (moe.loss_and_stats(p, b)[0], {"per_token": b["mask"]}),
     lambda s: jnp.sum(s["per_token"]), {},
     "The statistic ['per_token'] has shape (8, 8) for a microbatch of 8 rows and (1, 8)"),
], ids=["not a pair", "integer statistics", "non-scalar stats_loss", "state_argnums",
        "per-token statistics"])
def test_bad_input_is_refused_at_trace_time(fun, stats_loss, options, message):
  params, batch = moe.init_params(), moe.make_batch(BATCH)
  with pytest.raises(ValueError, match=re.escape(message)):
    jax.jit(accum_jax.stats_value_and_grad(fun, stats_loss, 4, **options))(params, batch)
