"""The critical batch size, measured while accumulating, and a batch-size warmup driven by it.

Every accumulated step takes the gradients of N small batches of the same parameters.
Their spread is the gradient noise; ``gradient_noise=True`` turns it into unbiased
estimates of ``|G|^2`` (the true gradient's squared norm) and ``tr(Sigma)`` (the trace
of the per-example gradient covariance), and ``B_simple = tr(Sigma) / |G|^2`` is the
batch size past which a larger batch buys little (McCandlish et al. 2018). One step's
estimate is noisy; a :class:`accum_jax.noise.NoiseScaleEMA` averages both over steps and takes
the ratio of the averages::

  vg = accum_jax.value_and_grad(loss, n, batch_argnums=(1, 2), gradient_noise=True,
                                return_info=True)
  loss, grads, info = vg(params, x, y)
  ema = ema.update(info.gradient_noise)      # ema.simple_noise_scale: B_simple, in examples

The task is scikit-learn's digits (1797 8x8 images, shipped with the package: no
download), classified by an MLP in plain JAX trained with SGD and momentum. It is easy,
but not too easy for this: its B_simple starts near 25 examples and grows past 500 over
15 epochs, so the batch that is worth taking changes several-fold within a run of
seconds. The script

  1. trains with fixed batches of N x MICROBATCH_SIZE examples (N = 8 and 32);
  2. trains again on the same number of examples with a noise-driven batch-size warmup
     (Merrill et al. 2025): before each step, N = clip(B_simple / MICROBATCH_SIZE,
     N_MIN, N_MAX) rounded to a power of two, never decreasing, so that only a few step
     functions compile;
  3. prints the optimizer steps (and examples) each took to reach a target training
     loss on the whole training set, the final training loss, and the
     test accuracy at the end; plots B_simple over training to ``OUT/critical_batch.png``
     and writes the warmup's per-step record to ``OUT/critical_batch.csv``.

The learning rate per optimizer step is the same in all runs and at every batch size:
a larger batch then buys a less noisy step, not a longer one. The alternative is to scale
the learning rate with the batch (linearly for SGD, by its square root for Adam) as the
batch grows; that takes larger steps but adds a second thing that changes at once.

  python examples/critical_batch.py           # about 20 s on 2 CPU cores
  python examples/critical_batch.py --quick   # 2 epochs, N = 8 only: a smoke test
  CRITICAL_BATCH_QUICK=1 python examples/critical_batch.py   # the same
"""

from __future__ import annotations

import argparse
import csv
import functools
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import accum_jax

MICROBATCH_SIZE = 8  # examples per small batch: B_simple / MICROBATCH_SIZE small batches
N_MIN, N_MAX = 2, 32  # the noise estimate needs N >= 2
FIXED_N = (8, 32)  # the fixed runs' batches: 64 and 256 examples
HIDDEN = 128
LEARNING_RATE = 0.05
MOMENTUM = 0.9
EMA_DECAY = 0.95  # about 20 steps
TARGET_LOSS = 0.05  # mean cross-entropy on the whole training set


def load_data(seed: int):
  """Digits scaled to [0, 1], split 80/20 into training and test sets."""
  digits = load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  split = int(0.8 * len(x))
  return (x[order[:split]], y[order[:split]]), (x[order[split:]], y[order[split:]])


def init_params(seed: int):
  rng = np.random.default_rng(seed)
  sizes = [64, HIDDEN, HIDDEN, 10]
  return [
      {"w": jnp.asarray(rng.standard_normal((m, n)) * math.sqrt(2 / m), jnp.float32),
       "b": jnp.zeros(n, jnp.float32)}
      for m, n in zip(sizes[:-1], sizes[1:])
  ]


