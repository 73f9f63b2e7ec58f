"""Token-weighted accumulation: a character-level Transformer on lines of varying length.

A language model's loss is the mean over the batch's valid (non-padding) tokens. Split the
batch into microbatches, take each one's mean over its own valid tokens, and average those
means, and short lines count for more than they should: a microbatch of short lines
weighs as much as one of long lines with several times its tokens. That was the 2024
gradient-accumulation bug of the Hugging Face Transformers trainer, fixed there by
dividing by the token count of the whole batch. With accum_jax, give each microbatch its
token count as its weight::

  accum_jax.value_and_grad(loss, num_microbatches, weight_fn=lambda batch: batch["mask"].sum())

and the result is ``sum_i n_i * mean_i / sum_i n_i``, the exact token mean of the batch.

The model is a small causal Transformer in plain JAX (2 layers, width 64, context 64),
reading bytes. The text is Python's own: the lines of the standard library's ``json``
package and ``textwrap`` module, read from the installed sources (no download). Each
batch is sorted by line length, as length-grouped sampling makes it, so its microbatches
hold very different numbers of tokens. The script

  1. compares, on one batch, the full-batch loss and gradient with the token-weighted
     accumulation and with the mean of microbatch means, and prints both deviations;
  2. trains briefly with the token-weighted version and prints the loss going down.

  python examples/token_weighted_lm.py                    # 60 steps, about 20 s on 2 CPU cores
  python examples/token_weighted_lm.py --num-microbatches 8
  python examples/token_weighted_lm.py --quick            # 1 layer, 5 steps: a smoke test
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import accum_jax

CONTEXT = 64  # tokens the model sees; longer lines are cut
VOCAB = 128  # ASCII bytes; lines with other characters are left out
NEWLINE = ord("\n")  # starts and ends every line; byte 0 pads
D_MODEL = 64
NUM_HEADS = 4
NUM_LAYERS = 2
BATCH_SIZE = 64  # lines per optimizer step
LEARNING_RATE = 3e-3
# The token-weighted result should equal the full batch's up to float32 round-off (~1e-7).
PARITY_TOLERANCE = 1e-5
WEIGHTED = "token-weighted (weight_fn)"
MEAN_OF_MEANS = "mean of means (no weight_fn)"


def standard_library_lines() -> list[bytes]:
  """The non-blank ASCII lines of the installed ``json`` package and ``textwrap`` module."""
  json_dir = os.path.dirname(inspect.getsourcefile(json))
  paths = [os.path.join(json_dir, name) for name in sorted(os.listdir(json_dir))
           if name.endswith(".py")]
  paths.append(inspect.getsourcefile(textwrap))
  lines = []
  for path in paths:
    with open(path, encoding="utf-8") as f:
      for line in f:
        data = line.rstrip().encode("utf-8")
        if data.strip() and max(data) < VOCAB:
          lines.append(data)
  return lines


def make_batch(lines: list[bytes]) -> dict[str, np.ndarray]:
  """Next-byte prediction on ``\\n line \\n``, padded to CONTEXT, with a mask of real targets.

  The lines are sorted by length first, as a length-grouped sampler would hand them out, so
  that consecutive microbatches hold few and many tokens.
  """
  lines = sorted(lines, key=len)
  inputs = np.zeros((len(lines), CONTEXT), np.int32)
  targets = np.zeros((len(lines), CONTEXT), np.int32)
  mask = np.zeros((len(lines), CONTEXT), np.float32)
  for row, line in enumerate(lines):
    seq = np.frombuffer(bytes([NEWLINE]) + line + bytes([NEWLINE]), np.uint8)[: CONTEXT + 1]
    n = len(seq) - 1
    inputs[row, :n], targets[row, :n], mask[row, :n] = seq[:-1], seq[1:], 1.0
  return {"inputs": inputs, "targets": targets, "mask": mask}


def init_params(seed: int, num_layers: int = NUM_LAYERS):
  """Pre-norm Transformer parameters, drawn with NumPy (nothing to compile)."""
  rng = np.random.default_rng(seed)

  def normal(shape, scale):
    return jnp.asarray(scale * rng.standard_normal(shape, np.float32))

  def norm():
    return {"scale": jnp.ones(D_MODEL), "bias": jnp.zeros(D_MODEL)}

  std = D_MODEL**-0.5
  return {
      "embed": normal((VOCAB, D_MODEL), 1.0),
      "position": normal((CONTEXT, D_MODEL), 0.1),
      "layers": [
          {
              "norm1": norm(),
              "qkv": normal((D_MODEL, 3 * D_MODEL), std),
              "out": normal((D_MODEL, D_MODEL), std / num_layers),
              "norm2": norm(),
              "mlp_in": normal((D_MODEL, 4 * D_MODEL), std),
              "mlp_out": normal((4 * D_MODEL, D_MODEL), std / num_layers),
          }
          for _ in range(num_layers)
      ],
      "final_norm": norm(),
  }


def layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def attention(layer, x):
  batch, length, _ = x.shape
  head_dim = D_MODEL // NUM_HEADS
  q, k, v = jnp.split(x @ layer["qkv"], 3, axis=-1)
  q, k, v = (t.reshape(batch, length, NUM_HEADS, head_dim) for t in (q, k, v))
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(head_dim)
  # Causal: padding comes after a line's last byte, so no real position ever sees it.
  causal = jnp.tril(jnp.ones((length, length), bool))
  weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, length, D_MODEL)
  return out @ layer["out"]


def apply_model(params, inputs):
  x = params["embed"][inputs] + params["position"][: inputs.shape[1]]
  for layer in params["layers"]:
    x = x + attention(layer, layer_norm(layer["norm1"], x))
    h = jax.nn.gelu(layer_norm(layer["norm2"], x) @ layer["mlp_in"])
    x = x + h @ layer["mlp_out"]
  # Tied output embedding, scaled so that the initial logits are of order 1.
  return layer_norm(params["final_norm"], x) @ params["embed"].T * D_MODEL**-0.5


def loss_fn(params, batch):
  """Mean cross-entropy over the valid tokens of ``batch`` (a microbatch, or all of it)."""
  logits = apply_model(params, batch["inputs"])
  losses = optax.losses.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["mask"]
  # A microbatch of padding only would be 0 / 0; its weight is 0 anyway.
  return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def num_tokens(batch):
  return batch["mask"].sum()


def deviation(result, reference):
  """(loss |diff|, loss relative, gradient max |diff|, gradient relative by global norm)."""
  # On the host in float64: the differences are near float32 round-off.
  (loss, grads), (ref_loss, ref_grads) = jax.tree.map(
      lambda x: np.asarray(x, np.float64), jax.device_get((result, reference))
  )
  diffs = [a - b for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))]
  ref_norm = np.sqrt(sum(np.sum(g**2) for g in jax.tree.leaves(ref_grads)))
  loss_abs = float(abs(loss - ref_loss))
  grad_max = max(float(np.max(np.abs(d))) for d in diffs)
  grad_rel = float(np.sqrt(sum(np.sum(d**2) for d in diffs)) / ref_norm)
  return loss_abs, loss_abs / float(abs(ref_loss)), grad_max, grad_rel


def make_compare(num_microbatches):
  """A function printing how far each way of accumulating is from the full batch."""
  full = jax.jit(jax.value_and_grad(loss_fn))
  ways = {
      WEIGHTED: jax.jit(
          accum_jax.value_and_grad(loss_fn, num_microbatches, weight_fn=num_tokens)),
      MEAN_OF_MEANS: jax.jit(accum_jax.value_and_grad(loss_fn, num_microbatches)),
  }

  def compare(params, batch):
    reference = full(params, batch)
    print(f"full-batch loss (token mean): {float(reference[0]):.4f}")
    print(f"{'deviation from the full batch':30s} {'loss |diff|':>11s} {'loss rel':>10s}"
          f" {'grad max|diff|':>14s} {'grad rel':>10s}")
    rows = {}
    for name, way in ways.items():
      rows[name] = deviation(way(params, batch), reference)
      loss_abs, loss_rel, grad_max, grad_rel = rows[name]
      print(f"{name:30s} {loss_abs:11.2e} {loss_rel:10.2e} {grad_max:14.2e} {grad_rel:10.2e}")
    return rows

  return compare


def make_train_step(optimizer, num_microbatches):
  grad_fn = accum_jax.value_and_grad(loss_fn, num_microbatches, weight_fn=num_tokens)

  @jax.jit
  def train_step(params, opt_state, batch):
    loss, grads = grad_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
  parser.add_argument(
      "--num-microbatches", type=int, default=4,
      help=f"microbatches per batch of {BATCH_SIZE} lines (default 4)",
  )
  parser.add_argument(
      "--quick", action="store_true", help="1 layer, 5 training steps: a smoke test")
  parser.add_argument("--seed", type=int, default=0, help="initialisation and sampling")
  args = parser.parse_args()
  steps = 5 if args.quick else args.steps
  if steps < 1:
    parser.error(f"--steps={steps} must be >= 1")
  if args.num_microbatches < 2 or BATCH_SIZE % args.num_microbatches:
    parser.error(
        f"--num-microbatches={args.num_microbatches} must be >= 2 and divide the batch of"
        f" {BATCH_SIZE} lines"
    )
  # On GPUs, float32 matmuls may otherwise run in TF32, whose rounding depends on the
  # shapes; the comparison is about accumulation, so keep full float32.
  jax.config.update("jax_default_matmul_precision", "highest")

  start = time.perf_counter()
  lines = standard_library_lines()
  rng = np.random.default_rng(args.seed)
  # The quick run has one layer: it is mostly compilation, which grows with the depth.
  params = init_params(args.seed, num_layers=1 if args.quick else NUM_LAYERS)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  print(f"{len(lines)} lines of json/ and textwrap.py; {len(params['layers'])}-layer model of"
        f" {num_params} parameters;"
        f" batches of {BATCH_SIZE} lines in {args.num_microbatches} microbatches")

  batch = make_batch([lines[i] for i in rng.choice(len(lines), BATCH_SIZE, replace=False)])
  tokens = batch["mask"].reshape(args.num_microbatches, -1).sum(axis=1).astype(int)
  print(f"valid tokens per microbatch (length-sorted batch): {', '.join(map(str, tokens))}"
        f" (total {tokens.sum()})")
  compare = make_compare(args.num_microbatches)
  print("\nat initialisation")
  rows_init = compare(params, batch)

  optimizer = optax.adam(LEARNING_RATE)
  train_step = make_train_step(optimizer, args.num_microbatches)
  opt_state = optimizer.init(params)
  print(f"\ntraining {steps} steps with the token-weighted gradient (loss: the batch's token mean)")
  losses = []
  every = 10 if steps >= 20 else 1  # print the mean loss of blocks of this many steps
  for step in range(1, steps + 1):
    idx = rng.choice(len(lines), BATCH_SIZE, replace=False)
    params, opt_state, loss = train_step(params, opt_state, make_batch([lines[i] for i in idx]))
    losses.append(float(loss))
    if step % every == 0 or step == steps:
      block = losses[(step - 1) // every * every :]
      steps_text = f"{step - len(block) + 1:3d}-{step:<3d}" if len(block) > 1 else f"{step:7d}"
      print(f"step {steps_text}  loss {np.mean(block):.4f}")
  print(f"first loss: {losses[0]:.4f}")
  print(f"last loss:  {losses[-1]:.4f}")

  print(f"\nafter {steps} steps, on the same batch")
  rows = compare(params, batch)

  def worst(name, column):
    return max(rows_init[name][column], rows[name][column])

  exact = max(worst(WEIGHTED, 1), worst(WEIGHTED, 3)) < PARITY_TOLERANCE
  if exact:
    print("\nverdict: token-weighted accumulation gives the full-batch loss and gradient to"
          " float32 round-off;\n         the mean of microbatch means is off by up to"
          f" {worst(MEAN_OF_MEANS, 1):.1%} in the loss and {worst(MEAN_OF_MEANS, 3):.0%} in the"
          " gradient")
  else:
    print(f"\nverdict: token-weighted accumulation DIFFERS from the full batch by more than"
          f" {PARITY_TOLERANCE:g}, far beyond float32 round-off")
  print(f"time, imports not counted: {time.perf_counter() - start:.1f} s")
  return 0 if exact else 1


if __name__ == "__main__":
  raise SystemExit(main())
