"""DP-SGD on the digits: logical batches of 256 expected examples, streamed in calls of 64.

Differentially private SGD (Abadi et al. 2016) on the 8x8 digits of scikit-learn (no
download), with an MLP in plain JAX. Each step draws a Poisson sample of the training
set (each example with probability q = 256 / 1408) and streams it through the jitted
train step in physical batches of 64 (4 x smaller), padded and masked::

  grad_sum = accum_jax.privacy.clipped_grad_sum(per_example_loss, l2_clip)
  opt = accum_jax.privacy.accumulate_private(
      optax.adam(...), l2_clip=..., noise_multiplier=..., expected_batch_size=256, key=...)
  for each logical batch (accum_jax.privacy.poisson_batches):
    for each physical batch (indices, mask):
      grads, _ = grad_sum(params, batch, mask)     # clipped per example, summed
      updates, state = opt.update(grads, state, params, apply=is_last)

``apply`` is static in the jitted step: the host knows which physical batch is a
logical batch's last, so the calls before it compile to the clipped gradient sum and
one add, and only the last one runs the noise and Adam. Adam runs once per logical
batch, on (sum of the clipped gradients + one noise draw) / 256. The script checks
the first logical batch against one call on the whole of it, written out by hand
(vmap, clip, sum, the same noise, Adam), and prints the test accuracy and the numbers
a privacy accountant takes: the optimizer steps (``accum_jax.optimizer_step``), the
sampling rate and the noise multiplier. With ``dp_accounting`` installed it prints
epsilon too.

  python examples/dp_sgd.py           # 40 epochs, about 15 s on a laptop CPU
  python examples/dp_sgd.py --quick   # 6 epochs, a smoke test
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import accum_jax
import accum_jax.privacy

TRAIN_SIZE = 1408
EXPECTED_BATCH_SIZE = 256  # the logical batch, on average
PHYSICAL_BATCH_SIZE = 64  # what one call holds
SAMPLING_RATE = EXPECTED_BATCH_SIZE / TRAIN_SIZE
L2_CLIP = 1.0
NOISE_MULTIPLIER = 1.0
LEARNING_RATE = 1e-2
DELTA = 1e-5


def load_data():
  """Digits as (N, 64) float32 in [0, 1] and int32 labels, with a fixed split."""
  digits = load_digits()
  images = (digits.data / 16.0).astype(np.float32)
  labels = digits.target.astype(np.int32)
  return train_test_split(images, labels, train_size=TRAIN_SIZE, random_state=0, stratify=labels)


def init_params(key: jax.Array) -> dict[str, jax.Array]:
  k1, k2 = jax.random.split(key)
  return {
      "w1": jax.random.normal(k1, (64, 64)) / 8.0,
      "b1": jnp.zeros(64),
      "w2": jax.random.normal(k2, (64, 10)) / 8.0,
      "b2": jnp.zeros(10),
  }


def logits_fn(params, x):
  hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
  return hidden @ params["w2"] + params["b2"]


def per_example_loss(params, example):
  """The loss of one example: ``example`` is a pair of one image and its label."""
  x, y = example
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y)


@jax.jit
def accuracy(params, x, y):
  return jnp.mean(jnp.argmax(logits_fn(params, x), -1) == y)


def one_call_reference(params, x, y, key):
  """Adam's first update on the whole logical batch at once, without accum_jax."""
  grads = jax.vmap(jax.grad(per_example_loss), in_axes=(None, 0))(params, (x, y))
  leaves = jax.tree.leaves(grads)
  norms = jnp.sqrt(sum(jnp.sum(g.reshape(len(y), -1) ** 2, axis=1) for g in leaves))
  total = jax.tree.map(lambda g: jnp.tensordot(jnp.minimum(1.0, L2_CLIP / norms), g, 1), grads)
  flat, treedef = jax.tree.flatten(total)
  keys = jax.random.split(jax.random.fold_in(key, 0), len(flat))  # draw 0
  noisy = [(g + NOISE_MULTIPLIER * L2_CLIP * jax.random.normal(k, g.shape)) / EXPECTED_BATCH_SIZE
           for g, k in zip(flat, keys)]
  adam = optax.adam(LEARNING_RATE)
  updates, _ = adam.update(jax.tree.unflatten(treedef, noisy), adam.init(params), params)
  return optax.apply_updates(params, updates)