def logits_fn(params, x):
  for layer in params[:-1]:
    x = jax.nn.relu(x @ layer["w"] + layer["b"])
  return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
  """Mean cross-entropy: a small batch's mean gradient, per example."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x), y).mean()


@jax.jit
def evaluate(params, x, y):
  logits = logits_fn(params, x)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  return loss, jnp.mean(jnp.argmax(logits, -1) == y)


OPTIMIZER = optax.sgd(LEARNING_RATE, momentum=MOMENTUM)


@functools.cache  # one compiled step per N, shared by the runs
def make_step(num_microbatches: int):
  """One optimizer step over ``num_microbatches`` small batches, with the noise EMA."""
  # on_nonfinite="unchecked": nothing overflows in float32 here, so the step leaves out
  # the check of the sums after the loop (and the compile time it adds to each N).
  vg = accum_jax.value_and_grad(
      loss_fn, num_microbatches, batch_argnums=(1, 2), gradient_noise=True, return_info=True,
      on_nonfinite="unchecked",
  )

  @jax.jit
  def step(params, opt_state, ema, x, y):
    loss, grads, info = vg(params, x, y)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    ema = ema.update(info.gradient_noise)
    # One step's ratio: noisy and biased, plotted faintly behind the average.
    return optax.apply_updates(params, updates), opt_state, ema, loss, (
        info.gradient_noise.simple_noise_scale)

  return step


def next_num_microbatches(b_simple: float, current: int) -> int:
  """The warmup's rule: B_simple in small batches, a power of two in [N_MIN, N_MAX].

  Never below ``current``: the batch only grows. Before the first estimate
  (``b_simple`` NaN), ``current``; likewise where it is not positive, as it can be
  near convergence, where the unbiased ``|G|^2`` is small beside its noise and its
  average can fall below zero.
  """
  if not math.isfinite(b_simple) or b_simple <= 0:
    return current
  n = 2 ** round(math.log2(max(b_simple / MICROBATCH_SIZE, 1.0)))
  return max(current, min(max(n, N_MIN), N_MAX))


class Sampler:
  """Batches drawn in order from a new shuffle of the training set each epoch."""

  def __init__(self, x, y, seed):
    self.x, self.y = x, y
    self.rng = np.random.default_rng(seed)
    self.order = np.empty(0, np.int64)

  def take(self, size):
    while len(self.order) < size:
      self.order = np.concatenate([self.order, self.rng.permutation(len(self.x))])
    rows, self.order = self.order[:size], self.order[size:]
    return self.x[rows], self.y[rows]


def train(name, data, budget, seed, schedule, bar):
  """Trains until ``budget`` examples; ``schedule(b_simple, n) -> n`` picks each step's N.

  Returns the per-step record and the final parameters.
  """
  (x_train, y_train), _ = data
  params = init_params(seed)
  opt_state = OPTIMIZER.init(params)
  ema = accum_jax.noise.NoiseScaleEMA.create(EMA_DECAY)
  sampler = Sampler(x_train, y_train, seed + 1)
  record = []
  examples, n, b_ema = 0, schedule(math.nan, None), math.nan
  while True:
    n = schedule(b_ema, n)  # between steps only
    batch = n * MICROBATCH_SIZE
    if examples + batch > budget:
      break
    x, y = sampler.take(batch)
    params, opt_state, ema, _, b_step = make_step(n)(params, opt_state, ema, x, y)
    examples += batch
    b_ema = float(ema.simple_noise_scale)
    train_loss, _ = evaluate(params, x_train, y_train)
    record.append({"step": len(record) + 1, "num_microbatches": n, "batch_size": batch,
                   "examples": examples, "b_simple_step": float(b_step),
                   "b_simple_ema": b_ema, "train_loss": float(train_loss)})
    bar.set_postfix_str(f"{name}: N={n} B_simple={b_ema:.0f}")
    bar.update(batch)
  return record, params


def fixed(n):
  return lambda b_simple, current: n


def warmup(b_simple, current):
  return N_MIN if current is None else next_num_microbatches(b_simple, current)


def first_reaching(record, target):
  """The first step's record whose training loss is at most ``target``, or None."""
  return next((r for r in record if r["train_loss"] <= target), None)


def run_lengths(values):
  """``[2, 2, 4, 4, 4]`` -> ``"2x2 4x3"``."""
  out = []
  for v in values:
    if out and out[-1][0] == v:
      out[-1][1] += 1
    else:
      out.append([v, 1])
  return " ".join(f"{v}x{c}" for v, c in out)


