"""Resume in the middle of an accumulation window: checkpoint with Orbax, restore, continue.

A small Linen CNN with BatchNorm and Dropout learns the 8x8 digits of scikit-learn
(no download) in a ``TrainState`` whose optimizer is
``accum_jax.accumulate(optax.adam(...), every_k=4)``: one jitted call per
microbatch of 32, one Adam update per 4 calls. Each call passes its number of
examples as ``weight``, and ``apply`` from ``accum_jax.HostSchedule(state)``: static
in the jitted step, so the calls that only add compile to the gradient and one add.

The training runs twice over the same data:

  (a) without a break;
  (b) stopped after 2 of the 4 calls of a window, when the accumulator holds half
      a window, saved with Orbax to a temporary directory, dropped, restored into
      a state built from scratch, and continued to the end.

The checkpoint is the whole ``TrainState``: the parameters, BatchNorm's
statistics, the call counter and the ``accumulate`` state (the window's
gradient sum and weight, the update count, Adam's moments). Orbax restores it
against an abstract state from ``jax.eval_shape``, which gives back the
``TrainState`` class and the ``AccumulationState`` named tuple. The loop's
``HostSchedule`` is not in the checkpoint: (b) makes a new one from the restored
state, which reads where the window stopped. The final parameters of (a) and (b)
are then equal bit for bit.

  python examples/resume.py            # 4 epochs, about 10 s on a laptop CPU
  python examples/resume.py --quick    # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax.training import train_state
from sklearn.datasets import load_digits

import accum_jax
import accum_jax.flax

MICROBATCH_SIZE = 32
EVERY_K = 4  # calls per Adam update
TRAIN_SIZE = 1440  # 45 microbatches of 32 per epoch
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


# Built once: a TrainState's apply_fn and tx are static, and new ones would recompile.
MODEL = CNN()
OPTIMIZER = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=EVERY_K)


class TrainState(train_state.TrainState):
  batch_stats: Any  # BatchNorm's running statistics


@jax.jit
def init_variables(key: jax.Array):
  return MODEL.init(key, jnp.ones((1, 8, 8, 1)), train=False)


def create_state(key: jax.Array) -> TrainState:
  variables = init_variables(key)
  return TrainState.create(
      apply_fn=MODEL.apply,
      params=variables["params"],
      batch_stats=variables["batch_stats"],
      tx=OPTIMIZER,
  )


def loss_fn(params, batch_stats, images, labels, dropout_key):
  logits, updates = MODEL.apply(
      {"params": params, "batch_stats": batch_stats},
      images,
      train=True,
      rngs={"dropout": dropout_key},
      mutable=["batch_stats"],
  )
  loss = optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss, updates["batch_stats"]


@functools.partial(jax.jit, static_argnames="apply")
def train_step(state: TrainState, images, labels, key, apply: bool):
  # The dropout key follows the call counter, which the checkpoint holds.
  dropout_key = jax.random.fold_in(key, state.step)
  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state.params, state.batch_stats, images, labels, dropout_key
  )
  # TrainState.apply_gradients would not pass `weight` and `apply` on to accumulate().
  state = accum_jax.flax.apply_gradients(
      state, grads=grads, weight=labels.shape[0], apply=apply
  )
  return state.replace(batch_stats=batch_stats), loss


def train(state: TrainState, data, calls: range, key) -> TrainState:
  """Makes calls number `calls` of the run: call c takes microbatch c."""
  images, labels, microbatches = data
  # Made from the state it starts from, new or restored: it reads every_k and where
  # the window stands, once; then next() is Python arithmetic.
  schedule = accum_jax.HostSchedule(state)
  for call in calls:
    idx = microbatches[call]
    state, _ = train_step(state, images[idx], labels[idx], key, schedule.next())
  return state


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=4, help="training epochs (default 4)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument("--seed", type=int, default=0, help="initialisation, shuffling, dropout")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")

  start = time.perf_counter()
  digits = load_digits()
  images = (digits.images[:TRAIN_SIZE] / 16.0).astype(np.float32)[..., None]
  labels = digits.target[:TRAIN_SIZE].astype(np.int32)
  rng = np.random.default_rng(args.seed)
  per_epoch = TRAIN_SIZE // MICROBATCH_SIZE
  microbatches = [
      mb for _ in range(epochs) for mb in np.split(rng.permutation(TRAIN_SIZE), per_epoch)
  ]
  data = (images, labels, microbatches)
  total_calls = len(microbatches)
  # Half-way through the run, rounded to a window boundary, plus 2 calls.
  stop = total_calls // 2 // EVERY_K * EVERY_K + 2
  init_key, dropout_key = jax.random.split(jax.random.key(args.seed))

  # (a) Without a break.
  uninterrupted = train(create_state(init_key), data, range(total_calls), dropout_key)

  # (b) Stopped at `stop`, saved, restored in a state built from nothing, continued.
  with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / f"call_{stop}"
    state = train(create_state(init_key), data, range(stop), dropout_key)
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(path, state)
    window = state.opt_state
    print(f"checkpoint after call {stop} of {total_calls}: the window holds"
          f" {int(window.mini_step)} of {EVERY_K} microbatches (weight"
          f" {float(window.window_weight):g}), {int(accum_jax.optimizer_step(state))}"
          " Adam updates so far")
    del state, window

    abstract_state = jax.eval_shape(create_state, init_key)
    with ocp.StandardCheckpointer() as checkpointer:
      restored = checkpointer.restore(path, abstract_state)
  print(f"restored: {type(restored).__name__} with opt_state"
        f" {type(restored.opt_state).__name__}, step {int(restored.step)},"
        f" mini_step {int(restored.opt_state.mini_step)}")
  resumed = train(restored, data, range(stop, total_calls), dropout_key)

  leaves_a, leaves_b = jax.tree.leaves(uninterrupted), jax.tree.leaves(resumed)
  equal = len(leaves_a) == len(leaves_b) and all(
      np.array_equal(a, b) for a, b in zip(leaves_a, leaves_b)
  )
  print(f"calls (TrainState.step):                 {int(resumed.step)}")
  print(f"Adam updates (accum_jax.optimizer_step): {int(accum_jax.optimizer_step(resumed))}")
  print(f"bitwise equal: {equal}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
