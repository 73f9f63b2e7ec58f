"""Step time on a model of many small leaves: accum_jax vs a hand-written lax.scan.

A 2-block Transformer of width 32 (26 parameter leaves, most under 4 KiB) at
N=8 microbatches: per-leaf work in the loop body, not FLOPs, sets the step time
here, so this is where a per-leaf finiteness check would show. Rows, timed
interleaved in one process (median of rounds):

* ``scan``: the hand-written loop every user could write (no skip, no weights);
* ``accum_jax``: ``value_and_grad`` with its defaults (``skip_nonfinite=True``);
* ``accum_jax, skip_nonfinite=False``;
* ``accum_jax, gradient_noise=True``: one squared norm per microbatch more.

Run: ``python bench/bench_many_leaves.py [--rounds 30]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import accum_jax

WIDTH, HEADS, BLOCKS, VOCAB, SEQ, BATCH, N = 32, 4, 2, 64, 16, 64, 8


def init_params(seed=0):
  rng = np.random.default_rng(seed)

  def dense(n_in, n_out):
    return jnp.asarray(rng.standard_normal((n_in, n_out)) / np.sqrt(n_in), jnp.float32)

  blocks = []
  for _ in range(BLOCKS):
    blocks.append({
        "ln1": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "qkv": {"w": dense(WIDTH, 3 * WIDTH), "b": jnp.zeros(3 * WIDTH)},
        "out": {"w": dense(WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
        "ln2": {"scale": jnp.ones(WIDTH), "bias": jnp.zeros(WIDTH)},
        "mlp1": {"w": dense(WIDTH, 4 * WIDTH), "b": jnp.zeros(4 * WIDTH)},
        "mlp2": {"w": dense(4 * WIDTH, WIDTH), "b": jnp.zeros(WIDTH)},
    })
  return {"embed": dense(VOCAB, WIDTH), "pos": dense(SEQ, WIDTH), "blocks": blocks}


def layer_norm(p, x):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def block(p, x):
  b, t, _ = x.shape
  q, k, v = jnp.split(layer_norm(p["ln1"], x) @ p["qkv"]["w"] + p["qkv"]["b"], 3, axis=-1)
  heads = lambda z: z.reshape(b, t, HEADS, WIDTH // HEADS).transpose(0, 2, 1, 3)  # noqa: E731
  q, k, v = heads(q), heads(k), heads(v)
  mask = jnp.tril(jnp.ones((t, t), bool))
  att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / np.sqrt(WIDTH // HEADS), -1e9)
  y = (jax.nn.softmax(att) @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
  x = x + y @ p["out"]["w"] + p["out"]["b"]
  h = jax.nn.gelu(layer_norm(p["ln2"], x) @ p["mlp1"]["w"] + p["mlp1"]["b"])
  return x + h @ p["mlp2"]["w"] + p["mlp2"]["b"]


def loss_fn(params, tokens):
  x = params["embed"][tokens[:, :-1]] + params["pos"][: SEQ - 1]
  for p in params["blocks"]:
    x = block(p, x)
  logits = x @ params["embed"].T
  logp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def hand_written_scan(params, tokens):
  micro = tokens.reshape(N, BATCH // N, SEQ)

  def body(carry, mb):
    loss, grads = jax.value_and_grad(loss_fn)(params, mb)
    return jax.tree.map(jnp.add, carry, (loss, grads)), None

  zeros = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), params))
  total, _ = jax.lax.scan(body, zeros, micro)
  return jax.tree.map(lambda x: x / N, total)


def main(rounds: int) -> dict[str, float]:
  params = init_params()
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
  steps = {
      "scan": jax.jit(hand_written_scan),
      "accum_jax": jax.jit(accum_jax.value_and_grad(loss_fn, N)),
      "accum_jax, skip_nonfinite=False": jax.jit(
          accum_jax.value_and_grad(loss_fn, N, skip_nonfinite=False)
      ),
      "accum_jax, gradient_noise=True": jax.jit(
          accum_jax.value_and_grad(loss_fn, N, gradient_noise=True, return_info=True)
      ),
  }
  reference = steps["scan"](params, tokens)
  for name, step in steps.items():
    out = step(params, tokens)
    np.testing.assert_allclose(out[1]["embed"], reference[1]["embed"], rtol=1e-4, atol=1e-6)
  times: dict[str, list[float]] = {name: [] for name in steps}
  for _ in range(rounds):
    for name, step in steps.items():
      start = time.perf_counter()
      for _ in range(5):
        out = step(params, tokens)
      jax.block_until_ready(out)
      times[name].append((time.perf_counter() - start) / 5)
  medians = {name: statistics.median(t) for name, t in times.items()}
  leaves = len(jax.tree.leaves(params))
  print(f"{leaves} parameter leaves, batch {BATCH} x {SEQ} tokens, N={N}, {rounds} rounds")
  for name, t in medians.items():
    print(f"{name:34s} {t * 1e3:7.2f} ms   {t / medians['scan']:.3f} x scan")
  return medians


if __name__ == "__main__":
  parser = argparse.ArgumentParser()
  parser.add_argument("--rounds", type=int, default=30)
  main(parser.parse_args().rounds)
