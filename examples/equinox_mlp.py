"""Equinox: an MLP on the digits, batches of 128 as 4 microbatches of 32, by both doors.

The 8x8 digits of scikit-learn (no download) train an ``eqx.nn.MLP`` with
``jax.nn.relu``, a model whose leaves are not all arrays. Three runs start from
the same model and see the same batches:

* full batch: ``eqx.filter_value_and_grad`` on each batch of 128, then Adam;
* ``accum_jax.equinox.filter_value_and_grad(loss_fn, num_microbatches=4)``: the
  same call, the batch scanned as 4 microbatches of 32 inside it;
* the standard Equinox loop on microbatches of 32, with the optimizer
  ``accum_jax.accumulate(optax.adam(...), every_k=4)``: Adam runs on every 4th
  call, on the mean of the 4 gradients. Each call passes ``apply`` from
  ``accum_jax.HostSchedule(opt_state)``, a Python bool that ``eqx.filter_jit``
  treats as static: the calls that only add compile to the gradient and one add.

Both doors compute the full-batch gradient (each microbatch's mean loss, averaged
over 4 equal microbatches), so the three runs' parameters agree to float32
round-off; the script prints the largest difference and plots the losses and
the differences under ``examples/out/``.

  python examples/equinox_mlp.py            # 10 epochs, a few seconds on a laptop CPU
  python examples/equinox_mlp.py --quick    # one epoch, a smoke test
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import accum_jax
import accum_jax.equinox

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NUM_MICROBATCHES = 4
MICROBATCH_SIZE = 32
BATCH_SIZE = NUM_MICROBATCHES * MICROBATCH_SIZE
TRAIN_SIZE = 1408  # 11 batches of 128
LEARNING_RATE = 3e-3


def load_data():
  """Digits as (N, 64) float32 in [0, 1] and int32 labels, with a fixed split."""
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  return train_test_split(images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels)


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  logits = jax.vmap(model)(x)
  return optax.losses.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_step(value_and_grad, optim):
  """The usual Equinox training step, with the gradient from ``value_and_grad``.

  ``apply`` is None for a plain optimizer; for ``accumulate`` it is the host's word on
  whether the call ends a window, a Python bool and so static under ``filter_jit``.
  """

  @eqx.filter_jit
  def step(model, opt_state, x, y, apply):
    loss, grads = value_and_grad(model, x, y)
    extra = {} if apply is None else {"apply": apply}
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array), **extra)
    return eqx.apply_updates(model, updates), opt_state, loss

  return step


@eqx.filter_jit
def accuracy(model, x, y):
  return jnp.mean(jnp.argmax(jax.vmap(model)(x), -1) == y)


@eqx.filter_jit
def max_abs_diff(a, b) -> jax.Array:
  """The largest difference between two models' arrays."""
  diffs = jax.tree.map(lambda u, v: jnp.max(jnp.abs(u - v)), eqx.filter(a, eqx.is_array),
                       eqx.filter(b, eqx.is_array))
  return jnp.max(jnp.stack(jax.tree.leaves(diffs)))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
  parser.add_argument("--quick", action="store_true", help="one epoch, for smoke tests")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling")
  parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                      help="where the plot goes (default examples/out)")
  args = parser.parse_args()
  epochs = 1 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")

  start = time.perf_counter()
  train_x, test_x, train_y, test_y = load_data()
  model0 = eqx.nn.MLP(64, 10, width_size=64, depth=2, activation=jax.nn.relu,
                      key=jax.random.key(args.seed))
  rng = np.random.default_rng(args.seed)
  batches = [rng.permutation(TRAIN_SIZE).reshape(-1, BATCH_SIZE) for _ in range(epochs)]
  batches = np.concatenate(batches)  # (steps, 128) row indices, one batch per step

  adam = optax.adam(LEARNING_RATE)
  accumulating_adam = accum_jax.accumulate(optax.adam(LEARNING_RATE), every_k=NUM_MICROBATCHES)
  runs = {
      "full batch": (make_step(eqx.filter_value_and_grad(loss_fn), adam), adam, 1),
      "filter_value_and_grad": (
          make_step(accum_jax.equinox.filter_value_and_grad(loss_fn, NUM_MICROBATCHES), adam),
          adam,
          1,
      ),
      "accumulate": (
          make_step(eqx.filter_value_and_grad(loss_fn), accumulating_adam),
          accumulating_adam,
          NUM_MICROBATCHES,  # calls per batch: one per microbatch
      ),
  }
  print(f"eqx.nn.MLP (relu) on {TRAIN_SIZE} digits, {len(batches)} Adam steps on batches of"
        f" {BATCH_SIZE} = {NUM_MICROBATCHES} x {MICROBATCH_SIZE}")

  losses, snapshots = {}, {}  # per step: the batch's mean loss, the model after it
  with tqdm(total=len(runs) * len(batches), desc="training", unit="step") as bar:
    for name, (step, optim, calls_per_batch) in runs.items():
      model, opt_state = model0, optim.init(eqx.filter(model0, eqx.is_array))
      # accumulate's window length, read from its state; a plain optimizer has none.
      schedule = accum_jax.HostSchedule(opt_state) if calls_per_batch > 1 else None
      history, snapshots[name] = [], []
      for idx in batches:
        batch_losses = []
        for part in np.split(idx, calls_per_batch):
          apply = schedule.next() if schedule else None
          model, opt_state, loss = step(model, opt_state, train_x[part], train_y[part], apply)
          batch_losses.append(loss)
        history.append(float(np.mean(batch_losses)))
        snapshots[name].append(model)
        bar.update()
      losses[name] = history

  models = {name: steps[-1] for name, steps in snapshots.items()}
  diffs = {  # after each step, against the full-batch run
      name: [float(max_abs_diff(m, f)) for m, f in zip(snapshots[name], snapshots["full batch"])]
      for name in ("filter_value_and_grad", "accumulate")
  }
  print(f"{'run':<24}{'first loss':>12}{'last loss':>12}{'test accuracy':>15}")
  for name, model in models.items():
    print(f"{name:<24}{losses[name][0]:>12.4f}{losses[name][-1]:>12.4f}"
          f"{float(accuracy(model, test_x, test_y)):>15.4f}")
  for name in ("filter_value_and_grad", "accumulate"):
    print(f"max |param diff| vs full batch, {name}: {max(diffs[name]):.3e}")

  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / "equinox_mlp.png"
  fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(10, 4))
  for name, style in zip(runs, ("-", "--", ":")):
    ax_loss.plot(losses[name], style, label=name)
  ax_loss.set(xlabel="Adam step", ylabel="training loss (batch mean)", yscale="log",
              title="Same batches, three ways")
  ax_loss.legend()
  for name, marker in zip(diffs, ("o", "x")):
    # Exact zeros (bitwise-equal parameters) have no place on a log axis: left out.
    ax_diff.plot([d if d > 0 else np.nan for d in diffs[name]], marker, ms=3, label=name)
  ax_diff.set(xlabel="Adam step", ylabel="max |parameter - full-batch parameter|",
              yscale="log", title="Difference from the full batch (float32 round-off)")
  ax_diff.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  print(f"plot: {path}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
