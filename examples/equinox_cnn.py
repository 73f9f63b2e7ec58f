"""Equinox: a CNN with BatchNorm and Dropout on the digits, 4 microbatches per Adam step.

The model holds what Equinox models hold: ``eqx.nn.Conv2d``, ``eqx.nn.MaxPool2d``,
``eqx.nn.Lambda(jax.nn.relu)``, an ``eqx.nn.BatchNorm`` whose statistics live in an
``eqx.nn.State`` (``eqx.nn.make_with_state``), and ``eqx.nn.Dropout`` driven by a
key. The loss is written as in Equinox's stateful example,
``compute_loss(model, state, x, y, key) -> (loss, (state, accuracy))``, and
``accum_jax.equinox.filter_value_and_grad(compute_loss, 4, has_aux=True)`` runs it
on 4 microbatches of 32 per batch of 128: the State passes through them in order,
and microbatch ``i`` gets the key ``jax.random.fold_in(key, i)``.

Before training, the script checks the first batch against the same 4
microbatches run one after another with ``eqx.filter_value_and_grad``, threading
the State and folding the keys by hand, and prints the largest differences.

  python examples/equinox_cnn.py            # 8 epochs, a few seconds on a laptop CPU
  python examples/equinox_cnn.py --quick    # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import accum_jax.equinox

NUM_MICROBATCHES = 4
BATCH_SIZE = 128
TRAIN_SIZE = 1408  # 11 batches
LEARNING_RATE = 3e-3


class CNN(eqx.Module):
  conv: eqx.nn.Conv2d
  norm: eqx.nn.BatchNorm
  act: eqx.nn.Lambda
  pool: eqx.nn.MaxPool2d
  dropout: eqx.nn.Dropout
  linear: eqx.nn.Linear

  def __init__(self, key):
    key1, key2 = jax.random.split(key)
    self.conv = eqx.nn.Conv2d(1, 8, kernel_size=3, padding=1, key=key1)  # (1, 8, 8) -> (8, 8, 8)
    self.norm = eqx.nn.BatchNorm(8, axis_name="batch", mode="batch")
    self.act = eqx.nn.Lambda(jax.nn.relu)
    self.pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)  # -> (8, 4, 4)
    self.dropout = eqx.nn.Dropout(0.2)
    self.linear = eqx.nn.Linear(8 * 4 * 4, 10, key=key2)

  def __call__(self, x, state, *, key=None):
    x, state = self.norm(self.conv(x), state)
    x = self.pool(self.act(x)).ravel()
    return self.linear(self.dropout(x, key=key)), state


def compute_loss(model, state, x, y, key):
  keys = jax.random.split(key, x.shape[0])
  batch_model = jax.vmap(
      lambda x, state, key: model(x, state, key=key),
      axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None),
  )
  logits, state = batch_model(x, state, keys)
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, (state, jnp.mean(jnp.argmax(logits, -1) == y))


microbatched = accum_jax.equinox.filter_value_and_grad(
    compute_loss, NUM_MICROBATCHES, has_aux=True
)
optim = optax.adam(LEARNING_RATE)


@eqx.filter_jit
def make_step(model, state, opt_state, x, y, key):
  (loss, (state, accuracy)), grads = microbatched(model, state, x, y, key)
  updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
  return eqx.apply_updates(model, updates), state, opt_state, loss, accuracy


plain_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(compute_loss, has_aux=True))


def sequential_reference(model, state, x, y, key):
  """The same batch as 4 plain calls, one after another."""
  size = x.shape[0] // NUM_MICROBATCHES
  losses, grads = [], []
  for i in range(NUM_MICROBATCHES):
    rows = slice(i * size, (i + 1) * size)
    (loss, (state, _)), g = plain_value_and_grad(
        model, state, x[rows], y[rows], jax.random.fold_in(key, i)
    )
    losses.append(loss)
    grads.append(g)
  mean = lambda *xs: sum(xs) / len(xs)  # noqa: E731
  return mean(*losses), state, jax.tree.map(mean, *grads)


@eqx.filter_jit
def accuracy(model, state, x, y):
  inference_model = eqx.nn.inference_mode(model)
  logits, _ = jax.vmap(inference_model, axis_name="batch", in_axes=(0, None))(x, state)
  return jnp.mean(jnp.argmax(logits, -1) == y)


def max_abs_diff(a, b) -> float:
  diffs = jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))), eqx.filter(a, eqx.is_array),
                       eqx.filter(b, eqx.is_array))
  return max(jax.tree.leaves(diffs))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=8, help="training epochs (default 8)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument("--seed", type=int, default=0, help="initialisation, shuffling, dropout")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")

  start = time.perf_counter()
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8), channels first
  train_x, test_x, train_y, test_y = train_test_split(
      images, digits.target.astype(np.int32), train_size=TRAIN_SIZE, random_state=0,
      stratify=digits.target,
  )
  model_key, key = jax.random.split(jax.random.key(args.seed))
  model, state = eqx.nn.make_with_state(CNN)(model_key)
  opt_state = optim.init(eqx.filter(model, eqx.is_array))
  print(f"Equinox CNN (BatchNorm, Dropout) on {TRAIN_SIZE} digits: batches of {BATCH_SIZE}"
        f" as {NUM_MICROBATCHES} microbatches of {BATCH_SIZE // NUM_MICROBATCHES}")

  # The first batch, microbatched and by hand.
  x0, y0, key0 = train_x[:BATCH_SIZE], train_y[:BATCH_SIZE], jax.random.key(123)
  (loss, (new_state, _)), grads = eqx.filter_jit(microbatched)(model, state, x0, y0, key0)
  ref_loss, ref_state, ref_grads = sequential_reference(model, state, x0, y0, key0)
  print(f"first batch vs sequential calls, |loss diff|: {abs(float(loss - ref_loss)):.3e}")
  print(f"first batch vs sequential calls, max |grad diff|: {max_abs_diff(grads, ref_grads):.3e}")
  print(f"first batch vs sequential calls, max |state diff|: "
        f"{max_abs_diff(new_state, ref_state):.3e}")

  rng = np.random.default_rng(args.seed)
  for epoch in tqdm(range(1, epochs + 1), desc="epochs"):
    losses = []
    for idx in rng.permutation(TRAIN_SIZE).reshape(-1, BATCH_SIZE):
      key, step_key = jax.random.split(key)
      model, state, opt_state, loss, _ = make_step(
          model, state, opt_state, train_x[idx], train_y[idx], step_key
      )
      losses.append(float(loss))
    if epoch == 1:
      print(f"first loss: {losses[0]:.4f}")
  print(f"last loss: {losses[-1]:.4f}")
  print(f"test accuracy: {float(accuracy(model, state, test_x, test_y)):.4f}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
