"""accum_jax with Flax: a Linen TrainState, an nnx.Optimizer, and accum_jax.flax.

Each test compares with the plain way: a hand-written sequential loop over the
microbatches, or plain Optax on the weighted mean of the gradients. Models are
tiny and every step is jitted once.
"""

from __future__ import annotations

import functools
import re
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
from helpers import RTOL, make_params, microbatch_grads, tree_allclose, tree_weighted_mean
from linen_model import Net as LinenNet
from linen_model import TrainState as LinenState
from linen_model import loss_fn as linen_loss

import accum_jax
import accum_jax.flax
import accum_jax.testing

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


# ---------------------------------------------------------------------------
# NNX: nnx_value_and_grad on the official MNIST pattern (nnx.Rngs argument,
# BatchNorm, Dropout, nnx.MultiMetric, nnx.Optimizer with adamw).


class MnistCNN(nnx.Module):
  """The Flax NNX MNIST tutorial's CNN, shrunk to 8x8 images and 4 channels.

  Its two dropout layers draw from the ``rngs`` the call passes (the tutorial's
  way) or from ``dropout_rngs``, an ``nnx.Rngs`` the model holds; holding one and
  passed another, the first layer draws from the held one, the second from the
  passed one, so when they are one object its count advances twice per call.
  """

  def __init__(self, *, rngs: nnx.Rngs, dropout_rngs: nnx.Rngs | None = None):
    # No bias before BatchNorm: its gradient is zero up to round-off, which Adam
    # scales up to full steps of either sign, so no two summation orders agree.
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), use_bias=False, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.1)
    self.batch_norm = nnx.BatchNorm(4, momentum=0.9, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.25)
    self.linear = nnx.Linear(4 * 4 * 4, 3, rngs=rngs)
    self.dropout_rngs = dropout_rngs

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    held = self.dropout_rngs
    x = self.dropout1(self.conv(x), rngs=held if held is not None else rngs)
    x = nnx.avg_pool(nnx.relu(self.batch_norm(x)), (2, 2), strides=(2, 2))
    x = self.dropout2(x.reshape(x.shape[0], -1), rngs=rngs if rngs is not None else held)
    return self.linear(x)


def mnist_loss(model: MnistCNN, rngs: nnx.Rngs | None, batch):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"]
  ).mean()
  return loss, logits


MNIST_BATCH = 64  # 4 microbatches of 16


def _mnist_batch(seed: int) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  return {
      "image": jnp.asarray(rng.random((MNIST_BATCH, 8, 8, 1)), jnp.float32),
      "label": jnp.asarray(rng.integers(0, 3, MNIST_BATCH), jnp.int32),
  }


def _mnist_metrics() -> nnx.MultiMetric:
  return nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))


_mnist_value_and_grad = accum_jax.flax.nnx_value_and_grad(
    mnist_loss, NUM_MICROBATCHES, has_aux=True, aux_reduction="concat"
)


@nnx.jit
def _mnist_microbatched_step(model, optimizer, metrics, rngs, batch):
  """The tutorial's train_step with nnx_value_and_grad: 4 microbatches, one update."""
  (loss, logits), grads = _mnist_value_and_grad(model, rngs, batch)  # logits: (64, 3)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def _mnist_train_step(model, optimizer, metrics, rngs, batch):
  """The reference: the tutorial's train_step as written, one call per microbatch."""
  grad_fn = nnx.value_and_grad(mnist_loss, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


def _relative_l2(a: Any, b: Any) -> float:
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b) > 0
  diff = sum(float(jnp.sum((x - y) ** 2)) for x, y in zip(a, b))
  return (diff / sum(float(jnp.sum(y**2)) for y in b)) ** 0.5


def _rngs_argument():
  return MnistCNN(rngs=nnx.Rngs(0)), nnx.Rngs(1)


def _rngs_in_the_model():
  return MnistCNN(rngs=nnx.Rngs(0), dropout_rngs=nnx.Rngs(1)), None


