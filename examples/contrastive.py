"""A contrastive loss over a batch that does not fit: two towers, InfoNCE, exact in chunks.

Two towers learn to embed two noisy views of the same handwritten digit close
together and the other digits of the batch apart (symmetric InfoNCE with a learned
temperature, as CLIP does with images and captions). Each example is compared with the
whole batch, so the batch is the point: splitting it with ``accum_jax.value_and_grad``
would train on the mean of smaller contrastive losses, another loss. Instead::

  grad_fn = accum_jax.cached_value_and_grad(embed, clip_loss, num_microbatches)

embeds the batch chunk by chunk without keeping activations, takes the loss and its
gradient with respect to the embeddings on the whole batch, and pulls that gradient back
into the towers chunk by chunk: the full batch's gradient, with one chunk's activations
in memory. The script

  1. measures the compiled memory (``memory_analysis()``) of one step against N, picks
     the smallest N that fits MEMORY_BUDGET_MIB, and plots memory against N to
     ``examples/out/contrastive.png``;
  2. compares the gradient at initialisation with the full batch's: the cached one to
     float32 round-off, ``value_and_grad`` over the same N chunks far from it;
  3. trains with Adam and reports the top-1 retrieval accuracy (view A -> view B) on
     held-out digits, before and after, and a verdict line.

The data are scikit-learn's 8x8 digits (no download).

  python examples/contrastive.py            # about 20 s on 2 CPU cores
  python examples/contrastive.py --quick    # fewer N and steps: a smoke test
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import accum_jax

BATCH_SIZE = 512
HIDDEN = 256
EMBED = 32
MEMORY_BUDGET_MIB = 12.0  # what one step may take, inputs and outputs included
LEARNING_RATE = 1e-3
NUM_TEST = 397  # held-out digits; the other 1400 are sampled for training
# Exact: float32 round-off is ~1e-7 relative; anything real is far above this.
PARITY_TOLERANCE = 1e-5
TOKEN_FEATURES = 16  # a digit's row: 8 pixels and a one-hot of the row's index
OUT = Path(__file__).resolve().parent / "out"
_MIB = 2**20


def init_params(seed: int):
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return (rng.standard_normal((n_in, n_out)) * np.sqrt(1 / n_in)).astype(np.float32)

  def tower():
    return {"w1": dense(TOKEN_FEATURES, HIDDEN), "b1": np.zeros(HIDDEN, np.float32),
            "w2": dense(HIDDEN, HIDDEN), "b2": np.zeros(HIDDEN, np.float32),
            "out": dense(HIDDEN, EMBED)}

  return {"a": tower(), "b": tower(), "log_t": np.float32(np.log(10.0))}


def tower(params, x):
  """A token-wise MLP over the digit's 8 rows, mean-pooled, projected, normalised."""
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  h = jax.nn.gelu(h @ params["w2"] + params["b2"])
  z = jnp.mean(h, axis=1) @ params["out"]
  return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed(params, batch):
  """Both towers on one chunk: a dict of (rows, EMBED) unit vectors."""
  return {"a": tower(params["a"], batch["a"]), "b": tower(params["b"], batch["b"])}


def clip_loss(params, emb, batch):
  """Symmetric InfoNCE over the whole batch, with a learned temperature."""
  logits = jnp.exp(params["log_t"]) * emb["a"] @ emb["b"].T
  diagonal = jnp.arange(logits.shape[0])
  a_to_b = jax.nn.log_softmax(logits, axis=1)[diagonal, diagonal]
  b_to_a = jax.nn.log_softmax(logits, axis=0)[diagonal, diagonal]
  return -jnp.mean(a_to_b + b_to_a) / 2


def whole_loss(params, batch):
  return clip_loss(params, embed(params, batch), batch)


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
  """A view: each 8x8 digit with its own pixel noise, as 8 tokens (its rows), each its 8
  pixels and a one-hot of its row."""
  out = images + 0.15 * rng.standard_normal(images.shape).astype(np.float32)
  rows = np.broadcast_to(np.eye(8, dtype=np.float32), (len(images), 8, 8))
  return np.concatenate([out, rows], axis=2)


def views(images: np.ndarray, rng: np.random.Generator) -> dict[str, np.ndarray]:
  return {"a": augment(images, rng), "b": augment(images, rng)}


def compile_step(fn, *args):
  """``fn`` jitted and compiled for ``args``, and its memory: temporaries + outputs +
  arguments - aliased, in MiB."""
  compiled = jax.jit(fn).lower(*args).compile()
  stats = compiled.memory_analysis()
  total = (stats.temp_size_in_bytes + stats.output_size_in_bytes
           + stats.argument_size_in_bytes - stats.alias_size_in_bytes)
  return compiled, total / _MIB


def relative_deviation(grads, reference) -> float:
  """Global norm of the difference over the reference's, on the host in float64."""
  a = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads)])
  b = np.concatenate([np.ravel(np.asarray(g, np.float64)) for g in jax.tree.leaves(reference)])
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@jax.jit
def retrieval_accuracy(params, test_views):
  """How often view A's nearest view B (cosine) is the same digit image."""
  emb = embed(params, test_views)
  nearest = jnp.argmax(emb["a"] @ emb["b"].T, axis=1)
  return jnp.mean(nearest == jnp.arange(nearest.shape[0]))


