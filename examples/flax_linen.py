"""Flax Linen: a CNN with BatchNorm and Dropout, each batch of 128 run as 4 microbatches.

The 8x8 digits of scikit-learn (no download) train a small Linen CNN held in a
``TrainState``. Each step computes the gradient of a batch of 128 with
``accum_jax.value_and_grad(..., num_microbatches=4)``: a ``lax.scan`` over 4
microbatches of 32, so only one microbatch's activations are alive at a time.

* ``state_argnums`` threads BatchNorm's ``batch_stats`` through the 4
  microbatches in order, as 4 sequential forward passes would update them;
* ``rng_argnums`` gives microbatch ``i`` the dropout key ``fold_in(key, i)``, so
  each draws its own mask.

Before training, the script checks the first step against those 4 forward and
backward passes written out by hand, and prints the largest difference.

  python examples/flax_linen.py            # 15 epochs, about 10 s on a laptop CPU
  python examples/flax_linen.py --quick    # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import accum_jax

BATCH_SIZE = 128
NUM_MICROBATCHES = 4  # of 32 examples each
TRAIN_SIZE = 1408  # 11 batches of 128; the other 389 digits are the test set
LEARNING_RATE = 3e-3


class CNN(nn.Module):
  """Two 3x3 convolutions with BatchNorm (the second with stride 2), dropout, dense."""

  @nn.compact
  def __call__(self, x, train: bool):
    for features, stride in ((8, 1), (16, 2)):
      x = nn.Conv(features, (3, 3), strides=stride)(x)
      x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
      x = nn.relu(x)
    x = x.reshape(x.shape[0], -1)
    x = nn.Dropout(0.2, deterministic=not train)(x)
    return nn.Dense(10)(x)


class TrainState(train_state.TrainState):
  batch_stats: Any  # BatchNorm's running statistics


def load_data():
  """Digits as (N, 8, 8, 1) float32 in [0, 1] and int32 labels, with a fixed split."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  return train_test_split(
      images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels
  )


@jax.jit
def init_variables(key: jax.Array):
  return CNN().init(key, jnp.ones((1, 8, 8, 1)), train=False)


def create_state(key: jax.Array) -> TrainState:
  variables = init_variables(key)
  return TrainState.create(
      apply_fn=CNN().apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=optax.adam(LEARNING_RATE),
  )


def loss_fn(params, batch_stats, batch, dropout_key):
  """One microbatch's mean loss; returns ``(loss, (new_batch_stats, metrics))``."""
  logits, updates = CNN().apply(
      {"params": params, "batch_stats": batch_stats},
      batch["image"],
      train=True,
      rngs={"dropout": dropout_key},
      mutable=["batch_stats"],
  )
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return loss, (updates["batch_stats"], {"accuracy": accuracy})


microbatched_grad_fn = accum_jax.value_and_grad(
    loss_fn,
    num_microbatches=NUM_MICROBATCHES,
    batch_argnums=2,  # split `batch` into 4
    state_argnums=1,  # thread `batch_stats` through them
    rng_argnums=3,  # fold the microbatch index into `dropout_key`
    has_aux=True,
)


@jax.jit
def train_step(state: TrainState, batch, key):
  dropout_key = jax.random.fold_in(key, state.step)
  (loss, (batch_stats, metrics)), grads = microbatched_grad_fn(
      state.params, state.batch_stats, batch, dropout_key
  )
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  return state, loss, metrics["accuracy"]


@jax.jit
def sequential_grads(state: TrainState, batch, dropout_key):
  """What `microbatched_grad_fn` computes, written out: 4 passes, one after another."""
  size = batch["label"].shape[0] // NUM_MICROBATCHES
  batch_stats, grads = state.batch_stats, []
  for i in range(NUM_MICROBATCHES):
    microbatch = jax.tree.map(lambda x: x[i * size : (i + 1) * size], batch)
    (_, (batch_stats, _)), g = jax.value_and_grad(loss_fn, has_aux=True)(
        state.params, batch_stats, microbatch, jax.random.fold_in(dropout_key, i)
    )
    grads.append(g)
  return jax.tree.map(lambda *g: sum(g) / NUM_MICROBATCHES, *grads), batch_stats


@jax.jit
def accuracy(state: TrainState, images, labels):
  logits = CNN().apply(
      {"params": state.params, "batch_stats": state.batch_stats}, images, train=False
  )
  return jnp.mean(jnp.argmax(logits, -1) == labels)


def max_difference(a, b) -> float:
  return max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=15, help="training epochs (default 15)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument("--seed", type=int, default=0, help="initialisation, shuffling, dropout")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")
  # On GPUs, keep full float32 so that the check below measures accumulation only.
  jax.config.update("jax_default_matmul_precision", "highest")

  start = time.perf_counter()
  train_images, test_images, train_labels, test_labels = load_data()
  init_key, dropout_key = jax.random.split(jax.random.key(args.seed))
  state = create_state(init_key)
  rng = np.random.default_rng(args.seed)  # shuffling
  print(f"Linen CNN with BatchNorm and Dropout on {TRAIN_SIZE} digits: batches of"
        f" {BATCH_SIZE} as {NUM_MICROBATCHES} microbatches of {BATCH_SIZE // NUM_MICROBATCHES}")

  first = {"image": train_images[:BATCH_SIZE], "label": train_labels[:BATCH_SIZE]}
  step_key = jax.random.fold_in(dropout_key, state.step)
  (_, (batch_stats, _)), grads = jax.jit(microbatched_grad_fn)(
      state.params, state.batch_stats, first, step_key
  )
  reference_grads, reference_batch_stats = sequential_grads(state, first, step_key)
  check = max(max_difference(grads, reference_grads),
              max_difference(batch_stats, reference_batch_stats))
  print(f"check, first batch: largest difference from 4 sequential passes: {check:.2e}")

  for epoch in range(1, epochs + 1):
    order = rng.permutation(TRAIN_SIZE)
    losses, accuracies = [], []
    for i in range(0, TRAIN_SIZE, BATCH_SIZE):
      idx = order[i : i + BATCH_SIZE]
      batch = {"image": train_images[idx], "label": train_labels[idx]}
      state, loss, batch_accuracy = train_step(state, batch, dropout_key)
      losses.append(float(loss))
      accuracies.append(float(batch_accuracy))
    test_accuracy = float(accuracy(state, test_images, test_labels))
    print(f"epoch {epoch:2d}: train loss {np.mean(losses):.4f}, train accuracy"
          f" {np.mean(accuracies):.4f}, test accuracy {test_accuracy:.4f}")

  print(f"optimizer steps (TrainState.step):       {int(state.step)}")
  print(f"test accuracy:                           {test_accuracy:.4f}")
  print(f"largest difference from sequential:      {check:.2e}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
