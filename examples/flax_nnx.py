"""Flax NNX: the MNIST tutorial's training step, one AdamW update per 4 microbatches of 32.

The code is shaped like Flax's NNX MNIST tutorial: a CNN with BatchNorm and
Dropout whose ``__call__`` takes an ``nnx.Rngs``, ``loss_fn(model, rngs,
batch)`` returning the loss and the logits, ``nnx.Optimizer(model,
optax.adamw(...), wrt=nnx.Param)``, an ``nnx.MultiMetric`` of accuracy and
average loss, and ``train_step(model, optimizer, metrics, rngs, batch)``. The
8x8 digits of scikit-learn (no download) stand in for MNIST.

By default (``--door accumulate``) the optimizer accumulates across calls::

  nnx.Optimizer(model, accum_jax.accumulate(optax.adamw(...), every_k=4), wrt=nnx.Param)

Each jitted call takes one microbatch of 32 and calls ``optimizer.update(model,
grads, apply=...)``, which passes ``apply`` through to ``accumulate``. ``apply``
comes from ``accum_jax.HostSchedule(optimizer)``, which reads ``every_k`` from the
optimizer's state and counts the calls in Python, and it is static in ``nnx.jit``:
the calls that only add compile to the gradient plus one add, and AdamW runs on
every 4th call, on the mean of the 4 gradients; the other calls leave the
parameters as they are. The training set is 45 microbatches, so each epoch ends
with a window of 1, closed by ``schedule.next(last=True)``.

With ``--door value_and_grad`` each call takes a whole batch of 128 instead, and
``accum_jax.flax.nnx_value_and_grad`` scans over its 4 microbatches inside the
call, threading the state of the model (BatchNorm statistics) and of the
``nnx.Rngs`` argument (its count, so each microbatch draws new dropout keys)
through them; the logits come back as (128, 10) for the metrics
(``aux_reduction="concat"``), and AdamW updates once per call. One line guards
it against a bad batch::

  nnx.Optimizer(model, optax.apply_if_finite(optax.adamw(...), 5), wrt=nnx.Param)

A step whose loss or gradient sums are not finite comes back with a NaN gradient
(and the BatchNorm statistics as they were), so ``apply_if_finite`` leaves the
parameters and AdamW's state as they are and counts the step; ``accumulate``
does the same for a window by itself. After 5 consecutive non-finite steps the
sixth goes through and the parameters become NaN: choose the cap for how long a
run of bad batches you would rather stop on.

Both doors see the same microbatches in the same order, with the same dropout
keys and BatchNorm updates, so they train alike; they differ in each epoch's
last 32 examples, a window of 1 microbatch here, 4 microbatches of 8 there.

The two step counters differ with ``accumulate``: ``nnx.Optimizer.step`` counts
calls of ``update``, ``accum_jax.optimizer_step(optimizer)`` counts AdamW updates.

  python examples/flax_nnx.py                        # 15 epochs, about 10 s on a laptop CPU
  python examples/flax_nnx.py --door value_and_grad  # the same, microbatched inside a step
  python examples/flax_nnx.py --quick                # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import numpy as np
import optax
from flax import nnx
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import accum_jax
import accum_jax.flax

MICROBATCH_SIZE = 32
EVERY_K = 4  # microbatches per AdamW update: batches of 128
BATCH_SIZE = EVERY_K * MICROBATCH_SIZE
TRAIN_SIZE = 1440  # 45 microbatches: 11 windows of 4 and a last window of 1
LEARNING_RATE = 3e-3


class CNN(nnx.Module):
  """Two 3x3 convolutions with BatchNorm and average pooling, dropout, two dense layers."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm1 = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dropout1 = nnx.Dropout(rate=0.025)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.batch_norm2 = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(2 * 2 * 16, 64, rngs=rngs)
    self.dropout2 = nnx.Dropout(rate=0.2)
    self.linear2 = nnx.Linear(64, 10, rngs=rngs)

  def __call__(self, x, rngs: nnx.Rngs | None = None):
    x = self.avg_pool(nnx.relu(self.batch_norm1(self.dropout1(self.conv1(x), rngs=rngs))))
    x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
    x = x.reshape(x.shape[0], -1)  # flatten
    x = nnx.relu(self.dropout2(self.linear1(x), rngs=rngs))
    return self.linear2(x)