def plot(memory: dict[int, float], full_mib: float, path: Path) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  ns = sorted(memory)
  fig, ax = plt.subplots(figsize=(5.5, 3.5))
  ax.plot(ns, [memory[n] for n in ns], "o-", label="cached_value_and_grad")
  ax.axhline(full_mib, color="C1", linestyle="--", label="full batch")
  ax.axhline(MEMORY_BUDGET_MIB, color="C3", linestyle=":", label="budget")
  ax.set_xscale("log", base=2)
  ax.set_xticks(ns, [str(n) for n in ns])
  ax.set_ylim(bottom=0)
  ax.set_xlabel("chunks N")
  ax.set_ylabel("compiled memory of one step (MiB)")
  ax.set_title(f"Symmetric InfoNCE, batch {BATCH_SIZE}: memory against N")
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=40, help="training steps (default 40)")
  parser.add_argument("--quick", action="store_true", help="N in 4, 8; 3 steps")
  parser.add_argument("--plot", type=Path, default=OUT / "contrastive.png",
                      help="where to write the plot (default examples/out/contrastive.png)")
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args()
  steps = 3 if args.quick else args.steps
  candidates = (4, 8) if args.quick else (2, 4, 8, 16)
  start = time.perf_counter()

  digits = load_digits()
  images = (digits.images / 16.0).astype(np.float32)
  rng = np.random.default_rng(args.seed)
  order = rng.permutation(len(images))
  train, test = images[order[NUM_TEST:]], images[order[:NUM_TEST]]
  test_views = jax.device_put(views(test, np.random.default_rng(args.seed + 1)))

  def sample_batch():
    return jax.device_put(views(train[rng.choice(len(train), BATCH_SIZE)], rng))

  params = jax.device_put(init_params(args.seed))
  batch = sample_batch()

  # 1. Memory against N, from the compiled steps; the smallest N within the budget.
  full_step, full_mib = compile_step(jax.value_and_grad(whole_loss), params, batch)
  cached_steps, memory = {}, {}
  for n in candidates:
    grad_fn = accum_jax.cached_value_and_grad(embed, clip_loss, n)
    cached_steps[n], memory[n] = compile_step(grad_fn, params, batch)
  print(f"batch {BATCH_SIZE}, budget {MEMORY_BUDGET_MIB:.1f} MiB; compiled memory of one step:")
  print(f"full batch compiled memory (MiB): {full_mib:.1f}")
  for n in candidates:
    print(f"cached, N = {n:2d} (MiB): {memory[n]:.1f}")
  fitting = [n for n in candidates if memory[n] <= MEMORY_BUDGET_MIB]
  if not fitting:
    raise SystemExit(f"no N among {candidates} fits {MEMORY_BUDGET_MIB} MiB")
  n = fitting[0]
  print(f"chosen num_microbatches: {n}")
  plot(memory, full_mib, args.plot)
  print(f"plot: {args.plot}")

  # 2. The gradient against the full batch's: the cached one, and value_and_grad over the
  # same N chunks, each of whose losses sees only its own chunk's negatives.
  plain_step, _ = compile_step(accum_jax.value_and_grad(whole_loss, n), params, batch)

  def deviations(params, batch):
    _, full_grads = full_step(params, batch)
    return tuple(relative_deviation(step(params, batch)[1], full_grads)
                 for step in (cached_steps[n], plain_step))

  deviation, plain_deviation = deviations(params, batch)
  print(f"gradient deviation at initialisation, cached: {deviation:.1e}")
  print(f"gradient deviation at initialisation, value_and_grad: {plain_deviation:.3f}")

  # 3. Training.
  optimizer = optax.adam(LEARNING_RATE)
  grad_fn = accum_jax.cached_value_and_grad(embed, clip_loss, n)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  before = float(retrieval_accuracy(params, test_views))
  opt_state = optimizer.init(params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = train_step(params, opt_state, batch)
    losses.append(float(loss))
    batch = sample_batch()
  after = float(retrieval_accuracy(params, test_views))
  print(f"first loss: {losses[0]:.4f}")
  print(f"last loss: {losses[-1]:.4f}")
  print(f"retrieval top-1 on {NUM_TEST} held-out digits: {before:.3f} before, {after:.3f} after")
  trained_deviation, trained_plain_deviation = deviations(params, batch)
  print(f"gradient deviation after training, cached: {trained_deviation:.1e}")
  print(f"gradient deviation after training, value_and_grad: {trained_plain_deviation:.3f}")

  largest = max(deviation, trained_deviation)
  exact = largest < PARITY_TOLERANCE
  fits = memory[n] <= MEMORY_BUDGET_MIB < full_mib
  verdict = "exact and within budget" if exact and fits else "FAILED"
  print(f"verdict: {verdict}: N = {n}, {memory[n]:.1f} of {MEMORY_BUDGET_MIB:.1f} MiB (full batch"
        f" {full_mib:.1f}), gradient deviation {largest:.1e} (value_and_grad up to"
        f" {max(plain_deviation, trained_plain_deviation):.1%})")
  print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
  main()
