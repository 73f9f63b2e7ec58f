"""DP-SGD with a logical batch streamed through several calls, against the one-call reference.

The reference is written without accum_jax: the per-example gradients of the whole
logical batch (``jax.vmap``), each clipped to norm ``L2_CLIP``, summed; the noise drawn
with the key ``add_gaussian_noise`` documents (``fold_in(KEY, window)``, split per
leaf); the sum divided by the expected batch size; then the inner optimizer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import jit_traced_at_most, tree_allclose

import accum_jax
import accum_jax.privacy as privacy

L2_CLIP = 1.0
NOISE_MULTIPLIER = 0.7
KEY = jax.random.key(42)
NUM_FEATURES, NUM_CLASSES = 5, 3

INNERS = [
    pytest.param(lambda: optax.sgd(0.5), id="sgd"),
    pytest.param(lambda: optax.adam(0.05), id="adam"),
]


def per_example_loss(params, example):
  hidden = jnp.tanh(example["x"] @ params["w1"] + params["b1"])
  logits = hidden @ params["w2"]
  return optax.softmax_cross_entropy_with_integer_labels(logits, example["y"])


def make_params(seed: int = 0) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
      "w1": jnp.asarray(rng.normal(size=(NUM_FEATURES, 8)), jnp.float32),
      "b1": jnp.zeros(8, jnp.float32),
      "w2": jnp.asarray(rng.normal(size=(8, NUM_CLASSES)), jnp.float32),
  }


def make_data(size: int, seed: int = 1) -> dict[str, np.ndarray]:
  # Features of very different scales: some examples' gradients are clipped, some not.
  rng = np.random.default_rng(seed)
  scale = rng.choice([0.05, 3.0], size=(size, 1))
  return {
      "x": (scale * rng.normal(size=(size, NUM_FEATURES))).astype(np.float32),
      "y": rng.integers(0, NUM_CLASSES, size=size).astype(np.int32),
  }


def take(data: dict[str, np.ndarray], indices: np.ndarray) -> dict[str, np.ndarray]:
  return {name: column[indices] for name, column in data.items()}


# --- the reference, without accum_jax ---------------------------------------------------
@jax.jit  # op by op, each logical batch's size would compile every op of it again
def _clipped_sum(params, examples):
  grads = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0))(params, examples)
  squares = [jnp.sum(jnp.reshape(g, (g.shape[0], -1)) ** 2, axis=1) for g in jax.tree.leaves(grads)]
  factors = jnp.minimum(1.0, L2_CLIP / jnp.sqrt(sum(squares)))
  return jax.tree.map(lambda g: jnp.tensordot(factors, g, axes=1), grads)


def reference_clipped_sum(params, examples):
  """The sum of the clipped per-example gradients, computed the plain way in float64
  and returned in float32: the value a float32 sum must come within round-off of."""
  def wide(x):
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind == "f" else x

  with jax.enable_x64(True):
    total = jax.device_get(_clipped_sum(*jax.tree.map(wide, (params, examples))))
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), total)


@jax.jit
def reference_noise(like, draw: int):
  leaves, treedef = jax.tree.flatten(like)
  keys = jax.random.split(jax.random.fold_in(KEY, draw), len(leaves))
  stddev = NOISE_MULTIPLIER * L2_CLIP
  noise = [stddev * jax.random.normal(k, leaf.shape, jnp.float32) for k, leaf in zip(keys, leaves)]
  return jax.tree.unflatten(treedef, noise)


def reference_training(params, inner, logical_batches: Sequence[dict], expected_batch_size):
  """The parameters after each logical batch: one call on the whole batch, one draw."""
  state = inner.init(params)
  update = jax.jit(inner.update)
  history = []
  for draw, examples in enumerate(logical_batches):
    if len(examples["y"]):
      total = reference_clipped_sum(params, examples)
    else:  # an empty logical batch: its step adds noise alone
      total = jax.tree.map(jnp.zeros_like, params)
    noise = reference_noise(total, draw)
    noisy = jax.tree.map(lambda s, n: (s + n) / expected_batch_size, total, noise)
    updates, state = update(noisy, state, params)
    params = optax.apply_updates(params, updates)
    history.append(params)
  return history


# --- accum_jax: the logical batch streamed in physical batches ---------------------------


def physical_batches(examples: dict, size: int) -> list[tuple[dict, np.ndarray]]:
  """``examples`` cut into padded batches of ``size`` (at least one), with masks."""
  n = len(examples["y"])
  count = max(1, -(-n // size))
  indices = np.zeros(count * size, np.int64)
  indices[:n] = np.arange(n)
  mask = np.arange(count * size) < n
  padded = {name: np.concatenate([column, np.zeros_like(column[:1]).repeat(count * size - n, 0)])
            for name, column in examples.items()}
  return [(take(padded, idx), m) for idx, m in zip(np.split(indices, count), np.split(mask, count))]


def make_step(opt, grad_sum=None):
  grad_sum = grad_sum or privacy.clipped_grad_sum(per_example_loss, L2_CLIP)

  def step(params, state, batch, mask, last):
    grads, _ = grad_sum(params, batch, mask)
    updates, state = opt.update(grads, state, params, flush=last)
    return optax.apply_updates(params, updates), state

  return jit_traced_at_most(step, 1)


def streamed_training(params, opt, calls_per_logical_batch: Sequence[Sequence[tuple[dict, Any]]],
                      *, flush: bool):
  """The parameters after each logical batch, and the final state."""
  step = make_step(opt)
  state = opt.init(params)
  history = []
  for calls in calls_per_logical_batch:
    for i, (batch, mask) in enumerate(calls):
      params, state = step(params, state, batch, mask, flush and i == len(calls) - 1)
    history.append(params)
  return history, state


def accumulate_private(inner, every_k=None, expected_batch_size=32.0):
  return privacy.accumulate_private(
      inner, every_k, l2_clip=L2_CLIP, noise_multiplier=NOISE_MULTIPLIER,
      expected_batch_size=expected_batch_size, key=KEY,
  )


def noise_state(state) -> privacy.GaussianNoiseState:
  [found] = [
      x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, privacy.GaussianNoiseState))
      if isinstance(x, privacy.GaussianNoiseState)
  ]
  return found


def fixed_logical_batches(num_windows=3, k=4, physical=8):
  data = make_data(num_windows * k * physical)
  logical = [take(data, np.arange(w * k * physical, (w + 1) * k * physical))
             for w in range(num_windows)]
  return logical, [physical_batches(examples, physical) for examples in logical]


# --- streamed equals one call ------------------------------------------------------------


@pytest.mark.parametrize("make_inner", INNERS)
def test_a_logical_batch_streamed_in_k_calls_equals_one_call_on_it_with_the_same_noise(
    make_inner,
):
  params = make_params()
  logical, calls = fixed_logical_batches(num_windows=3, k=4, physical=8)
  expected = reference_training(params, make_inner(), logical, expected_batch_size=32.0)
  streamed, state = streamed_training(
      params, accumulate_private(make_inner(), every_k=4), calls, flush=False
  )
  for got, want in zip(streamed, expected, strict=True):
    tree_allclose(got, want)
  assert int(accum_jax.optimizer_step(state)) == 3
  # The parameters moved: the comparison is not of two no-ops.
  assert not np.allclose(expected[-1]["w1"], params["w1"], atol=1e-3)


def test_the_noise_is_drawn_once_per_window_on_the_emitting_call():
  params = make_params()
  _, calls = fixed_logical_batches(num_windows=3, k=4, physical=8)
  opt = accumulate_private(optax.sgd(0.5), every_k=4)
  step = make_step(opt)
  state = opt.init(params)
  for window, window_calls in enumerate(calls):
    for i, (batch, mask) in enumerate(window_calls):
      params, state = step(params, state, batch, mask, False)
      assert int(noise_state(state).num_draws) == window + (i == 3)
      assert int(noise_state(state).num_draws) == int(accum_jax.optimizer_step(state))


def test_noise_drawn_on_every_call_misses_the_reference():
  # What the tests above would see if the noise ran on every call: the same pieces, with
  # the noise chained before accumulate (the chain is not given flush=, so nothing refuses).
  params = make_params()
  logical, calls = fixed_logical_batches(num_windows=2, k=4, physical=8)
  expected = reference_training(params, optax.sgd(0.5), logical, expected_batch_size=32.0)
  per_call = optax.chain(
      privacy.add_gaussian_noise(NOISE_MULTIPLIER * L2_CLIP, KEY),
      accum_jax.accumulate(optax.chain(optax.scale(1 / 32), optax.sgd(0.5)), 4, reduction="sum"),
  )
  step = jax.jit(lambda p, s, b, m: _apply(per_call, p, s, b, m))
  state = per_call.init(params)
  for window_calls in calls:
    for batch, mask in window_calls:
      params, state = step(params, state, batch, mask)
  deviation = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                  zip(jax.tree.leaves(params), jax.tree.leaves(expected[-1])))
  assert deviation > 1e-3
  with pytest.raises(ValueError, match="sits outside accum_jax.accumulate"):
    privacy.check_state(state)


def test_optax_multisteps_after_optax_dp_aggregate_draws_noise_on_every_call():
  # What docs/comparison.md says of optax.MultiSteps: optax's aggregate, which takes the
  # per-example gradients of one call, runs before it on every call, with a new key each.
  params = make_params()
  opt = optax.chain(
      optax.contrib.differentially_private_aggregate(L2_CLIP, NOISE_MULTIPLIER, key=0),
      optax.MultiSteps(optax.sgd(0.5), 4).gradient_transformation(),
  )
  _, calls = fixed_logical_batches(num_windows=1, k=4, physical=8)
  state = opt.init(params)
  update = jax.jit(lambda g, s, p: opt.update(g, s, p))
  per_example_grads = jax.jit(jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0)))
  keys = [jax.random.key_data(state[0].rng_key)]
  for batch, _ in calls[0]:
    _, state = update(per_example_grads(params, batch), state, params)
    keys.append(jax.random.key_data(state[0].rng_key))
  assert int(state[1].gradient_step) == 1  # one window ...
  assert len({tuple(np.asarray(k).ravel()) for k in keys}) == 5  # ... four draws


def _apply(opt, params, state, batch, mask):
  grads, _ = privacy.clipped_grad_sum(per_example_loss, L2_CLIP)(params, batch, mask)
  updates, state = opt.update(grads, state, params)
  return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("make_inner", INNERS)
def test_poisson_sampled_logical_batches_of_varying_size_equal_the_reference(make_inner):
  dataset_size, sampling_rate, physical = 50, 0.25, 4
  expected_batch_size = sampling_rate * dataset_size
  data = make_data(dataset_size)
  rng = np.random.default_rng(7)
  samples = [
      privacy.poisson_batches(rng, dataset_size, sampling_rate=sampling_rate,
                              physical_batch_size=physical)
      for _ in range(4)
  ]
  # An empty logical batch too: one call of padding, whose step adds the noise alone.
  samples.insert(2, [(np.zeros(physical, np.int64), np.zeros(physical, bool))])
  sizes = [sum(int(mask.sum()) for _, mask in sample) for sample in samples]
  assert len(set(sizes)) > 2 and 0 in sizes  # the sizes vary
  assert max(len(sample) for sample in samples) > 1

  logical = [take(data, np.concatenate([idx[mask] for idx, mask in sample])) for sample in samples]
  calls = [[(take(data, idx), mask) for idx, mask in sample] for sample in samples]
  params = make_params()
  expected = reference_training(params, make_inner(), logical, expected_batch_size)
  opt = accumulate_private(make_inner(), every_k=None, expected_batch_size=expected_batch_size)
  streamed, state = streamed_training(params, opt, calls, flush=True)  # one compilation
  for got, want in zip(streamed, expected, strict=True):
    tree_allclose(got, want)
  assert int(accum_jax.optimizer_step(state)) == len(samples)
  assert int(noise_state(state).num_draws) == len(samples)


def test_a_fixed_every_k_with_flush_closes_a_partial_last_window():
  params = make_params()
  logical, calls = fixed_logical_batches(num_windows=2, k=4, physical=8)
  logical[-1] = take(logical[-1], np.arange(8 * 2))  # the last window holds 2 calls of 4
  calls[-1] = calls[-1][:2]
  expected = reference_training(params, optax.sgd(0.5), logical, expected_batch_size=32.0)
  streamed, _ = streamed_training(params, accumulate_private(optax.sgd(0.5), every_k=4), calls,
                                  flush=True)
  for got, want in zip(streamed, expected, strict=True):
    tree_allclose(got, want)


# --- padding, non-finite examples and batches --------------------------------------------


def test_clipped_grad_sum_clips_each_example_and_sums():
  params = make_params()
  examples = make_data(12)
  out = privacy.clipped_grad_sum(per_example_loss, L2_CLIP)(params, examples)
  # A sum of 12 gradients of norm up to 1 that cancel: its float32 round-off is that
  # of terms of size 1, some 1e-6, however small the sum.
  tree_allclose(out.grads, reference_clipped_sum(params, examples), atol=1e-5)
  assert int(out.num_examples) == 12
  grads = jax.jit(jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0)))(params, examples)
  norms = jnp.sqrt(sum(jnp.sum(jnp.reshape(g, (12, -1)) ** 2, 1) for g in jax.tree.leaves(grads)))
  assert bool(jnp.any(norms > L2_CLIP)) and bool(jnp.any(norms < L2_CLIP))  # both cases occur


def test_padding_examples_weigh_nothing_even_when_their_loss_is_not_finite():
  params = make_params()
  real = make_data(5)
  padded = {
      "x": np.concatenate([real["x"], np.full((3, NUM_FEATURES), np.nan, np.float32)]),
      "y": np.concatenate([real["y"], np.zeros(3, np.int32)]),
  }
  mask = np.arange(8) < 5
  grad_sum = privacy.clipped_grad_sum(per_example_loss, L2_CLIP)
  out = jax.jit(grad_sum)(params, padded, mask)
  tree_allclose(out.grads, reference_clipped_sum(params, real))
  assert int(out.num_examples) == 5
  # Huge finite padding: still nothing (a select, not a product with the mask).
  padded["x"][5:] = 1e30
  tree_allclose(grad_sum(params, padded, mask.astype(np.float32)).grads,
                reference_clipped_sum(params, real))


def test_an_example_whose_gradient_is_not_finite_is_dropped_alone():
  params = make_params()
  examples = make_data(6)
  examples["x"][2, 0] = np.inf
  out = jax.jit(privacy.clipped_grad_sum(per_example_loss, L2_CLIP))(params, examples)
  others = take(examples, np.array([0, 1, 3, 4, 5]))
  tree_allclose(out.grads, reference_clipped_sum(params, others))
  assert int(out.num_examples) == 5


def test_a_non_finite_physical_batch_is_skipped_and_counted():
  # A gradient sum brought from elsewhere (a clipping that keeps NaNs): accumulate skips
  # the call, and the window applies what the other calls hold, with one draw.
  params = make_params()
  logical, calls = fixed_logical_batches(num_windows=1, k=4, physical=8)
  opt = accumulate_private(optax.sgd(0.5), every_k=4)
  grad_sum = privacy.clipped_grad_sum(per_example_loss, L2_CLIP)
  state = opt.init(params)
  update = jax.jit(opt.update)
  for i, (batch, mask) in enumerate(calls[0]):
    grads, _ = grad_sum(params, batch, mask)
    if i == 1:
      grads = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grads)
    updates, state = update(grads, state, params)
    if i == 1:
      assert int(state.num_skipped) == 1 and int(state.mini_step) == 1
  # The skipped call did not count toward every_k: a fifth call closes the window.
  updates, state = update(grad_sum(params, *calls[0][0]).grads, state, params)
  assert bool(accum_jax.has_updated(state)) and int(noise_state(state).num_draws) == 1
  used = take(logical[0], np.r_[0:8, 16:32, 0:8])  # calls 0, 2, 3, then call 0 again
  expected = reference_training(params, optax.sgd(0.5), [used], expected_batch_size=32.0)
  tree_allclose(optax.apply_updates(params, updates), expected[0])


def test_clipped_grad_sum_returns_per_example_aux():
  def loss_with_aux(params, example):
    loss = per_example_loss(params, example)
    return loss, {"loss": loss}

  params, examples = make_params(), make_data(4)
  (out, aux), plain = (
      jax.jit(privacy.clipped_grad_sum(loss_with_aux, L2_CLIP, has_aux=True))(params, examples),
      jax.jit(privacy.clipped_grad_sum(per_example_loss, L2_CLIP))(params, examples),
  )
  tree_allclose(out, plain)
  tree_allclose(aux["loss"],
                jax.jit(jax.vmap(per_example_loss, in_axes=(None, 0)))(params, examples))


def test_poisson_batches_sample_each_example_independently_and_pad():
  rng = np.random.default_rng(0)
  sizes = []
  for _ in range(300):
    batches = privacy.poisson_batches(rng, 40, sampling_rate=0.2, physical_batch_size=3)
    indices = np.concatenate([idx[mask] for idx, mask in batches])
    assert len(np.unique(indices)) == len(indices) and indices.max(initial=0) < 40
    assert all(idx.shape == mask.shape == (3,) for idx, mask in batches)
    assert len(batches) == max(1, -(-len(indices) // 3))
    sizes.append(len(indices))
  assert abs(np.mean(sizes) - 8.0) < 0.6  # 300 draws: a standard error of about 0.15
  [(idx, mask)] = privacy.poisson_batches(rng, 40, sampling_rate=1e-12, physical_batch_size=3)
  assert not mask.any() and idx.shape == (3,)


# --- refusals ------------------------------------------------------------------------------


def _optax_dp_aggregate():
  return optax.contrib.differentially_private_aggregate(L2_CLIP, NOISE_MULTIPLIER, key=0)


def test_accumulate_private_refuses_optax_dp_aggregate_in_its_inner_optimizer():
  opt = accumulate_private(optax.chain(_optax_dp_aggregate(), optax.sgd(0.1)))
  with pytest.raises(ValueError, match=re.escape(
      "optax.contrib.differentially_private_aggregate cannot run inside accum_jax.accumulate")):
    opt.init(make_params())


def test_accumulate_refuses_optax_dp_aggregate_in_its_inner_optimizer_at_init():
  opt = accum_jax.accumulate(optax.chain(_optax_dp_aggregate(), optax.sgd(0.1)), 4)
  with pytest.raises(ValueError, match="cannot run inside accum_jax.accumulate"):
    opt.init(make_params())


def test_noise_chained_before_accumulate_refuses_the_flush_meant_for_accumulate():
  params = make_params()
  opt = optax.chain(privacy.add_gaussian_noise(1.0, KEY),
                    accum_jax.accumulate(optax.sgd(0.1), 4, reduction="sum"))
  state = opt.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for update in (opt.update, jax.jit(opt.update)):
    with pytest.raises(ValueError, match=re.escape(
        "add_gaussian_noise got flush=, an argument of accum_jax.accumulate's update: it sits"
        " outside accumulate")):
      update(grads, state, params, flush=False)
  with pytest.raises(ValueError, match=re.escape("add_gaussian_noise got weight=")):
    opt.update(grads, state, params, weight=2.0)


@pytest.mark.parametrize("outside", [
    pytest.param(lambda: privacy.add_gaussian_noise(1.0, KEY), id="add_gaussian_noise"),
    pytest.param(_optax_dp_aggregate, id="optax-dp-aggregate"),
])
def test_check_state_refuses_noise_outside_accumulate(outside):
  params = make_params()
  inner = accum_jax.accumulate(optax.sgd(0.1), 4, reduction="sum")
  for opt in (optax.chain(outside(), inner), optax.chain(inner, outside())):
    with pytest.raises(ValueError, match=re.escape(
        "sits outside accum_jax.accumulate: it runs on every call")):
      privacy.check_state({"opt_state": opt.init(params)})


def test_check_state_accepts_the_recipe_and_noise_without_accumulation():
  params = make_params()
  privacy.check_state(accumulate_private(optax.adam(0.1)).init(params))
  privacy.check_state(optax.chain(privacy.add_gaussian_noise(1.0, KEY), optax.sgd(0.1))
                      .init(params))
  # Inside accumulate, optax's aggregate is refused by check_inner, which check_state calls.
  opt = accum_jax.accumulate(optax.chain(_optax_dp_aggregate(), optax.sgd(0.1)), 4)
  with pytest.raises(ValueError, match="cannot run inside accum_jax.accumulate"):
    privacy.check_state(opt.init(params))


def test_check_inner_refuses_noise_added_to_a_mean():
  params = make_params()
  inner = optax.chain(privacy.add_gaussian_noise(1.0, KEY), optax.sgd(0.1))
  message = "add_gaussian_noise is inside accum_jax.accumulate(..., reduction='mean')"
  with pytest.raises(ValueError, match=re.escape(message)):
    privacy.check_inner(inner.init(params), "mean")
  privacy.check_inner(inner.init(params), "sum")
  # accumulate and MultiSteps check their inner optimizer at init.
  for opt in (accum_jax.accumulate(inner, 4), accum_jax.MultiSteps(inner, 4)):
    with pytest.raises(ValueError, match=re.escape(message)):
      opt.init(params)
  accum_jax.accumulate(inner, 4, reduction="sum").init(params)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: privacy.add_gaussian_noise(-1.0, KEY), "stddev=-1.0 must be a finite number >= 0"),
    (lambda: privacy.add_gaussian_noise(1.0, jax.random.split(KEY, 2)), "is not one PRNG key"),
    (lambda: privacy.dp_aggregate(l2_clip=1.0, noise_multiplier=1.0, expected_batch_size=0,
                                  key=0), "expected_batch_size=0 must be a finite number > 0"),
    (lambda: privacy.dp_aggregate(l2_clip=1.0, noise_multiplier=float("nan"),
                                  expected_batch_size=8, key=0),
     "noise_multiplier=nan must be a finite number >= 0"),
    (lambda: privacy.clipped_grad_sum(per_example_loss, 0.0), "l2_clip=0.0 must be a finite"),
    (lambda: privacy.clipped_grad_sum(per_example_loss, 1.0)(make_params(), make_data(4),
                                                            np.ones(3)),
     "mask has shape (3,), but the batch has 4 examples"),
    (lambda: privacy.poisson_batches(np.random.default_rng(0), 10, sampling_rate=1.5,
                                     physical_batch_size=2), "sampling_rate=1.5 must be at most 1"),
])
def test_bad_arguments_are_refused_with_the_argument_and_its_value(build, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    build()


def test_the_noise_key_may_be_a_raw_key_or_a_seed():
  params = {"w": jnp.zeros(3)}
  outs = []
  for key in (jax.random.PRNGKey(3), 3, jax.random.key(3)):
    noise = privacy.add_gaussian_noise(1.0, key)
    outs.append(noise.update(params, noise.init(params))[0]["w"])
  np.testing.assert_array_equal(outs[1], outs[2])  # a seed is jax.random.key(seed)
  assert outs[0].shape == (3,) and bool(jnp.all(jnp.isfinite(outs[0])))