def epsilon_or_none(steps: int) -> float | None:
  """Epsilon at DELTA from dp_accounting's RDP accountant, if it is installed."""
  try:
    import dp_accounting  # not a dependency of accum_jax
  except ImportError:
    return None
  event = dp_accounting.SelfComposedDpEvent(
      dp_accounting.PoissonSampledDpEvent(
          SAMPLING_RATE, dp_accounting.GaussianDpEvent(NOISE_MULTIPLIER)),
      steps,
  )
  accountant = dp_accounting.rdp.RdpAccountant()
  accountant.compose(event)
  return float(accountant.get_epsilon(DELTA))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=40, help="expected passes (default 40)")
  parser.add_argument("--quick", action="store_true", help="6 epochs, for smoke tests")
  parser.add_argument("--seed", type=int, default=0, help="initialisation, sampling, noise")
  args = parser.parse_args()
  epochs = 6 if args.quick else args.epochs
  if epochs < 1:
    parser.error(f"--epochs={epochs} must be >= 1")

  start = time.perf_counter()
  train_x, test_x, train_y, test_y = load_data()
  init_key, noise_key = jax.random.split(jax.random.key(args.seed))
  params0 = init_params(init_key)
  rng = np.random.default_rng(args.seed)

  grad_sum = accum_jax.privacy.clipped_grad_sum(per_example_loss, L2_CLIP)
  opt = accum_jax.privacy.accumulate_private(
      optax.adam(LEARNING_RATE), l2_clip=L2_CLIP, noise_multiplier=NOISE_MULTIPLIER,
      expected_batch_size=EXPECTED_BATCH_SIZE, key=noise_key,
  )

  @functools.partial(jax.jit, static_argnames="last")
  def train_step(params, opt_state, x, y, mask, last):
    grads, _ = grad_sum(params, (x, y), mask)  # and the examples kept, for logging
    updates, opt_state = opt.update(grads, opt_state, params, apply=last)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = params0, opt.init(params0)
  accum_jax.privacy.check_state(opt_state)  # the noise runs once per logical batch
  num_steps = round(epochs / SAMPLING_RATE)  # epochs * TRAIN_SIZE / EXPECTED_BATCH_SIZE
  calls, sizes = 0, []
  for step in range(num_steps):
    batches = accum_jax.privacy.poisson_batches(
        rng, TRAIN_SIZE, sampling_rate=SAMPLING_RATE, physical_batch_size=PHYSICAL_BATCH_SIZE)
    for i, (indices, mask) in enumerate(batches):
      params, opt_state = train_step(params, opt_state, train_x[indices], train_y[indices],
                                     mask, i == len(batches) - 1)
    calls += len(batches)
    size = sum(int(mask.sum()) for _, mask in batches)
    sizes.append(size)
    if step == 0:
      sampled = np.concatenate([indices[mask] for indices, mask in batches])
      reference = one_call_reference(params0, train_x[sampled], train_y[sampled], noise_key)
      difference = max(float(jnp.max(jnp.abs(a - b)))
                       for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference)))
      print(f"first logical batch: {size} examples in {len(batches)} calls of"
            f" {PHYSICAL_BATCH_SIZE}")
      print(f"largest difference from one call on the logical batch: {difference:.2e}")

  steps = int(accum_jax.optimizer_step(opt_state))
  print(f"logical batch sizes: mean {np.mean(sizes):.1f}, min {min(sizes)}, max {max(sizes)}"
        f" (expected {EXPECTED_BATCH_SIZE})")
  print(f"calls of the train step: {calls}")
  print(f"test accuracy: {float(accuracy(params, test_x, test_y)):.4f}")
  print("for the accountant (Poisson-sampled Gaussian mechanism, composed):")
  print(f"optimizer steps (accum_jax.optimizer_step): {steps}")
  print(f"sampling rate q: {SAMPLING_RATE:.4f}")
  print(f"noise multiplier: {NOISE_MULTIPLIER}")
  epsilon = epsilon_or_none(steps)
  if epsilon is None:
    print("epsilon: install dp_accounting to compute it (see the guide)")
  else:
    print(f"epsilon at delta={DELTA}: {epsilon:.2f}")
  print(f"wall time: {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
  main()