def _one_rngs_in_the_model_and_passed():
  rngs = nnx.Rngs(1)
  return MnistCNN(rngs=nnx.Rngs(0), dropout_rngs=rngs), rngs


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(_rngs_argument, id="nnx.Rngs argument"),
        pytest.param(_rngs_in_the_model, id="nnx.Rngs held by the model"),
        pytest.param(_one_rngs_in_the_model_and_passed, id="one nnx.Rngs held and passed"),
    ],
)
def test_nnx_value_and_grad_in_a_step_equals_accumulate_across_calls_on_the_mnist_pattern(make):
  model, rngs = make()
  model.train()
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  metrics = _mnist_metrics()
  reference, reference_rngs = make()
  reference.train()
  reference_optimizer = nnx.Optimizer(
      reference, accum_jax.accumulate(optax.adamw(1e-2), every_k=NUM_MICROBATCHES), wrt=nnx.Param
  )
  reference_metrics = _mnist_metrics()
  shared = rngs is not None and model.dropout_rngs is rngs
  # nnx.value_and_grad rejects an object shared by the differentiated model and
  # another argument ("Inconsistent aliasing"), so the reference lets the model
  # draw from the Rngs it holds: the same object, hence the same keys.
  reference_argument = None if shared else reference_rngs
  size = MNIST_BATCH // NUM_MICROBATCHES
  for step in range(2):
    batch = _mnist_batch(step)
    _mnist_microbatched_step(model, optimizer, metrics, rngs, batch)
    for i in range(NUM_MICROBATCHES):
      microbatch = jax.tree.map(lambda x: x[i * size : (i + 1) * size], batch)
      _mnist_train_step(reference, reference_optimizer, reference_metrics, reference_argument,
                        microbatch)
  params, reference_params = (nnx.as_pure(nnx.state(m, nnx.Param)) for m in (model, reference))
  stats, reference_stats = (nnx.as_pure(nnx.state(m, nnx.BatchStat)) for m in (model, reference))
  assert _relative_l2(params, reference_params) < RTOL
  assert _relative_l2(stats, reference_stats) < RTOL
  tree_allclose(metrics.compute(), reference_metrics.compute())
  # Two steps of four microbatches, two dropout layers: 16 keys, as eight calls drew.
  stream = (rngs if rngs is not None else model.dropout_rngs).default
  reference_stream = (reference_rngs if rngs is not None else reference.dropout_rngs).default
  assert int(stream.count[...]) == int(reference_stream.count[...]) == 16
  if shared:
    assert model.dropout_rngs is rngs  # still one object
  # nnx.Optimizer.step counts calls; optimizer_step counts the updates applied.
  assert int(optimizer.step[...]) == 2
  assert int(reference_optimizer.step[...]) == 8
  assert int(accum_jax.optimizer_step(reference_optimizer)) == 2


# ---------------------------------------------------------------------------
# NNX: against the mean of sequential nnx.value_and_grad calls.


class NnxNet(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(5, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.hidden(x)))))


def _metered_loss(model, metrics, x, y, temperature):
  """A classifier loss that also updates metrics, differentiated w.r.t. model and temperature."""
  logits = model(x) / temperature
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  metrics.update(loss=loss, logits=logits, labels=y)
  return loss, jnp.mean(jnp.argmax(logits, -1) == y)


_metered_value_and_grad = accum_jax.flax.nnx_value_and_grad(
    _metered_loss, NUM_MICROBATCHES, argnums=(0, 4), has_aux=True
)


@nnx.jit
def _nnx_microbatched(model, metrics, x, y, temperature):
  # By keyword, as nnx.value_and_grad allows: y and temperature keep their numbers.
  return _metered_value_and_grad(model, metrics, x, y=y, temperature=temperature)


@nnx.jit
def _nnx_sequential_value_and_grad(model, metrics, x, y, temperature):
  """The reference: NUM_MICROBATCHES nnx.value_and_grad calls on one model and metrics."""
  outs = []
  for i in range(NUM_MICROBATCHES):
    mb = _microbatch({"x": x, "y": y}, i)
    vg = nnx.value_and_grad(_metered_loss, argnums=(0, 4), has_aux=True)
    outs.append(vg(model, metrics, mb["x"], mb["y"], temperature))
  return jax.tree.map(lambda *xs: sum(xs) / NUM_MICROBATCHES, *outs)


