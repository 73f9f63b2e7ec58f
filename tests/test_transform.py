"""Tests of accum_jax.accumulate, the across-calls Optax transformation.

Everything runs under ``jax.jit``. To keep compiles few, a sequence of calls runs
as one ``lax.scan`` in :func:`helpers.scan_updates`, whose compiled versions are
cached per optimizer object; the optimizers are built once by the cached
factories below. The reference is the same loop over the inner optimizer alone.

The tests of what a call's concrete values decide (the mean of k calls, weights, a
flush, a non-finite call) also run eagerly (``helpers.with_and_without_jit``), as in
a loop that never compiles; the others check the same library code on the same
values under ``jax.jit`` alone.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    FLOAT_DTYPES,
    INNER_OPTIMIZER_PARAMS,
    INNER_OPTIMIZERS,
    dtype_id,
    full_size_copies,
    make_params,
    microbatch_grads,
    scan_updates,
    shapes_and_dtypes,
    stack_trees,
    tolerance_for,
    tree_all_finite,
    tree_allclose,
    tree_weighted_mean,
    unstack_tree,
    with_and_without_jit,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import accum_jax
from accum_jax._across_calls import _layout

# ---------------------------------------------------------------------------
# Shared machinery.


@functools.cache
def _inner(name):
  return INNER_OPTIMIZERS[name]()


@functools.cache
def _accumulated(name, every_k, **kwargs):
  return accum_jax.accumulate(_inner(name), every_k, **kwargs)


@functools.cache
def _identity_accumulated(every_k, **kwargs):
  """Emits the combined gradient itself: what most reduction tests look at."""
  return accum_jax.accumulate(optax.identity(), every_k, **kwargs)


def _zeros_like(tree):
  return jax.tree.map(jnp.zeros_like, tree)


def _nan_like(tree):
  return jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), tree)


def _scaled(factor, tree):
  return jax.tree.map(lambda x: factor * x, tree)


def _assert_zeros(tree):
  for x in jax.tree.leaves(tree):
    assert not np.any(np.asarray(x)), x


def _bools(x):
  return [bool(b) for b in np.asarray(x)]


def _inner_tree(state):
  """The inner optimizer's own tree, packed or not (of stacked states too)."""
  return _layout.tree_of(state.inner_opt_state)


def _ints(x):
  return [int(i) for i in np.asarray(x)]


# ---------------------------------------------------------------------------
# 1, 2. Zeros until the k-th call, then exactly the inner update on the mean.


