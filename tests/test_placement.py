"""Where an Optax wrapper goes, inside or outside accumulate, and what changes.

Each test backs one row of docs/guides/optax_wrappers.md: the wrapper inside
``accumulate`` behaves as on the full batch (compared with the wrapper run on the
mean gradient of each window), and outside it does what the guide says it does.
Gradients are given, not computed, so the windows' means are known exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from helpers import microbatch_grads, scan_updates, stack_trees, tree_allclose, unstack_tree

import accum_jax

K = 2


def _params():
  return {"w": jnp.array([1.0, -2.0, 0.5]), "b": jnp.array([0.25, 0.0])}


def _grads(windows: int, scale: float = 1.0):
  """K calls per window, and the windows' mean gradients (what a full batch gives)."""
  calls = microbatch_grads(_params(), K * windows, scale=scale)
  means = [
      jax.tree.map(lambda *g: sum(g) / K, *calls[i * K : (i + 1) * K]) for i in range(windows)
  ]
  return calls, means


def _run(opt, calls, params=None, **extra):
  params = _params() if params is None else params
  return scan_updates(opt, params, stack_trees(calls), extra or None)


def test_clipping_inside_clips_the_window_and_outside_each_call():
  calls, means = _grads(3, scale=2.0)
  for clip in (optax.clip_by_global_norm(1.0), optax.clip(0.5)):
    inside = accum_jax.accumulate(optax.chain(clip, optax.sgd(0.1)), K)
    outside = optax.chain(clip, accum_jax.accumulate(optax.sgd(0.1), K))
    full_batch = optax.chain(clip, optax.sgd(0.1))
    # Outside is the same as clipping each call's gradient, then averaging.
    clipped_calls = [clip.update(g, clip.init(g))[0] for g in calls]
    per_call_means = [
        jax.tree.map(lambda *g: sum(g) / K, *clipped_calls[i * K : (i + 1) * K])
        for i in range(3)
    ]
    tree_allclose(_run(inside, calls)[0], _run(full_batch, means)[0])
    tree_allclose(_run(outside, calls)[0], _run(optax.sgd(0.1), per_call_means)[0])
    assert not np.allclose(_run(inside, calls)[0]["w"], _run(outside, calls)[0]["w"])


def test_apply_if_finite_outside_counts_nonfinite_calls_and_inside_sees_none():
  calls, _ = _grads(2)
  calls[1] = jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), calls[1])
  inside = accum_jax.accumulate(
      optax.apply_if_finite(optax.sgd(0.1), 3), K, on_nonfinite="skip_microbatch")
  outside = optax.apply_if_finite(
      accum_jax.accumulate(optax.sgd(0.1), K, on_nonfinite="skip_microbatch"), 3)
  inside_params, _, inside_states = _run(inside, calls)
  outside_params, _, outside_states = _run(outside, calls)
  # The same parameters: the NaN call is skipped either way...
  tree_allclose(inside_params, outside_params)
  # ...by accumulate inside (apply_if_finite never sees it), by apply_if_finite
  # outside (accumulate never sees it).
  assert int(inside_states.num_skipped[-1]) == 1
  assert int(inside_states.inner_opt_state.total_notfinite[-1]) == 0
  assert int(outside_states.total_notfinite[-1]) == 1
  assert int(outside_states.inner_state.num_skipped[-1]) == 0


