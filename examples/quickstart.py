"""Quickstart: batch 64 in one step, or 4 microbatches of 16 accumulated. Same training.

A small CNN learns the 8x8 digits of scikit-learn (no download) twice, from the same
initial parameters and over the same shuffled examples:

  (a) plain ``optax.adam``, one update per batch of 64;
  (b) ``accum_jax.accumulate(optax.adam(...), every_k=4)``, fed each batch of 64 as 4
      microbatches of 16, one jitted call per microbatch; the parameters change only on
      every 4th call, with the mean of the 4 gradients.

In (b) the host says which call ends a window: ``apply=schedule.next(last=...)`` from
``accum_jax.HostSchedule(opt_state)``, a Python bool, static in the jitted step, so the
calls that only add compile to the gradient plus one add. The training set does not
divide into batches of 64, so each epoch ends with a partial window, which (b) closes
with ``last=True`` and (a) sees as a short last batch. The two loss curves then agree
to float32 round-off, and the script prints by how much. The losses stay on the device
until training ends, so neither loop waits for the device.

  python examples/quickstart.py            # about 10 s on two CPU cores
  python examples/quickstart.py --quick    # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import functools
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import accum_jax

BATCH_SIZE = 64
MICROBATCH_SIZE = 16
EVERY_K = BATCH_SIZE // MICROBATCH_SIZE  # microbatches per optimizer step
# 1456 = 22 * 64 + 48: every epoch ends with a batch of 48, i.e. a window of 3 of the 4
# microbatches, which must be closed early. It is kept a multiple of 16 so that the mean
# of the microbatch gradients is the mean over the batch (for ragged microbatches, pass
# each one's size as `weight=`).
TRAIN_SIZE = 1456
LEARNING_RATE = 3e-3
# The two runs should differ by float32 round-off only; this is far above that.
TOLERANCE = 1e-4


def load_data():
  """Digits as (N, 8, 8, 1) float32 in [0, 1] and int32 labels, with a fixed split."""
  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)[..., None]
  labels = digits.target.astype(np.int32)
  return train_test_split(
      images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels
  )


@jax.jit  # one compilation instead of one per eager random op
def init_params(key):
  """Two 3x3 convolutions (8 and 16 channels, the second with stride 2), then dense."""

  def he_normal(key, shape, fan_in):
    # Drawn flat and reshaped: XLA on CPU compiles a multi-dimensional draw ~1 s slower.
    flat = jax.random.normal(key, (math.prod(shape),), jnp.float32)
    return flat.reshape(shape) * jnp.sqrt(2.0 / fan_in)

  k1, k2, k3 = jax.random.split(key, 3)
  return {
      "conv1": {"w": he_normal(k1, (3, 3, 1, 8), 3 * 3 * 1), "b": jnp.zeros(8)},
      "conv2": {"w": he_normal(k2, (3, 3, 8, 16), 3 * 3 * 8), "b": jnp.zeros(16)},
      "dense": {"w": he_normal(k3, (4 * 4 * 16, 10), 4 * 4 * 16), "b": jnp.zeros(10)},
  }


def conv(layer, x, stride):
  y = jax.lax.conv_general_dilated(
      x, layer["w"], (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  return y + layer["b"]


def apply_model(params, images):
  # GELU, not ReLU: with ReLU, a pre-activation within round-off of zero can fall on
  # different sides of the kink in the two runs, changing a gradient by a whole example's
  # share; Adam then carries that on, and for some seeds the loss curves drift ~1e-3 apart.
  # That is float32 chaos, not accumulation, and a smooth activation does not have it.
  x = jax.nn.gelu(conv(params["conv1"], images, stride=1))  # (B, 8, 8, 8)
  x = jax.nn.gelu(conv(params["conv2"], x, stride=2))  # (B, 4, 4, 16)
  x = x.reshape(x.shape[0], -1)
  return x @ params["dense"]["w"] + params["dense"]["b"]


def loss_fn(params, images, labels):
  logits = apply_model(params, images)
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@functools.partial(jax.jit, static_argnames="optimizer")
def train_step(params, opt_state, images, labels, optimizer):
  """One jitted gradient step of a plain optimizer."""
  loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


@functools.partial(jax.jit, static_argnames=("optimizer", "apply"))
def accumulate_step(params, opt_state, images, labels, optimizer, apply):
  """One microbatch's call of `accumulate`: `apply` (static) says whether it ends a window."""
  loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
  updates, opt_state = optimizer.update(grads, opt_state, params, apply=apply)
  return optax.apply_updates(params, updates), opt_state, loss


@jax.jit
def accuracy(params, images, labels):
  return jnp.mean(jnp.argmax(apply_model(params, images), axis=-1) == labels)


def epoch_batches(orders, num_examples):
  """Index arrays of the batches of 64, epoch by epoch; each epoch's last one is short."""
  for order in orders:
    yield [order[i : i + BATCH_SIZE] for i in range(0, num_examples, BATCH_SIZE)]


def train_batch64(params, data, orders, num_steps):
  """Run (a): plain Adam, one update per batch of 64. Returns params and loss per step."""
  images, labels = data
  optimizer = optax.adam(LEARNING_RATE)
  opt_state = optimizer.init(params)
  losses = []
  with tqdm(total=num_steps, desc="batch 64          ", disable=None) as bar:
    for batches in epoch_batches(orders, len(labels)):
      for idx in batches:
        # The short last batch compiles train_step a second time, for its shape; run (b)
        # only ever sees microbatches of 16.
        params, opt_state, loss = train_step(
            params, opt_state, images[idx], labels[idx], optimizer
        )
        losses.append(loss)
        bar.update()
  return params, np.array(jax.device_get(losses))