@pytest.mark.parametrize("inner_name", INNER_OPTIMIZER_PARAMS)
@with_and_without_jit
def test_k_calls_give_one_inner_step_on_the_mean_gradient(inner_name):
  k, windows = 3, 3
  params = make_params()
  # The window means have global norms of 1.5 to 2.5: the clipping optimizer clips.
  grads = microbatch_grads(params, k * windows, scale=1.5)
  final_params, updates, states = scan_updates(
      _accumulated(inner_name, k), params, stack_trees(grads)
  )

  means = [tree_weighted_mean(grads[i * k : (i + 1) * k]) for i in range(windows)]
  ref_params, ref_updates, _ = scan_updates(_inner(inner_name), params, stack_trees(means))
  ref_updates = unstack_tree(ref_updates)
  for i, u in enumerate(unstack_tree(updates)):
    if i % k == k - 1:
      tree_allclose(u, ref_updates[i // k])
    else:
      _assert_zeros(u)
  tree_allclose(final_params, ref_params)
  assert _bools(accum_jax.has_updated(states)) == [i % k == k - 1 for i in range(k * windows)]
  assert _ints(accum_jax.optimizer_step(states)) == [(i + 1) // k for i in range(k * windows)]


def test_clipping_applies_to_the_accumulated_gradient():
  inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
  params = {"w": jnp.zeros(2)}
  g1, g2 = {"w": jnp.array([4.0, 0.0])}, {"w": jnp.array([0.0, 0.5])}
  _, updates, _ = scan_updates(
      accum_jax.accumulate(inner, 2), params, stack_trees([g1, g2]), apply_updates=False
  )
  mean = np.array([2.0, 0.25])
  clipped_mean = mean / np.linalg.norm(mean)
  inside = unstack_tree(updates)[1]["w"]
  tree_allclose(inside, -clipped_mean)
  # Clipping outside accumulate clips each call, then averages: another update,
  # which the update above must not be.
  _, outside_updates, _ = scan_updates(
      optax.chain(optax.clip_by_global_norm(1.0), accum_jax.accumulate(optax.sgd(1.0), 2)),
      params,
      stack_trees([g1, g2]),
      apply_updates=False,
  )
  outside = unstack_tree(outside_updates)[1]["w"]
  mean_of_clipped = (np.array([1.0, 0.0]) + np.array([0.0, 0.5])) / 2
  tree_allclose(outside, -mean_of_clipped)
  assert not np.allclose(inside, outside, rtol=0.1)


_ADAM_K2 = accum_jax.accumulate(optax.adam(1e-2), 2)


def _two_calls(params, grads):
  """Two calls (k=2) of accumulate(adam), and adam's own update for reference."""
  state = _ADAM_K2.init(params)
  holding, state = _ADAM_K2.update(grads, state, params)
  emitted, state = _ADAM_K2.update(grads, state, params)
  inner = optax.adam(1e-2)
  reference, _ = inner.update(grads, inner.init(params), params)
  return holding, emitted, reference


# Real runs of a representative subset (each pair is a compile of its own).
_REAL_RUN_PAIRS = [
    (jnp.bfloat16, jnp.bfloat16),
    (jnp.float32, jnp.bfloat16),
    (jnp.bfloat16, jnp.float32),
    (jnp.float16, jnp.float16),
]


def test_update_dtypes_are_the_inner_updates_for_all_param_and_grad_dtypes():
  pairs, tolerances = {}, {}
  for params_dtype, grads_dtype in itertools.product(FLOAT_DTYPES, FLOAT_DTYPES):
    key = f"params {dtype_id(params_dtype)}, grads {dtype_id(grads_dtype)}"
    params = make_params(params_dtype)
    pairs[key] = params, microbatch_grads(params, 1, dtype=grads_dtype)[0]
    tolerances[key] = tolerance_for(params_dtype, grads_dtype)
    holding, emitted, reference = jax.eval_shape(_two_calls, *pairs[key])
    expected = shapes_and_dtypes(reference, weak_type=False)
    assert shapes_and_dtypes(holding, weak_type=False) == expected, key
    assert shapes_and_dtypes(emitted, weak_type=False) == expected, key

  real_keys = [f"params {dtype_id(p)}, grads {dtype_id(g)}" for p, g in _REAL_RUN_PAIRS]
  results = jax.jit(lambda pairs: {key: _two_calls(*pairs[key]) for key in real_keys})(pairs)
  for key, (holding, emitted, reference) in results.items():
    expected = shapes_and_dtypes(reference, weak_type=False)
    assert shapes_and_dtypes(holding, weak_type=False) == expected, key
    assert shapes_and_dtypes(emitted, weak_type=False) == expected, key
    _assert_zeros(holding)
    # The mean of two equal gradients is that gradient, exactly; the inner
    # update, compiled inside a conditional, may round differently.
    tree_allclose(emitted, reference, **tolerances[key])


# ---------------------------------------------------------------------------
# 3. The inner optimizer runs, and counts, only on emitting calls.


def test_inner_update_executes_only_on_emitting_calls():
  executions = []
  sgd = optax.sgd(0.1)

  def counting_update(updates, state, params=None):
    jax.debug.callback(lambda: executions.append(None))
    return sgd.update(updates, state, params)

  k = 3
  opt = accum_jax.accumulate(optax.GradientTransformation(sgd.init, counting_update), k)
  params = make_params()
  step = jax.jit(opt.update)
  state = jax.jit(opt.init)(params)
  for g in microbatch_grads(params, 2 * k):
    _, state = step(g, state, params)
  jax.effects_barrier()
  assert len(executions) == 2
  assert step._cache_size() == 1


def test_inner_state_count_advances_only_on_updates():
  k = 3
  params = make_params()
  _, _, states = scan_updates(
      _accumulated("adam", k), params, stack_trees(microbatch_grads(params, 2 * k))
  )
  adam_state = _inner_tree(states)[0]
  assert isinstance(adam_state, optax.ScaleByAdamState)
  assert _ints(adam_state.count) == [0, 0, 1, 1, 1, 2]


def _lr_schedule(count):
  return 0.1 * (count + 1)


@pytest.mark.parametrize(
    "make_inner",
    [
        pytest.param(lambda: optax.sgd(_lr_schedule), id="sgd with a schedule"),
        pytest.param(
            lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=_lr_schedule),
            id="inject_hyperparams sgd with a schedule",
        ),
    ],
)
def test_learning_rate_schedule_counts_optimizer_steps(make_inner):
  k, windows = 2, 3
  params = {"w": jnp.zeros(3)}
  grads = stack_trees([{"w": jnp.ones(3)}] * (k * windows))
  _, updates, states = scan_updates(
      accum_jax.accumulate(make_inner(), k), params, grads, apply_updates=False
  )
  emitted = np.asarray(updates["w"])[k - 1 :: k, 0]
  np.testing.assert_allclose(emitted, [-0.1, -0.2, -0.3], rtol=1e-6)
  if isinstance(states.inner_opt_state, optax.InjectHyperparamsState):
    learning_rates = np.asarray(states.inner_opt_state.hyperparams["learning_rate"])
    np.testing.assert_allclose(learning_rates[k - 1 :: k], [0.1, 0.2, 0.3], rtol=1e-6)


# ---------------------------------------------------------------------------
# 3b. A call that only accumulates costs what a bare jitted add costs.

# How a call is jitted, by name: what tx.update's arguments (grads, state, params)
# donate; None for a step that donates the state and returns it first. The forms whose
# state leaves do not keep their buffers are in test_xla_facts.py: how many copies XLA
# inserts there is its buffer assignment's choice.
JIT_FORMS = {
    "state donated and returned first": None,
    "jax.jit(tx.update, donate_argnums=(0, 1))": (0, 1),
}


def _lower(form: str, update: Any, state: Any, grads: Any, params: Any) -> Any:
  """``update(grads, state, params)`` jitted as ``form``, lowered."""
  if JIT_FORMS[form] is None:
    step = jax.jit(lambda state, g, p: update(g, state, p)[::-1], donate_argnums=0)
    return step.lower(state, grads, params)
  return jax.jit(update, donate_argnums=JIT_FORMS[form]).lower(grads, state, params)


# A packed window's sum cannot carry the updates through the device schedule's
# conditional (it is read back through slices): the gradient does, which is free
# where it is donated or computed in the step, as a training step computes it.
@pytest.mark.parametrize("form, layout", [(form, "tree") for form in JIT_FORMS] + [
    ("jax.jit(tx.update, donate_argnums=(0, 1))", "packed")])
def test_a_call_that_only_accumulates_copies_nothing_where_the_state_keeps_its_buffers(
    form, layout):
  # Counting copies in the compiled HLO is deterministic; the time this saves is
  # in bench/. Several parameters share a shape, as in most models.
  params = {f"layer{i}": {"w": jnp.ones((32, 32)), "b": jnp.ones(32)} for i in range(3)}
  grads = jax.tree.map(lambda x: 0.5 * x, params)
  opt = accum_jax.accumulate(optax.adam(1e-3), every_k=4, layout=layout)
  compiled = _lower(form, opt.update, opt.init(params), grads, params).compile()
  # Each state leaf keeps its buffer: the sum is added in place, the moments stay
  # where they are, and the updates take the gradients' buffers, or come through in
  # the sum's (the conditional's skip branch passes a carrier of the updates
  # through, so that XLA:GPU keeps it).
  assert full_size_copies(compiled, params) == 0
  assert full_size_copies(compiled, opt.init(params)) == 0  # nor of a packed vector


@pytest.mark.parametrize("layout", ["packed", "tree"])
def test_a_call_that_takes_its_gradient_in_the_same_step_copies_nothing(layout):
  # As a training step is written: the gradient is computed in the step, so its
  # buffer is free to become the updates the skip branch passes through.
  params = {f"layer{i}": {"w": jnp.ones((32, 32)), "b": jnp.ones(32)} for i in range(3)}
  opt = accum_jax.accumulate(optax.adam(1e-3), every_k=4, layout=layout)

  def step(state, params, x):
    def loss(p):
      return sum(jnp.sum(jnp.tanh(x @ layer["w"]) + layer["b"]) for layer in p.values())

    updates, state = opt.update(jax.grad(loss)(params), state, params)
    return state, optax.apply_updates(params, updates)

  compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
      opt.init(params), params, jnp.ones((4, 32))).compile()
  assert full_size_copies(compiled, params) == 0


# ---------------------------------------------------------------------------
# 4. Weights and reductions.


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@with_and_without_jit
def test_weighted_calls_emit_the_weighted_mean_or_sum(reduction):
  k = 3
  params = make_params()
  grads = microbatch_grads(params, 2 * k)
  # The zero-weight call holds NaN: it must add nothing, and is not skipped.
  grads[3] = _nan_like(grads[3])
  weights = [1.0, 2.0, 0.5, 0.0, 4.0, 1.0]
  _, updates, states = scan_updates(
      _identity_accumulated(k, reduction=reduction),
      params,
      stack_trees(grads),
      {"weight": jnp.array(weights)},
      apply_updates=False,
  )
  updates = unstack_tree(updates)
  # In the second window the NaN call weighs nothing.
  windows = [(grads[0:3], weights[0:3]), (grads[4:6], weights[4:6])]
  for emitting_call, (g, w) in zip((2, 5), windows):
    expected = tree_weighted_mean(g, w)
    if reduction == "sum":
      expected = _scaled(sum(w), expected)
    tree_allclose(updates[emitting_call], expected)
  # The zero-weight call still counts as one of the k calls.
  assert _bools(states.last_updated) == [False, False, True, False, False, True]
  assert int(states.num_skipped[-1]) == 0
  assert tree_all_finite(states.acc_grads)


def test_negative_or_nan_weights_are_skipped_under_jit_and_refused_when_concrete():
  k = 3
  opt = _identity_accumulated(k, reduction="mean")  # shares a compile with the test above
  params = make_params()
  grads = microbatch_grads(params, 2 * k)
  weights = [1.0, -1.0, float("nan"), 2.0, 0.5, 1.0]
  _, updates, states = scan_updates(
      opt, params, stack_trees(grads), {"weight": jnp.array(weights)}, apply_updates=False
  )
  # The two bad weights are left out, not counted toward k, not added, and
  # counted as bad weights (not as non-finite data).
  assert _ints(states.num_bad_weights) == [0, 1, 2, 2, 2, 2]
  assert _ints(states.num_skipped) == [0] * 6
  assert _ints(states.mini_step) == [1, 1, 1, 2, 0, 1]
  expected = tree_weighted_mean([grads[0], grads[3], grads[4]], [1.0, 2.0, 0.5])
  tree_allclose(unstack_tree(updates)[4], expected)

  state = jax.eval_shape(opt.init, params)
  with pytest.raises(ValueError, match=re.escape("weight=-1.0 must be a finite number >= 0")):
    opt.update(grads[0], state, weight=-1.0)


def test_unweighted_calls_count_as_weight_one():
  opt = _identity_accumulated(3)

  @jax.jit
  def three_calls(g1, g2, g3):
    state = opt.init(g1)
    _, state = opt.update(g1, state)
    _, state = opt.update(g2, state, weight=3.0)
    updates, _ = opt.update(g3, state)
    return updates

  g1, g2, g3 = microbatch_grads(make_params(), 3)
  tree_allclose(three_calls(g1, g2, g3), tree_weighted_mean([g1, g2, g3], [1.0, 3.0, 1.0]))


# ---------------------------------------------------------------------------
# 5. flush.


def test_traced_flush_emits_the_partial_window_without_recompiling():
  k = 4
  opt = _identity_accumulated(k)
  params = make_params()
  grads = microbatch_grads(params, 6)
  step = jax.jit(lambda g, state, flush: opt.update(g, state, flush=flush))
  state = jax.jit(opt.init)(params)
  emitted = []
  for i, g in enumerate(grads):
    updates, state = step(g, state, jnp.array(i == 1))
    emitted.append(updates)
  assert step._cache_size() == 1
  # The flushed partial window is normalised by what it held; the next window
  # starts empty.
  tree_allclose(emitted[1], tree_weighted_mean(grads[:2]))
  tree_allclose(emitted[5], tree_weighted_mean(grads[2:6]))
  for i in (0, 2, 3, 4):
    _assert_zeros(emitted[i])


@with_and_without_jit
def test_python_bool_flush():
  opt = _identity_accumulated(4)
  g1, g2 = microbatch_grads(make_params(), 2)

  @jax.jit
  def flush_second_call(g1, g2):
    state = opt.init(g1)
    _, state = opt.update(g1, state, flush=False)
    updates, state = opt.update(g2, state, flush=True)
    return updates, state

  updates, state = flush_second_call(g1, g2)
  tree_allclose(updates, tree_weighted_mean([g1, g2]))
  assert bool(accum_jax.has_updated(state))
  assert int(state.mini_step) == 0
  _assert_zeros(state.acc_grads)


@with_and_without_jit
def test_flush_drops_nothing_and_an_empty_window_flush_does_nothing():
  k = 3
  # The learning rate is the optimizer step + 1: the updates show both the
  # gradient and the step count the inner optimizer saw.
  opt = accum_jax.accumulate(
      optax.sgd(lambda count: count + 1.0), k, on_nonfinite="skip_microbatch")
  params = make_params()
  g = microbatch_grads(params, 7)
  nan = _nan_like(g[0])
  calls = [  # (gradient, weight, flush)
      (g[0], 1.0, False),
      (g[1], 1.0, True),  # flushes a window of two
      (g[2], 0.0, True),  # a window of weight zero: nothing to apply
      (nan, 1.0, True),  # skipped, so the window is empty: nothing to apply
      (g[3], 1.0, False),
      (nan, 1.0, True),  # skipped, but the window holds g3: g3 is applied
      (g[4], 1.0, False),
      (g[5], 1.0, False),
      (g[6], 1.0, False),  # a full window
  ]
  _, updates, states = scan_updates(
      opt,
      params,
      stack_trees([c[0] for c in calls]),
      {
          "weight": jnp.array([c[1] for c in calls]),
          "flush": jnp.array([c[2] for c in calls]),
      },
      apply_updates=False,
  )
  updates = unstack_tree(updates)
  tree_allclose(updates[1], _scaled(-1.0, tree_weighted_mean(g[0:2])))
  # The empty flushes neither leaked into the next windows nor advanced the
  # inner optimizer.
  tree_allclose(updates[5], _scaled(-2.0, g[3]))
  tree_allclose(updates[8], _scaled(-3.0, tree_weighted_mean(g[4:7])))
  for i in (0, 2, 3, 4, 6, 7):
    _assert_zeros(updates[i])
  emitting = [i in (1, 5, 8) for i in range(len(calls))]
  assert _bools(states.last_updated) == emitting
  assert _ints(states.optimizer_step) == list(np.cumsum(emitting))
  assert _ints(_inner_tree(states)[1].count) == list(np.cumsum(emitting))
  assert _ints(states.num_skipped) == [0, 0, 0, 1, 1, 2, 2, 2, 2]
  assert _ints(states.num_empty_windows) == [0, 0, 1, 1, 1, 1, 1, 1, 1]


# ---------------------------------------------------------------------------
# 6. Non-finite gradients.


@with_and_without_jit
def test_nonfinite_calls_are_skipped_and_the_accumulator_stays_finite():
  k = 3
  params = make_params()
  g = microbatch_grads(params, 6)
  inf_in_one_leaf = {**g[0], "scale": jnp.asarray(jnp.inf, jnp.float32)}
  sequence = [g[0], _nan_like(g[0]), g[1], inf_in_one_leaf, g[2], g[3], g[4], g[5]]
  _, updates, states = scan_updates(
      _identity_accumulated(k, on_nonfinite="skip_microbatch"), params, stack_trees(sequence),
      apply_updates=False,
  )
  updates = unstack_tree(updates)
  tree_allclose(updates[4], tree_weighted_mean(g[0:3]))
  tree_allclose(updates[7], tree_weighted_mean(g[3:6]))
  for i in (0, 1, 2, 3, 5, 6):
    _assert_zeros(updates[i])
  assert _ints(states.num_skipped) == [0, 1, 1, 2, 2, 2, 2, 2]
  assert _ints(states.mini_step) == [1, 1, 2, 2, 0, 1, 2, 0]
  assert tree_all_finite(states.acc_grads)

  # optax.MultiSteps without a skip function counts the NaN call, emits NaN,
  # and its accumulator stays NaN after the update (0 * NaN is NaN).
  optax_multisteps = optax.MultiSteps(optax.identity(), k).gradient_transformation()
  _, optax_updates, optax_states = scan_updates(
      optax_multisteps, params, stack_trees(sequence), apply_updates=False
  )
  assert not tree_all_finite(unstack_tree(optax_updates)[2])
  assert not tree_all_finite(jax.tree.map(lambda x: x[-1], optax_states.acc_grads))


def test_large_finite_gradients_whose_sum_overflows_are_added_not_skipped():
  # Each leaf is judged by its sum first; a sum of finite values can overflow
  # float32 (2 x 3e38), and only then is every element looked at.
  params = {"w": jnp.zeros(4)}
  large = {"w": jnp.full(4, 3e38, jnp.float32)}
  nan = {"w": jnp.array([3e38, 3e38, jnp.nan, 0.0], jnp.float32)}
  _, updates, states = scan_updates(
      _identity_accumulated(1), params, stack_trees([large, nan]), apply_updates=False
  )
  assert _ints(states.num_skipped) == [0, 1]
  tree_allclose(unstack_tree(updates)[0], large)
  _assert_zeros(unstack_tree(updates)[1])


def test_skip_nonfinite_false_adds_nonfinite_gradients():
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  _, updates, states = scan_updates(
      _identity_accumulated(2, on_nonfinite="unchecked"),
      params,
      stack_trees([g, _nan_like(g)]),
      apply_updates=False,
  )
  assert np.isnan(np.asarray(updates["scale"][1]))
  assert int(states.num_skipped[-1]) == 0


def test_jitted_init_of_nonfinite_params_gives_a_zero_accumulator():
  # A parameter may legitimately hold inf (e.g. a frozen -inf mask bias); the
  # accumulator must start at zero whether or not init is jitted.
  params = {"w": jnp.array([1.0, 2.0]), "mask": jnp.array([0.0, -jnp.inf])}
  opt = _identity_accumulated(2)
  state = jax.jit(opt.init)(params)
  tree_allclose(state.acc_grads, _zeros_like(params))
  grads = jax.tree.map(jnp.ones_like, params)
  _, updates, _ = scan_updates(
      opt, params, stack_trees([grads, grads]), state=state, apply_updates=False
  )
  tree_allclose(unstack_tree(updates)[1], grads)


# ---------------------------------------------------------------------------
# 7. every_k as a schedule.


def test_every_k_schedule_changes_the_window_without_recompiling():
  opt = accum_jax.accumulate(optax.identity(), accum_jax.piecewise_every_k({0: 1, 2: 3}))
  params = make_params()
  grads = microbatch_grads(params, 8)
  step = jax.jit(opt.update)
  state = jax.jit(opt.init)(params)
  emitted = []
  for g in grads:
    updates, state = step(g, state)
    emitted.append(bool(accum_jax.has_updated(state)))
    if emitted[-1]:
      last = updates
  # Windows of 1, 1, 3, 3 calls.
  assert emitted == [True, True, False, False, True, False, False, True]
  tree_allclose(last, tree_weighted_mean(grads[5:8]))
  assert int(accum_jax.optimizer_step(state)) == 4
  assert step._cache_size() == 1


def test_every_k_schedule_values():
  schedule = accum_jax.piecewise_every_k({2: 3, 0: 1, 5: 8})
  steps = jnp.array([0, 1, 2, 4, 5, 1000], jnp.int32)
  assert _ints(jax.jit(jax.vmap(schedule))(steps)) == [1, 1, 3, 3, 8, 8]
  # Before the first boundary, every call updates.
  assert int(accum_jax.piecewise_every_k({3: 4})(jnp.int32(0))) == 1


@pytest.mark.parametrize(
    ("boundaries", "message"),
    [
        pytest.param({}, "boundaries is empty", id="empty"),
        pytest.param({-1: 2}, "boundaries has the key -1", id="negative step"),
        pytest.param({1.5: 2}, "boundaries has the key 1.5", id="float step"),
        pytest.param({0: 0}, "boundaries[0]=0 must be an int >= 1", id="zero k"),
        pytest.param({0: 1, 10: 2.5}, "boundaries[10]=2.5 must be an int >= 1", id="float k"),
        pytest.param({0: True}, "boundaries[0]=True must be an int >= 1", id="bool k"),
        pytest.param(
            [(0, 2)], "boundaries=[(0, 2)] is a list, not a mapping", id="list of pairs"
        ),
        pytest.param(
            {0: _lr_schedule},
            "pass the function itself as every_k",
            id="callable k",
        ),
    ],
)
def test_every_k_schedule_errors(boundaries, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    accum_jax.piecewise_every_k(boundaries)


# ---------------------------------------------------------------------------
# 8. Accumulator dtype, state stability, sharding.


@functools.cache
def _sum_many_bf16(num_calls):
  params = {"w": jnp.zeros(4, jnp.bfloat16)}
  # bfloat16(0.01) has 8 significant bits; the exact mean is itself.
  g = jnp.full((num_calls, 4), 0.01, jnp.bfloat16)
  results = {}
  for accumulator_dtype in (jnp.float32, None):
    opt = _identity_accumulated(num_calls, accumulator_dtype=accumulator_dtype)
    _, updates, states = scan_updates(opt, params, {"w": g}, apply_updates=False)
    results[accumulator_dtype] = updates["w"][-1], jax.tree.map(lambda x: x[0], states)
  return float(g[0, 0]), results


def test_float32_accumulator_sums_many_bf16_gradients_accurately():
  exact, results = _sum_many_bf16(1024)
  emitted, state = results[jnp.float32]
  assert emitted.dtype == jnp.bfloat16
  assert state.acc_grads["w"].dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(emitted, np.float32), exact, rtol=0)


def test_bf16_accumulator_keeps_the_running_mean_in_bf16():
  exact, results = _sum_many_bf16(1024)
  emitted, state = results[None]
  assert emitted.dtype == jnp.bfloat16
  assert state.acc_grads["w"].dtype == jnp.bfloat16
  # A bfloat16 running *sum* stops growing once 0.01 is below half its spacing
  # (at 4), and would give about 4 / 1024; the running mean of equal values is
  # that value.
  np.testing.assert_allclose(np.asarray(emitted, np.float32), exact, rtol=0)


@pytest.mark.parametrize("params_dtype", [jnp.float32, jnp.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("inner_name", INNER_OPTIMIZER_PARAMS)
def test_state_structure_and_dtypes_are_the_same_after_init_and_update(inner_name, params_dtype):
  opt = _accumulated(inner_name, 2)
  params = make_params(params_dtype)
  (grads,) = microbatch_grads(params, 1, dtype=jnp.float32)
  init_state = jax.eval_shape(opt.init, params)
  _, after_one = jax.eval_shape(opt.update, grads, init_state, params)
  _, after_two = jax.eval_shape(opt.update, grads, after_one, params)
  assert shapes_and_dtypes(after_one) == shapes_and_dtypes(init_state)
  assert shapes_and_dtypes(after_two) == shapes_and_dtypes(init_state)


def test_state_is_a_scan_carry_with_bf16_params_and_grads():
  params = make_params(jnp.bfloat16)
  grads = microbatch_grads(params, 4)
  final_params, _, states = scan_updates(
      _accumulated("global norm clipping then adam", 2), params, stack_trees(grads)
  )
  assert shapes_and_dtypes(final_params) == shapes_and_dtypes(params)
  assert _ints(states.optimizer_step) == [0, 1, 1, 2]


def test_jitted_init_and_update_keep_the_params_sharding():
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  shardings = {"w": NamedSharding(mesh, P("d", None)), "b": NamedSharding(mesh, P("d"))}
  params = jax.device_put(
      {"w": jnp.ones((8, 4)), "b": jnp.ones(8, jnp.bfloat16)},
      shardings,
  )
  opt = _accumulated("adam", 2)
  state = jax.jit(opt.init)(params)
  for path, acc in jax.tree.leaves_with_path(state.acc_grads):
    sharding = shardings[path[0].key]
    assert acc.sharding.is_equivalent_to(sharding, acc.ndim), (path, acc.sharding)
  _, state = jax.jit(opt.update)(params, state, params)
  for path, acc in jax.tree.leaves_with_path(state.acc_grads):
    sharding = shardings[path[0].key]
    assert acc.sharding.is_equivalent_to(sharding, acc.ndim), (path, acc.sharding)


# ---------------------------------------------------------------------------
# 9. Extra arguments and inject_hyperparams.


def _scale_by_factor_arg():
  """An inner transformation that needs the extra keyword argument ``factor``."""

  def update(updates, state, params=None, *, factor, **extra_args):
    del params, extra_args
    return jax.tree.map(lambda g: factor * g, updates), state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def test_extra_args_reach_the_inner_optimizer_also_inside_chain():
  accumulated = accum_jax.accumulate(_scale_by_factor_arg(), 2)
  chained = optax.chain(optax.clip(100.0), accumulated)

  @jax.jit
  def run(g1, g2, factor):
    state = accumulated.init(g1)
    _, state = accumulated.update(g1, state, factor=factor)
    direct, _ = accumulated.update(g2, state, factor=factor)
    state = chained.init(g1)
    _, state = chained.update(g1, state, factor=factor, weight=1.0)
    in_chain, _ = chained.update(g2, state, factor=factor, weight=3.0)
    return direct, in_chain

  g1, g2 = microbatch_grads(make_params(), 2)
  direct, in_chain = run(g1, g2, 3.0)
  tree_allclose(direct, _scaled(3.0, tree_weighted_mean([g1, g2])))
  tree_allclose(
      in_chain, _scaled(3.0, tree_weighted_mean([g1, g2], [1.0, 3.0]))
  )


def test_inject_hyperparams_inner_keeps_working():
  inner = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
  opt = accum_jax.accumulate(inner, 2)
  params = make_params()
  g1, g2 = microbatch_grads(params, 2)
  state = jax.jit(opt.init)(params)
  # optax.tree.get and set reach the inner hyperparameters in either layout.
  np.testing.assert_allclose(optax.tree.get(state, "learning_rate"), 0.1)
  # Change the learning rate between steps, as a user would.
  state = optax.tree.set(state, learning_rate=jnp.asarray(0.5, jnp.float32))
  _, updates, states = scan_updates(
      opt, params, stack_trees([g1, g2]), state=state, apply_updates=False
  )
  tree_allclose(unstack_tree(updates)[1], _scaled(-0.5, tree_weighted_mean([g1, g2])))
  np.testing.assert_allclose(optax.tree.get(states, "learning_rate"), 0.5)


# ---------------------------------------------------------------------------
# 10, 11. State readers, nesting, retracing.


def test_has_updated_and_optimizer_step_under_jit_find_the_state_in_a_chain():
  opt = optax.chain(optax.clip_by_global_norm(10.0), _accumulated("sgd", 2))
  params = make_params()

  @jax.jit
  def step(g, state):
    updates, state = opt.update(g, state, params)
    return state, accum_jax.has_updated(state), accum_jax.optimizer_step(state)

  state = jax.jit(opt.init)(params)
  seen = []
  for g in microbatch_grads(params, 5):
    state, updated, optimizer_step = step(g, state)
    seen.append((bool(updated), int(optimizer_step)))
  assert seen == [(False, 0), (True, 1), (False, 1), (True, 2), (False, 2)]
  assert step._cache_size() == 1


@pytest.mark.parametrize("reader", [accum_jax.has_updated, accum_jax.optimizer_step])
def test_state_readers_without_an_accumulation_state(reader):
  state = optax.sgd(0.1).init(make_params())
  with pytest.raises(ValueError, match=re.escape(f"{reader.__name__} found no accum_jax")):
    reader(state)


def test_repeated_jitted_calls_compile_once():
  opt = _accumulated("adamw", 3)
  params = make_params()
  step = jax.jit(
      lambda g, state, params, weight, flush: opt.update(
          g, state, params, weight=weight, flush=flush
      )
  )
  state = jax.jit(opt.init)(params)
  for i, g in enumerate(microbatch_grads(params, 7)):
    updates, state = step(g, state, params, jnp.float32(i % 3), jnp.array(i == 5))
    params = optax.apply_updates(params, updates)
  assert step._cache_size() == 1


# ---------------------------------------------------------------------------
# 11b. Per-batch extra arguments: value and grad are the window's.


class _SeenState(NamedTuple):
  value: jax.Array
  grad: Any


def _record_value_and_grad():
  """An inner transformation whose state records the value and grad it was given."""

  def init(params):
    return _SeenState(jnp.zeros((), jnp.float32), _zeros_like(params))

  def update(updates, state, params=None, *, value, grad=None, **extra_args):
    del state, params, extra_args
    return updates, _SeenState(jnp.asarray(value, jnp.float32), grad)

  return optax.GradientTransformationExtraArgs(init, update)


@functools.cache
def _value_recorder(k, reduction="mean"):
  return accum_jax.accumulate(
      _record_value_and_grad(), k, reduction=reduction, on_nonfinite="skip_microbatch")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_value_and_grad_given_to_the_inner_optimizer_are_the_windows(reduction):
  k = 4
  params = make_params()
  grads = microbatch_grads(params, 2 * k + 1)
  grads[1] = _nan_like(grads[1])  # skipped: its value must not count
  values = [1.0, 100.0, 3.0, 5.0, 2.0, float("nan"), 4.0, 8.0, 6.0, 7.0]
  weights = [1.0, 1.0, 2.0, 0.5, 1.0, 1.0, 3.0, 1.0, 1.0, 0.5]
  grads.insert(5, grads[4])  # a finite gradient with a NaN value: skipped too
  _, _, states = scan_updates(
      _value_recorder(k, reduction),
      params,
      stack_trees(grads),
      {
          "weight": jnp.array(weights),
          "value": jnp.array(values),
          # A line search's `grad`, as the emitting call would pass it: replaced.
          "grad": stack_trees(grads),
      },
      apply_updates=False,
  )
  seen = _inner_tree(states)
  kept = [[0, 2, 3, 4], [6, 7, 8, 9]]
  emitting = [4, 9]
  assert _bools(states.last_updated) == [i in emitting for i in range(10)]
  assert _ints(states.num_skipped) == [0, 1, 1, 1, 1, 2, 2, 2, 2, 2]
  for call, window in zip(emitting, kept):
    w = [weights[i] for i in window]
    expected_value = np.average([values[i] for i in window], weights=w)
    expected_grad = tree_weighted_mean([grads[i] for i in window], w)
    if reduction == "sum":
      expected_value, expected_grad = sum(w) * expected_value, _scaled(sum(w), expected_grad)
    np.testing.assert_allclose(seen.value[call], expected_value, rtol=1e-6)
    tree_allclose(jax.tree.map(lambda x, call=call: x[call], seen.grad), expected_grad)


def test_value_must_be_a_scalar():
  opt = _value_recorder(2)
  params = make_params()
  state = jax.eval_shape(opt.init, params)
  with pytest.raises(ValueError, match=re.escape("value must be a scalar loss")):
    jax.eval_shape(lambda s: opt.update(params, s, params, value=jnp.ones(3)), state)


def test_flush_none_is_no_flush_and_a_float_flush_is_an_error():
  opt = _identity_accumulated(2)
  g1, g2 = microbatch_grads(make_params(), 2)

  @jax.jit
  def two_calls(g1, g2):
    state = opt.init(g1)
    held, state = opt.update(g1, state, flush=None)
    emitted, state = opt.update(g2, state, flush=None)
    return held, emitted

  held, emitted = two_calls(g1, g2)
  _assert_zeros(held)
  tree_allclose(emitted, tree_weighted_mean([g1, g2]))
  state = jax.eval_shape(opt.init, g1)
  with pytest.raises(ValueError, match=re.escape("flush must be a bool")):
    opt.update(g1, state, flush=0.5)


# ---------------------------------------------------------------------------
# 11c. Narrow accumulators and complex parameters.


def test_float16_window_with_a_total_weight_of_1e5_applies_the_weighted_mean():
  # 1000 tokens x a gradient of 100, and a window weighing 1e5 in all: beyond
  # float16 as sums, finite as a mean.
  params = {"w": jnp.zeros(2, jnp.float16)}
  grads = {"w": jnp.array([[-100.0, 3.0], [-50.0, 1.0], [20.0, -2.0], [-100.0, 0.5]], jnp.float16)}
  weights = jnp.array([1000.0, 49000.0, 30000.0, 20000.0])
  for accumulator_dtype in (None, jnp.float16, jnp.float32):
    opt = _identity_accumulated(4, accumulator_dtype=accumulator_dtype)
    _, updates, states = scan_updates(
        opt, params, grads, {"weight": weights}, apply_updates=False
    )
    expected = np.average(np.asarray(grads["w"], np.float64), axis=0, weights=weights)
    np.testing.assert_allclose(
        np.asarray(updates["w"][-1], np.float64), expected, rtol=4e-3, atol=1e-3
    )
    assert int(states.num_skipped[-1]) == 0
    assert float(states.window_weight[-2]) == 1e5 - 20000.0


@pytest.mark.parametrize("layout", ["packed", "tree"])
def test_a_float16_sum_that_overflows_is_skipped_and_counted(layout):
  params = {"w": jnp.zeros(1, jnp.float16)}
  grads = {"w": jnp.array([[30000.0], [30000.0], [30000.0], [1.0], [2.0], [3.0]], jnp.float16)}
  for accumulator_dtype in (None, jnp.float32):
    opt = _identity_accumulated(3, reduction="sum", accumulator_dtype=accumulator_dtype,
                                layout=layout)
    _, updates, states = scan_updates(opt, params, grads, apply_updates=False)
    # The first window sums to 90000: not applied, its three calls counted.
    assert _bools(states.last_updated) == [False, False, False, False, False, True]
    assert _ints(states.num_overflowed) == [0, 0, 3, 3, 3, 3]
    assert _ints(states.num_skipped) == [0] * 6
    np.testing.assert_array_equal(np.asarray(updates["w"], np.float32)[:, 0], [0, 0, 0, 0, 0, 6])
    assert _ints(states.optimizer_step) == [0, 0, 0, 0, 0, 1]


def _complex_loss(params, batch):
  residual = batch["x"] @ params["z"] - batch["y"]
  return jnp.mean(jnp.abs(residual) ** 2) + jnp.sum(params["r"] ** 2)


def _complex_problem():
  rng = np.random.default_rng(0)
  params = {
      "z": jnp.asarray(rng.standard_normal(3) + 1j * rng.standard_normal(3), jnp.complex64),
      "r": jnp.asarray(rng.standard_normal(2), jnp.float32),
  }
  batch = {
      "x": jnp.asarray(rng.standard_normal((8, 3)) + 1j * rng.standard_normal((8, 3)),
                       jnp.complex64),
      "y": jnp.asarray(rng.standard_normal(8) - 1j * rng.standard_normal(8), jnp.complex64),
  }
  return params, batch


@pytest.mark.parametrize(
    "make_inner",
    [
        pytest.param(lambda: optax.adam(1e-1), id="adam"),
        pytest.param(
            lambda: optax.contrib.split_real_and_imaginary(optax.adam(1e-1)),
            id="split_real_and_imaginary(adam)",
        ),
    ],
)
def test_complex_parameters_match_the_full_batch_through_both_doors(make_inner):
  k, steps = 4, 3
  params, batch = _complex_problem()
  microbatches = jax.tree.map(lambda x: x.reshape(k, -1, *x.shape[1:]), batch)
  opt, inner = accum_jax.accumulate(make_inner(), k), make_inner()
  microbatched = accum_jax.value_and_grad(_complex_loss, num_microbatches=k)

  @jax.jit
  def run(params):
    ours, ours_inside, reference = params, params, params
    state, inside_state, ref_state = opt.init(params), inner.init(params), inner.init(params)
    for _ in range(steps):
      for i in range(k):
        mb = jax.tree.map(lambda x, i=i: x[i], microbatches)
        g = jax.grad(_complex_loss)(ours, mb)
        updates, state = opt.update(g, state, ours)
        ours = optax.apply_updates(ours, updates)
      _, g = microbatched(ours_inside, batch)
      updates, inside_state = inner.update(g, inside_state, ours_inside)
      ours_inside = optax.apply_updates(ours_inside, updates)
      g = jax.grad(_complex_loss)(reference, batch)
      updates, ref_state = inner.update(g, ref_state, reference)
      reference = optax.apply_updates(reference, updates)
    return ours, ours_inside, reference, state.acc_grads

  ours, ours_inside, reference, acc_grads = run(params)
  assert acc_grads["z"].dtype == jnp.complex64
  assert np.any(np.asarray(reference["z"]).imag != np.asarray(params["z"]).imag)
  tree_allclose(ours, reference)
  tree_allclose(ours_inside, reference)


# ---------------------------------------------------------------------------
# 12. Errors.


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        pytest.param({"every_k": 0}, "every_k=0 must be an int >= 1", id="every_k=0"),
        pytest.param({"every_k": -2}, "every_k=-2 must be an int >= 1", id="every_k=-2"),
        pytest.param({"every_k": 2.5}, "every_k=2.5 must be an int >= 1", id="every_k=2.5"),
        pytest.param({"every_k": True}, "every_k=True must be an int >= 1", id="every_k=True"),
        pytest.param(
            {"every_k": 2, "reduction": "avg"},
            "reduction='avg' is not one of ('mean', 'sum', 'max', 'last')",
            id="unknown reduction",
        ),
        pytest.param(
            {"every_k": 2, "accumulator_dtype": jnp.int32},
            "accumulator_dtype=int32 is not a floating dtype",
            id="integer accumulator_dtype",
        ),
    ],
)
def test_construction_errors(kwargs, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    accum_jax.accumulate(optax.sgd(0.1), **kwargs)


def test_call_errors_at_trace_time():
  opt = _accumulated("sgd", 2)
  params = make_params()
  (g,) = microbatch_grads(params, 1)
  # eval_shape traces as jit does, and the errors are raised while tracing.
  state = jax.eval_shape(opt.init, params)
  update = functools.partial(jax.eval_shape, opt.update)

  with pytest.raises(ValueError, match=re.escape("tree structure")):
    update({"linear": g["linear"]}, state, params)
  with pytest.raises(ValueError, match=re.escape("differs from the parameters'")):
    update({**g, "extra": g["scale"]}, state, params)

  wrong_shape = {**g, "linear": {**g["linear"], "b": jnp.zeros(3)}}
  with pytest.raises(
      ValueError,
      match=re.escape("['linear']['b'] has shape (3,) but the parameter has shape (2,)"),
  ):
    update(wrong_shape, state, params)

  with pytest.raises(ValueError, match=re.escape("weight must be a scalar")):
    jax.eval_shape(lambda g, s, w: opt.update(g, s, params, weight=w), g, state, jnp.ones(2))


def test_a_transformation_after_accumulate_in_a_chain_is_refused_by_the_readers():
  # After accumulate, weight decay would act on every call: 0.1 * params on each
  # call that only adds. The readers and HostSchedule refuse it with the fix.
  params = make_params()
  after = optax.chain(accum_jax.accumulate(optax.sgd(0.1), 2), optax.add_decayed_weights(0.1))
  state = after.init(params)
  updates, state = after.update(microbatch_grads(params, 1)[0], state, params, apply=False)
  assert any(np.abs(np.asarray(u)).max() > 0 for u in jax.tree.leaves(updates))  # the trap
  for read in (accum_jax.HostSchedule, accum_jax.has_updated, accum_jax.optimizer_step):
    with pytest.raises(ValueError, match=re.escape("accumulate(optax.chain(inner, ...), every_k)")):
      read(state)
  # Inside, it acts once per window; before accumulate (clipping each call's
  # gradient) the readers take the state.
  inside = accum_jax.accumulate(optax.chain(optax.sgd(0.1), optax.add_decayed_weights(0.1)), 2)
  before = optax.chain(optax.clip_by_global_norm(1.0), accum_jax.accumulate(optax.sgd(0.1), 2))
  for opt in (inside, before):
    state = opt.init(params)
    updates, state = opt.update(microbatch_grads(params, 1)[0], state, params, apply=False)
    _assert_zeros(updates)
    assert accum_jax.HostSchedule(state).window_length == 2