def plot(runs, path):
  import matplotlib

  matplotlib.use("Agg")  # files only, no display needed
  import matplotlib.pyplot as plt

  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True)
  for (label, record), color in zip(runs.items(), ("tab:blue", "tab:green", "tab:orange")):
    seen = [r["examples"] for r in record]
    per_step = [(r["examples"], r["b_simple_step"]) for r in record if r["b_simple_step"] > 0]
    top.plot(*zip(*per_step), ".", color=color, alpha=0.15, markersize=3)
    top.plot(seen, [r["b_simple_ema"] for r in record], color=color,
             label=f"{label}: B_simple (EMA)")
    bottom.plot(seen, [r["train_loss"] for r in record], color=color, label=label)
  warm = runs[list(runs)[-1]]
  top.step([r["examples"] for r in warm], [r["batch_size"] for r in warm], "k--", where="pre",
           linewidth=1, label="warmup's batch size")
  top.set_yscale("log")
  top.set_ylabel("examples")
  top.set_title("simple noise scale B_simple (faint: one step's estimate)")
  top.legend(fontsize=8)
  bottom.axhline(TARGET_LOSS, color="gray", linewidth=0.8, linestyle=":")
  bottom.set_yscale("log")
  bottom.set_ylabel("training loss")
  bottom.set_xlabel("examples processed")
  bottom.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=float, default=15,
                      help="examples processed per run, in epochs of the training set")
  parser.add_argument("--quick", action="store_true",
                      default=bool(os.environ.get("CRITICAL_BATCH_QUICK")),
                      help="2 epochs, one fixed run: a smoke test (or CRITICAL_BATCH_QUICK=1)")
  parser.add_argument("--target-loss", type=float, default=None,
                      help=f"training loss to reach (default {TARGET_LOSS}; 0.3 with --quick)")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and shuffling")
  parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out",
                      help="folder for critical_batch.png and critical_batch.csv")
  args = parser.parse_args()
  epochs = 2 if args.quick else args.epochs
  target = args.target_loss or (0.3 if args.quick else TARGET_LOSS)

  data = load_data(args.seed)
  budget = int(epochs * len(data[0][0]))
  fixed_ns = FIXED_N[:1] if args.quick else FIXED_N
  warmup_name = f"warmup(N={N_MIN}..{N_MAX})"
  runs, finals = {}, {}
  schedules = {f"fixed(N={n})": fixed(n) for n in fixed_ns} | {warmup_name: warmup}
  with tqdm(total=len(schedules) * budget, desc="examples", unit="ex", disable=None) as bar:
    for name, schedule in schedules.items():
      runs[name], finals[name] = train(name, data, budget, args.seed, schedule, bar)

  warm = runs[warmup_name]
  emas = [r["b_simple_ema"] for r in warm]
  print(f"digits: {len(data[0][0])} training, {len(data[1][0])} test examples;"
        f" microbatch {MICROBATCH_SIZE} examples, {budget} examples per run")
  print(f"B_simple EMA (examples), warmup run: first {emas[0]:.1f}  max {max(emas):.1f}"
        f"  last {emas[-1]:.1f}")
  print(f"warmup schedule (N x steps): {run_lengths([r['num_microbatches'] for r in warm])}")
  print()
  print(f"target: training loss <= {target:g}")
  print(f"{'run':17s} {'batch':>7s} {'steps to target':>15s} {'examples to target':>18s}"
        f" {'steps':>6s} {'examples':>9s} {'train loss':>10s} {'test acc':>8s}")
  for name, record in runs.items():
    sizes = sorted({r["batch_size"] for r in record})
    batch = str(sizes[0]) if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
    reached = first_reaching(record, target) or {"step": "-", "examples": "-"}
    _, accuracy = evaluate(finals[name], *data[1])
    print(f"{name:17s} {batch:>7s} {reached['step']:>15} {reached['examples']:>18}"
          f" {len(record):6d} {record[-1]['examples']:9d} {record[-1]['train_loss']:10.4f}"
          f" {float(accuracy):8.4f}")

  args.out.mkdir(parents=True, exist_ok=True)
  with open(args.out / "critical_batch.csv", "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(warm[0]))
    writer.writeheader()
    writer.writerows(warm)
  plot(runs, args.out / "critical_batch.png")
  print()
  print(f"wrote {args.out / 'critical_batch.png'} and {args.out / 'critical_batch.csv'}")


if __name__ == "__main__":
  main()