def train_accumulated(params, data, orders, num_steps):
  """Run (b): 4 x 16 accumulated into one Adam update. Returns params and loss per step."""
  images, labels = data
  optimizer = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=EVERY_K)
  opt_state = optimizer.init(params)
  # Reads every_k and the state's counters once; then next() is Python arithmetic.
  schedule = accum_jax.HostSchedule(opt_state)
  windows, window_losses = [], []
  with tqdm(total=num_steps, desc="4 x 16 accumulated", disable=None) as bar:
    for batches in epoch_batches(orders, len(labels)):
      microbatches = [
          mb for idx in batches for mb in np.split(idx, len(idx) // MICROBATCH_SIZE)
      ]
      for i, idx in enumerate(microbatches):
        # Close the epoch's last window even if it holds fewer than 4 microbatches; the
        # update is then the mean over what it holds.
        apply = schedule.next(last=i == len(microbatches) - 1)
        params, opt_state, loss = accumulate_step(
            params, opt_state, images[idx], labels[idx], optimizer, apply
        )
        window_losses.append(loss)
        if apply:
          windows.append(window_losses)
          window_losses = []
          bar.update()
  assert not window_losses, "every window should have ended with apply=True"
  assert int(accum_jax.optimizer_step(opt_state)) == len(windows), "a window was skipped"
  # Equal-sized microbatches: the mean of their losses is the loss of the batch.
  losses = [np.mean(jax.device_get(window)) for window in windows]
  return params, np.array(losses)


def plot_losses(path, loss_a, loss_b, title):
  import matplotlib

  matplotlib.use("Agg")  # files only, no display needed
  import matplotlib.pyplot as plt

  steps = np.arange(1, len(loss_a) + 1)
  fig, (top, bottom) = plt.subplots(
      2, 1, figsize=(7, 5.5), sharex=True, height_ratios=(3, 1), layout="constrained"
  )
  top.plot(steps, loss_a, lw=2.5, color="tab:blue", label="batch 64, optax.adam")
  top.plot(
      steps,
      loss_b,
      lw=1.5,
      ls="--",
      color="tab:orange",
      label=f"4 x 16, accum_jax.accumulate(optax.adam, every_k={EVERY_K})",
  )
  top.set_yscale("log")
  top.set_ylabel("training loss (per optimizer step)")
  top.set_title(title)
  top.legend()
  top.grid(alpha=0.3)
  # A floor keeps steps where the two losses are bitwise equal visible on a log scale.
  bottom.plot(steps, np.maximum(np.abs(loss_a - loss_b), 1e-10), lw=1, color="tab:gray")
  bottom.set_yscale("log")
  bottom.set_ylim(1e-10, 1e-2)
  bottom.set_ylabel("|difference|")
  bottom.set_xlabel("optimizer step")
  bottom.grid(alpha=0.3)
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=20, help="training epochs (default 20)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument(
      "--plot",
      type=Path,
      default=Path(__file__).parent / "out" / "quickstart_loss.png",
      help="where to save the loss plot (default examples/out/quickstart_loss.png)",
  )
  parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")
  # On GPUs, float32 convolutions may otherwise run in TF32, whose rounding would depend
  # on the batch shape; this comparison is about accumulation, so keep full float32.
  jax.config.update("jax_default_matmul_precision", "highest")

  start = time.perf_counter()
  train_images, test_images, train_labels, test_labels = load_data()
  init = init_params(jax.random.key(args.seed))
  # One shuffle per epoch, shared by both runs so they see the same examples per step.
  rng = np.random.default_rng(args.seed)
  orders = [rng.permutation(TRAIN_SIZE) for _ in range(epochs)]
  steps = epochs * math.ceil(TRAIN_SIZE / BATCH_SIZE)

  data = (train_images, train_labels)
  params_a, loss_a = train_batch64(init, data, orders, steps)
  params_b, loss_b = train_accumulated(init, data, orders, steps)

  acc_a = float(accuracy(params_a, test_images, test_labels))
  acc_b = float(accuracy(params_b, test_images, test_labels))
  loss_diff = float(np.max(np.abs(loss_a - loss_b)))
  param_diff = max(
      float(jnp.max(jnp.abs(a - b)))
      for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b))
  )
  epochs_text = f"{epochs} epoch{'' if epochs == 1 else 's'}"
  print(
      f"{epochs_text} x {steps // epochs} optimizer steps ({TRAIN_SIZE} training examples,"
      f" last batch {TRAIN_SIZE % BATCH_SIZE or BATCH_SIZE}); {len(test_labels)} test examples"
  )
  print(f"test accuracy, batch 64:                 {acc_a:.4f}")
  print(f"test accuracy, 4 x 16 accumulated:       {acc_b:.4f}")
  print(f"largest loss difference:                 {loss_diff:.3e}")
  print(f"largest parameter difference:            {param_diff:.3e}")
  same = loss_diff < TOLERANCE
  if same:
    print("verdict: same training; accumulating 4 x 16 matches batch 64 to float32 round-off")
  else:
    print(f"verdict: the runs DIFFER by more than {TOLERANCE:g}, far beyond float32 round-off")
  plot_losses(args.plot, loss_a, loss_b, f"Digits CNN, {epochs_text}: one training, two ways")
  print(f"loss plot: {args.plot}")
  print(f"time, imports not counted: {time.perf_counter() - start:.1f} s")
  return 0 if same else 1


if __name__ == "__main__":
  raise SystemExit(main())
