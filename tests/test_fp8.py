"""Flax Linen FP8 layers over microbatches: every FP8 statistic as on the full batch.

Flax's FP8 dot products (delayed scaling) keep amax histories and scales in the
``_overwrite_with_gradient`` collection; the "gradient" of each is its new value,
which ``TrainState.apply_gradients`` writes over the old. The whole batch's amax
is the largest microbatch's, and the scales depend only on the history passed
in, so each of these leaves must combine by max, with no option given. The
reference is ``jax.grad`` on the whole batch.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.linen.fp8_ops import OVERWRITE_WITH_GRADIENT
from flax.training.train_state import TrainState
from helpers import normal, tree_allclose

import accum_jax

NUM_MICROBATCHES = 8
BATCH = 32
LOUD = slice(8, 12)  # microbatch 2 of 8: activations 20 times the others'
Fp8 = functools.partial(nn.Fp8DirectDotGeneralOp, amax_history_length=4)


class Mlp(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16, dot_general_cls=Fp8)(x))
    return nn.Dense(4, dot_general_cls=Fp8)(x)


MODEL = Mlp()


def make_batch(seed: int = 0) -> dict[str, np.ndarray]:
  x = normal(seed, (BATCH, 8))
  x[LOUD] *= 20.0
  # 1 to 4 tokens per row: 7 to 12 per microbatch, the loud one 12.
  counts = 1 + (np.arange(BATCH) * 7 // 5) % 4
  mask = np.arange(4)[None, :] < counts[:, None]
  return {"x": x, "y": normal(seed + 1, (BATCH, 4)), "mask": mask.astype(np.float32)}


def plain_loss(variables, batch):
  return jnp.mean((MODEL.apply(variables, batch["x"]) - batch["y"]) ** 2)


def token_loss(variables, batch):
  err = (MODEL.apply(variables, batch["x"]) - batch["y"]) ** 2 * batch["mask"]
  return jnp.sum(err) / jnp.sum(batch["mask"])


def tokens(batch):
  return jnp.sum(batch["mask"])


def full_step(variables, grads):
  """What TrainState.apply_gradients does with the FP8 collection: overwrites it."""
  return {"params": variables["params"], OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}


# One compiled function per loss, shared by the tests.
GRADS = {
    "plain": (jax.jit(jax.grad(plain_loss)),
              jax.jit(accum_jax.grad(plain_loss, NUM_MICROBATCHES))),
    "token-weighted": (jax.jit(jax.grad(token_loss)),
                       jax.jit(accum_jax.grad(token_loss, NUM_MICROBATCHES, weight_fn=tokens))),
}


@functools.cache
def variables_with_history():
  """Variables whose amax histories hold two earlier full-batch steps, so that the
  roll and the scales computed from the history are exercised."""
  # Compiled (the steps with the plain loss's full-batch gradient, which its test
  # compiles too): run op by op, the FP8 model's ops compile one by one.
  variables = jax.jit(MODEL.init)(jax.random.key(0), jnp.ones((1, 8)))
  for seed in (1, 2):
    variables = full_step(variables, GRADS["plain"][0](variables, make_batch(seed)))
  return variables


def _fp8_leaves(tree):
  return tree[OVERWRITE_WITH_GRADIENT]


@pytest.mark.parametrize("loss", GRADS)
def test_every_fp8_statistic_and_gradient_equals_the_full_batch_with_no_option(loss):
  full_grad, microbatched = GRADS[loss]
  variables, batch = variables_with_history(), make_batch()
  full = full_grad(variables, batch)
  grads = microbatched(variables, batch)
  # The loud microbatch's amax is the batch's: a mean or a sum of the
  # microbatches' amaxes cannot equal it.
  history = _fp8_leaves(grads)["Dense_0"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
  assert float(history[0]) == float(jnp.max(jnp.abs(batch["x"])))
  assert np.count_nonzero(np.asarray(history)[1:]) == 2  # earlier steps', rolled
  tree_allclose(_fp8_leaves(grads), _fp8_leaves(full), rtol=1e-6, atol=0)
  tree_allclose(grads["params"], full["params"], rtol=1e-5, atol=1e-7)


def _train(grad_fn, batches):
  state = TrainState.create(
      apply_fn=MODEL.apply, params=variables_with_history(), tx=optax.sgd(0.1, momentum=0.9)
  )
  for batch in batches:
    state = state.apply_gradients(grads=grad_fn(state.params, batch))
  return state


def test_three_train_state_steps_with_microbatches_equal_three_full_batch_steps():
  full_grad, microbatched = GRADS["token-weighted"]
  batches = [make_batch(seed) for seed in (3, 5, 7)]
  full, mine = _train(full_grad, batches), _train(microbatched, batches)
  tree_allclose(_fp8_leaves(mine.params), _fp8_leaves(full.params), rtol=1e-6, atol=0)
  tree_allclose(mine.params["params"], full.params["params"], rtol=1e-5, atol=1e-6)
  # Three steps rolled three amaxes into the histories of length 4.
  history = _fp8_leaves(mine.params)["Dense_1"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
  assert np.all(np.asarray(history) > 0)