def test_nnx_value_and_grad_threads_state_of_every_graph_node_like_sequential_calls():
  model, reference = NnxNet(nnx.Rngs(0, dropout=1)), NnxNet(nnx.Rngs(0, dropout=1))
  metrics, reference_metrics = _mnist_metrics(), _mnist_metrics()
  temperature = jnp.float32(1.5)
  for step in range(2):
    batch = _batch(step)
    (loss, accuracy), (grads, temperature_grad) = _nnx_microbatched(
        model, metrics, batch["x"], batch["y"], temperature
    )
    (ref_loss, ref_accuracy), (ref_grads, ref_temperature_grad) = _nnx_sequential_value_and_grad(
        reference, reference_metrics, batch["x"], batch["y"], temperature
    )
    tree_allclose((loss, accuracy), (ref_loss, ref_accuracy))
    assert isinstance(grads, nnx.State)
    tree_allclose(nnx.as_pure(grads), nnx.as_pure(ref_grads))
    tree_allclose(temperature_grad, ref_temperature_grad)
  tree_allclose(nnx.as_pure(nnx.state(model.norm, nnx.BatchStat)),
                nnx.as_pure(nnx.state(reference.norm, nnx.BatchStat)))
  tree_allclose(metrics.compute(), reference_metrics.compute())
  assert int(metrics.loss.count[...]) == 2 * NUM_MICROBATCHES  # one update per microbatch
  # Two calls of four microbatches: the dropout stream drew eight keys, as in the reference.
  assert int(model.dropout.rngs.count[...]) == int(reference.dropout.rngs.count[...]) == 8


def _linear_loss(model, x, y):
  prediction = model(x)
  return jnp.mean((prediction - y) ** 2), prediction


def test_nnx_grad_returns_grads_and_aux_like_nnx_grad():
  model = nnx.Linear(5, 3, rngs=nnx.Rngs(0))
  batch = _batch(0)
  x, y = batch["x"], jax.nn.one_hot(batch["y"], 3)
  grad_fn = nnx.jit(
      accum_jax.flax.nnx_grad(
          _linear_loss, NUM_MICROBATCHES, has_aux=True, aux_reduction="concat",
          return_info=True
      )
  )
  (grads, predictions), info = grad_fn(model, x, y)
  reference_grads, reference_predictions = nnx.grad(_linear_loss, has_aux=True)(model, x, y)
  assert isinstance(grads, nnx.State)
  tree_allclose(nnx.as_pure(grads), nnx.as_pure(reference_grads))
  tree_allclose(predictions, reference_predictions)  # per-example aux, in batch order
  assert int(info.num_skipped) == 0 and float(info.total_weight) == NUM_MICROBATCHES