def load_data():
  """Digits as {"image": (N, 8, 8, 1) float32 in [0, 1], "label": int32}, a fixed split."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  train_images, test_images, train_labels, test_labels = train_test_split(
      images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels
  )
  train = {"image": train_images, "label": train_labels}
  return train, {"image": test_images, "label": test_labels}


def loss_fn(model: CNN, rngs: nnx.Rngs | None, batch):
  logits = model(batch["image"], rngs)
  loss = optax.softmax_cross_entropy_with_integer_labels(
      logits=logits, labels=batch["label"]
  ).mean()
  return loss, logits


@partial(nnx.jit, static_argnames="apply", donate_argnums=(0, 1))
def train_step(model, optimizer, metrics, rngs, batch, apply):
  """One microbatch: its gradient goes into the window; AdamW runs where apply is True."""
  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, logits), grads = grad_fn(model, rngs, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads, apply=apply)  # apply reaches accumulate()


# The same loss_fn and call as nnx.value_and_grad; model and rngs are threaded
# through the microbatches, the batch (the only array argument) is split, and the
# logits come back per example, in batch order ("concat"; the default refuses them).
microbatched_grad_fn = accum_jax.flax.nnx_value_and_grad(
    loss_fn, num_microbatches=EVERY_K, has_aux=True, aux_reduction="concat"
)


@nnx.jit
def microbatched_train_step(model, optimizer, metrics, rngs, batch):
  """One batch, as 4 microbatches scanned inside the call; then one AdamW update."""
  (loss, logits), grads = microbatched_grad_fn(model, rngs, batch)  # logits: (batch, 10)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])
  optimizer.update(model, grads)


@nnx.jit
def eval_step(model, metrics, batch):
  loss, logits = loss_fn(model, None, batch)
  metrics.update(loss=loss, logits=logits, labels=batch["label"])


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
  train, test = load_data()
  model = CNN(rngs=nnx.Rngs(args.seed))
  rngs = nnx.Rngs(args.seed + 1)  # dropout keys, passed to every train step
  if args.door == "accumulate":
    tx = accum_jax.accumulate(optax.adamw(LEARNING_RATE), every_k=EVERY_K)
    print(f"NNX CNN on {TRAIN_SIZE} digits: nnx.Optimizer(model, accum_jax.accumulate("
          f"optax.adamw, every_k={EVERY_K})), one call per microbatch of {MICROBATCH_SIZE}")
  else:
    # A skipped step's gradient is NaN: apply_if_finite skips the update (XLA:GPU runs
    # its two cheap branches as selects, so the GPU never waits on the host for it).
    # After 5 consecutive non-finite steps the sixth goes through: the parameters
    # become NaN. Choose the cap for how long a run of bad batches to stop on.
    tx = optax.apply_if_finite(optax.adamw(LEARNING_RATE), max_consecutive_errors=5)
    print(f"NNX CNN on {TRAIN_SIZE} digits: accum_jax.flax.nnx_value_and_grad, one call per"
          f" batch of {BATCH_SIZE} scanned as {EVERY_K} microbatches")
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if args.door == "accumulate":
    schedule = accum_jax.HostSchedule(optimizer)  # every_k, read from the state, once
  metrics = nnx.MultiMetric(
      accuracy=nnx.metrics.Accuracy(),
      loss=nnx.metrics.Average("loss"),
  )
  order_rng = np.random.default_rng(args.seed)  # shuffling

  for epoch in range(1, epochs + 1):
    order = order_rng.permutation(TRAIN_SIZE)
    size = MICROBATCH_SIZE if args.door == "accumulate" else BATCH_SIZE
    chunks = [order[i : i + size] for i in range(0, TRAIN_SIZE, size)]
    model.train()  # dropout on, BatchNorm on the batch's statistics
    for i, idx in enumerate(chunks):
      batch = {key: value[idx] for key, value in train.items()}
      if args.door == "accumulate":
        # The epoch's last window holds 1 microbatch: last=True closes it.
        apply = schedule.next(last=i == len(chunks) - 1)
        train_step(model, optimizer, metrics, rngs, batch, apply)
      else:
        microbatched_train_step(model, optimizer, metrics, rngs, batch)
    train_metrics = {name: float(value) for name, value in metrics.compute().items()}
    metrics.reset()
    model.eval()  # dropout off, BatchNorm's running averages
    eval_step(model, metrics, test)
    accuracy = float(metrics.compute()["accuracy"])
    metrics.reset()
    print(f"epoch {epoch:2d}: train loss {train_metrics['loss']:.4f}, train accuracy"
          f" {train_metrics['accuracy']:.4f}, test accuracy {accuracy:.4f}")

  calls = int(optimizer.step[...])
  print(f"calls of optimizer.update (nnx.Optimizer.step):  {calls}")
  if args.door == "accumulate":
    print(f"Adam updates (accum_jax.optimizer_step):         "
          f"{int(accum_jax.optimizer_step(optimizer))}")
    windows, last = divmod(TRAIN_SIZE // MICROBATCH_SIZE, EVERY_K)
    print(f"  each epoch: {windows} windows of {EVERY_K} calls and a last window of {last}")
  else:
    skipped = int(optimizer.opt_state.total_notfinite[...])
    print(f"Adam updates (one per call):                     {calls - skipped}")
    print(f"steps skipped (apply_if_finite):                 {skipped}")
  print(f"dropout keys drawn (rngs.default.count):         {int(rngs.default.count[...])}")
  print(f"test accuracy:                                   {accuracy:.4f}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
