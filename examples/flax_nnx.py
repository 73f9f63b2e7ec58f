"""Flax NNX: a CNN with BatchNorm and Dropout, one Adam update per 4 microbatches of 32.

The 8x8 digits of scikit-learn (no download) train a small NNX CNN. By default
(``--door accumulate``) the optimizer accumulates across calls::

  nnx.Optimizer(model, accum_jax.accumulate(optax.adam(...), every_k=4), wrt=nnx.Param)

Each jitted call takes one microbatch of 32 and calls ``optimizer.update(model,
grads, flush=...)``, which passes ``flush`` through to ``accumulate``. Adam
runs on every 4th call, on the mean of the 4 gradients; the other calls leave
the parameters as they are. The training set is 45 microbatches, so each epoch
ends with a window of 1, closed with ``flush=True``.

With ``--door value_and_grad`` each call takes a whole batch of 128 instead, and
``accum_jax.flax.nnx_value_and_grad`` scans over its 4 microbatches inside the
call, threading BatchNorm's statistics and the dropout ``nnx.Rngs`` through them;
plain Adam then updates once per call.

Both doors see the same microbatches in the same order, with the same dropout
draws and BatchNorm updates, so they train alike; they differ in each epoch's
last 32 examples, a window of 1 microbatch here, 4 microbatches of 8 there.

The two step counters differ with ``accumulate``: ``nnx.Optimizer.step`` counts
calls of ``update``, ``accum_jax.optimizer_step(optimizer)`` counts Adam updates.

  python examples/flax_nnx.py                        # 15 epochs, about 10 s on a laptop CPU
  python examples/flax_nnx.py --door value_and_grad  # the same, microbatched inside a step
  python examples/flax_nnx.py --quick                # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import accum_jax
import accum_jax.flax

MICROBATCH_SIZE = 32
EVERY_K = 4  # microbatches per Adam update: batches of 128
BATCH_SIZE = EVERY_K * MICROBATCH_SIZE
TRAIN_SIZE = 1440  # 45 microbatches: 11 windows of 4 and a last window of 1
LEARNING_RATE = 3e-3


class CNN(nnx.Module):
  """Two 3x3 convolutions with BatchNorm (the second with stride 2), dropout, dense."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, (3, 3), rngs=rngs)
    self.norm1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, (3, 3), strides=2, rngs=rngs)
    self.norm2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)
    self.dense = nnx.Linear(4 * 4 * 16, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.norm1(self.conv1(x)))
    x = nnx.relu(self.norm2(self.conv2(x)))
    return self.dense(self.dropout(x.reshape(x.shape[0], -1)))


def load_data():
  """Digits as (N, 8, 8, 1) float32 in [0, 1] and int32 labels, with a fixed split."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  return train_test_split(
      images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels
  )


def loss_fn(model: CNN, images, labels):
  logits = model(images)
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == labels)


@nnx.jit
def accumulate_step(model, optimizer, images, labels, flush):
  """One microbatch: its gradient goes into the window; Adam runs when it is full."""
  (loss, accuracy), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, images, labels)
  optimizer.update(model, grads, flush=flush)  # flush reaches accumulate()
  return loss, accuracy


microbatched_value_and_grad = accum_jax.flax.nnx_value_and_grad(
    loss_fn, num_microbatches=EVERY_K, batch_argnums=(1, 2), has_aux=True
)


@nnx.jit
def microbatched_step(model, optimizer, images, labels):
  """One batch, as 4 microbatches scanned inside the call; then one Adam update."""
  (loss, accuracy), grads = microbatched_value_and_grad(model, images, labels)
  optimizer.update(model, grads)
  return loss, accuracy


@nnx.jit
def evaluate(model, images, labels):
  return jnp.mean(jnp.argmax(model(images), -1) == labels)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=15, help="training epochs (default 15)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument(
      "--door",
      choices=("accumulate", "value_and_grad"),
      default="accumulate",
      help="accumulate across calls (default) or microbatch inside each call",
  )
  parser.add_argument("--seed", type=int, default=0, help="initialisation, shuffling, dropout")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")

  start = time.perf_counter()
  train_images, test_images, train_labels, test_labels = load_data()
  model = CNN(nnx.Rngs(params=args.seed, dropout=args.seed + 1))
  if args.door == "accumulate":
    tx = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=EVERY_K)
    print(f"NNX CNN on {TRAIN_SIZE} digits: nnx.Optimizer(model, accum_jax.accumulate("
          f"optax.adam, every_k={EVERY_K})), one call per microbatch of {MICROBATCH_SIZE}")
  else:
    tx = optax.adam(LEARNING_RATE)
    print(f"NNX CNN on {TRAIN_SIZE} digits: accum_jax.flax.nnx_value_and_grad, one call per"
          f" batch of {BATCH_SIZE} scanned as {EVERY_K} microbatches")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  # Evaluation sees the same arrays, with dropout off and BatchNorm's running averages.
  eval_model = nnx.view(model, deterministic=True, use_running_average=True)
  rng = np.random.default_rng(args.seed)  # shuffling

  for epoch in range(1, epochs + 1):
    order = rng.permutation(TRAIN_SIZE)
    size = MICROBATCH_SIZE if args.door == "accumulate" else BATCH_SIZE
    chunks = [order[i : i + size] for i in range(0, TRAIN_SIZE, size)]
    losses, accuracies = [], []
    for i, idx in enumerate(chunks):
      if args.door == "accumulate":
        # The epoch's last window holds 1 microbatch: flush it. `flush` is traced,
        # so this does not recompile.
        flush = i == len(chunks) - 1
        loss, accuracy = accumulate_step(
            model, optimizer, train_images[idx], train_labels[idx], flush
        )
      else:
        loss, accuracy = microbatched_step(model, optimizer, train_images[idx], train_labels[idx])
      losses.append(float(loss))
      accuracies.append(float(accuracy))
    accuracy = float(evaluate(eval_model, test_images, test_labels))
    print(f"epoch {epoch:2d}: train loss {np.mean(losses):.4f}, train accuracy"
          f" {np.mean(accuracies):.4f}, test accuracy {accuracy:.4f}")

  calls = int(optimizer.step[...])
  print(f"calls of optimizer.update (nnx.Optimizer.step):  {calls}")
  if args.door == "accumulate":
    print(f"Adam updates (accum_jax.optimizer_step):         "
          f"{int(accum_jax.optimizer_step(optimizer))}")
    windows, last = divmod(TRAIN_SIZE // MICROBATCH_SIZE, EVERY_K)
    print(f"  each epoch: {windows} windows of {EVERY_K} calls and a flushed window of {last}")
  else:
    print(f"Adam updates (one per call):                     {calls}")
  print(f"test accuracy:                                   {accuracy:.4f}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