# ---------------------------------------------------------------------------
# NNX: errors, in the user's argument numbers.


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"state_argnums": 2}, "{door} does not take state_argnums=2"),
        ({"aux_reduction": "median"}, "aux_reduction='median' is not one of"),
        ({"num_microbatches": 0}, "num_microbatches=0 must be an int >= 1"),
        ({"argnums": (0, 2), "batch_argnums": 2}, "argnums=(0, 2) and batch_argnums=(2,) both"),
        ({"rng_argnums": -1}, "rng_argnums=-1 must be a non-negative int"),
        ({"wrt": 3}, "wrt=3 is not an NNX filter"),
    ],
)
def test_nnx_value_and_grad_checks_its_options_when_built(options, message):
  options = {"num_microbatches": 2, **options}
  for door in (accum_jax.flax.nnx_value_and_grad, accum_jax.flax.nnx_grad):
    with pytest.raises(ValueError, match=re.escape(message.format(door=door.__name__))):
      door(mnist_loss, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"batch_argnums": 1}, "batch_argnums=(1,) names argument 1, a Rngs (an NNX graph node)"),
        ({"batch_argnums": 3}, "batch_argnums=(3,) names argument 3, but the function was called"
                               " with 3 positional argument(s)"),
        ({"rng_argnums": 1}, "rng_argnums=(1,) names argument 1, a Rngs (an NNX graph node)"),
        ({"argnums": 2}, "No argument of the 3 given is a batch"),
        ({"batch_argnums": (0, 2)}, "argnums=(0,) and batch_argnums=(0, 2) both name argument(s)"
                                    " [0]"),  # at construction
    ],
)
def test_nnx_value_and_grad_errors_name_the_users_argument_numbers(options, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    vg = accum_jax.flax.nnx_value_and_grad(mnist_loss, 2, has_aux=True, **options)
    vg(MnistCNN(rngs=nnx.Rngs(0)), nnx.Rngs(1), _mnist_batch(0))


def test_nnx_value_and_grad_refuses_an_argument_of_the_batch_s_length_beside_a_batch_pytree():
  def weighted_loss(model, batch, class_weights):
    return jnp.mean(model(batch["x"]) ** 2) * jnp.sum(class_weights)

  model, batch = nnx.Linear(3, 1, rngs=nnx.Rngs(0)), {"x": jnp.linspace(-1, 1, 24).reshape(8, 3)}
  class_weights = jnp.arange(8.0)  # as many classes as rows, by coincidence
  vg = accum_jax.flax.nnx_value_and_grad(weighted_loss, 2)
  with pytest.raises(ValueError, match=re.escape(
      "batch_argnums=None finds arguments [1, 2] that could each be the batch")):
    vg(model, batch, class_weights)
  # Named, the weights are passed whole to every microbatch.
  value, _ = accum_jax.flax.nnx_value_and_grad(weighted_loss, 2, batch_argnums=1)(
      model, batch, class_weights)
  np.testing.assert_allclose(value, weighted_loss(model, batch, class_weights), rtol=RTOL)


def test_nnx_value_and_grad_errors_from_the_core_name_the_users_argument_numbers():
  vg = accum_jax.flax.nnx_value_and_grad(mnist_loss, 2, has_aux=True, batch_argnums=2)
  with pytest.raises(ValueError, match=re.escape("Argument 2['label'] is a scalar")):
    vg(MnistCNN(rngs=nnx.Rngs(0)), nnx.Rngs(1), {**_mnist_batch(0), "label": jnp.int32(1)})
  keyword_only = accum_jax.flax.nnx_value_and_grad(
      lambda model, batch, *, rngs: mnist_loss(model, rngs, batch), 2, has_aux=True
  )
  with pytest.raises(ValueError, match=re.escape("Keyword argument rngs= holds an NNX graph")):
    keyword_only(MnistCNN(rngs=nnx.Rngs(0)), _mnist_batch(0), rngs=nnx.Rngs(1))


# ---------------------------------------------------------------------------
# NNX on a mesh: the official sharding pattern (nnx.with_partitioning metadata,
# with_sharding_constraint in an nnx.jit-ed create) reaches the FSDP mode.


class _ShardedMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.hidden = nnx.Linear(
        16, 32, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("data", None)),
        bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("data",)),
    )
    self.out = nnx.Linear(32, 3, rngs=rngs, kernel_init=nnx.with_partitioning(init, ("data", None)))

  def __call__(self, x):
    return self.out(jnp.tanh(self.hidden(x)))


@nnx.jit
def _create_sharded_mlp():
  model = _ShardedMLP(nnx.Rngs(0))
  state = nnx.state(model)
  nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
  return model


def _nnx_sharded_loss(model, x, y):
  return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("given", [False, True], ids=["from the metadata", "param_sharding"])
def test_nnx_value_and_grad_reaches_fsdp_from_the_variables_sharding_metadata(given):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    model = _create_sharded_mlp()
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((BATCH_SIZE, 16)).astype(np.float32), rows)
  y = jax.device_put(rng.standard_normal((BATCH_SIZE, 3)).astype(np.float32), rows)
  options = {"mesh": mesh, "data_axis": "data"}
  if given:
    options["param_sharding"] = nnx.get_partition_spec(nnx.state(model, nnx.Param))
  vg = accum_jax.flax.nnx_value_and_grad(
      _nnx_sharded_loss, 2, data_parallel=accum_jax.DataParallel(**options))
  compiled = nnx.jit(vg).lower(model, x, y).compile()
  loss, grads = nnx.jit(vg)(model, x, y)

  graphdef, params = nnx.split(model)
  plain = nnx.merge(graphdef, jax.device_put(params, jax.devices()[0]))
  expected = nnx.value_and_grad(_nnx_sharded_loss)(plain, *jax.device_put((x, y), jax.devices()[0]))
  tree_allclose((loss, nnx.to_pure_dict(grads)), (expected[0], nnx.to_pure_dict(expected[1])))
  sharded = 0
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(nnx.state(model, nnx.Param))):
    assert g.sharding.is_equivalent_to(p.sharding, g.ndim), (g.sharding, p.sharding)
    sharded += not p.sharding.is_fully_replicated
  assert sharded == 3  # both kernels and the hidden bias; the output bias is replicated
  found = accum_jax.testing.collectives(compiled.as_text(), mesh)
  per_microbatch = [c for c in found if c.in_loop and not c.in_branch]
  assert sorted(c.kind for c in per_microbatch if c.kind != "all-reduce") == ["reduce-scatter"] * 3
  assert all(c.axes == ("data",) for c in per_microbatch)


