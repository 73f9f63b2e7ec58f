"""accum_jax with Flax: a Linen TrainState, an nnx.Optimizer, and accum_jax.flax.

Each test compares with the plain way: a hand-written sequential loop over the
microbatches, or plain Optax on the weighted mean of the gradients. Models are
tiny and every step is jitted once.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from helpers import make_params, microbatch_grads, tree_allclose, tree_weighted_mean
from linen_model import Net as LinenNet
from linen_model import TrainState as LinenState
from linen_model import loss_fn as linen_loss

import accum_jax
import accum_jax.flax

NUM_MICROBATCHES = 4
BATCH_SIZE = 32


def _batch(seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
      "x": jnp.asarray(rng.standard_normal((BATCH_SIZE, 5)), jnp.float32),
      "y": jnp.asarray(rng.integers(0, 3, BATCH_SIZE), jnp.int32),
  }


def _microbatch(batch: Any, i: int) -> Any:
  size = BATCH_SIZE // NUM_MICROBATCHES
  return jax.tree.map(lambda x: x[i * size : (i + 1) * size], batch)


def test_import_accum_jax_does_not_import_flax():
  code = "import sys, accum_jax; print(sorted(m for m in sys.modules if m.startswith('flax')))"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------
# Linen: the inside-one-step door, with BatchNorm and dropout.


def _linen_state(tx: optax.GradientTransformation) -> LinenState:
  variables = LinenNet().init(jax.random.key(0), jnp.ones((1, 5)), train=False)
  return LinenState.create(
      apply_fn=LinenNet().apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=tx,
  )


@jax.jit
def _linen_accum_step(state, batch, key):
  vg = accum_jax.value_and_grad(
      linen_loss,
      NUM_MICROBATCHES,
      batch_argnums=2,
      state_argnums=1,
      rng_argnums=3,
      has_aux=True,
  )
  (loss, (batch_stats, _)), grads = vg(state.params, state.batch_stats, batch, key)
  return state.apply_gradients(grads=grads, batch_stats=batch_stats), loss


@jax.jit
def _linen_sequential_step(state, batch, key):
  """The reference: NUM_MICROBATCHES forward/backward passes written out."""
  batch_stats, losses, grads = state.batch_stats, [], []
  for i in range(NUM_MICROBATCHES):
    (loss, (batch_stats, _)), g = jax.value_and_grad(linen_loss, has_aux=True)(
        state.params, batch_stats, _microbatch(batch, i), jax.random.fold_in(key, i)
    )
    losses.append(loss)
    grads.append(g)
  mean_grads = jax.tree.map(lambda *g: sum(g) / NUM_MICROBATCHES, *grads)
  return state.apply_gradients(grads=mean_grads, batch_stats=batch_stats), sum(losses) / 4


def test_linen_value_and_grad_threads_batch_stats_and_dropout_keys_like_sequential_passes():
  state = reference = _linen_state(optax.adam(1e-2))
  for step in range(2):
    batch, key = _batch(step), jax.random.key(100 + step)
    state, loss = _linen_accum_step(state, batch, key)
    reference, reference_loss = _linen_sequential_step(reference, batch, key)
    tree_allclose(loss, reference_loss)
  tree_allclose(state.params, reference.params)
  tree_allclose(state.batch_stats, reference.batch_stats)
  tree_allclose(state.opt_state, reference.opt_state)
  assert int(state.step) == 2
  # Dropout is on: another key gives another loss.
  _, other_loss = _linen_accum_step(state, _batch(0), jax.random.key(7))
  _, same_key_loss = _linen_accum_step(state, _batch(0), jax.random.key(100))
  assert float(other_loss) != float(same_key_loss)


# ---------------------------------------------------------------------------
# Linen: the across-calls door in a TrainState.


@jax.jit
def _apply_gradients(state, grads, weight, flush):
  return accum_jax.flax.apply_gradients(state, grads=grads, weight=weight, flush=flush)


def test_train_state_with_accumulate_matches_optax_on_the_weighted_mean():
  params = make_params()
  grads = microbatch_grads(params, 5)
  weights = [1.0, 2.0, 3.0, 4.0, 5.0]
  state = train_state.TrainState.create(
      apply_fn=None, params=params, tx=accum_jax.accumulate(optax.adam(1e-2), every_k=3)
  )
  reference_params = params
  reference_opt = optax.adam(1e-2)
  reference_state = reference_opt.init(params)
  windows = {2: slice(0, 3), 4: slice(3, 5)}  # the last window is flushed after 2 calls
  for call, (g, w) in enumerate(zip(grads, weights)):
    before = state.params
    state = _apply_gradients(state, g, jnp.float32(w), call == 4)
    updated = call in windows
    if updated:
      mean = tree_weighted_mean(grads[windows[call]], weights[windows[call]])
      updates, reference_state = reference_opt.update(mean, reference_state, reference_params)
      reference_params = optax.apply_updates(reference_params, updates)
    else:
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), state.params, before)
    assert bool(accum_jax.has_updated(state)) == updated
    assert bool(accum_jax.has_updated(state.opt_state)) == updated
    # TrainState.step counts calls; optimizer_step counts updates.
    assert int(state.step) == call + 1
    assert int(accum_jax.optimizer_step(state)) == sum(c <= call for c in windows)
  tree_allclose(state.params, reference_params)
  assert state.tx is not None and type(state) is train_state.TrainState


def _adam_in_inject_hyperparams_outside():
  return optax.inject_hyperparams(
      lambda learning_rate: accum_jax.accumulate(optax.adam(learning_rate), every_k=2)
  )(learning_rate=1e-2)


@pytest.mark.parametrize(
    "make_tx",
    [
        pytest.param(
            lambda: optax.chain(
                optax.clip_by_global_norm(1.0), accum_jax.accumulate(optax.adam(1e-2), 2)
            ),
            id="optax.chain(clip, accumulate(adam))",
        ),
        pytest.param(
            lambda: accum_jax.accumulate(
                optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), every_k=2
            ),
            id="accumulate(inject_hyperparams(adam))",
        ),
        pytest.param(
            _adam_in_inject_hyperparams_outside,
            id="inject_hyperparams(lambda lr: accumulate(adam(lr)))",
        ),
    ],
)
def test_has_updated_and_optimizer_step_find_the_state_in_a_nested_train_state(make_tx):
  params = make_params()
  state = train_state.TrainState.create(apply_fn=None, params=params, tx=make_tx())
  apply = jax.jit(lambda state, grads: state.apply_gradients(grads=grads))
  for call, g in enumerate(microbatch_grads(params, 4), start=1):
    state = apply(state, g)
    for holder in (state, state.opt_state):
      assert bool(accum_jax.has_updated(holder)) == (call % 2 == 0)
      assert int(accum_jax.optimizer_step(holder)) == call // 2
  assert int(state.step) == 4


# ---------------------------------------------------------------------------
# NNX: nnx.Optimizer around accumulate, and nnx_value_and_grad.


def _nnx_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def _nnx_accumulate_step(model, optimizer, x, y, weight, flush):
  grads = nnx.grad(_nnx_loss)(model, x, y)
  optimizer.update(model, grads, weight=weight, flush=flush)
  return nnx.as_pure(grads)


def test_nnx_optimizer_with_accumulate_passes_weight_and_flush_and_matches_optax():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, accum_jax.accumulate(optax.adam(1e-2), every_k=3), wrt=nnx.Param)
  reference_opt = optax.adam(1e-2)
  reference_params = nnx.as_pure(nnx.state(model, nnx.Param))
  reference_state = reference_opt.init(reference_params)
  rng = np.random.default_rng(0)
  weights = [1.0, 2.0, 3.0, 4.0, 5.0]
  windows = {2: slice(0, 3), 4: slice(3, 5)}  # the last window is flushed after 2 calls
  grads = []
  for call, w in enumerate(weights):
    before = nnx.as_pure(nnx.state(model, nnx.Param))
    x = jnp.asarray(rng.standard_normal((4, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((4, 2)), jnp.float32)
    grads.append(_nnx_accumulate_step(model, optimizer, x, y, jnp.float32(w), call == 4))
    after = nnx.as_pure(nnx.state(model, nnx.Param))
    if call in windows:
      mean = tree_weighted_mean(grads[windows[call]], weights[windows[call]])
      updates, reference_state = reference_opt.update(mean, reference_state, reference_params)
      reference_params = optax.apply_updates(reference_params, updates)
      tree_allclose(after, reference_params)
    else:
      jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), after, before)
  # nnx.Optimizer.step counts calls; the accumulate state counts updates.
  assert int(optimizer.step[...]) == 5
  assert int(nnx.as_pure(optimizer.opt_state).optimizer_step) == 2


def test_has_updated_and_optimizer_step_read_an_nnx_optimizer():
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, accum_jax.accumulate(optax.sgd(0.1), every_k=2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    optimizer.update(model, nnx.grad(_nnx_loss)(model, x, x[:, :2]))
    return accum_jax.has_updated(optimizer), accum_jax.optimizer_step(optimizer.opt_state)

  for call in range(1, 5):
    updated, opt_step = step(model, optimizer, jnp.full((4, 3), float(call)))
    assert bool(updated) == (call % 2 == 0)
    assert int(opt_step) == call // 2
    for holder in (optimizer, optimizer.opt_state):
      assert bool(accum_jax.has_updated(holder)) == (call % 2 == 0)
      assert int(accum_jax.optimizer_step(holder)) == call // 2


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def _nnx_classifier_loss(model, x, y):
  logits = model(x)
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == y)


@nnx.jit
def _nnx_sequential_value_and_grad(model, x, y):
  """The reference: NUM_MICROBATCHES nnx.value_and_grad calls on one model."""
  outs = []
  for i in range(NUM_MICROBATCHES):
    mb = _microbatch({"x": x, "y": y}, i)
    outs.append(nnx.value_and_grad(_nnx_classifier_loss, has_aux=True)(model, mb["x"], mb["y"]))
  ((losses, accuracies), grads) = jax.tree.map(lambda *xs: sum(xs) / NUM_MICROBATCHES, *outs)
  return (losses, accuracies), grads


def test_nnx_value_and_grad_threads_batch_stats_and_rng_counts_like_sequential_calls():
  model, reference = NnxNet(nnx.Rngs(0, dropout=1)), NnxNet(nnx.Rngs(0, dropout=1))
  vg = nnx.jit(
      accum_jax.flax.nnx_value_and_grad(
          _nnx_classifier_loss, NUM_MICROBATCHES, batch_argnums=(1, 2), has_aux=True
      )
  )
  for step in range(2):
    batch = _batch(step)
    (loss, accuracy), grads = vg(model, batch["x"], batch["y"])
    (ref_loss, ref_accuracy), ref_grads = _nnx_sequential_value_and_grad(
        reference, batch["x"], batch["y"]
    )
    tree_allclose((loss, accuracy), (ref_loss, ref_accuracy))
    assert isinstance(grads, nnx.State)
    tree_allclose(nnx.as_pure(grads), nnx.as_pure(ref_grads))
  rest, ref_rest = nnx.state(model, nnx.Not(nnx.Param)), nnx.state(reference, nnx.Not(nnx.Param))
  tree_allclose(jax.tree.map(jnp.asarray, nnx.to_pure_dict(rest["norm"])),
                jax.tree.map(jnp.asarray, nnx.to_pure_dict(ref_rest["norm"])))
  # Two calls of four microbatches: the dropout stream drew eight keys, as in the reference.
  assert int(model.dropout.rngs.count[...]) == int(reference.dropout.rngs.count[...]) == 8


def test_nnx_value_and_grad_rejects_arguments_that_name_the_model():
  with pytest.raises(ValueError, match="names argument 0, the model"):
    accum_jax.flax.nnx_value_and_grad(_nnx_loss, 2, batch_argnums=(0, 1))
  with pytest.raises(ValueError, match="state_argnums is fixed"):
    accum_jax.flax.nnx_value_and_grad(_nnx_loss, 2, state_argnums=2)