def test_lookahead_inside_syncs_every_sync_period_updates_and_outside_every_calls():
  calls, means = _grads(4)
  params = optax.LookaheadParams.init_synced(_params())
  lookahead = optax.lookahead(optax.sgd(0.1), sync_period=3, slow_step_size=0.5)
  inside = accum_jax.accumulate(lookahead, K)
  outside = optax.lookahead(
      accum_jax.accumulate(optax.sgd(0.1), K), sync_period=3, slow_step_size=0.5
  )
  inside_params, _, inside_states = _run(inside, calls, params)
  full_batch_params, _, _ = _run(lookahead, means, params)
  tree_allclose(inside_params, full_batch_params)
  _, outside_updates, outside_states = _run(outside, calls, params)
  _, inside_updates, _ = _run(inside, calls, params)
  # Inside, lookahead counts optimizer steps; outside, calls (K per step), and
  # syncs the slow weights in the middle of windows.
  calls_made = np.arange(1, len(calls) + 1)
  inside_counts = np.asarray(inside_states.inner_opt_state.steps_since_sync)
  np.testing.assert_array_equal(inside_counts, (calls_made // K) % 3)
  np.testing.assert_array_equal(np.asarray(outside_states.steps_since_sync), calls_made % 3)
  # The sync after call 3, in the middle of the second window, moves the
  # parameters on a call that only accumulates.
  assert np.any(np.asarray(outside_updates.fast["w"][2]) != 0)
  assert not np.any(np.asarray(inside_updates.fast["w"][2]))


def _schedule(count):
  return 0.1 / (1.0 + count)


def test_schedules_inside_count_optimizer_steps_and_outside_count_calls():
  calls, means = _grads(3)
  inside = accum_jax.accumulate(
      optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule), K
  )
  outside = optax.chain(
      accum_jax.accumulate(optax.identity(), K), optax.scale_by_learning_rate(_schedule)
  )
  full_batch = optax.inject_hyperparams(optax.sgd)(learning_rate=_schedule)
  inside_params, _, inside_states = _run(inside, calls)
  tree_allclose(inside_params, _run(full_batch, means)[0])
  rates = np.asarray(inside_states.inner_opt_state.hyperparams["learning_rate"])
  np.testing.assert_allclose(rates[K - 1 :: K], [_schedule(0), _schedule(1), _schedule(2)])
  # Outside, the schedule's count advances on every call: the update of window i
  # is scaled by schedule(K * i + K - 1), not schedule(i).
  _, outside_updates, _ = _run(outside, calls)
  for i, mean in enumerate(means):
    expected = jax.tree.map(lambda g, i=i: -_schedule(K * i + K - 1) * g, mean)
    tree_allclose(unstack_tree(outside_updates)[K * i + K - 1], expected)


def test_schedule_free_inside_and_its_eval_params_from_the_inner_state():
  calls, means = _grads(3)
  make = lambda: optax.contrib.schedule_free_adamw(1e-1, warmup_steps=2)  # noqa: E731
  params, _, states = _run(accum_jax.accumulate(make(), K), calls)
  full_batch_params, _, full_batch_states = _run(make(), means)
  tree_allclose(params, full_batch_params)
  last = jax.tree.map(lambda x: x[-1], states)
  last_full_batch = jax.tree.map(lambda x: x[-1], full_batch_states)
  tree_allclose(
      optax.contrib.schedule_free_eval_params(last.inner_opt_state, params),
      optax.contrib.schedule_free_eval_params(last_full_batch, full_batch_params),
  )


def test_multisteps_inside_accumulate_multiplies_the_windows():
  calls, _ = _grads(4)
  multisteps = optax.MultiSteps(optax.adam(0.1), 2).gradient_transformation()
  longer_window = accum_jax.accumulate(optax.adam(0.1), 2 * K)
  tree_allclose(_run(accum_jax.accumulate(multisteps, K), calls)[0], _run(longer_window, calls)[0])


def test_multi_transform_inside_accumulates_every_group_and_outside_only_its_own():
  calls, means = _grads(2)
  labels = {"w": "adam", "b": "sgd"}
  inner = optax.multi_transform({"adam": optax.adam(0.1), "sgd": optax.sgd(0.1)}, labels)
  inside_params = _run(accum_jax.accumulate(inner, K), calls)[0]
  tree_allclose(inside_params, _run(inner, means)[0])
  outside = optax.multi_transform(
      {"adam": accum_jax.accumulate(optax.adam(0.1), K), "sgd": optax.sgd(0.1)}, labels
  )
  outside_params, outside_updates, _ = _run(outside, calls)
  # The "sgd" group is not accumulated: it steps on every call.
  assert np.all(np.asarray(outside_updates["b"]) != 0)
  tree_allclose(outside_params["w"], inside_params["w"])
  masked = optax.masked(accum_jax.accumulate(optax.adam(0.1), K), {"w": True, "b": False})
  # masked passes the leaves it masks out through as they came: raw gradients.
  _, masked_updates, _ = _run(masked, calls)
  tree_allclose(unstack_tree(masked_updates)[0]["b"], calls[0]["b"])


def test_an_ema_of_the_params_updated_when_has_updated_is_the_full_batchs():
  calls, means = _grads(3)
  opt, decay = accum_jax.accumulate(optax.adam(0.1), K), 0.5

  @jax.jit
  def train(params, grads):
    def call(carry, g):
      params, ema, state = carry
      updates, state = opt.update(g, state, params)
      params = optax.apply_updates(params, updates)
      # Only a real update moves the average; a call that only accumulates
      # leaves the parameters, and so their average, where they were.
      ema = jax.tree.map(
          lambda e, p: jnp.where(accum_jax.has_updated(state), decay * e + (1 - decay) * p, e),
          ema,
          params,
      )
      return (params, ema, state), None

    return jax.lax.scan(call, (params, params, opt.init(params)), grads)[0][1]

  @jax.jit
  def full_batch(params, grads):
    adam = optax.adam(0.1)

    def step(carry, g):
      params, ema, state = carry
      updates, state = adam.update(g, state, params)
      params = optax.apply_updates(params, updates)
      ema = jax.tree.map(lambda e, p: decay * e + (1 - decay) * p, ema, params)
      return (params, ema, state), None

    return jax.lax.scan(step, (params, params, adam.init(params)), grads)[0][1]

  tree_allclose(train(_params(), stack_trees(calls)), full_batch(_params(), stack_trees(means)))


def test_the_window_loss_is_the_token_weighted_full_batch_loss():
  # Per-token losses of four microbatches with different numbers of valid tokens.
  rng = np.random.default_rng(0)
  losses = rng.uniform(0.5, 3.0, (2 * K, 8)).astype(np.float32)
  mask = np.zeros((2 * K, 8), np.float32)
  for i, valid in enumerate([8, 2, 5, 3]):
    mask[i, :valid] = 1.0
  microbatch_loss = (losses * mask).sum(1) / mask.sum(1)
  tokens = mask.sum(1)
  calls, _ = _grads(2)
  opt = accum_jax.accumulate(optax.sgd(0.1), K)
  _, _, states = _run(opt, calls, weight=jnp.asarray(tokens), value=jnp.asarray(microbatch_loss))
  for window in range(2):
    rows = slice(K * window, K * window + K)
    full_batch_loss = (losses[rows] * mask[rows]).sum() / mask[rows].sum()
    window_value = float(states.window_value[K * window + K - 1])
    np.testing.assert_allclose(window_value, full_batch_loss, rtol=1e-6)
    # The plain mean of the microbatch means (what an unweighted metric gives) is not.
    assert not np.isclose(microbatch_loss[rows].mean(), full_batch_loss, rtol=1e-3)
  assert float(states.window_value[0]) == 0.0  # before the first update