# The packed layout (the default where JAX has one device) in an nnx.Optimizer: the
# state holds the Variables' plain values in its buckets (nnx.Optimizer hands init
# nnx.Param and update plain arrays), so that gates, schedule-free and Muon, whose
# updates rebuild their state from the gradient's tree, keep one structure.
NNX_PACKED_INNERS = {
    "adamw": lambda: optax.adamw(1e-2),
    "apply_if_finite(adamw)": lambda: optax.apply_if_finite(optax.adamw(1e-2), 5),
    "contrib.schedule_free_adamw": lambda: optax.contrib.schedule_free_adamw(1e-2),
    "contrib.muon": lambda: optax.contrib.muon(1e-2),
    "inject_hyperparams(adam)": lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
}


@pytest.mark.parametrize("name", list(NNX_PACKED_INNERS))
def test_nnx_optimizer_with_the_packed_state_equals_the_full_batch(name):
  nnx = pytest.importorskip("flax.nnx")
  k, windows = 4, 2
  rng = np.random.default_rng(0)
  x = rng.normal(size=(windows, k, 8, 4)).astype(np.float32)
  y = rng.normal(size=(windows, k, 8, 3)).astype(np.float32)

  def loss_fn(model, xb, yb):
    return jnp.mean((model(xb) - yb) ** 2)

  model, ref_model = (nnx.Linear(4, 3, rngs=nnx.Rngs(0)) for _ in range(2))
  make = NNX_PACKED_INNERS[name]
  tx = accum_jax.accumulate(make(), k, layout="packed")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  reference = nnx.Optimizer(ref_model, make(), wrt=nnx.Param)

  @functools.partial(nnx.jit, static_argnames="apply")
  def step(model, optimizer, xb, yb, apply):
    optimizer.update(model, nnx.grad(loss_fn)(model, xb, yb), apply=apply)

  @nnx.jit
  def full_batch_step(model, optimizer, xb, yb):
    optimizer.update(model, nnx.grad(loss_fn)(model, xb, yb))

  schedule = accum_jax.HostSchedule(optimizer)
  for w in range(windows):
    for i in range(k):
      step(model, optimizer, x[w, i], y[w, i], schedule.next())
    full_batch_step(ref_model, reference, x[w].reshape(-1, 4), y[w].reshape(-1, 3))
  assert int(accum_jax.optimizer_step(optimizer)) == windows
  tree_allclose(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
  # A few buffers: the bucket of each dtype, the counters, and the inner state's scalars.
  assert len(jax.tree.leaves(optimizer.opt_state)) <= 16


def test_accumulate_over_an_nnx_state_of_params_under_plain_jax_jit():
  # nnx.split's state of nnx.Param under jax.jit: the gradient keeps the Variables,
  # and the inner optimizer gets its state with them, in either layout.
  nnx = pytest.importorskip("flax.nnx")
  graphdef, params = nnx.split(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), nnx.Param)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32)

  def loss(p, x):
    return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

  results = []
  for layout in ("packed", "tree"):
    tx = accum_jax.accumulate(optax.adamw(1e-2), 2, layout=layout)
    p, state = params, tx.init(params)
    step = jax.jit(lambda p, s, apply, tx=tx: tx.update(jax.grad(loss)(p, x), s, p, apply=apply),
                   static_argnames="apply")
    for i in range(4):
      updates, state = step(p, state, apply=i % 2 == 1)
      p = optax.apply_updates(p, updates)
    assert int(accum_jax.optimizer_step(state)) == 2
    results.append(p)
  tree_allclose(*results)


def test_nnx_optimizer_update_refuses_a_misspelt_apply():
  # nnx.Optimizer.update hands its keywords to accumulate's update: a misspelt
  # apply= would otherwise reach the inner optimizer, which ignores it.
  nnx = pytest.importorskip("flax.nnx")
  model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, accum_jax.accumulate(optax.sgd(0.1), 2), wrt=nnx.Param)
  grads = nnx.grad(lambda m: jnp.sum(m(jnp.ones((1, 2)))))(model)
  for wrong, meant in (("aplly", "apply"), ("flsh", "flush"), ("weigth", "weight")):
    with pytest.raises(ValueError, match=re.escape(f"did you mean {meant}=?")):
      optimizer.update(model, grads, **{wrong: True})
